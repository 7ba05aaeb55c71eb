"""sde.py against independent references: diffusers' schedule, torch.distributions, the closed-form
velocity of Gaussian data (marginals), and the step-selection rules."""

import math

import pytest
import torch

import sde

# ----------------------------------------------------------------------------- Gaussian toy
# Data x0 ~ N(M, diag(SD^2)), x_s = (1 - s) x0 + s eps. Per dimension, with a = 1 - s:
#   x_s ~ N(a M, a^2 SD^2 + s^2),  E[x0 | x_s] = M + a SD^2 (x_s - a M) / var_s,
#   E[eps | x_s] = s (x_s - a M) / var_s,  so the exact velocity is v = E[eps | x_s] - E[x0 | x_s].
M = torch.tensor([1.0, -0.5])
SD = torch.tensor([1.0, 1.5])


def exact_velocity(x, s):
    a = 1 - s
    var = a * a * SD**2 + s * s
    z = (x - a * M) / var
    return s * z - (M + a * SD**2 * z)


def exact_transport(x, s):
    """Where the exact ODE takes a state at level s when it reaches s = 0 (a monotone affine map)."""
    a = 1 - s
    return M + SD * (x - a * M) / (a * a * SD**2 + s * s).sqrt()


def final_samples(kind, eta, num_steps, n=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    sigmas = sde.sd3_sigmas(num_steps)
    steps = [] if kind == "ode" else sde.sde_steps(num_steps)
    out = sde.rollout(exact_velocity, torch.randn(n, 2, generator=g), sigmas, sde_steps=steps, kind=kind,
                      eta=eta, generator=g)
    return out["latents"][:, -1]


def marginal_errors(samples):
    """(max |mean - M|, max relative std error) over the two dimensions."""
    return (samples.mean(0) - M).abs().max().item(), (samples.std(0) / SD - 1).abs().max().item()


def random_step_inputs(batch=6, shape=(3, 4, 4), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(batch, *shape, generator=g).to(dtype)
    x = torch.randn(batch, *shape, generator=g).to(dtype)
    return v, x


SIGMAS = sde.sd3_sigmas(10)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


# ----------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("num_steps", [1, 2, 10, 28, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_sd3_sigmas_equal_diffusers(num_steps, shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    sigmas = sde.sd3_sigmas(num_steps, shift=shift)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
    assert torch.equal(sigmas, scheduler.sigmas)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas[1:] < sigmas[:-1]).all()


def test_sd3_sigmas_bad_input():
    with pytest.raises(ValueError, match="--num-steps"):
        sde.sd3_sigmas(0)


# ----------------------------------------------------------------------------- one step
def reference_mean_std(kind, v, x, s, s_next, eta, s_max):
    """The step written from the papers' SDE form, independently of sde.py's grouping of terms."""
    dt = s_next - s
    if kind == "flow":  # Flow-GRPO: x + [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt + sigma_t sqrt(-dt) eps
        g = eta * math.sqrt(s / (1 - (s_max if s > 1 - 1e-4 else s)))
        return x + (v + g**2 / (2 * s) * (x + (1 - s) * v)) * dt, g * math.sqrt(-dt)
    if kind == "dance":  # DanceGRPO: score of x_s from Tweedie, constant diffusion eta
        score = -(x + (1 - s) * v) / s
        return x + v * dt - 0.5 * eta**2 * score * dt, eta * math.sqrt(-dt)
    std = s_next * math.sin(eta * math.pi / 2)  # Flow-CPS
    return (1 - s_next) * (x - s * v) + math.sqrt(s_next**2 - std**2) * (x + (1 - s) * v), std


@pytest.mark.parametrize("kind", ["flow", "dance", "cps"])
@pytest.mark.parametrize("step", [0, 3, 8])
def test_step_mean_std_and_log_prob(kind, step):
    v, x = random_step_inputs(seed=step)
    s, s_next = SIGMAS[step].item(), SIGMAS[step + 1].item()
    out = sde.sde_step(v, x, s, s_next, kind=kind, eta=0.7, generator=torch.Generator().manual_seed(1),
                       sigma_max=SIGMAS[1].item())
    mean, std = reference_mean_std(kind, v, x, s, s_next, 0.7, SIGMAS[1].item())
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std, torch.full((6,), std), rtol=1e-6, atol=1e-7)
    dims = (1, 2, 3)
    if kind == "cps":  # Flow-CPS convention: -mean((x' - mean)^2), no normalisation
        expected = -((out.prev_sample - mean) ** 2).mean(dims)
    else:
        expected = torch.distributions.Normal(mean, std).log_prob(out.prev_sample).mean(dims)
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-5, atol=1e-5)
    assert out.log_prob.shape == (6,) and out.log_prob.dtype == torch.float32


