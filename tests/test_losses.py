"""losses.py against hand-written references, torch.distributions and Monte Carlo."""

import inspect
import math

import pytest
import torch

import advantages
import losses

Normal = torch.distributions.Normal


# ----------------------------------------------------------------------------- advantages
def test_group_advantages_match_a_loop():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 0.5, -0.5])
    group_ids = [7, 7, 7, 2, 2, 2, 5, 5]  # any ints, any order
    adv = advantages.group_advantages(rewards, group_ids)
    expected = []
    for i, r in enumerate(rewards.tolist()):
        group = [rewards[j].item() for j in range(8) if group_ids[j] == group_ids[i]]
        mean = sum(group) / len(group)
        std = (sum((g - mean) ** 2 for g in group) / len(group)) ** 0.5
        expected.append((r - mean) / (std + 1e-4))
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert adv[3:6].eq(0).all()  # a constant-reward group: zero, never NaN
    torch.testing.assert_close(advantages.group_advantages(rewards, torch.tensor(group_ids)), adv)


def test_group_advantages_global_std_and_clip():
    rewards = torch.tensor([0.0, 1.0, 5.0, 7.0])
    adv = advantages.group_advantages(rewards, [0, 0, 1, 1], global_std=True)
    centred = torch.tensor([-0.5, 0.5, -1.0, 1.0])
    torch.testing.assert_close(adv, centred / (rewards.std(unbiased=False) + 1e-4))
    many = torch.tensor([0.0] * 99 + [1.0])  # one outlier: (1 - 0.01) / 0.0995 = 9.95 before the clip
    assert advantages.group_advantages(many, [0] * 100, clip=5.0).max().item() == 5.0
    assert advantages.group_advantages(torch.ones(4), [0, 0, 1, 1]).eq(0).all()
    assert advantages.group_advantages(torch.tensor([3.0]), [0]).eq(0).all()  # a group of one


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="non-finite"):
        advantages.group_advantages(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="group_ids"):
        advantages.group_advantages(torch.tensor([1.0, 2.0]), [0])


# ----------------------------------------------------------------------------- GRPO
def _by_hand(values, group_ids, eps=1e-4):
    """Per-group (r - mean) / (population std + eps) in plain Python; 0 for a group of equal values."""
    out = []
    for i, r in enumerate(values):
        group = [v for v, g in zip(values, group_ids) if g == group_ids[i]]
        mean = sum(group) / len(group)
        std = (sum((v - mean) ** 2 for v in group) / len(group)) ** 0.5
        out.append(0.0 if max(group) == min(group) else (r - mean) / (std + eps))
    return out


def test_combined_advantages_by_hand_with_rewards_of_very_different_ranges():
    # Two prompts x 3 samples: an HPS-like reward near 0.3 and a reward in the hundreds; the second group's small
    # reward is saturated (all equal), so only the large one moves it.
    small = [0.21, 0.28, 0.35, 0.30, 0.30, 0.30]
    large = [100.0, 400.0, 250.0, -300.0, 0.0, 900.0]
    ids = [0, 0, 0, 1, 1, 1]
    weights = {"small": 1.0, "large": 0.5}
    adv, info = advantages.combined_advantages({"small": torch.tensor(small), "large": torch.tensor(large)}, weights, ids)
    a_small, a_large = _by_hand(small, ids), _by_hand(large, ids)
    expected = [(1.0 * s + 0.5 * g) / 1.5 for s, g in zip(a_small, a_large)]  # weights over their sum (MixGRPO)
    torch.testing.assert_close(adv, torch.tensor(expected))
    mean_abs = {"small": sum(abs(a) for a in a_small) / 6, "large": 0.5 * sum(abs(a) for a in a_large) / 6}
    for name, values in (("small", small), ("large", large)):
        mean = sum(values) / 6
        assert info[f"{name}_mean"] == pytest.approx(mean)
        assert info[f"{name}_std"] == pytest.approx((sum((v - mean) ** 2 for v in values) / 6) ** 0.5, rel=1e-5)
        assert info[f"{name}_share"] == pytest.approx(mean_abs[name] / sum(mean_abs.values()), rel=1e-5)
    assert 0.3 < info["small_share"] < 0.7  # both rewards steer the update
    # A weighted sum of raw scores is the large reward's advantage: the small one is drowned.
    raw = advantages.group_advantages(torch.tensor(small) + 0.5 * torch.tensor(large), ids)
    torch.testing.assert_close(raw, advantages.group_advantages(torch.tensor(large), ids), atol=2e-3, rtol=0)
    # The combined advantage does not depend on either reward's scale or offset (eps aside: tiny here).
    rescaled = {"small": 1000 * torch.tensor(small) + 7, "large": torch.tensor(large) / 1000 - 3}
    base = advantages.combined_advantages({"small": torch.tensor(small), "large": torch.tensor(large)}, weights, ids,
                                      eps=1e-9)[0]
    torch.testing.assert_close(advantages.combined_advantages(rescaled, weights, ids, eps=1e-9)[0], base,
                               rtol=1e-4, atol=1e-4)


