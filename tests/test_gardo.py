"""GARDO's gated KL and adaptive reference as train.py wires them into every loss (the rules themselves:
tests/test_regularizers.py): the KL term over the flagged samples only, the gate's share carried from step to step
and through a checkpoint, the reference renewed at the step it is due and the KL measured against it, and a resumed
run that continues as the uninterrupted one. G = tinnerhrhe/GARDO scripts/train_sd3_grpo_gardo.py, N =
scripts/train_sd3_nft_gardo.py (1cc77fb)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import advantages
import diversity
import losses
import train
from test_train import SMALL, metrics

TIMING = ("seconds", "seconds_sampling", "seconds_reward_wait", "seconds_training")
LORA_KL = ["--lora-rank", "4", "--lora-alpha", "4", "--kl-beta", "0.1"]


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """The trained reward (JPEG compressibility) and an auxiliary one the gate ranks against (the mean brightness),
    scored, weighted 0 and not trained: (the reward flags, the gate flag)."""
    path = tmp_path_factory.mktemp("scorer") / "scorer.py"
    path.write_text("def brightness(images, prompts, metadata, args):\n"
                    "    return images.float().mean(dim=(1, 2, 3)) / 255\n")
    return (["--reward", "jpeg_compressibility=1,custom=0", "--custom-rm-path", f"{path}:brightness", "--reward-key",
             "jpeg_compressibility"], ["--gardo-gate", "custom"])


def train_in_process(out, *flags):
    """train.main in this process (the imports and the first model load are paid once)."""
    train.main([*SMALL, "--log-images-every", "0", "--out", str(out), *flags])
    return metrics(str(out))


def state(out, step):
    with open(os.path.join(out, "checkpoints", str(step), "state.json")) as f:
        return json.load(f)


def weights(out, step, name):
    return load_file(os.path.join(out, "checkpoints", str(step), f"{name}.safetensors"))


def same_rows(a, b):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in a] == \
        [{k: v for k, v in r.items() if k not in TIMING} for r in b]


# ----------------------------------------------------------------------------- the KL term of every loss
def terms(name, gen):
    """One trained term of 4 samples with every tensor any loss reads (losses.py, "the algorithms"), and its flags."""
    _, args = train.parse_args(["--model", "tiny", "--loss", name, "--kl-beta", "0.5", "--group-size", "2"])
    shape = (4, 2, 3, 3)
    t = dict(log_prob=torch.randn(4, generator=gen) * 1e-3, old_log_prob=torch.zeros(4),
             mean=torch.randn(shape, generator=gen), old_mean=torch.randn(shape, generator=gen),
             ref_mean=torch.randn(shape, generator=gen), std=torch.rand(4, generator=gen) + 0.5,
             dt=-torch.rand(4, generator=gen) * 0.2 - 0.05, sigma=torch.rand(4, generator=gen) * 0.8 + 0.1,
             adv=torch.tensor([1.0, -1.0, 0.5, -0.5]), v=torch.randn(shape, generator=gen, requires_grad=True),
             v_old=torch.randn(shape, generator=gen), v_ref=torch.randn(shape, generator=gen),
             x_t=torch.randn(shape, generator=gen), x0=torch.randn(shape, generator=gen),
             noise=torch.randn(shape, generator=gen), unit=torch.tensor([0, 0, 1, 1]), old_stat=None)
    t["sigma_next"], t["schedule"] = t["sigma"] + t["dt"], torch.linspace(1, 0, 5)
    if name == "sft":
        t["adv"] = torch.tensor([1.0, 0.0, 1.0, 0.0])  # best_of_group's 0 / 1
    return t, vars(args)


@pytest.mark.parametrize("name", [n for n, loss in losses.LOSSES.items() if "kl_beta" in loss.reads()])  # a KL term
def test_the_gated_kl_term_is_beta_times_the_mean_over_the_flagged_samples(name):
    """Every loss: with the gate, loss - loss without it = beta (gated KL - KL over all), the gated KL computed here by
    hand: GRPO's form (mean_dims((mean - ref_mean)^2) / (2 std^2) x |dt|, G L984-985) on the reverse process, the
    mean squared velocity difference (N L1051-1053) on the forward one. No flagged sample: no KL term on the reverse
    process (G L988-989), every sample's on the forward one (N L1054-1057)."""
    t, hyper = terms(name, torch.Generator().manual_seed(0))
    reverse = losses.LOSSES[name].process == "reverse"
    if reverse:  # --kl-form flow-grpo, the default
        kl = ((t["mean"] - t["ref_mean"]) ** 2).mean((1, 2, 3)) / (2 * t["std"] ** 2) * -t["dt"]
    else:
        kl = ((t["v"].detach() - t["v_ref"]) ** 2).mean((1, 2, 3))
    flagged = torch.tensor([False, True, False, True])
    fn, hyper = losses.LOSSES[name].fn, losses.LOSSES[name].hyper(hyper)  # the flags the loss reads
    plain, plain_info = fn(dict(t), **hyper)
    gated, info = fn(dict(t, kl_gate=flagged), **hyper)
    assert plain_info["kl"].item() == pytest.approx(kl.mean().item(), rel=1e-5)
    assert info["kl"].item() == pytest.approx(kl[flagged].mean().item(), rel=1e-5)
    weighted = kl
    if name == "crd" and hyper["crd_adaptive_kl"]:  # CRD weights each sample's KL by its [0, 1] advantage
        floor = 1e-4 / hyper["kl_beta"]
        weighted = kl * (floor + losses.nft_optimality(t["adv"], adv_clip=hyper["adv_clip"]) * (1 - floor))
    assert (gated - plain).item() == pytest.approx(0.5 * (weighted[flagged].mean() - weighted.mean()).item(), rel=1e-4,
                                                   abs=1e-6)
    none, info = fn(dict(t, kl_gate=torch.zeros(4, dtype=torch.bool)), **hyper)
    if reverse:
        no_kl, _ = fn(dict(t), **dict(hyper, kl_beta=0.0))
        assert info["kl"].item() == 0.0 and none.item() == pytest.approx(no_kl.item(), rel=1e-6)
    else:
        assert info["kl"].item() == plain_info["kl"].item() and none.item() == plain.item()