@pytest.mark.parametrize("kind", ["flow", "dance", "cps"])
def test_sampling_then_scoring_gives_the_same_log_prob(kind):
    v, x = random_step_inputs()
    sampled = sde.sde_step(v, x, 0.8, 0.7, kind=kind, generator=torch.Generator().manual_seed(0))
    scored = sde.sde_step(v, x, 0.8, 0.7, kind=kind, prev_sample=sampled.prev_sample)
    assert torch.equal(scored.log_prob, sampled.log_prob) and torch.equal(scored.mean, sampled.mean)
    assert torch.equal(scored.prev_sample, sampled.prev_sample)
    resampled = sde.sde_step(v, x, 0.8, 0.7, kind=kind, generator=torch.Generator().manual_seed(0))
    assert torch.equal(resampled.prev_sample, sampled.prev_sample)  # the generator alone fixes the noise


@pytest.mark.parametrize("kind", ["flow", "dance", "cps"])
def test_bf16_inputs_give_finite_float32_at_sigma_one(kind):
    v, x = random_step_inputs(dtype=torch.bfloat16)
    for sigma_max in (None, SIGMAS[1].item()):  # default: sigma_next, = sigmas[1] at the first step
        out = sde.sde_step(v, x * 30, 1.0, SIGMAS[1].item(), kind=kind, generator=torch.Generator().manual_seed(0),
                           sigma_max=sigma_max)
        for t in (out.prev_sample, out.log_prob, out.mean, out.std):
            assert t.dtype == torch.float32 and torch.isfinite(t).all()
    # A schedule that starts just below 1 (0.999993) takes the same guard.
    out = sde.sde_step(v, x, 0.999993, 0.95, kind="flow", generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out.log_prob).all() and torch.isfinite(out.std).all()


@pytest.mark.parametrize("kind", ["flow", "dance", "cps"])
def test_per_sample_sigmas_match_per_sample_float_calls(kind):
    v, x = random_step_inputs(batch=4)
    sigma = torch.tensor([1.0, 0.9, 0.5, 0.2])
    sigma_next = torch.tensor([0.95, 0.7, 0.45, 0.0])
    prev = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    batched = sde.sde_step(v, x, sigma, sigma_next, kind=kind, prev_sample=prev)
    for i in range(4):
        single = sde.sde_step(v[i:i + 1], x[i:i + 1], sigma[i].item(), sigma_next[i].item(), kind=kind,
                              prev_sample=prev[i:i + 1])
        torch.testing.assert_close(batched.mean[i:i + 1], single.mean, rtol=0, atol=0)
        torch.testing.assert_close(batched.std[i:i + 1], single.std, rtol=0, atol=0)
        torch.testing.assert_close(batched.log_prob[i:i + 1], single.log_prob, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["flow", "dance", "cps", "ode"])
def test_eta_zero_and_ode_are_the_euler_step(kind):
    v, x = random_step_inputs()
    for s, s_next in ((1.0, 0.95), (0.6, 0.5)):
        out = sde.sde_step(v, x, s, s_next, kind=kind, eta=0.0 if kind != "ode" else 0.7)
        dt = torch.tensor(s_next) - torch.tensor(s)  # float32, as every sigma is
        assert torch.equal(out.prev_sample, x + dt * v)
        assert out.log_prob is None and torch.equal(out.std, torch.zeros(6))


