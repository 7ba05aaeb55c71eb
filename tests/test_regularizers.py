"""GARDO's rules (advantages.py, regularizers.py) against hand-worked values and against the authors' code at
tinnerhrhe/GARDO 1cc77fb, rule by rule (G = scripts/train_sd3_grpo_gardo.py, N = scripts/train_sd3_nft_gardo.py,
S = flow_grpo/stat_tracking.py). The references below restate each rule in numpy as the cited lines compute it."""

import numpy as np
import pytest
import torch

import advantages
import losses
import regularizers


def test_uncertainty_is_the_trained_rank_less_the_mean_auxiliary_rank():
    """G L827-834: ranks 1 = highest; u = rank(main) - (rank(aesthetic) + rank(imagereward)) / 2."""
    main, aux = torch.tensor([3.0, 2.0, 1.0]), [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 3.0, 2.0])]
    # ranks: main 1, 2, 3; aux 3, 2, 1 and 3, 1, 2 -> means 3, 1.5, 1.5
    assert advantages.uncertainty(main, aux).tolist() == [-2.0, 0.5, 1.5]
    with pytest.raises(ValueError, match="auxiliary"):
        advantages.uncertainty(main, [])


def test_an_auxiliary_reward_that_left_samples_unscored_judges_only_those_it_scored():
    """NaN (a row that chose other components) would sort first, as the best; instead each auxiliary reward ranks what
    it scored, stretched onto 1..N, and a sample none scored is never flagged (worked by hand)."""
    nan = float("nan")
    main = torch.tensor([4.0, 3.0, 2.0, 1.0])  # ranks 1, 2, 3, 4
    aux = [torch.tensor([nan, 1.0, 2.0, 3.0]),  # ranks 3, 2, 1 among the scored -> 4, 2.5, 1 on 1..4
           torch.tensor([nan, nan, 5.0, 6.0])]  # ranks 2, 1 -> 4, 1
    u = advantages.uncertainty(main, aux)
    assert torch.isnan(u[0]) and u[1:].tolist() == [2 - 4, 3 - (2.5 + 4) / 2, 4 - (1 + 1) / 2]
    assert not advantages.kl_gate(torch.cat([u, torch.tensor([0.0, 1.0])]), 0.5)[0]
    assert advantages.gate_fraction(0.1, [], u)[1] == [3.0]  # the level: the mean of the non-negative u alone
    full = [torch.tensor([1.0, 2.0, 3.0, 4.0])]
    gardo = advantages.ranks(main) - advantages.ranks(full[0])  # every sample scored: GARDO's ranks exactly
    assert advantages.uncertainty(main, full).tolist() == gardo.tolist()


class RiskCompensatorReference:
    """G L219-238, restated."""
    def __init__(self):
        self.buffer, self.beta = [], 0.1

    def update(self, scores):
        level = np.mean(scores)
        if not self.buffer:
            self.beta = 0.1
        elif level > max(self.buffer):
            self.beta *= 1.1
        elif level < min(self.buffer):
            self.beta *= 0.9
        self.beta = float(np.clip(self.beta, 0.02, 0.2))
        self.buffer = (self.buffer + [level])[-20:]


def test_gate_fraction_follows_the_risk_compensator():
    rng = np.random.default_rng(0)
    ref, fraction, history = RiskCompensatorReference(), 0.5, []
    for step in range(60):
        u = rng.normal(step % 7, 2.0, 32)
        ref.update(u[u >= 0])
        fraction, history = advantages.gate_fraction(fraction, history, torch.tensor(u))
        assert fraction == pytest.approx(ref.beta) and history == pytest.approx(ref.buffer)
    assert advantages.gate_fraction(0.5, [], torch.tensor([1.0]))[0] == 0.1  # the first update sets the base
    assert advantages.gate_fraction(0.2, [0.5], torch.tensor([3.0]))[0] == 0.2  # x 1.1, clipped to 0.2


def test_gate_flags_u_above_the_percentile_of_the_non_negative_u():
    """G L835-837: threshold = np.percentile(u[u >= 0], 100 - 100 fraction); flagged = u > threshold."""
    u = torch.tensor([-2.0, 0.0, 2.0, 1.0, 3.0])
    # percentile 80 of [0, 1, 2, 3] = 2.4 (linear): only 3 is above
    assert advantages.kl_gate(u, 0.2).tolist() == [False, False, False, False, True]
    rng = np.random.default_rng(1)
    for fraction in (0.02, 0.1, 0.137, 0.2):
        v = rng.normal(0, 3, 48).round(1)
        expected = v > np.percentile(v[v >= 0], 100 - fraction * 100)
        assert advantages.kl_gate(torch.tensor(v), fraction).numpy().tolist() == expected.tolist()
    assert not advantages.kl_gate(torch.tensor([-1.0, -2.0]), 0.1).any()