def test_the_gate_needs_scored_auxiliary_rewards_and_both_rules_a_kl(gate, capsys):
    base = ["--model", "tiny", "--lora-rank", "4"]
    _, args = train.parse_args(base + [*gate[0], *gate[1], "--gardo-reference", "--kl-beta", "0"])
    assert args.gardo_gate is None and not args.gardo_reference  # no KL term: said, and both off
    assert "--kl-beta 0 leaves no KL term" in capsys.readouterr().out
    for flags, needle in ((["--kl-beta", "0.1", "--gardo-gate", "custom"], "components of --reward"),
                          ([*gate[0], "--kl-beta", "0.1", "--gardo-gate", "jpeg_compressibility"],
                           "other than the trained"),
                          (["--kl-beta", "0.1", "--gardo-reference", "--gardo-reset-freq", "0"], "--gardo-reset-freq")):
        p, args = train.parse_args(base + flags)
        with pytest.raises(SystemExit):
            train.check_args(p, args, 1)
        assert needle in capsys.readouterr().err.strip().splitlines()[-1]
    p, args = train.parse_args(["--model", "tiny", "--lora-rank", "0", "--kl-beta", "0.1", "--gardo-reference"])
    train.check_args(p, args, 1)  # a full fine-tune keeps a KL: the snapshot is its reference


# ----------------------------------------------------------------------------- runs on the tiny model
def test_no_flagged_sample_trains_as_without_a_kl_on_grpo_and_as_the_plain_kl_on_nft(tmp_path, monkeypatch, gate):
    """The gate's empty rule through whole steps: GRPO leaves the KL out (its weights as with --kl-beta 0),
    DiffusionNFT keeps every sample's (its weights as without the gate)."""
    monkeypatch.setattr(advantages, "kl_gate", lambda u, fraction: torch.zeros(len(u), dtype=torch.bool))
    for loss, twin in (("grpo", [*LORA_KL[:4], "--kl-beta", "0"]), ("nft", LORA_KL)):
        gated = train_in_process(tmp_path / f"{loss}-gated", "--loss", loss, "--steps", "2", *gate[0], *gate[1],
                                 *LORA_KL)
        plain = train_in_process(tmp_path / f"{loss}-plain", "--loss", loss, "--steps", "2", *gate[0], *twin)
        assert all(r["gardo_flagged"] == 0 for r in gated)
        a, b = weights(tmp_path / f"{loss}-gated", 2, "trainable"), weights(tmp_path / f"{loss}-plain", 2, "trainable")
        assert all(torch.equal(a[n], b[n]) for n in a), loss
        assert [r["loss"] for r in gated] == [r["loss"] for r in plain], loss


