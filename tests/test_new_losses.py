"""flow_grpo's online SFT and DPO (scripts/train_sd3_sft.py, train_sd3_dpo.py) through the registry: their sample
weights and pairs, their losses against closed forms and an independent float64 transcription, their logit-normal
training sigmas by Monte Carlo, the snapshot's copy schedule, the pair layout of train.py's micro-batches, and each
loss on the 2-D toy of tests/test_toy_learning.py (the registry's record driving the loop: its advantages, pairs,
training sigmas, old copy and its decay)."""

import copy
import math

import pytest
import torch

import losses
import sde
import train
from test_toy_learning import HYPER, NUM_STEPS, base_model, ode_samples  # noqa: F401 (base_model: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- sample weights and pairs
def test_best_of_group_marks_every_sample_at_the_group_maximum():
    rewards = torch.tensor([0.1, 0.7, 0.7, 0.2, 0.5, 0.5, 0.5, 0.9])
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    assert losses.best_of_group(rewards, groups).tolist() == [0, 1, 1, 0, 0, 0, 0, 1]
    # A group of equal rewards is all "best" (flow_grpo's max == max), whatever the value.
    assert losses.best_of_group(torch.zeros(4), [3, 3, 3, 3]).tolist() == [1, 1, 1, 1]


def test_preference_pairs_take_the_first_best_and_the_first_worst_of_each_group():
    rewards = torch.tensor([0.3, 0.9, 0.1, 0.9, 0.1, 0.4, 0.4, 0.4, 0.2, 0.8, 0.8, 0.2])
    groups = [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    adv = losses.preference_pairs(rewards, groups)
    # group 0: first 0.9 at 1 chosen, first 0.1 at 2 rejected; group 1 tied: no pair; group 2: 9 over 8
    assert adv.tolist() == [0, 1, -1, 0, 0, 0, 0, 0, -1, 1, 0, 0]
    with pytest.raises(ValueError, match="non-finite reward"):
        losses.preference_pairs(torch.tensor([0.0, math.nan]), [0, 0])


# ----------------------------------------------------------------------------- the losses, closed forms
def test_sft_loss_is_the_weighted_flow_matching_error_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    v, x0, eps = (torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64) for _ in range(3))
    v.requires_grad_(True)
    w = torch.tensor([1.0, 0.0, 1.0, 0.0])
    loss, info = losses.sft_loss(v, x0, eps, w)
    target = eps - x0
    expected = sum(w[i] * ((v[i] - target[i]) ** 2).mean() for i in range(4)) / 4  # the mean over all 4 samples
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    d = v[0].numel()
    assert torch.allclose(v.grad, (2 * w.view(-1, 1, 1, 1) * (v - target) / (d * 4)).detach().float().double(),
                          rtol=1e-5, atol=1e-9)
    assert v.grad[1].abs().max() == 0 and info["sft_targets"] == 0.5


def reference_dpo(v, v_ref, x0, eps, beta):
    """flow_grpo train_sd3_dpo.py L924-937, transcribed in float64: the first half chosen, the second rejected."""
    target = (eps - x0).double()
    theta = ((v.double() - target) ** 2).flatten(1).mean(1)
    ref = ((v_ref.double() - target) ** 2).flatten(1).mean(1)
    b = v.shape[0] // 2
    w_l_diff = (theta[:b] - ref[:b]) - (theta[b:] - ref[b:])
    return -torch.log(torch.sigmoid(-0.5 * beta * w_l_diff)).mean()