@pytest.mark.parametrize("kind", ["flow", "dance", "cps"])
def test_scoring_backpropagates_to_the_velocity(kind):
    v, x = random_step_inputs()
    prev = sde.sde_step(v, x, 0.7, 0.6, kind=kind, generator=torch.Generator().manual_seed(0)).prev_sample
    v = v.clone().requires_grad_(True)
    out = sde.sde_step(v, x, 0.7, 0.6, kind=kind, prev_sample=prev)
    assert out.log_prob.requires_grad and out.mean.requires_grad
    (out.log_prob.sum() + out.mean.sum()).backward()
    assert torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


def test_step_rejects_bad_input():
    v, x = random_step_inputs()
    with pytest.raises(ValueError, match="--sde"):
        sde.sde_step(v, x, 0.5, 0.4, kind="ddim")
    with pytest.raises(ValueError, match="sigma"):
        sde.sde_step(v, x, torch.tensor([0.5, 0.4]), 0.3)
    with pytest.raises(ValueError, match="sigma_max"):
        sde.sde_step(v, x, 1.0, 0.9, sigma_max=1.0)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        sde.sde_step(v, x, 0.5, 0.5)


# ----------------------------------------------------------------------------- marginals
def test_flow_and_dance_preserve_the_data_marginal():
    mean_err, std_err = marginal_errors(final_samples("flow", 0.7, 50))
    assert mean_err < 0.03 and std_err < 0.03, (mean_err, std_err)
    mean_err, std_err = marginal_errors(final_samples("dance", 0.3, 50))
    assert mean_err < 0.03 and std_err < 0.05, (mean_err, std_err)


def test_marginal_test_fails_without_the_score_correction():
    """Same noise as `flow`, mean = the Euler step: the samples come out far too wide."""
    g = torch.Generator().manual_seed(0)
    sigmas = sde.sd3_sigmas(50)
    x = torch.randn(20000, 2, generator=g)
    for i in range(50):
        s, s_next = sigmas[i].item(), sigmas[i + 1].item()
        v = exact_velocity(x, s)
        if i < 49:
            std = sde.sde_step(v, x, s, s_next, kind="flow", eta=0.7).std[:, None]
            x = x + (s_next - s) * v + std * torch.randn(x.shape, generator=g)
        else:
            x = x + (s_next - s) * v
    _, std_err = marginal_errors(x)
    assert std_err > 0.3, std_err


def test_cps_keeps_coefficients_not_the_marginal():
    """Pinned bias (see sde.py): cps ends 18-29 % too narrow, far more than Euler's own error."""
    for num_steps, low in ((10, 0.29), (20, 0.23), (50, 0.185)):
        _, std_err = marginal_errors(final_samples("cps", 0.7, num_steps))
        _, ode_std_err = marginal_errors(final_samples("ode", 0.0, num_steps))
        assert abs(std_err - low) < 0.02, (num_steps, std_err)
        assert std_err > ode_std_err + 0.1, (num_steps, std_err, ode_std_err)
        samples = final_samples("cps", 0.7, num_steps)
        assert (samples.std(0) < SD).all()  # always too narrow, never too wide


# ----------------------------------------------------------------------------- sde_steps
def test_sde_steps_all():
    assert sde.sde_steps(10) == list(range(9))  # the last step is never trained
    assert sde.sde_steps(10, timestep_fraction=0.99) == list(range(9))
    assert sde.sde_steps(10, timestep_fraction=0.5) == list(range(5))
    assert sde.sde_steps(10, timestep_fraction=0.35) == [0, 1, 2]
    assert sde.sde_steps(2) == [0]