def test_the_gate_share_is_carried_and_a_resumed_run_continues_exactly(tmp_path, gate):
    """The gate's state (the share and the last 20 levels, G L219-238) goes from step to step and into state.json: the
    share of each step follows gate_fraction from the one before, and a run resumed from step 1 logs what the
    uninterrupted one does (the flagged share, the KL, the loss)."""
    flags = ["--loss", "grpo", "--steps", "4", "--save-every", "1", "--keep-checkpoints", "9", *gate[0], *gate[1],
             *LORA_KL]
    full = train_in_process(tmp_path / "full", *flags)
    carried = [state(tmp_path / "full", s)["carry"] for s in (1, 2, 3, 4)]
    assert [len(c["gate_history"]) for c in carried] == [1, 2, 3, 4] and carried[0]["gate_fraction"] == 0.1
    assert len({c["gate_fraction"] for c in carried}) > 1  # the share moved
    for before, after in zip(carried, carried[1:]):
        assert after["gate_history"][:-1] == before["gate_history"]
        level = after["gate_history"][-1]  # the step's mean non-negative uncertainty: the rule, restated
        expected = before["gate_fraction"] * (1.1 if level > max(before["gate_history"]) else
                                              0.9 if level < min(before["gate_history"]) else 1.0)
        assert after["gate_fraction"] == pytest.approx(min(max(expected, 0.02), 0.2))
    assert [r["gardo_fraction"] for r in full] == [c["gate_fraction"] for c in carried]
    assert all(0 <= r["gardo_flagged"] <= 0.25 for r in full) and any(r["gardo_flagged"] > 0 for r in full)
    assert all((r["kl"] > 0) == (r["gardo_flagged"] > 0) for r in full[1:])  # no flagged sample, no KL (G L988-989)
    resumed = train_in_process(tmp_path / "resumed", *flags, "--resume", str(tmp_path / "full" / "checkpoints" / "1"))
    assert same_rows(full[1:], resumed)
    assert state(tmp_path / "resumed", 4)["carry"] == carried[3]


def test_the_reference_is_renewed_when_due_the_kl_measured_against_it_and_resumed(tmp_path):
    """--gardo-kl-thres 0: any KL renews the reference at the next step (G L1042-1043, L789). Step 1's KL is 0 (the
    snapshot starts as the trained weights, G L636-641), so no renewal at step 2; step 2's is not, so the snapshot
    becomes the weights after step 2 at the start of step 3, whose KL (one optimizer step: every term before it) is 0
    again, against the snapshot and not the base model. A run resumed from step 2 continues identically."""
    flags = ["--loss", "grpo", "--steps", "4", "--save-every", "1", "--keep-checkpoints", "9", *LORA_KL,
             "--gardo-reference", "--gardo-kl-thres", "0", "--gardo-reset-freq", "100"]
    full = train_in_process(tmp_path / "full", *flags)
    assert [r["gardo_reset"] for r in full] == [0, 0, 1, 0]
    assert full[0]["kl"] == 0 and full[1]["kl"] > 0 and full[2]["kl"] == 0 and full[3]["kl"] > 0
    assert [r["gardo_kl_max"] for r in full] == pytest.approx([r["kl"] for r in full], rel=1e-6)  # one optimizer
    # step per step
    out = tmp_path / "full"
    ref = {s: weights(out, s, "reference") for s in (1, 2, 3, 4)}
    after_2 = weights(out, 2, "trainable")
    assert all(torch.equal(ref[1][n], ref[2][n]) for n in ref[1])  # untouched until due
    assert not all(torch.equal(ref[2][n], after_2[n]) for n in ref[2])
    assert all(torch.equal(ref[3][n], after_2[n]) and torch.equal(ref[4][n], after_2[n]) for n in ref[3])
    assert [state(out, s)["carry"]["last_reset"] for s in (1, 2, 3, 4)] == [0, 0, 2, 2]
    # the plain KL to the base model at step 3 is not 0: the renewal moved the anchor
    base = train_in_process(tmp_path / "base", *flags[:-5])
    assert base[2]["kl"] > 0 and "gardo_reset" not in base[2]
    resumed = train_in_process(tmp_path / "resumed", *flags, "--resume", str(out / "checkpoints" / "2"))
    assert same_rows(full[2:], resumed)
    last = weights(tmp_path / "resumed", 4, "reference")
    assert all(torch.equal(last[n], ref[4][n]) for n in last)