def test_combined_advantages_clip_the_sum_and_skip_unscored_samples():
    a, b = torch.tensor([0.0, 1.0]), torch.tensor([0.0, 2.0])
    # centred +-0.5 and +-1 over stds 0.5 and 1; the weights 3 and 3 divided by their sum (MixGRPO): 1/2 each
    unit = (0.5 / (0.5 + 1e-4) + 1 / (1 + 1e-4)) / 2
    adv, info = advantages.combined_advantages({"a": a, "b": b}, {"a": 3.0, "b": 3.0}, [0, 0], clip=100.0)
    torch.testing.assert_close(adv, torch.tensor([-unit, unit]))  # about +-1, not the +-6 of raw weights
    outlier = torch.tensor([0.0] * 29 + [1.0])  # one sample apart from 29: its advantage is sqrt(29) = 5.39
    adv, _ = advantages.combined_advantages({"a": outlier, "b": outlier}, {"a": 3.0, "b": 3.0}, [0] * 30)
    assert adv[-1] == 5.0 and adv[0] == pytest.approx(-1 / 29**0.5, rel=1e-3)  # clip 5 acts on the sum
    assert info["a_share"] == pytest.approx(0.5, rel=1e-4) and info["b_share"] == pytest.approx(0.5, rel=1e-4)
    # NaN: the reward does not score that sample (a per-sample rm_type); it is normalised over the others.
    part = torch.tensor([1.0, float("nan"), 3.0, float("nan")])
    adv, info = advantages.combined_advantages({"p": part, "q": torch.tensor([5.0, 5.0, 5.0, 5.0])},
                                           {"p": 1.0, "q": 1.0}, [0, 0, 0, 0])
    one = 1 / (1 + 1e-4)  # [1, 3]: centred +-1, std 1
    torch.testing.assert_close(adv, torch.tensor([-one, 0.0, one, 0.0]) / 2)  # weight 1 of 2
    assert info["p_mean"] == 2.0 and info["q_share"] == 0.0 and info["p_share"] == 1.0
    saturated, info = advantages.combined_advantages({"q": torch.ones(4)}, {"q": 2.0}, [0, 0, 1, 1])
    assert saturated.eq(0).all() and info["q_share"] == 0.0  # equal rewards: exactly 0, shares 0, never NaN
    # a reward that scores no sample of this batch (every row's rm_type leaves it out) adds nothing, its mean NaN
    none, info = advantages.combined_advantages({"a": a, "b": torch.full((2,), float("nan"))}, {"a": 3.0, "b": 1.0}, [0, 0])
    torch.testing.assert_close(none, 0.75 * advantages.combined_advantages({"a": a}, {"a": 3.0}, [0, 0])[0])
    assert math.isnan(info["b_mean"]) and info["b_share"] == 0.0
    for bad, match in ((({"a": a}, {"b": 1.0}), "same rewards"),
                       (({"a": torch.tensor([0.0, float("inf")])}, {"a": 1.0}), "non-finite")):
        with pytest.raises(ValueError, match=match):
            advantages.combined_advantages(*bad, [0, 0])


def test_grpo_at_ratio_one_is_minus_mean_advantage():
    adv = torch.tensor([1.5, -0.5, 2.0, -3.0])
    lp = torch.randn(4)
    loss, info = losses.grpo_loss(lp, lp.clone(), adv, clip_range=1e-4)
    torch.testing.assert_close(loss, -adv.mean())
    assert info["ratio_mean"] == 1 and info["clipfrac"] == 0 and info["approx_kl"] == 0