def test_sde_steps_fast_is_a_seeded_window_in_range():
    starts = set()
    for it in range(200):
        steps = sde.sde_steps(10, window="fast", iteration=it, window_size=2, seed=7)
        assert steps == list(range(steps[0], steps[0] + 2)) and steps[-1] <= 8
        assert steps == sde.sde_steps(10, window="fast", iteration=it, window_size=2, seed=7)  # reproducible
        starts.add(steps[0])
    assert starts == set(range(0, 8))  # every start that fits is drawn
    other = [sde.sde_steps(10, window="fast", iteration=it, seed=8)[0] for it in range(50)]
    assert other != [sde.sde_steps(10, window="fast", iteration=it, seed=7)[0] for it in range(50)]
    ranged = {sde.sde_steps(10, window="fast", iteration=it, window_size=3, window_range=(2, 7))[0]
              for it in range(100)}
    assert ranged == {2, 3, 4}


def test_a_window_range_as_wide_as_the_window_fixes_it():
    """Flow-GRPO's Qwen-Image rollouts always train steps 3-4 (their draw is seeded with random.seed(0)):
    --window-size 2 --window-range 3 5 gives that window for every batch, seed and rank."""
    import random

    random.seed(0)
    assert random.randint(0, 5 - 2) == 3  # qwenimage_pipeline_with_logprob.py L138-141 with process_index 0
    windows = {tuple(sde.sde_steps(10, window="fast", iteration=it, window_size=2, window_range=(3, 5),
                                   seed=(seed, rank, b)))
               for it in range(50) for seed in (0, 1) for rank in (0, 3) for b in (0, 2)}
    assert windows == {(3, 4)}


def test_sde_steps_sparse_is_flowdppos_random_subset():
    """UniRL's FlowDPPO recipe: 3 distinct steps drawn from steps 0-4 (timestep_fraction [0, 0.5] of 10), not
    necessarily adjacent, one set per step; every 3-subset of 0..4 comes up, and the draw is reproducible."""
    import itertools

    draws = [sde.sde_steps(10, window="sparse", iteration=it, window_size=3, window_range=(0, 5), seed=4)
             for it in range(400)]
    assert all(d == sorted(set(d)) and len(d) == 3 and 0 <= d[0] and d[-1] <= 4 for d in draws)
    assert {tuple(d) for d in draws} == set(itertools.combinations(range(5), 3))  # all 10, gaps included
    assert draws[7] == sde.sde_steps(10, window="sparse", iteration=7, window_size=3, window_range=(0, 5), seed=4)
    assert sde.sde_steps(10, window="sparse", window_size=9) == list(range(9))  # the whole default range
    with pytest.raises(ValueError, match="--window-range"):
        sde.sde_steps(10, window="sparse", window_size=3, window_range=(0, 10))  # past the last trainable step


def test_sde_steps_fast_window_range_is_flow_grpos():
    """Flow-GRPO's sde_window_range (lo, hi) holds the whole window: start = randint(lo, hi - size), both ends
    inclusive (sd3_pipeline_with_logprob_fast.py); pickscore_sd3_fast_nocfg's (0, 5) with size 3 trains 0..4 only."""
    windows = {tuple(sde.sde_steps(10, window="fast", iteration=it, window_size=3, window_range=(0, 5), seed=3))
               for it in range(200)}
    assert windows == {(0, 1, 2), (1, 2, 3), (2, 3, 4)}
    assert {sde.sde_steps(10, window="fast", iteration=it, window_size=2, window_range=(4, 9))[0]
            for it in range(200)} == {4, 5, 6, 7}  # up to step 8, the last trainable one
    assert sde.sde_steps(10, window="fast", window_size=3, window_range=(2, 5)) == [2, 3, 4]  # the only window