def test_the_forward_process_renews_its_reference_and_gates_as_well(tmp_path, gate):
    """DiffusionNFT with both rules (N L770-781, L1049-1059): renewed every 2 steps by --gardo-reset-freq 1, resumed."""
    flags = ["--loss", "nft", "--steps", "3", "--save-every", "1", "--keep-checkpoints", "9", *gate[0], *gate[1],
             *LORA_KL, "--gardo-reference", "--gardo-reset-freq", "1", "--gardo-kl-thres", "1e9"]
    full = train_in_process(tmp_path / "full", *flags)
    assert [r["gardo_reset"] for r in full] == [0, 0, 1] and all("gardo_flagged" in r for r in full)
    ref, before = weights(tmp_path / "full", 3, "reference"), weights(tmp_path / "full", 2, "trainable")
    assert all(torch.equal(ref[n], before[n]) for n in ref)
    resumed = train_in_process(tmp_path / "resumed", *flags, "--resume", str(tmp_path / "full" / "checkpoints" / "1"))
    assert same_rows(full[1:], resumed)


@pytest.mark.slow  # two torchrun launches of two processes: about a minute on two cores
def test_two_processes_share_the_gate_and_a_sharded_snapshot_that_resumes_exactly(tmp_path, gate):
    """Under torchrun, a full fine-tune sharded by FSDP keeps a KL through the snapshot (no base model to switch to):
    the gate ranks both ranks' samples, the snapshot is sharded like the weights, gathered into reference.safetensors,
    renewed at the due step and scattered back on resume, which then continues as the uninterrupted run."""
    import subprocess
    import sys
    flags = [*SMALL, "--log-images-every", "0", "--train-batch-size", "2", "--steps", "3", "--save-every", "1",
             "--keep-checkpoints", "9", "--lora-rank", "0", "--fsdp", "--mixed-precision", "bf16", "--kl-beta", "0.1",
             *gate[0], *gate[1], "--gardo-reference", "--gardo-reset-freq", "1"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def torchrun(out, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
               *flags, "--out", str(out), *extra]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return metrics(str(out))
    full = torchrun(tmp_path / "full")
    assert [r["gardo_reset"] for r in full] == [0, 0, 1] and full[2]["gardo_kl_max"] == 0  # every rank's KL: 0
    assert (full[1]["gardo_kl_max"] > 0) == (full[1]["gardo_flagged"] > 0)  # over the ranks (G L1041)
    assert all(r["gardo_flagged"] <= 0.25 for r in full)  # a share of the 8 samples of both ranks
    ref, before = weights(tmp_path / "full", 3, "reference"), weights(tmp_path / "full", 2, "trainable")
    assert all(torch.equal(ref[n], before[n]) for n in ref)
    resumed = torchrun(tmp_path / "resumed", "--resume", str(tmp_path / "full" / "checkpoints" / "1"))
    assert same_rows(full[1:], resumed)
    last = weights(tmp_path / "resumed", 3, "reference")
    assert all(torch.equal(last[n], ref[n]) for n in last)


def test_a_full_fine_tune_anchors_its_kl_at_the_starting_weights_with_kl_reference_start(tmp_path, capsys):
    """--kl-reference start: the reference is the step-0 weights for the whole run (kept in every checkpoint, as
    GARDO's snapshot is), the KL measured against it, the same run as GARDO's snapshot never renewed; without an
    anchor a full fine-tune's KL is refused in one line naming the flag."""
    flags = ["--loss", "nft", "--steps", "3", "--save-every", "1", "--keep-checkpoints", "9", "--lora-rank", "0",
             "--kl-beta", "0.1"]
    with pytest.raises(SystemExit):
        train.main([*SMALL, "--out", str(tmp_path / "refused"), *flags])
    assert "add --kl-reference start" in capsys.readouterr().err
    start = train_in_process(tmp_path / "start", *flags, "--kl-reference", "start")
    assert start[0]["kl"] == 0 < start[1]["kl"] and start[2]["kl"] > 0  # one update a step: equal at the first
    assert "gardo_reset" not in start[0]
    first = weights(tmp_path / "start", 1, "reference")
    assert all(torch.equal(weights(tmp_path / "start", 3, "reference")[n], first[n]) for n in first)  # never renewed
    moved = weights(tmp_path / "start", 3, "trainable")
    assert not all(torch.equal(moved[n], first[n]) for n in first)
    never = train_in_process(tmp_path / "never", *flags, "--gardo-reference", "--gardo-reset-freq", "1000000",
                             "--gardo-kl-thres", "1e9")
    drop = ("gardo_reset", "gardo_kl_max", *TIMING)
    assert [{k: v for k, v in r.items() if k not in drop} for r in start] == \
        [{k: v for k, v in r.items() if k not in drop} for r in never]
    resumed = train_in_process(tmp_path / "resumed", *flags, "--kl-reference", "start", "--resume",
                               str(tmp_path / "start" / "checkpoints" / "1"))
    assert same_rows(start[1:], resumed)
    with pytest.raises(SystemExit):
        parser, args = train.parse_args([*SMALL, *flags, "--kl-reference", "start", "--gardo-reference"])
        train.check_args(parser, args, 1)
    assert "pick one" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the diversity-aware advantage
def test_the_diversity_weighted_advantage_is_clipped_again_as_gardo_clips_after_weighting():
    """G L967-971 clamps the advantage to +-adv_clip_max (5) after the tracker's weighting (S L127-135). In a
    near-collapsed group (7 identical images and one novel) the novel image's weight is the group's size, 8: its
    std-normalised advantage 2.65 x 8 = 21 would pass 5 without the clamp. The negative ones keep weight 1, another
    group's advantages are unchanged where no weight pushes them past the clip."""
    _, args = train.parse_args(["--model", "tiny", "--gardo-diversity", "--diversity", "pixels"])
    rewards = torch.tensor([1.0] + [0.0] * 7 + [0.2, 0.4, 0.6, 0.8, 0.1, 0.3, 0.5, 0.7])  # two groups of 8
    groups = torch.arange(2).repeat_interleave(8)
    keep = torch.ones(16, dtype=torch.bool)
    adv = advantages.group_advantages(rewards, groups, clip=args.adv_clip)
    gen = torch.Generator().manual_seed(0)
    images = torch.full((16, 8, 8, 3), 100, dtype=torch.uint8)
    images[0] = torch.randint(0, 256, (8, 8, 3), generator=gen, dtype=torch.uint8)  # the one novel image
    images[8:] = torch.randint(0, 256, (8, 8, 8, 3), generator=gen, dtype=torch.uint8)  # all different
    features = diversity.pixel_features(images)
    weight = advantages.diversity_weights(adv, features, groups).to(adv)
    assert weight[0].item() == pytest.approx(8.0) and (adv[0] * weight[0]).item() > 20  # what the clamp catches
    shaped, info = advantages.step_advantages(rewards, groups, keep, clip=args.adv_clip, features=features)
    assert info["gardo_weight_max"] == pytest.approx(8.0)
    assert shaped[0].item() == pytest.approx(args.adv_clip) and shaped.abs().max().item() <= args.adv_clip
    assert torch.equal(shaped[1:8], adv[1:8])  # negative advantages: weight 1
    unclipped = (adv[8:] * weight[8:]).abs() < args.adv_clip
    assert unclipped.sum() >= 4 and torch.allclose(shaped[8:][unclipped], (adv[8:] * weight[8:])[unclipped])
