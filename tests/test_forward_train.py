"""train.py with the forward-process losses (--loss nft, --loss awm) on the tiny model: runs, the old copy's soft
update and checkpoint, exact resume, two processes, presets and refused flags."""
import json
import os
import sys

import pytest
import torch

import train
from test_train import SMALL, metrics, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("seconds", "seconds_sampling", "seconds_reward_wait", "seconds_training")
AWM_SMALL = ["--train-timesteps", "2"]  # 4 steps at fraction 0.9 leave schedule indices 1 and 2: two strata


def tensors(path):
    from safetensors.torch import load_file
    return load_file(path)


def train_in_process(out, *flags):
    """train.main in this process (the imports are paid once), with test_train's small tiny setup."""
    train.main([*SMALL, "--log-images-every", "0", "--out", str(out), *flags])
    return metrics(str(out))


@pytest.mark.parametrize("loss", ["nft", "awm"])
def test_runs_soft_updates_the_old_copy_and_resumes_exactly(tmp_path, loss):
    # awm with two optimizer steps per step: the second one's old log-probs are computed before the first step. Its
    # old copy is the anchor of its EMA-KL, which AWM adds only with a KL to the base (a LoRA adapter's).
    flags = ["--loss", loss, "--steps", "3", "--save-every", "1"] + (
        AWM_SMALL + ["--minibatches", "2", "--lora-rank", "4", "--lora-alpha", "4", "--kl-beta", "1e-3"]
        if loss == "awm" else [])
    full = train_in_process(tmp_path / "full", *flags)
    assert [r["step"] for r in full] == [1, 2, 3] and not any(r.get("skipped") for r in full)
    for r in full:
        assert r["loss"] == r["loss"] and r["trained_steps"] == (3 if loss == "nft" else 2)  # int(4 x 0.99); 2 strata
        if loss == "awm":  # ratio 1 on the first optimizer step, near 1 on the second (same noise and sigmas:
            # approx_kl 4e-6 to 5e-5 here; old log-probs taken at other noise put it at 3e-4 to 7e-4)
            assert r["ratio_mean"] != 1 and r["approx_kl"] < 1.5e-4, r
    # The old copy starts as the weights: at step 1 (one optimizer step) the old velocities are the current ones.
    if loss == "nft":
        assert full[0]["old_deviate"] == 0 and full[1]["old_deviate"] > 0
    # old <- d old + (1 - d) current after each step, d = min(0.001 k, 0.5) (nft) or min(0.3, 0.001 k) (awm) after
    # k optimizer steps (awm here: 2 per step).
    ckpt = tmp_path / "full" / "checkpoints"
    import models
    initial = dict(models.load_pipeline("tiny").transformer.named_parameters())
    old_prev = {n: q.detach() for n, q in initial.items()}
    for step in (1, 2, 3):
        folder = ckpt / str(step)
        weights, old = tensors(folder / "trainable.safetensors"), tensors(folder / "old.safetensors")
        d = 0.001 * step * (2 if loss == "awm" else 1)
        assert full[step - 1]["old_decay"] == pytest.approx(d)
        if step == 1 and loss == "awm":  # the adapter's initial weights are not the base's: from step 2 on
            old_prev = old
            continue
        for name, w in weights.items():
            torch.testing.assert_close(old[name], d * old_prev[name] + (1 - d) * w, rtol=1e-6, atol=1e-7)
        old_prev = old
    # Resume from step 1's checkpoint in another folder: steps 2 and 3 as in the uninterrupted run, which needs
    # the old copy restored (it enters every loss term) as well as the weights, Adam and the seeds.
    resumed = train_in_process(tmp_path / "resumed", *flags, "--resume", str(ckpt / "1"))
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(full[1:], resumed):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