def test_grpo_matches_a_hand_written_loop_and_clipped_terms_have_no_gradient():
    eps = 0.2
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 0.9])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, -2.0])
    old = torch.randn(6)
    lp = (old + ratio.log()).requires_grad_(True)
    loss, info = losses.grpo_loss(lp, old, adv, clip_range=eps)
    terms, clipped = [], []
    for r, a in zip(ratio.tolist(), adv.tolist()):
        rc = min(max(r, 1 - eps), 1 + eps)
        terms.append(max(-a * r, -a * rc))
        clipped.append(-a * rc > -a * r)  # the constant branch wins
    assert loss.item() == pytest.approx(sum(terms) / 6, rel=1e-6)
    assert clipped == [True, False, False, True, False, False]
    loss.backward()
    for i in range(6):  # d loss / d logp_i = -A_i r_i / B where unclipped, 0 where clipped
        expected = 0.0 if clipped[i] else -adv[i].item() * ratio[i].item() / 6
        assert lp.grad[i].item() == pytest.approx(expected, abs=1e-7)
    assert info["clipfrac"] == pytest.approx(4 / 6)  # |r - 1| > eps, whichever branch wins
    assert info["ratio_max"] == pytest.approx(1.5) and info["ratio_min"] == pytest.approx(0.5)


def test_adv_clip_is_optional():
    lp = torch.zeros(2)
    loss, _ = losses.grpo_loss(lp, lp, torch.tensor([8.0, 0.0]), clip_range=0.1)
    assert loss.item() == pytest.approx(-4.0)
    loss, _ = losses.grpo_loss(lp, lp, torch.tensor([8.0, 0.0]), clip_range=0.1, adv_clip=5.0)
    assert loss.item() == pytest.approx(-2.5)


def test_losses_reject_missing_log_probs_and_shapes():
    with pytest.raises(ValueError, match="ODE step"):
        losses.grpo_loss(None, torch.zeros(2), torch.zeros(2), clip_range=0.1)
    with pytest.raises(ValueError, match="shape"):
        losses.grpo_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), clip_range=0.1)


# ----------------------------------------------------------------------------- KL penalty
def test_kl_penalty_is_the_gaussian_kl_mean_over_dims():
    g = torch.Generator().manual_seed(0)
    mean, ref = torch.randn(5, 3, 4, generator=g), torch.randn(5, 3, 4, generator=g)
    std = torch.rand(5, generator=g) + 0.1
    kl, info = losses.kl_penalty(mean, ref, std)
    s = std.view(5, 1, 1).expand_as(mean)
    expected = torch.distributions.kl_divergence(Normal(mean, s), Normal(ref, s)).mean((1, 2))
    torch.testing.assert_close(kl, expected.mean())
    assert info["kl_max"] == pytest.approx(expected.max().item(), rel=1e-5)
    kl_float, _ = losses.kl_penalty(mean, ref, 0.3)
    torch.testing.assert_close(kl_float, ((mean - ref) ** 2).mean((1, 2)).mean() / (2 * 0.09))



def test_kl_penalty_flow_grpo_form_is_the_exact_kl_times_the_step_length():
    """Flow-GRPO's code divides by 2 std_dev_t^2 (its diffusion coefficient), not by 2 (std_dev_t sqrt(-dt))^2."""
    g = torch.Generator().manual_seed(1)
    mean, ref = torch.randn(4, 2, 3, generator=g), torch.randn(4, 2, 3, generator=g)
    s, s_next, eta = torch.tensor([0.9, 0.7, 0.5, 0.3]), torch.tensor([0.8, 0.5, 0.45, 0.1]), 0.7
    std_dev_t = eta * torch.sqrt(s / (1 - s))  # sde.py (3)
    dt = s_next - s
    std = std_dev_t * torch.sqrt(-dt)  # the transition std, sde.py (5)
    kl, info = losses.kl_penalty(mean, ref, std, dt=dt)
    by_hand = [((mean[i] - ref[i]) ** 2).mean() / (2 * std_dev_t[i] ** 2) for i in range(4)]  # the reference's line
    torch.testing.assert_close(kl, torch.stack(by_hand).mean())
    s_b = std.view(4, 1, 1).expand_as(mean)
    exact = torch.distributions.kl_divergence(Normal(mean, s_b), Normal(ref, s_b)).mean((1, 2))  # [B]
    torch.testing.assert_close(kl, (exact * -dt).mean())
    assert info["kl_max"] == pytest.approx((exact * -dt).max().item(), rel=1e-5)
    kl_float, _ = losses.kl_penalty(mean, ref, 0.3, dt=-0.1)  # floats: one dt for the batch
    torch.testing.assert_close(kl_float, ((mean - ref) ** 2).mean((1, 2)).mean() / (2 * 0.09) * 0.1)
    with pytest.raises(ValueError, match="negative"):
        losses.kl_penalty(mean, ref, 0.3, dt=0.1)