def test_sde_steps_mix_slides_and_rolls_back():
    kw = dict(window="mix", window_size=4, stride=2, iters_per_window=3)
    starts = [sde.sde_steps(12, iteration=it, **kw)[0] for it in range(18)]
    # 11 trainable steps, window 4: starts 0, 2, 4, 6, then the last position 7, then it stays.
    assert starts == [0] * 3 + [2] * 3 + [4] * 3 + [6] * 3 + [7] * 3 + [7] * 3
    rolled = [sde.sde_steps(12, iteration=it, roll_back=True, **kw)[0] for it in range(18)]
    assert rolled == [0] * 3 + [2] * 3 + [4] * 3 + [6] * 3 + [7] * 3 + [0] * 3
    assert sde.sde_steps(12, iteration=4, **kw) == [2, 3, 4, 5]
    assert max(sde.sde_steps(12, iteration=10**6, **kw)) == 10  # never the last step (11)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(window="fast", window_size=10), "--window-size"),
    (dict(window="mix", window_size=0), "--window-size"),
    (dict(window="fast", window_size=2, window_range=(0, 10)), "--window-range"),  # would hold the last step
    (dict(window="fast", window_size=2, window_range=(5, 6)), "--window-range"),  # too short for the window
    (dict(window="fast", window_size=2, window_range=(-1, 4)), "--window-range"),
    (dict(window="mix", stride=0), "--window-stride"),
    (dict(window="mix", iters_per_window=0), "--iters-per-window"),
    (dict(timestep_fraction=0.05), "--timestep-fraction"),
    (dict(timestep_fraction=1.5), "--timestep-fraction"),
    (dict(window="random"), "--sde-window"),
])
def test_sde_steps_bad_knobs_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag) as err:
        sde.sde_steps(10, **kwargs)
    assert "\n" not in str(err.value)


def test_sde_steps_needs_two_steps():
    with pytest.raises(ValueError, match="--num-steps"):
        sde.sde_steps(1)


# ----------------------------------------------------------------------------- rollout
def counting(fn):
    def wrapped(x, s):
        assert isinstance(s, float)
        wrapped.calls += 1
        return fn(x, s)
    wrapped.calls = 0
    return wrapped


def test_rollout_records_what_training_rescores():
    sigmas = sde.sd3_sigmas(10)
    steps = [2, 3, 4]
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    velocity = counting(exact_velocity)
    out = sde.rollout(velocity, x, sigmas, sde_steps=steps, kind="flow", eta=0.7,
                      generator=torch.Generator().manual_seed(1))
    assert velocity.calls == 10
    assert out["latents"].shape == (5, 11, 2) and out["latents"].dtype == torch.float32
    assert out["log_probs"].shape == (5, 3) and out["means"].shape == (5, 3, 2) and out["stds"].shape == (5, 3)
    assert out["steps"].tolist() == steps and torch.equal(out["sigmas"], sigmas)
    assert torch.equal(out["latent_sigmas"], sigmas)
    assert torch.equal(out["latents"][:, 0], x.float())
    lat = out["latents"]
    for i in range(10):
        s, s_next = sigmas[i].item(), sigmas[i + 1].item()
        v = exact_velocity(lat[:, i], s)
        if i in steps:  # exactly what a trainer does: score the stored transition with the same step
            j = steps.index(i)
            scored = sde.sde_step(v, lat[:, i], s, s_next, kind="flow", eta=0.7, prev_sample=lat[:, i + 1],
                                  sigma_max=sigmas[1].item())
            assert torch.equal(scored.log_prob, out["log_probs"][:, j])
            assert torch.equal(scored.mean, out["means"][:, j]) and torch.equal(scored.std, out["stds"][:, j])
        else:
            assert torch.equal(lat[:, i + 1], lat[:, i] + (sigmas[i + 1] - sigmas[i]) * v)


def test_rollout_first_step_uses_sigmas_1():
    sigmas = sde.sd3_sigmas(10)
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    out = sde.rollout(exact_velocity, x, sigmas, sde_steps=[0], generator=torch.Generator().manual_seed(1))
    s1 = sigmas[1].item()  # std = eta sqrt(1 / (1 - s1)) sqrt(-dt), dt = s1 - 1: exactly eta
    assert torch.allclose(out["stds"][:, 0], torch.tensor(0.7 * math.sqrt(1 / (1 - s1)) * math.sqrt(1 - s1)))