# awm is slow: its ranks share nft's distributed pieces (the old copy's update, the velocity KL, the checksums)
@pytest.mark.parametrize("loss", ["nft", pytest.param("awm", marks=pytest.mark.slow)])
def test_torchrun_two_processes(tmp_path, loss):
    out = str(tmp_path / "ddp")
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *SMALL,
         "--loss", loss, "--lora-rank", "4", "--lora-alpha", "8", "--kl-beta", "0.01", "--steps", "2",
         "--log-images-every", "0", "--out", out] + (AWM_SMALL if loss == "awm" else []), tmp_path)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["kl"] > 0 for r in rows[1:])
    state = json.load(open(os.path.join(out, "checkpoints", "2", "state.json")))
    assert len(state["rank_checksums"]) == 2 and state["rank_checksums"][0] == state["rank_checksums"][1]
    weights = tensors(os.path.join(out, "checkpoints", "2", "trainable.safetensors"))
    old = tensors(os.path.join(out, "checkpoints", "2", "old.safetensors"))
    assert set(old) == set(weights) and any(not torch.equal(old[n], weights[n]) for n in weights)


def test_loss_presets():
    _, a = train.parse_args(["--loss", "nft", "--model", "sd3"])
    assert (a.guidance_scale, a.sampler, a.timestep_fraction, a.old_decay) == (1.0, "dpm2", 0.99, "nft")
    assert a.kl_beta == 1e-4
    assert a.train_cfg is False
    _, a = train.parse_args(["--loss", "awm", "--model", "sd3", "--guidance-scale", "4.5"])  # the command line wins
    assert (a.guidance_scale, a.clip_range, a.timestep_fraction, a.kl_beta, a.train_cfg) == (4.5, 1.0, 0.9, 1e-3, True)
    _, a = train.parse_args(["--loss", "nft", "--model", "flux"])  # FLUX keeps its distilled guidance
    assert a.guidance_scale == 3.5
    _, a = train.parse_args(["--loss", "nft"])  # tiny: no LoRA, so no KL
    assert a.kl_beta == 0.0 and a.sampler == "dpm2"
    _, a = train.parse_args(["--loss", "grpo", "--model", "sd3"])  # the reverse-process losses are untouched
    assert (a.guidance_scale, a.sampler, a.timestep_fraction, a.old_decay, a.kl_beta) == (4.5, None, 1.0, None, 0.04)


@pytest.mark.parametrize("flags, needle", [
    (["--loss", "nft", "--sde-window", "fast"], "--sde-window"),
    (["--loss", "awm", "--flash"], "--flash"),
    (["--loss", "grpo", "--sampler", "dpm2"], "--sampler"),
    (["--loss", "grpo", "--old-decay", "nft"], "--old-decay"),
    (["--loss", "nft", "--timestep-fraction", "0.05"], "--timestep-fraction"),
    (["--loss", "awm", "--num-steps", "4", "--timestep-fraction", "0.25"], "leaves no schedule index"),  # and names the fraction that works
    (["--loss", "nft", "--nft-beta", "0"], "--nft-beta"),
    (["--loss", "nft", "--kl-beta", "0.1"], "--kl-beta"),  # tiny trains all weights: no base to compare with
])
def test_bad_flags_are_refused_in_one_line(flags, needle, capsys):
    with pytest.raises(SystemExit):  # at parsing (a flag's own range) or in check_args (combinations)
        p, args = train.parse_args(flags)
        train.check_args(p, args, 1)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("train.py: error:") or "error:" in err
    assert needle in err, err


@pytest.mark.slow
def test_fsdp_full_fine_tune_resumes_exactly(tmp_path):
    """--lora-rank 0 --fsdp: the old copy is sharded like the weights, exchanged shard by shard, gathered into the
    checkpoint and cut back into shards on resume."""
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *SMALL,
            "--loss", "nft", "--lora-rank", "0", "--fsdp", "--steps", "3", "--log-images-every", "0"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run(base + ["--save-every", "1", "--out", full], tmp_path)
    run(base + ["--resume", os.path.join(full, "checkpoints", "2"), "--out", part], tmp_path)
    a, b = metrics(full)[-1], metrics(part)[-1]
    assert a["step"] == b["step"] == 3
    assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
