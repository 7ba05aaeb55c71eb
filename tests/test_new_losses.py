"""flow_grpo's online SFT and DPO (scripts/train_sd3_sft.py, train_sd3_dpo.py) through the registry: their sample
weights and pairs, their losses against closed forms and an independent float64 transcription, their logit-normal
training sigmas by Monte Carlo, the snapshot's copy schedule, the pair layout of train.py's micro-batches, and each
loss on the 2-D toy of tests/test_toy_learning.py (the registry's record driving the loop: its advantages, pairs,
training sigmas, old copy and its decay)."""

import copy
import math

import pytest
import torch

import advantages
import losses
import sde
import train
from test_toy_learning import HYPER, NUM_STEPS, base_model, ode_samples  # noqa: F401 (base_model: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- sample weights and pairs
def test_best_of_group_marks_every_sample_at_the_group_maximum():
    rewards = torch.tensor([0.1, 0.7, 0.7, 0.2, 0.5, 0.5, 0.5, 0.9])
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    assert advantages.best_of_group(rewards, groups).tolist() == [0, 1, 1, 0, 0, 0, 0, 1]
    # A group of equal rewards is all "best" (flow_grpo's max == max), whatever the value.
    assert advantages.best_of_group(torch.zeros(4), [3, 3, 3, 3]).tolist() == [1, 1, 1, 1]


def test_preference_pairs_take_the_first_best_and_the_first_worst_of_each_group():
    rewards = torch.tensor([0.3, 0.9, 0.1, 0.9, 0.1, 0.4, 0.4, 0.4, 0.2, 0.8, 0.8, 0.2])
    groups = [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    adv = advantages.preference_pairs(rewards, groups)
    # group 0: first 0.9 at 1 chosen, first 0.1 at 2 rejected; group 1 tied: no pair; group 2: 9 over 8
    assert adv.tolist() == [0, 1, -1, 0, 0, 0, 0, 0, -1, 1, 0, 0]
    with pytest.raises(ValueError, match="non-finite reward"):
        advantages.preference_pairs(torch.tensor([0.0, math.nan]), [0, 0])


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
    """flow_grpo train_sd3_dpo.py L924-937, transcribed in float64, its halves (chosen, then rejected) taken from
    the [chosen, rejected] rows of the batch here."""
    order = torch.cat([torch.arange(0, v.shape[0], 2), torch.arange(1, v.shape[0], 2)])
    v, v_ref, x0, eps = v[order], v_ref[order], x0[order], eps[order]
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
    sign = torch.tensor([1.0, -1, 1, -1, 1, -1]).view(-1, 1, 1, 1)
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
    better = torch.stack([target[0], v_ref[1]])  # the chosen (row 0) fit exactly, the rejected as the reference
    worse = torch.stack([v_ref[0], target[1]])  # the rejected fit exactly
    low, info = losses.dpo_loss(better, v_ref, x0, eps, beta=10.0)
    high, _ = losses.dpo_loss(worse, v_ref, x0, eps, beta=10.0)
    assert low.item() < math.log(2) < high.item() and info["implicit_acc"] == 1


def reference_dgpo(v, v_ref, x0, eps, adv, groups, beta, group_size):
    """Flow-Factory dgpo.py L448-528 by loops, float64: the group sums, their sigmoid, the weighted mean."""
    err = [((v[i].double() - (eps[i] - x0[i]).double()) ** 2).mean() for i in range(len(v))]
    ref = [((v_ref[i].double() - (eps[i] - x0[i]).double()) ** 2).mean() for i in range(len(v))]
    total = 0.0
    for i in range(len(v)):
        s = sum(adv[j] * beta * (err[j].detach() - ref[j]) / group_size for j in range(len(v)) if groups[j] == groups[i])
        total = total + torch.sigmoid(torch.as_tensor(s, dtype=torch.float64)) * adv[i] * err[i]
    return total / len(v)


def test_dgpo_loss_matches_its_group_sums_and_its_gradient_at_the_reference():
    g = torch.Generator().manual_seed(3)
    shape = (8, 2, 3, 3)  # two groups of 4
    x0, eps, v_ref = (torch.randn(shape, generator=g) for _ in range(3))
    adv = torch.tensor([1.5, -0.5, -1.0, 0.0, 0.7, 0.7, -1.4, 0.0])
    unit = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    v = (v_ref + 0.4 * torch.randn(shape, generator=g)).requires_grad_(True)
    loss, info = losses.dgpo_loss(v, v_ref, x0, eps, adv, unit, beta=10.0, group_size=4)
    expected = reference_dgpo(v.detach(), v_ref, x0, eps, adv.tolist(), unit.tolist(), 10.0, 4)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5) and info["clipfrac"] == 0
    # At v = v_ref every group weight is sigmoid(0) = 1/2: d loss / d v_i = A_i (v_i - target_i) / (D B).
    at_ref = v_ref.clone().requires_grad_(True)
    loss, info = losses.dgpo_loss(at_ref, v_ref, x0, eps, adv, unit, beta=10.0, group_size=4)
    loss.backward()
    assert info["dgpo_weight"] == pytest.approx(0.5)
    want = adv.view(-1, 1, 1, 1) * (v_ref - (eps - x0)) / (v_ref[0].numel() * 8)
    assert torch.allclose(at_ref.grad, want, rtol=1e-4, atol=1e-8)