def test_rollout_without_stochastic_steps_and_bad_calls():
    sigmas = sde.sd3_sigmas(4)
    x = torch.randn(3, 2)
    out = sde.rollout(exact_velocity, x, sigmas, sde_steps=[], kind="ode")
    assert out["log_probs"].shape == (3, 0) and out["means"].shape == (3, 0, 2) and out["steps"].numel() == 0
    with pytest.raises(ValueError, match="--eta"):
        sde.rollout(exact_velocity, x, sigmas, sde_steps=[0], eta=0.0)
    with pytest.raises(ValueError, match="sde_steps"):
        sde.rollout(exact_velocity, x, sigmas, sde_steps=[4])


def test_flash_grid_is_mixgrpos_compressed_schedule():
    """MixGRPO sampling_utils.py (dpm_apply_strategy "post"): after the window's last stochastic step L, int(max((T - L)
    ratio, 1)) points from its unshifted time t_{L+1} to 0, evenly spaced and shifted again (shift 3, T = 25 there)."""
    num, shift, ratio = 25, 3.0, 0.4
    time_shift = lambda t: shift * t / (1 + (shift - 1) * t)
    sigmas = time_shift(torch.linspace(1, 0, num + 1, dtype=torch.float64))  # MixGRPO's own schedule
    for last in range(num - 1):
        points = int(max((num - last) * ratio, 1))
        reference = time_shift(torch.linspace(1 - (last + 1) / num, 0, points, dtype=torch.float64))
        grid = sde.flash_grid(sigmas, last + 1, ratio).double()
        if points == 1:  # MixGRPO would stop at sigma_{L+1}, short of 0: here one step to 0
            assert grid.tolist() == pytest.approx([sigmas[last + 1].item(), 0.0])
            continue
        assert len(grid) == points and grid[0] == pytest.approx(sigmas[last + 1].item()) and grid[-1] == 0
        assert (grid - reference).abs().max() < 2e-3  # equal on grid points, linear in sigma between them
    assert len(sde.flash_grid(sigmas, 4, 1.0)) == num - 3  # ratio 1: the original grid after the window
    with pytest.raises(ValueError, match="--flash-ratio"):
        sde.flash_grid(sigmas, 4, 0.0)


@pytest.mark.parametrize("num_steps, steps", [(20, [0, 1, 2, 3]), (20, [5, 6, 7, 8]), (50, [10, 11, 12, 13])])
def test_flash_matches_the_ode_with_fewer_calls(num_steps, steps):
    sigmas = sde.sd3_sigmas(num_steps)
    x = torch.randn(4000, 2, generator=torch.Generator().manual_seed(0))
    runs = {}
    for flash in (False, True):
        velocity = counting(exact_velocity)
        out = sde.rollout(velocity, x, sigmas, sde_steps=steps, kind="flow", eta=0.7,
                          generator=torch.Generator().manual_seed(1), flash=flash)
        runs[flash] = out, velocity.calls
    (base, base_calls), (fast, fast_calls) = runs[False], runs[True]
    end = steps[-1] + 1
    points = max(int((num_steps - end + 1) * 0.4), 2)  # MixGRPO's dpm_post_compress_ratio 0.4
    assert base_calls == num_steps and fast_calls == end + points - 1
    # The window is untouched: same states, same log-probs, indexed by step as without flash.
    assert torch.equal(fast["latents"][:, :end + 1], base["latents"][:, :end + 1])
    assert torch.equal(fast["log_probs"], base["log_probs"]) and torch.equal(fast["means"], base["means"])
    assert fast["latents"].shape[1] == len(fast["latent_sigmas"]) == end + points
    assert torch.equal(fast["latent_sigmas"][:end + 1], sigmas[:end + 1]) and fast["latent_sigmas"][-1] == 0
    # The final sample: closer to the exact ODE solution from the same state than Euler on the same
    # compressed grid (the second order at work), and near the full Euler ODE's.
    exact = exact_transport(base["latents"][:, end], sigmas[end].item())
    euler = base["latents"][:, end]
    grid = sde.flash_grid(sigmas, end, 0.4).tolist()
    for s, s_next in zip(grid[:-1], grid[1:]):
        euler = euler + (s_next - s) * exact_velocity(euler, s)
    rms = lambda a, b: ((a - b) ** 2).mean().sqrt().item()
    assert rms(fast["latents"][:, -1], exact) < rms(euler, exact)
    assert rms(fast["latents"][:, -1], base["latents"][:, -1]) < 0.15