def test_dpo_loss_matches_the_reference_and_its_gradient_at_the_reference():
    g = torch.Generator().manual_seed(1)
    shape = (6, 2, 4, 4)  # 3 pairs
    x0, eps, v_ref = (torch.randn(shape, generator=g) for _ in range(3))
    v = (v_ref + 0.3 * torch.randn(shape, generator=g)).requires_grad_(True)
    for beta in (1.0, 100.0):
        loss, _ = losses.dpo_loss(v, v_ref, x0, eps, beta=beta)
        assert loss.item() == pytest.approx(reference_dpo(v.detach(), v_ref, x0, eps, beta).item(), rel=1e-5)
    # At v = v_ref: loss log 2, and d loss / d v = +-(beta / 4) 2 (v - target) / (D P) on the chosen / rejected half.
    at_ref = v_ref.clone().requires_grad_(True)
    loss, info = losses.dpo_loss(at_ref, v_ref, x0, eps, beta=100.0)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6) and info["implicit_acc"] == 0
    loss.backward()
    d, p = v_ref[0].numel(), 3
    sign = torch.tensor([1.0, 1, 1, -1, -1, -1]).view(-1, 1, 1, 1)
    assert torch.allclose(at_ref.grad, sign * 25.0 * 2 * (v_ref - (eps - x0)) / (d * p), rtol=1e-4, atol=1e-7)
    # A filler pair (weight 0) adds nothing; the mean still counts it.
    weighted, _ = losses.dpo_loss(v_ref, v_ref, x0, eps, beta=100.0, weight=torch.tensor([1.0, 0.0, 1.0]))
    assert weighted.item() == pytest.approx(2 * math.log(2) / 3, rel=1e-6)
    with pytest.raises(ValueError, match="odd batch"):
        losses.dpo_loss(v_ref[:5], v_ref[:5], x0[:5], eps[:5], beta=1.0)


def test_dpo_loss_falls_as_the_chosen_sample_is_fit_better_than_by_the_reference():
    g = torch.Generator().manual_seed(2)
    x0, eps = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    target, v_ref = eps - x0, eps - x0 + 0.5 * torch.randn(2, 8, generator=g)
    better = torch.stack([target[0], v_ref[1]])  # the chosen fit exactly, the rejected as the reference
    worse = torch.stack([v_ref[0], target[1]])  # the rejected fit exactly
    low, info = losses.dpo_loss(better, v_ref, x0, eps, beta=10.0)
    high, _ = losses.dpo_loss(worse, v_ref, x0, eps, beta=10.0)
    assert low.item() < math.log(2) < high.item() and info["implicit_acc"] == 1


# ----------------------------------------------------------------------------- training sigmas and the snapshot
def test_logit_normal_times_follow_flow_grpos_density():
    """u = sigmoid(n), n ~ N(0, 1), floored to the 1000-step grid: 200,000 draws against the normal's quantiles."""
    pos = losses.LOSSES["dpo"].times(20000, torch.Generator().manual_seed(0), num_steps=10, timestep_fraction=0.99)
    assert pos.shape == (20000, 9) and pos.is_floating_point() and (pos >= 0).all() and (pos < 10).all()
    u = (pos / 10).flatten()
    assert torch.allclose(u * 1000, (u * 1000).round(), atol=1e-3)  # on the grid
    n = torch.logit((u + 0.0005).clamp(1e-6, 1 - 1e-6))  # the grid cell's centre
    for q, z in ((0.1, -1.2816), (0.25, -0.6745), (0.5, 0.0), (0.75, 0.6745), (0.9, 1.2816)):
        assert torch.quantile(n, q).item() == pytest.approx(z, abs=0.02), q


def test_schedule_at_interpolates_between_the_schedules_sigmas():
    sigmas = sde.sd3_sigmas(10)
    assert torch.equal(train.schedule_at(sigmas, torch.tensor([[0, 3]])), sigmas[[0, 3]].unsqueeze(0))
    got = train.schedule_at(sigmas, torch.tensor([[2.25]]))
    assert got.item() == pytest.approx((0.75 * sigmas[2] + 0.25 * sigmas[3]).item(), rel=1e-6)


def test_the_copy_decay_refreshes_the_snapshot_every_ref_update_every_steps():
    decay = losses.OLD_DECAYS["copy"]
    assert [decay(k, ref_update_every=3) for k in range(1, 8)] == [1, 1, 0, 1, 1, 0, 1]
    assert decay(40) == 0 and decay(39) == 1  # flow_grpo's online setting, 40
    assert decay(80, ref_update_every=10_000_000) == 1  # its published configs: never


def test_trained_pairs_keep_each_groups_pair_and_micro_batches_put_chosen_first():
    adv = torch.tensor([0, 1, -1, 0, -1, 0, 0, 1.0])  # groups of 4: pairs (1, 2) and (7, 4)
    pairs = train.trained_pairs(adv, 1, torch.Generator().manual_seed(0))
    assert pairs.tolist() == [[1, 2], [7, 4]]
    padded = train.trained_pairs(adv, 3, torch.Generator().manual_seed(0))  # topped up with copies to 3
    assert len(padded) == 3 and padded[:2].tolist() == [[1, 2], [7, 4]] and padded[2].tolist() in ([1, 2], [7, 4])
    filler = train.trained_pairs(torch.zeros(8), 2, torch.Generator().manual_seed(0))  # no pair: advantage-0 fillers
    assert filler.shape == (2, 2) and len(set(filler.flatten().tolist())) == 4
    assert pairs.T.reshape(-1).tolist() == [1, 7, 2, 4]  # the micro-batch train_on_batch builds: chosen, rejected