def test_dgpo_clip_holds_the_error_of_samples_that_moved_far_in_their_advantages_direction():
    g = torch.Generator().manual_seed(4)
    x0, eps = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    target = eps - x0
    v_old = target + 0.5 * torch.randn(4, 6, generator=g)
    # sample 0 (A > 0) fit much better than the old copy: ratio exp(e_old - e) > 1.05, clipped; sample 1 (A > 0)
    # as the old copy: kept; sample 2 (A < 0) fit much worse: ratio < 0.95, clipped; sample 3 (A < 0) kept.
    v = torch.stack([target[0], v_old[1], v_old[2] + 2.0, v_old[3]]).requires_grad_(True)
    adv, unit = torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.tensor([0, 0, 1, 1])
    loss, info = losses.dgpo_loss(v, v_old, x0, eps, adv, unit, beta=1.0, group_size=2, v_old=v_old, clip_range=0.05)
    loss.backward()
    assert info["clipfrac"] == 0.5
    assert v.grad[0].abs().max() == 0 and v.grad[2].abs().max() == 0
    assert v.grad[1].abs().max() > 0 and v.grad[3].abs().max() > 0


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


def test_dgpo_times_are_four_shared_strata_of_the_first_sixty_percent():
    times = losses.LOSSES["dgpo"].times(5, torch.Generator().manual_seed(0), num_steps=10, train_timesteps=4,
                                        timestep_fraction=0.6)
    assert times.shape == (5, 4) and (times == times[:1]).all()  # shared by the micro-batch
    assert times[0, 0] == 0 and times[0, 1] in (1, 2) and times[0, 2] == 3 and times[0, 3] in (4, 5)
    assert not losses.LOSSES["dgpo"].samples_with_old(200, dgpo_switch_step=200)
    assert losses.LOSSES["dgpo"].samples_with_old(201, dgpo_switch_step=200)


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
    assert pairs.reshape(-1).tolist() == [1, 2, 7, 4]  # the micro-batch train_on_batch builds: chosen, rejected