def test_saturated_groups_get_exactly_zero_advantage():
    """Equal rewards whose mean does not round back to them (0.1 x 3 = 0.30000000000000004) still give A = 0."""
    rewards = torch.rand(200, generator=torch.Generator().manual_seed(0))
    for global_std in (False, True):
        for n in (3, 12, 24):
            r = torch.cat([rewards.repeat_interleave(n), torch.tensor([0.0, 1.0])])  # plus one live group
            ids = torch.cat([torch.arange(200).repeat_interleave(n), torch.tensor([200, 200])])
            adv = advantages.group_advantages(r, ids, global_std=global_std)
            assert (adv[:-2] == 0).all()
            assert (adv[-2:] != 0).all()

# ----------------------------------------------------------------------------- GRPO-Guard
def gaussian_log_prob(x, mean, std):
    return Normal(mean, std.view(-1, 1)).log_prob(x).mean(1)


def test_guard_ratio_is_centred_on_one_where_the_plain_ratio_is_biased():
    """Monte Carlo: x' ~ pi_old, the new mean shifted by delta. Half the samples have a large
    per-sample shift and half none, so a batch-averaged correction would fail both halves."""
    g = torch.Generator().manual_seed(0)
    B, D = 4000, 256
    c = torch.rand(B, generator=g) * 0.5 + 0.1  # transition std, per sample
    old_mean = torch.randn(B, D, generator=g)
    scale = torch.where(torch.arange(B) < B // 2, 0.5, 0.0)[:, None]
    delta = scale * c[:, None] * torch.randn(B, D, generator=g)  # mean(delta^2) / (2 c^2) ~ 0.125
    x = old_mean + c[:, None] * torch.randn(B, D, generator=g)
    new_mean = old_mean + delta
    lp, old_lp = gaussian_log_prob(x, new_mean, c), gaussian_log_prob(x, old_mean, c)
    bias = (delta**2).mean(1) / (2 * c**2)  # the closed-form E[log r] = -bias
    plain = lp - old_lp
    shifted = slice(0, B // 2)
    assert plain[shifted].mean().item() == pytest.approx(-bias[shifted].mean().item(), abs=0.01)
    assert plain[shifted].exp().mean().item() < 0.9  # biased below 1
    _, plain_info = losses.grpo_loss(lp[shifted], old_lp[shifted], torch.ones(B // 2), clip_range=0.2)
    assert plain_info["ratio_mean"] < 0.9

    adv = torch.ones(B)
    _, info = losses.guard_loss(lp, old_lp, new_mean, old_mean, c, -0.1, adv, clip_range=0.2)
    assert info["ratio_mean"] == pytest.approx(1.0, abs=0.01)
    for half in (slice(0, B // 2), slice(B // 2, B)):
        _, info = losses.guard_loss(lp[half], old_lp[half], new_mean[half], old_mean[half], c[half], -0.1,
                                    adv[half], clip_range=0.2)
        assert info["ratio_mean"] == pytest.approx(1.0, abs=0.01)
    # Exactly: log r_hat = mean(noise * delta), noise = (x' - mu_old) / c.
    log_r_hat = (lp - old_lp) * c + (delta**2).mean(1) / (2 * c)
    torch.testing.assert_close(log_r_hat, ((x - old_mean) / c[:, None] * delta).mean(1), rtol=1e-3, atol=1e-4)


def test_guard_loss_matches_a_hand_written_reference():
    g = torch.Generator().manual_seed(1)
    B = 6
    lp, old_lp = torch.randn(B, generator=g) * 0.1, torch.randn(B, generator=g) * 0.1
    mean, old_mean = torch.randn(B, 2, 3, generator=g), torch.randn(B, 2, 3, generator=g)
    std, dt = torch.rand(B, generator=g) + 0.5, -(torch.rand(B, generator=g) + 0.05)
    adv = torch.randn(B, generator=g)
    loss, _ = losses.guard_loss(lp, old_lp, mean, old_mean, std, dt, adv, clip_range=0.05)
    total = 0.0
    for i in range(B):
        c = std[i].item()
        mse = ((mean[i] - old_mean[i]) ** 2).mean().item()
        r = torch.tensor((lp[i] - old_lp[i]).item() * c + mse / (2 * c)).exp().item()
        rc = min(max(r, 0.95), 1.05)
        total += max(-adv[i].item() * r, -adv[i].item() * rc) / -dt[i].item()
    assert loss.item() == pytest.approx(total / B, rel=1e-5)
    loss_float_dt, _ = losses.guard_loss(lp, old_lp, mean, old_mean, std, -0.25, adv, clip_range=0.05)
    loss_tensor_dt, _ = losses.guard_loss(lp, old_lp, mean, old_mean, std, torch.full((B,), -0.25), adv,
                                          clip_range=0.05)
    torch.testing.assert_close(loss_float_dt, loss_tensor_dt)


def test_guard_on_policy_is_minus_mean_advantage_over_dt():
    lp = torch.randn(4)
    mean = torch.randn(4, 8)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    loss, info = losses.guard_loss(lp, lp, mean, mean, torch.full((4,), 0.3), -0.05, adv, clip_range=1e-4)
    torch.testing.assert_close(loss, -adv.mean() / 0.05)
    assert info["ratio_mean"] == 1


# ----------------------------------------------------------------------------- FlowDPPO
def test_flowdppo_kl_is_the_exact_gaussian_kl():
    g = torch.Generator().manual_seed(2)
    mean, old_mean = torch.randn(5, 3, 4, generator=g), torch.randn(5, 3, 4, generator=g)
    sigma = torch.rand(5, generator=g) + 0.2
    lp = torch.zeros(5)
    _, info = losses.flowdppo_loss(lp, lp, mean, old_mean, sigma, torch.ones(5))
    s = sigma.view(5, 1, 1).expand_as(mean)
    kl = torch.distributions.kl_divergence(Normal(old_mean, s), Normal(mean, s)).mean((1, 2))
    assert info["kl_new_old_mean"] == pytest.approx(kl.mean().item(), rel=1e-5)
    assert info["kl_new_old_max"] == pytest.approx(kl.max().item(), rel=1e-5)


def test_flowdppo_mask_truth_table():
    # Every combination of KL (low/high) x ratio (>1, <1, =1) x advantage sign.
    rows = [(kl_high, r, a) for kl_high in (False, True) for r in (1.2, 0.8, 1.0) for a in (1.0, -1.0)]
    B = len(rows)
    ratio = torch.tensor([r for _, r, _ in rows])
    adv = torch.tensor([a for _, _, a in rows])
    old_mean = torch.zeros(B, 4)
    mean = torch.tensor([[0.1] * 4 if high else [0.001] * 4 for high, _, _ in rows])  # kl = 5e-3 or 5e-7
    old_lp = torch.zeros(B)
    lp = ratio.log().requires_grad_(True)
    loss, info = losses.flowdppo_loss(lp, old_lp, mean, old_mean, 1.0, adv, threshold=1e-5)
    dropped = [high and ((r > 1 and a > 0) or (r < 1 and a < 0)) for high, r, a in rows]
    assert dropped.count(True) == 2
    expected = sum(-a * r for (high, r, a), d in zip(rows, dropped) if not d) / B  # no clip on kept terms
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    for i, d in enumerate(dropped):
        assert (lp.grad[i].item() == 0) == d
    assert info["masked_fraction"] == pytest.approx(2 / B) and info["clipfrac"] == info["masked_fraction"]
    assert info["kl_mask_fraction"] == pytest.approx(0.5)
    assert info["pos_rm_fraction"] == pytest.approx(1 / B) and info["neg_rm_fraction"] == pytest.approx(1 / B)
    # The same rows with a threshold above every KL: nothing is dropped.
    _, info = losses.flowdppo_loss(ratio.log(), old_lp, mean, old_mean, 1.0, adv, threshold=1.0)
    assert info["masked_fraction"] == 0 and info["kl_mask_fraction"] == 0


def test_flowdppo_masks_nothing_on_policy():
    # mu_theta = mu_old (one optimizer step per batch): the KL is 0 and the mask has nothing to act on.
    mean, x = torch.randn(8, 4), torch.randn(8, 4)
    log_prob = -((x - mean) ** 2).mean(1)
    _, info = losses.flowdppo_loss(log_prob, log_prob.detach(), mean, mean.detach(), torch.ones(8), torch.randn(8))
    assert info["kl_new_old_max"] == 0 and info["kl_mask_fraction"] == 0 and info["masked_fraction"] == 0


# ----------------------------------------------------------------------------- Flow-GRPO's Wan step weight
def test_wan_step_weight_by_hand():
    # std_dev_t = 0 + 0.98 s; one sample at s 0.8 -> 0.7: 0.784 / sqrt(0.1)
    assert losses.wan_step_weight(0.8, 0.7, sigma_max=0.98, sigma_min=0.0).item() == pytest.approx(0.784 / 0.1 ** 0.5)
    # two samples: the ratio of the batch means (0.637 / 0.474342), not the mean of the ratios (1.627)
    w = losses.wan_step_weight(torch.tensor([0.8, 0.5]), torch.tensor([0.7, 0.1]), sigma_max=0.98, sigma_min=0.0)
    assert w.item() == pytest.approx(0.637 / ((0.1 ** 0.5 + 0.4 ** 0.5) / 2), rel=1e-6)
    assert losses.wan_step_weight(0.5, 0.4, sigma_max=0.9, sigma_min=0.1).item() == pytest.approx(
        (0.1 + 0.8 * 0.5) / 0.1 ** 0.5, rel=1e-6)
    with pytest.raises(ValueError, match="sigma > sigma_next"):
        losses.wan_step_weight(0.4, 0.5, sigma_max=0.98, sigma_min=0.0)


def test_wan_step_weight_on_wans_schedule():
    """On the sigmas of diffusers' UniPC flow scheduler as Wan 2.1 T2V configures it (flow_shift 3), 20 steps."""
    from diffusers import UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    scheduler.set_timesteps(20)
    s = scheduler.sigmas.double()
    weights = [losses.wan_step_weight(s[k], s[k + 1], sigma_max=s[1].item(), sigma_min=s[-1].item()).item()
               for k in range(19)]  # int(20 x 0.99) = 19 trained steps
    assert weights[0] == pytest.approx(7.489, abs=1e-3) and weights[-1] == pytest.approx(0.736, abs=1e-3)
    assert all(a > b for a, b in zip(weights, weights[1:]))


# ----------------------------------------------------------------------------- what a loss reads
def test_every_loss_names_its_flags_and_receives_exactly_those():
    """No loss takes the whole flag set: each loss function's keyword-only parameters are flags (argparse dests), and
    Loss.hyper hands it exactly those, whatever else the flags hold."""
    import config  # the flags, declared over every module
    _, args = config.parse_args(["--model", "tiny"])
    flags = vars(args)
    for name, loss in losses.LOSSES.items():
        params = inspect.signature(loss.fn).parameters.values()
        assert not any(p.kind is p.VAR_KEYWORD for p in params), f"{name} takes **"
        named = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        assert set(named) <= set(flags), name
        assert "kl_beta" in named or loss.terms, name  # every RL loss keeps the KL; distillation matches a teacher
        assert sorted(loss.hyper(dict(flags, unrelated=1))) == sorted(named)
    assert losses.LOSSES["grpo"].reads() == {"clip_range", "kl_beta", "kl_form", "sde", "step_loss_weight"}
    assert losses.LOSSES["crd"].reads() >= {"crd_kl_cfg", "train_timesteps", "num_steps", "timestep_fraction"}
    with pytest.raises(KeyError, match="dpo_beta"):  # a flag the loss requires is never filled in silently
        losses.LOSSES["dpo"].hyper({"kl_beta": 0.0})


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_a_flag_of_another_loss_is_refused_in_one_line_naming_its_losses(name, capsys):
    """Every flag that some loss reads and this one does not (losses.Loss.reads), given on the command line: refused,
    naming the losses that read it; the flags this loss reads are accepted."""
    import config
    own = losses.LOSSES[name].reads()
    group = next(g for g in config.parse_args([])[0]._action_groups if g.title == "loss")
    foreign = [a for a in group._group_actions if a.dest != "adv_clip" and a.dest not in own
               and any(a.dest in other.reads() for other in losses.LOSSES.values())]
    assert len(foreign) >= 5
    for action in foreign:
        value = action.choices[0] if action.choices else "1" if action.nargs != 0 else None
        argv = ["--model", "tiny", "--loss", name, action.option_strings[0]] + ([value] if value else [])
        p, args = config.parse_args(argv)
        with pytest.raises(SystemExit):
            config.check_args(p, args, 1)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        owners = [n for n, other in losses.LOSSES.items() if action.dest in other.reads()]
        assert line.endswith(f"{action.option_strings[0]} is read by --loss {' / '.join(owners)}, not by --loss "
                             f"{name}: drop it"), line
