"""A loss is one function and one line in losses.LOSSES (README, "Adding a loss"): a loss defined here, registered,
trains the tiny model through train.main with no edit to train.py; and nothing outside losses.py chooses by name."""
import json
import os
import re
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import losses
import models
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4",
         "--train-batch-size", "4", "--num-steps", "4", "--resolution", "32", "--log-images-every", "0",
         "--steps", "2", "--seed", "3"]


def reinforce(t, **_):
    """REINFORCE (Williams 1992) on each trained step: -A log pi(x_{k+1} | x_k), no ratio and no clip."""
    value = -(t["adv"] * t["log_prob"]).mean()
    return value, {"reinforce_logp": t["log_prob"].detach().mean().item()}


def trained(out, step=2):
    return load_file(os.path.join(out, "checkpoints", str(step), "trainable.safetensors"))


def test_a_loss_defined_outside_trains_through_train_main(tmp_path, monkeypatch, one_thread):
    monkeypatch.setitem(losses.LOSSES, "reinforce", losses.Loss(reinforce, "reverse", clip=False))
    train.main(SMALL + ["--loss", "reinforce", "--out", str(tmp_path / "reinforce")])
    rows = [json.loads(line) for line in open(tmp_path / "reinforce" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reinforce_logp" in r and r["grad_norm"] > 0 and not r.get("skipped") for r in rows)
    assert all(abs(r["first_ratio_dev"]) < 1e-6 for r in rows)  # train.py's on-policy check ran on it too
    # At ratio 1 the gradient of -A r is -A grad log pi: the first optimizer step of REINFORCE is GRPO's. One step of
    # each from the same start (same rollout, same advantages) must land on the same weights, to rounding.
    train.main(SMALL + ["--loss", "reinforce", "--steps", "1", "--out", str(tmp_path / "r1")])
    train.main(SMALL + ["--loss", "grpo", "--steps", "1", "--out", str(tmp_path / "g1")])
    a, b = trained(tmp_path / "r1", 1), trained(tmp_path / "g1", 1)
    initial = {n: q.detach() for n, q in models.load_pipeline("tiny").transformer.named_parameters()}
    moved = sum((a[n] - initial[n]).abs().sum().item() for n in a)
    assert moved > 0
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 1e-6 * max(1.0, moved)


def test_an_unknown_loss_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--loss", "reinforce"])
    assert "invalid choice: 'reinforce'" in capsys.readouterr().err


def test_the_forward_process_registry_fields_are_complete():
    for name, loss in losses.LOSSES.items():
        assert loss.process in ("reverse", "forward"), name
        if loss.process == "forward":  # trains at sigmas it draws, needs them to fit the schedule
            assert loss.times is not None, name
            times = loss.times(3, torch.Generator().manual_seed(0), num_steps=10, timestep_fraction=0.9,
                               train_timesteps=2, awm_timesteps="discrete_wo_init")
            # indices into the schedule, or positions between its sigmas (train.schedule_at interpolates)
            assert times.shape[0] == 3 and (times >= 0).all() and (times < 10).all()
            assert times.dtype == torch.long or times.is_floating_point()


# The one script that may name a loss: it times flow_grpo's own GRPO step beside ours, so it refuses every other loss.
NAMES_A_LOSS = {"scripts/anchor_bench.py"}


def test_nothing_outside_losses_chooses_by_loss_name():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    hits = [f"{f}:{i + 1}" for f in files if f != "losses.py" and not f.startswith("tests/") and f not in NAMES_A_LOSS
            for i, line in enumerate(open(os.path.join(ROOT, f))) if re.search(r"args\.loss *(==|!=|in )", line)]
    assert not hits, hits


def reverse_term(seed=0, batch=4):
    gen = torch.Generator().manual_seed(seed)
    mean, ref = torch.randn(batch, 3, 4, 4, generator=gen), torch.randn(batch, 3, 4, 4, generator=gen)
    sigma = torch.full((batch,), 0.6)
    return dict(log_prob=torch.randn(batch, generator=gen) * 1e-3, old_log_prob=torch.zeros(batch), mean=mean,
                old_mean=mean + 0.01, ref_mean=ref, std=torch.full((batch,), 0.3), dt=torch.full((batch,), -0.1),
                adv=torch.randn(batch, generator=gen), sigma=sigma, sigma_next=sigma - 0.1,
                schedule=torch.tensor([1.0, 0.9, 0.6, 0.5, 0.0]))


@pytest.mark.parametrize("name", ["grpo", "guard", "flowdppo"])
def test_the_wan_step_weight_scales_the_policy_term_alone(name):
    """Flow-GRPO's Wan 2.1 loop weights each step's policy loss and adds the KL after, unweighted."""
    t = reverse_term()
    hyper = dict(clip_range=0.2, kl_form="exact", sde="flow", kl_mask_threshold=1e-5, kl_beta=0.5)
    loss = losses.LOSSES[name]
    plain, info = loss.fn(t, **loss.hyper(dict(hyper, step_loss_weight="none")))  # the flags the loss reads
    weighted, _ = loss.fn(t, **loss.hyper(dict(hyper, step_loss_weight="wan")))
    kl = 0.5 * info["kl"]
    w = losses.wan_step_weight(t["sigma"], t["sigma_next"], sigma_max=0.9, sigma_min=0.0)
    assert w.item() == pytest.approx((0.9 * 0.6) / 0.1 ** 0.5)
    assert (weighted - kl).item() == pytest.approx(w.item() * (plain - kl).item(), rel=1e-5)


def test_awms_ema_kl_acts_only_with_a_kl_to_the_base():
    """AWM computes its EMA-KL inside `if config.train.beta > 0` (train_sd3_awm.py L1330-1351): at --kl-beta 0 there
    is no EMA-KL term and no old copy to keep."""
    gen = torch.Generator().manual_seed(0)
    x0, eps, v, v_old, v_ref = (torch.randn(3, 2, 4, 4, generator=gen) for _ in range(5))
    t = dict(v=v, x0=x0, noise=eps, sigma=torch.full((3,), 0.5), adv=torch.tensor([1.0, -1.0, 0.0]), v_old=v_old,
             v_ref=v_ref)
    hyper = dict(clip_range=1.0, adv_clip=5.0, ema_kl_beta=1.0, awm_weighting="ghuber", ghuber_power=0.25)
    off, info_off = losses.LOSSES["awm"].fn(t, kl_beta=0.0, **hyper)
    on, info_on = losses.LOSSES["awm"].fn(t, kl_beta=1e-3, **hyper)
    assert "ema_kl" not in info_off and "kl" not in info_off
    assert on.item() == pytest.approx(off.item() + float(info_on["ema_kl"]) + 1e-3 * float(info_on["kl"]), rel=1e-6)
    assert not losses.LOSSES["awm"].old_copy(dict(ema_kl_beta=1.0, kl_beta=0.0))
    assert losses.LOSSES["awm"].old_copy(dict(ema_kl_beta=1.0, kl_beta=1e-3))


BRIGHT = "import torch\ndef score(images, prompts, metadata, args):\n" \
         "    return images.reshape(len(images), -1).float().mean(1) * float(args)\n"


def test_reward_combine_advantage_trains_on_every_reward_and_logs_their_shares(tmp_path, monkeypatch, one_thread):
    """--reward-combine advantage (MixGRPO): each reward's group advantage, weighted and summed, so a reward scaled
    by 1000 does not drown another; each one's std and share of the advantage logged per step."""
    (tmp_path / "bright.py").write_text(BRIGHT)
    common = SMALL + ["--reward", "jpeg_incompressibility=1,custom=1", "--custom-rm-path",
                      f"{tmp_path / 'bright.py'}:score", "--steps", "1"]
    for scale in ("1", "1000"):
        train.main(common + ["--custom-rm-args", scale, "--reward-combine", "advantage", "--out",
                             str(tmp_path / f"adv{scale}")])
    train.main(common + ["--custom-rm-args", "1000", "--out", str(tmp_path / "score1000")])
    adv1, adv1000, score1000 = ([json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")][0]
                                for run in ("adv1", "adv1000", "score1000"))
    shares = [adv1["reward/jpeg_incompressibility_share"], adv1["reward/custom_share"]]
    assert sum(shares) == pytest.approx(1.0) and min(shares) > 0.1 and adv1["reward/custom_std"] > 0
    # The custom reward x1000 changes the advantage-combined step only through the +1e-4 of its std: the same shares
    # and gradient; summed as scores (the default), the scaled reward drowns the other and the gradient moves.
    assert adv1000["reward/custom_share"] == pytest.approx(adv1["reward/custom_share"], rel=1e-3)
    assert adv1000["grad_norm"] == pytest.approx(adv1["grad_norm"], rel=1e-3)
    assert abs(score1000["grad_norm"] / adv1["grad_norm"] - 1) > 0.01 and "reward/custom_share" not in score1000


def test_reward_combine_advantage_refuses_rows_with_other_weights(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input": "a cat", "metadata": {"rm_type": "jpeg_compressibility=3"}}) + "\n")
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--reward", "jpeg_compressibility=1,jpeg_incompressibility=1", "--reward-combine",
                            "advantage", "--prompts", str(prompts), "--out", str(tmp_path / "run")])
    assert "line 1" in str(e.value) and "--reward-combine advantage" in str(e.value)