def test_renoised_shares_a_pairs_draws_and_a_groups_noise():
    """train.renoised, as train_on_batch calls it: a DPO pair shares its noise and sigmas (Diffusion-DPO), a DGPO
    group one noise at all its sigmas and the micro-batch's shared strata; t["unit"] names each sample's unit."""
    batch = dict(latents=torch.randn(8, 1, 4, 2, 2, generator=torch.Generator().manual_seed(0)))
    sigmas = sde.sd3_sigmas(10)
    _, args = train.parse_args(["--model", "tiny", "--loss", "dpo"])
    fp = train.renoised(losses.LOSSES["dpo"], batch, torch.tensor([1, 2, 7, 4]), sigmas, args, (0, 0, 0, 0))
    assert fp["unit"].tolist() == [0, 0, 1, 1] and fp["s"].shape == (4, 9)
    assert torch.equal(fp["s"][0], fp["s"][1]) and torch.equal(fp["noise"][:, 0], fp["noise"][:, 1])
    assert not torch.equal(fp["s"][0], fp["s"][2]) and not torch.equal(fp["noise"][:, 0], fp["noise"][:, 2])
    assert torch.equal(fp["x0"][1], batch["latents"][2, -1])  # the rejected sample, re-noised with the chosen's noise
    _, args = train.parse_args(["--model", "tiny", "--loss", "dgpo", "--group-size", "4"])
    fp = train.renoised(losses.LOSSES["dgpo"], batch, torch.arange(8), sigmas, args, (0, 0, 0, 0))
    assert fp["unit"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and (fp["s"] == fp["s"][:1]).all()
    noise = fp["noise"]  # [n, b, ...]: one per group, the same at every sigma
    assert all(torch.equal(noise[j, i], noise[0, 4 * (i // 4)]) for j in range(len(noise)) for i in range(8))
    assert not torch.equal(noise[0, 0], noise[0, 4])


def test_pair_and_group_losses_refuse_split_units_and_a_missing_base(capsys):
    p, args = train.parse_args(["--model", "tiny", "--loss", "dpo", "--prompts-per-step", "3", "--group-size", "4",
                                "--sample-batch-size", "2", "--train-batch-size", "2"])
    with pytest.raises(SystemExit):
        train.check_args(p, args, 2)  # 6 samples per process, groups of 4
    assert "multiple of --group-size 4" in capsys.readouterr().err
    p, args = train.parse_args(["--model", "tiny", "--loss", "dpo", "--train-batch-size", "1"])
    with pytest.raises(SystemExit):
        train.check_args(p, args, 1)
    assert "--train-batch-size a multiple of 2" in capsys.readouterr().err
    p, args = train.parse_args(["--model", "tiny", "--loss", "dgpo", "--train-batch-size", "4"])  # groups of 8
    with pytest.raises(SystemExit):
        train.check_args(p, args, 1)
    err = capsys.readouterr().err
    assert "whole groups" in err and "--train-batch-size a multiple of 8" in err
    p, args = train.parse_args(["--model", "tiny", "--loss", "dgpo", "--dgpo-reference", "base"])  # full fine-tune
    with pytest.raises(SystemExit):
        train.check_args(p, args, 1)
    assert "compares with the base model" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the toy
def fine_tune_units(model, loss_name, *, lr, iters=30, batch=128, group=16, ref_update_every=5, **flags):
    """The registry's record runs the loop, as train.py does: its advantages (best of group / preference pairs /
    group-relative), its units (pairs and groups re-noised alike, in whole rows), its training sigmas, the old copy
    that samples when the record says so (and is DPO's reference), decayed by the record's schedule."""
    record = losses.LOSSES[loss_name]
    hyper = dict(HYPER, **{k: v for k, v in record.defaults.items() if k != "sampler"})
    hyper.update(ref_update_every=ref_update_every, group_size=group, dgpo_clip=True, dgpo_switch_step=200, **flags)
    sigmas = sde.sd3_sigmas(NUM_STEPS)
    old = copy.deepcopy(model).requires_grad_(False)
    base = copy.deepcopy(model).requires_grad_(False) if record.reference and record.reference(hyper) else None
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    group_ids = torch.arange(batch) // group
    log = []
    for k in range(iters):
        use_old = record.samples_with_old(k, **hyper) if callable(record.samples_with_old) else record.samples_with_old
        x0 = sde.ode_sample(old if use_old else model, torch.randn(batch, 2, generator=g), sigmas,
                            solver=record.defaults["sampler"])
        adv = record.advantages((x0[:, 0] > 0).float(), group_ids)
        ids = train.trained_pairs(adv, 1, g).reshape(-1) if record.unit == "pair" else torch.arange(batch)
        x0, adv = x0[ids], adv[ids]
        times = record.times(len(ids), g, **hyper)
        eps = torch.randn(times.shape[1], len(ids), 2, generator=g)
        width = {"sample": 1, "pair": 2, "group": group}[record.unit]
        unit = torch.arange(len(ids)) // width
        times, eps = times[unit * width], eps[:, unit * width]  # train.renoised: a unit shares its draws
        if record.unit == "group":
            eps = eps[:1].expand_as(eps)
        s = train.schedule_at(sigmas, times)
        opt.zero_grad()
        for j in range(times.shape[1]):
            x_t = sde.renoise(x0, eps[j], s[:, j])
            with torch.no_grad():
                v_old, v_ref = old(x_t, s[:, j]), None if base is None else base(x_t, s[:, j])
            value, info = record.fn(dict(v=model(x_t, s[:, j]), x_t=x_t, x0=x0, noise=eps[j], sigma=s[:, j], adv=adv,
                                         unit=unit, v_old=v_old, v_ref=v_ref), **record.hyper(hyper))
            (value / times.shape[1]).backward()
            log.append(dict(info, iteration=k))
        opt.step()
        decay = losses.OLD_DECAYS[record.defaults["old_decay"]](k + 1, **hyper)
        with torch.no_grad():
            for p_old, p in zip(old.parameters(), model.parameters()):
                p_old.lerp_(p, 1 - decay)
    return log


# DGPO against the base model, Flow-Factory's default, at beta 1: at its beta 10 or 100 the group weights saturate on
# the toy within a few steps (0.69 of the samples right after 30 at beta 10); against the old copy (which tracks the
# weights, so every weight stays 1/2) it is advantage-weighted flow matching and overshoots the mode (x ~ 6 at 3e-3).
# Its negative advantages push the samples away from the left mode with nothing but the weights' saturation to stop
# them, hence a wider spread on the right (0.90 in x; the reward is indifferent to where on the right).
@pytest.mark.parametrize("loss_name, lr, flags, spread", [
    ("sft", 3e-3, {}, 0.75), ("dpo", 3e-3, {}, 0.75), ("dgpo", 3e-3, dict(dgpo_reference="base", dpo_beta=1.0), 1.0)])
def test_sft_dpo_and_dgpo_move_the_samples_to_the_rewarded_mode(base_model, loss_name, lr, flags, spread):  # noqa: F811
    """The reward prefers the right mode (x > 0). Base model: about half the samples on the right. (DPO at 1e-3 or
    2e-3 reaches 0.78 in 30 iterations: 8 pairs a batch carry less than SFT's best samples.)"""
    model = copy.deepcopy(base_model)
    log = fine_tune_units(model, loss_name, lr=lr, **flags)
    if loss_name == "dpo":  # the first batch is exactly at the reference: log 2 per pair
        assert all(abs(info["implicit_acc"]) == 0 for info in log if info["iteration"] == 0)
        assert sum(info["implicit_acc"] for info in log[-20:]) / 20 > 0.5
    if loss_name == "dgpo":  # the first batch is at the base: every group weight 1/2; later ones move
        assert all(info["dgpo_weight"] == 0.5 for info in log if info["iteration"] == 0)
        assert any(info["dgpo_weight"] != 0.5 for info in log if info["iteration"] == 1)
    y = ode_samples(model)
    right = (y[:, 0] > 0).float().mean().item()
    assert right >= 0.9, right
    assert (y[y[:, 0] > 0].std(dim=0) < spread).all()  # still one mode


def test_dgpo_compares_with_the_base_model_on_lora_runs_and_with_the_old_copy_on_full_fine_tunes():
    """Flow-Factory's default reference is the base model (use_ema_ref false): the LoRA adapter switched off. A full
    fine-tune keeps no base model, so it compares with the old copy unless --dgpo-reference says otherwise."""
    _, recipe = train.parse_args(["@recipes/sd3_dgpo_pickscore.args"])
    assert recipe.dgpo_reference is None and losses._dgpo_reference(vars(recipe)) == "base"
    assert losses.LOSSES["dgpo"].reference(vars(recipe))
    _, full = train.parse_args(["@recipes/sd3_dgpo_pickscore.args", "--lora-rank", "0"])
    assert losses._dgpo_reference(vars(full)) == "old" and not losses.LOSSES["dgpo"].reference(vars(full))
    _, chosen = train.parse_args(["@recipes/sd3_dgpo_pickscore.args", "--dgpo-reference", "old"])
    assert losses._dgpo_reference(vars(chosen)) == "old"