def test_gated_kl_over_the_flagged_samples():
    kl = torch.tensor([1.0, 2.0, 3.0, 6.0], requires_grad=True)
    flagged = torch.tensor([False, True, False, True])
    assert losses.gated_kl(kl, flagged).item() == 4.0  # (2 + 6) / 2
    none = torch.zeros(4, dtype=torch.bool)
    assert losses.gated_kl(kl, none).item() == 0.0  # G L988-989: no KL term
    assert losses.gated_kl(kl, none, empty="all").item() == 3.0  # N L1054-1056: every sample
    losses.gated_kl(kl, flagged).backward()
    assert kl.grad.tolist() == [0.0, 0.5, 0.0, 0.5]  # no gradient reaches the samples the gate leaves out


def test_reference_reset_schedule():
    """G L789-799 with C reset_freq 15, kl_thres 3e-4: reset after a step's KL above kl_thres, or every 16 epochs."""
    kw = dict(reset_freq=15, kl_thres=3e-4)
    assert not regularizers.reference_due(0, 0, 1.0, **kw)  # never at step 0
    assert regularizers.reference_due(3, 0, 5e-4, **kw) and not regularizers.reference_due(3, 0, 3e-4, **kw)
    assert not regularizers.reference_due(15, 0, 0.0, **kw) and regularizers.reference_due(16, 0, 0.0, **kw)
    last, resets = 0, []
    for step in range(1, 60):  # KL never high: resets at 16, 32, 48
        if regularizers.reference_due(step, last, 0.0, **kw):
            resets.append(step)
            last = step
    assert resets == [16, 32, 48]


def diversity_reference(prompts, rewards, dists):
    """S L96-135, type 'gardo', restated on one reward column."""
    prompts, rewards = np.array(prompts), np.asarray(rewards, dtype=np.float64)
    dists = np.asarray(dists) / np.linalg.norm(dists, ord=2, axis=1, keepdims=True)
    adv = np.zeros_like(rewards)
    for p in np.unique(prompts):
        r = rewards[prompts == p]
        mean = r.mean()
        f = dists[prompts == p]
        d = 1 - np.dot(f, f.T).clip(-1, 1)
        nearest = np.array([np.min(d[i, np.arange(len(d)) != i]) for i in range(len(d))])
        weight = np.where(r - mean < 0, 1.0, nearest / nearest.mean())
        adv[prompts == p] = (r - mean) * weight
    return adv


def test_diversity_advantage_scales_positive_advantages_by_novelty():
    features = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]])  # the first two alike, the third apart
    adv = advantages.diversity_advantages(torch.tensor([1.0, 0.0, 2.0]), features, torch.tensor([0, 0, 0]))
    # nearest distances 0, 0, 1 (mean 1/3); centred rewards 0, -1, 1 -> 0 x 0, -1 x 1, 1 x 3
    assert adv.tolist() == pytest.approx([0.0, -1.0, 3.0])
    rng = np.random.default_rng(2)
    groups = np.repeat(np.arange(4), 6)
    rewards, feats = rng.random(24), rng.normal(size=(24, 8))
    ours = advantages.diversity_advantages(torch.tensor(rewards), torch.tensor(feats), torch.tensor(groups))
    assert ours.numpy() == pytest.approx(diversity_reference([f"p{g}" for g in groups], rewards, feats))


def test_diversity_weights_leave_negative_advantages_and_identical_groups():
    features = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    w = advantages.diversity_weights(torch.tensor([0.5, -1.0, 0.5, 1.0, -1.0]), features, groups)
    # group 0: nearest distances 0, 0, 1 (mean 1/3); group 1: identical images, weight 1
    assert w.tolist() == pytest.approx([0.0, 1.0, 3.0, 1.0, 1.0])


def test_gardo_diversity_trains_any_loss_and_needs_features(tmp_path):
    import json
    import os
    import sys

    from transformers import Dinov2Config, Dinov2Model

    import forkserver
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    small = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4",
             "--train-batch-size", "4", "--num-steps", "4", "--resolution", "32", "--steps", "1"]
    refused = forkserver.run([sys.executable, "train.py", *small, "--gardo-diversity", "--out", str(tmp_path / "no")],
                             cwd=root, timeout=300)
    assert refused.returncode != 0 and "--diversity dinov2" in refused.stderr.strip().splitlines()[-1]
    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             image_size=32, patch_size=8)).save_pretrained(tmp_path / "dinov2")
    for loss, features in (("grpo", ["dinov2", "--diversity-path", str(tmp_path / "dinov2")]), ("nft", ["pixels"])):
        out = tmp_path / loss
        done = forkserver.run([sys.executable, "train.py", *small, "--loss", loss, "--gardo-diversity", "--diversity",
                               *features, "--out", str(out)], cwd=root, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        step = [json.loads(line) for line in open(out / "metrics.jsonl")][-1]
        assert step["gardo_weight_max"] >= 1.0  # the most novel positive sample weighs at least the mean
        assert 0 <= step["diversity_features"] <= 2
