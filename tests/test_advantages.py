"""The ADVANTAGES phase (advantages.py): step_advantages and gardo_gate against the rules they compose, and train.py's
phase handing its results on as returned values (the advantages, the trained ids, GARDO's gate), not as keys left on
the rollout batch. The rules themselves: tests/test_losses.py (group_advantages, combined_advantages),
tests/test_new_losses.py (best_of_group, preference_pairs), tests/test_regularizers.py (GARDO's)."""
from types import SimpleNamespace

import pytest
import torch

import advantages
import losses
import train

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.25, 3.0, 1.0, 2.0, 0.0, 9.0, 9.0, 1.0, 4.0])  # three groups of 4
GROUPS = torch.arange(3).repeat_interleave(4)
KEEP = ~torch.tensor([False, True, False]).repeat_interleave(4)  # the second group's rewards did not all arrive
AUX = torch.tensor([0.0, 5.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.1, 3.0, 0.2])  # an auxiliary reward for the gate


def test_the_kept_samples_take_the_loss_rule_and_the_dropped_ones_zero():
    for rule in (advantages.group_advantages, advantages.best_of_group, advantages.preference_pairs):
        adv, info = advantages.step_advantages(REWARDS, GROUPS, KEEP, rule=rule, clip=5.0)
        assert info == {}
        assert adv[4:8].eq(0).all()
        assert torch.equal(adv[KEEP], rule(REWARDS[KEEP], GROUPS[KEEP], global_std=False, clip=5.0))
    adv, _ = advantages.step_advantages(REWARDS, GROUPS, KEEP)
    centred = REWARDS[:4] - REWARDS[:4].mean()
    torch.testing.assert_close(adv[:4], centred / (centred.pow(2).mean().sqrt() + 1e-4))  # GRPO's, by hand


def test_a_mix_sums_each_components_group_advantage_over_the_kept_samples():
    other = torch.arange(12.0).flip(0)
    adv, info = advantages.step_advantages(REWARDS, GROUPS, KEEP, mix=({"a": REWARDS, "b": other}, {"a": 3, "b": 1}),
                                           clip=5.0)
    a = advantages.group_advantages(REWARDS[KEEP], GROUPS[KEEP], clip=float("inf"))
    b = advantages.group_advantages(other[KEEP], GROUPS[KEEP], clip=float("inf"))
    torch.testing.assert_close(adv[KEEP], (0.75 * a + 0.25 * b).clamp(-5, 5))
    assert adv[4:8].eq(0).all()
    assert set(info) == {"reward/a_std", "reward/b_std", "reward/a_share", "reward/b_share"}
    assert info["reward/a_share"] + info["reward/b_share"] == pytest.approx(1.0)


def test_diversity_scales_only_the_positive_advantages_of_the_kept_samples():
    features = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    plain, _ = advantages.step_advantages(REWARDS, GROUPS, KEEP)
    shaped, info = advantages.step_advantages(REWARDS, GROUPS, KEEP, features=features)
    weight = advantages.diversity_weights(plain[KEEP], features[KEEP], GROUPS[KEEP]).float()
    torch.testing.assert_close(shaped[KEEP], (plain[KEEP] * weight).clamp(-5, 5))
    assert torch.equal(shaped[plain < 0], plain[plain < 0]) and shaped[4:8].eq(0).all()
    assert info["gardo_weight_max"] == pytest.approx(weight.max().item())


def test_the_gate_flags_kept_samples_only_and_carries_its_share():
    flagged, fraction, history = advantages.gardo_gate(REWARDS, [AUX], KEEP)
    u = advantages.uncertainty(REWARDS[KEEP], [AUX[KEEP]])  # by hand: the trained rank - the auxiliary rank
    assert u.tolist() == [-4.0, 7.0, 2.0, 4.0, -4.0, -5.0, 3.0, -3.0]
    assert fraction == 0.1 and history == [4.0]  # the first step sets the base share; the level: mean of u >= 0
    assert flagged.nonzero().flatten().tolist() == [1]  # u = 7, above the 90th percentile of the u >= 0
    _, fraction, history = advantages.gardo_gate(REWARDS, [REWARDS], KEEP, fraction, history)  # u = 0 everywhere
    assert fraction == pytest.approx(0.09) and history == [4.0, 0.0]  # a lower level: the share x 0.9


def test_train_advantages_returns_the_gate_and_leaves_the_batch_alone():
    """train.py's phase on one rank: the gate and the trained ids come back in its result; the batch (the rollout
    storage) gets no key of the phase's (the gate once travelled there as batch["kl_gate"])."""
    _, args = train.parse_args(["--model", "tiny", "--loss", "grpo", "--prompts-per-step", "3", "--group-size", "4",
                                "--sample-batch-size", "4", "--train-batch-size", "4",
                                "--kl-beta", "0.1", "--reward", "jpeg_compressibility=1,jpeg_incompressibility=0",
                                "--reward-key", "jpeg_compressibility", "--gardo-gate", "jpeg_incompressibility"])
    got = SimpleNamespace(dropped=torch.tensor([False, True, False]),
                          scores={"jpeg_compressibility": REWARDS, "jpeg_incompressibility": AUX,
                                  "reward": REWARDS})
    batch, carry = {"prompts": ["p"] * 12}, {}
    out, info = train.advantages(got, losses.LOSSES["grpo"], args, 0, 12, batch, carry)
    assert set(batch) == {"prompts"}
    expected, _ = advantages.step_advantages(REWARDS, GROUPS, KEEP)
    torch.testing.assert_close(out["adv"], expected)
    flagged, fraction, _ = advantages.gardo_gate(REWARDS, [AUX], KEEP)
    assert torch.equal(out["kl_gate"], flagged) and carry["gate_fraction"] == fraction
    assert out["rank_weight"] == 1.0 and info["dropped_groups"] == 1 and info["gardo_flagged"] == 0.125
    ids = out["ids"].tolist()  # every live sample, topped up with one advantage-0 sample to 3 micro-batches of 3
    assert sorted(ids[:8]) == [0, 1, 2, 3, 8, 9, 10, 11] and len(ids) == 9 and 4 <= ids[8] < 8