@pytest.mark.parametrize("num_steps", [10, 14])
def test_ode_sample_euler_is_the_rollout_and_dpm2_is_closer_to_the_exact_ode(num_steps):
    sigmas = sde.sd3_sigmas(num_steps)
    x = torch.randn(4000, 2, generator=torch.Generator().manual_seed(0))
    velocity = counting(exact_velocity)
    euler = sde.ode_sample(velocity, x, sigmas, solver="euler")
    assert velocity.calls == num_steps
    assert torch.equal(euler, sde.rollout(exact_velocity, x, sigmas, sde_steps=[], kind="ode")["latents"][:, -1])
    velocity = counting(exact_velocity)
    dpm2 = sde.ode_sample(velocity, x, sigmas, solver="dpm2")
    assert velocity.calls == num_steps and dpm2.shape == x.shape and dpm2.dtype == torch.float32
    exact = exact_transport(x, 1.0)  # the exact ODE maps the noise affinely onto the data
    rms = lambda a: ((a - exact) ** 2).mean().sqrt().item()
    assert rms(dpm2) < 0.5 * rms(euler), (rms(dpm2), rms(euler))  # second order: well under Euler's error
    with pytest.raises(ValueError, match="--sampler"):
        sde.ode_sample(exact_velocity, x, sigmas, solver="heun")


def test_nft_timesteps_drop_one_schedule_sigma_per_sample_at_random():
    idx = sde.nft_timesteps(10, 5000, fraction=0.99, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (5000, 9) and idx.dtype == torch.long
    assert all(len(set(row)) == 9 and set(row) <= set(range(10)) for row in idx.tolist()[:200])  # distinct
    dropped = torch.tensor([45 - sum(row) for row in idx.tolist()])  # 0 + ... + 9 = 45: the one left out
    counts = torch.bincount(dropped, minlength=10).float() / 5000
    assert (counts - 0.1).abs().max() < 0.02, counts  # uniform over the 10, sigma = 1 included
    assert (idx[:, 0] != idx[1:2, 0]).any()  # each sample its own order
    assert sde.nft_timesteps(14, 3, fraction=0.5).shape == (3, 7)
    with pytest.raises(ValueError, match="--timestep-fraction"):
        sde.nft_timesteps(10, 2, fraction=0.05)


@pytest.mark.parametrize("kind, strata", [
    ("discrete_wo_init", [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),  # AWM GenEval / OCR (14 steps, 0.9, 6)
    ("discrete", [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),  # AWM PickScore
])
def test_awm_timesteps_draw_one_index_per_stratum(kind, strata):
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sde.awm_timesteps(14, 6, fraction=0.9, kind=kind, generator=g) for _ in range(2000)])
    for j, stratum in enumerate(strata):
        values = draws[:, j]
        assert set(values.tolist()) == stratum, (j, set(values.tolist()))
        if len(stratum) == 2:
            assert abs((values == min(stratum)).float().mean().item() - 0.5) < 0.05  # uniform within
    with pytest.raises(ValueError, match="--awm-timesteps"):
        sde.awm_timesteps(14, 6, kind="logit_normal")
    with pytest.raises(ValueError, match="--train-timesteps"):
        sde.awm_timesteps(14, 12, fraction=0.9)  # 11 indices (1 .. 11) for 12 strata
    with pytest.raises(ValueError, match="--timestep-fraction 1 or more"):
        sde.awm_timesteps(2, 3, fraction=0.5)  # no index at all: the fraction that leaves one is named