def test_a_pair_loss_refuses_groups_split_over_processes_and_odd_micro_batches(capsys):
    p, args = train.parse_args(["--model", "tiny", "--loss", "dpo", "--prompts-per-step", "3", "--group-size", "4",
                                "--sample-batch-size", "2", "--train-batch-size", "2"])
    with pytest.raises(SystemExit):
        train.check_args(p, args, 2)  # 6 samples per process, groups of 4
    assert "multiple of --group-size 4" in capsys.readouterr().err
    p, args = train.parse_args(["--model", "tiny", "--loss", "dpo", "--train-batch-size", "1"])
    with pytest.raises(SystemExit):
        train.check_args(p, args, 1)
    assert "--train-batch-size even" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the toy
def fine_tune_pairs(model, loss_name, *, lr, iters=30, batch=128, group=16, ref_update_every=5):
    """The registry's record runs the loop, as train.py does: its advantages (best of group / preference pairs),
    its pairs (chosen and rejected re-noised alike), its logit-normal sigmas, the snapshot that samples (and is
    DPO's reference), hard-copied every ref_update_every steps."""
    record = losses.LOSSES[loss_name]
    hyper = dict(HYPER, timestep_fraction=0.99, dpo_beta=100.0, ref_update_every=ref_update_every)
    sigmas = sde.sd3_sigmas(NUM_STEPS)
    old = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    group_ids = torch.arange(batch) // group
    log = []
    for k in range(iters):
        x0 = sde.ode_sample(old, torch.randn(batch, 2, generator=g), sigmas, solver="dpm2")  # the snapshot samples
        adv = record.advantages((x0[:, 0] > 0).float(), group_ids)
        ids = train.trained_pairs(adv, 1, g).T.reshape(-1) if record.pairs else torch.arange(batch)
        x0, adv = x0[ids], adv[ids]
        times = record.times(len(ids), g, **hyper)
        eps = torch.randn(times.shape[1], len(ids), 2, generator=g)
        if record.pairs:
            half = len(ids) // 2
            times[half:], eps[:, half:] = times[:half], eps[:, :half]
        s = train.schedule_at(sigmas, times)
        opt.zero_grad()
        for j in range(times.shape[1]):
            x_t = sde.renoise(x0, eps[j], s[:, j])
            with torch.no_grad():
                v_old = old(x_t, s[:, j])
            value, info = record.fn(dict(v=model(x_t, s[:, j]), x_t=x_t, x0=x0, noise=eps[j], sigma=s[:, j], adv=adv,
                                         v_old=v_old, v_ref=None), **hyper)
            (value / times.shape[1]).backward()
            log.append(dict(info, iteration=k))
        opt.step()
        decay = losses.OLD_DECAYS[record.defaults["old_decay"]](k + 1, **hyper)
        with torch.no_grad():
            for p_old, p in zip(old.parameters(), model.parameters()):
                p_old.lerp_(p, 1 - decay)
    return log


@pytest.mark.parametrize("loss_name, lr", [("sft", 3e-3), ("dpo", 3e-3)])
def test_online_sft_and_dpo_move_the_samples_to_the_rewarded_mode(base_model, loss_name, lr):  # noqa: F811
    """The reward prefers the right mode (x > 0). Base model: about half the samples on the right. (DPO at 1e-3 or
    2e-3 reaches 0.78 in 30 iterations: 8 pairs a batch carry less than SFT's best samples.)"""
    model = copy.deepcopy(base_model)
    log = fine_tune_pairs(model, loss_name, lr=lr)
    if loss_name == "dpo":  # the first batch is exactly at the reference: log 2 per pair
        assert all(abs(info["implicit_acc"]) == 0 for info in log if info["iteration"] == 0)
        assert sum(info["implicit_acc"] for info in log[-20:]) / 20 > 0.5
    y = ode_samples(model)
    right = (y[:, 0] > 0).float().mean().item()
    assert right >= 0.9, right
    assert (y[y[:, 0] > 0].std(dim=0) < 0.75).all()  # still one compact mode
