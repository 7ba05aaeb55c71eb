"""Sigma schedules, the stochastic step with its Gaussian log-prob, and the rollout loop.

Rectified flow: x_s = (1 - s) x0 + s eps, the network predicts v ~ eps - x0, and sampling runs
from s = 1 (noise) to s = 0 (data). One step goes from s = sigma to s' = sigma_next.

    code          paper symbol
    ----          ------------
    x             x_t, the latent at noise level s
    sigma, s      t (Flow-GRPO, DanceGRPO), sigma_t (Flow-CPS); s = 1 is pure noise
    sigma_next    t - Delta t, written s'
    dt            s' - s < 0 (Flow-GRPO's -Delta t)
    v             v_theta(x_t, t), predicts eps - x0
    x0_hat        Tweedie's estimate of x0: x - s v
    eps_hat       the matching estimate of eps: x + (1 - s) v
    std_dev_t     diffusion coefficient sigma_t = a sqrt(t / (1 - t)) (Flow-GRPO), eta (DanceGRPO)
    eta           noise level: a (Flow-GRPO), eta (DanceGRPO), noise level (Flow-CPS)
    mean, std     mean and std of the Gaussian transition x_{t - Delta t} | x_t
    log_prob      log pi_theta(x_{t - Delta t} | x_t, c), averaged over latent dimensions

The four kinds of step (`sde_step(kind=...)`):

    (1) x0_hat = x - s v,  eps_hat = x + (1 - s) v                                   [Tweedie]
    (2) score  = -(x - (1 - s) x0_hat) / s^2 = -eps_hat / s                           [Tweedie]
    flow  (Flow-GRPO arXiv:2505.05470, the Euler-Maruyama step of its ODE-to-SDE conversion):
    (3) std_dev_t = eta sqrt(s / (1 - s)); s = 1 is replaced by sigma_max in 1 - s
    (4) mean = x (1 + std_dev_t^2 dt / (2 s)) + v (1 + std_dev_t^2 (1 - s) / (2 s)) dt
                = x + v dt - (std_dev_t^2 / 2) score dt
    (5) std  = std_dev_t sqrt(-dt)
    dance (DanceGRPO arXiv:2505.07818, constant noise):
    (6) mean = x + v dt - (eta^2 / 2) score dt,  std = eta sqrt(-dt)
    cps   (coefficient-preserving sampling, Flow-CPS arXiv:2509.05952):
    (7) std  = s' sin(eta pi / 2),  mean = (1 - s') x0_hat + sqrt(s'^2 - std^2) eps_hat
    ode:
    (8) x' = x + dt v
    all stochastic kinds:
    (9) x' = mean + std * noise,  noise ~ N(0, I)
   (10) log_prob = mean_dims[ -(x' - mean)^2 / (2 std^2) - log std - log(2 pi) / 2 ]   (flow, dance)
        log_prob = mean_dims[ -(x' - mean)^2 ]                 (cps: Flow-CPS's own convention)

Why the score term: the Fokker-Planck equation of dx = (v - g^2/2 score) dt + g dw has the same
marginals p_s as the ODE dx = v dt for any g, so (4) and (6) sample the model's own distribution
(up to discretisation error); dropping the score term adds variance g^2 |dt| per step and the
samples come out far too wide (tests/test_sde.py shows both).

`cps` preserves the schedule's coefficients, not the data marginal: x' = (1 - s') x0_hat + s' times
a mix of eps_hat and fresh noise. That would be the marginal if x0_hat and eps_hat were the true x0
and eps; they are posterior means, narrower than both, and the fresh noise s' sin(eta pi / 2) that
replaces part of eps_hat does not shrink with the step size, so the loss of spread adds up over
the steps instead of vanishing as they get finer. On Gaussian data with the exact velocity (eta 0.7,
SD3 schedule) the final std comes out about 18 % low at 50 steps, 23 % at 20 and 29 % at 10, where
the Euler ODE's own error is 3 %, 9 % and 18 %: the part due to cps grows with the step count.
tests/test_sde.py pins these numbers.

Log-probs are means over the latent dimensions, not sums (as Flow-GRPO's code). A sum over
D ~ 10^5 dimensions would make log(ratio) a sum of D per-dimension log-ratios, and exp() of it
overflows or vanishes; the mean makes the ratio the D-th root of the exact one. The price is scale:
the PPO clip acts on that root, so `clip_range` is about 1e-4 on hub models (Flow-GRPO's value;
1e-4 per dimension is a summed log-ratio of about 6.5 over SD3's 16 x 64 x 64 latent at 512 px)
where an LLM would use 0.2, and it must be re-tuned when the latent size changes. On a 2-D toy
(D = 2) a clip of 0.2 is right again. FlowDPPO's KL threshold and the KL penalty are mean-reduced
for the same reason.

The forward-process losses (DiffusionNFT, AWM, online SFT / DPO, DGPO, CRD) need none of the above at training
time: they sample with a deterministic solver (`ode_sample`), keep only the clean sample, and train at sigmas of
the same schedule on freshly re-noised copies of it. Their training times are all here: `nft_timesteps`, the
stratified draws of `awm_timesteps` (AWM, DGPO) and `crd_timesteps`, and `logit_normal_timesteps` (SFT, DPO).

Which steps are stochastic (`sde_steps`): `all` (Flow-GRPO: the first floor(T * fraction)),
`fast` (Flow-GRPO-Fast: a random window, the rest ODE), `mix` (MixGRPO arXiv:2507.21802: a window
sliding from the noisy end to the clean end). The last step (to s = 0) is always an ODE step: its
noise could not be removed any more, and at 10 SD3 steps it is only 0.009 -> 0.
"""

import collections
import math
import random

import torch

KINDS = ("flow", "dance", "cps", "ode")
WINDOWS = ("all", "fast", "mix", "sparse")
SOLVERS = ("euler", "dpm2")  # deterministic samplers of ode_sample
AWM_TIMESTEPS = ("discrete_wo_init", "discrete")  # AWM's time_type choices over the schedule
SIGMA_ONE = 1e-4  # s within this of 1 counts as s = 1 in the 1 - s of (3)

SDEStep = collections.namedtuple("SDEStep", "prev_sample log_prob mean std")


def time_shift(t, shift):
    """SD3's timestep shift (Esser et al. 2024, arXiv:2403.03206): t -> shift t / (1 + (shift - 1) t),
    on floats, numpy arrays or tensors (computed in their own precision)."""
    return shift * t / (1 + (shift - 1) * t)


def sd3_sigmas(num_steps, shift=3.0):
    """The time-shifted schedule of diffusers' FlowMatchEulerDiscreteScheduler(shift=shift) after
    set_timesteps(num_steps), which the SD3 pipelines sample with: float32 [num_steps + 1], 1 -> 0."""
    if num_steps < 1:
        raise ValueError(f"--num-steps must be at least 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"--shift must be positive, got {shift}")
    # diffusers spaces the steps evenly between the shifted ends of its 1000-step training grid
    # (computed in float32 there: the smallest is shift(1/1000)), then shifts them again.
    t_min = time_shift(torch.tensor(1.0, dtype=torch.float32) / 1000, shift).item()
    t = torch.linspace(1.0, t_min, num_steps, dtype=torch.float64)
    sigmas = time_shift(t, shift).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1)])


def _per_sample(value, batch, device, name):
    """A float or [B] tensor -> float32 [B]."""
    t = torch.as_tensor(value, dtype=torch.float32).to(device)
    if t.ndim == 0:
        return t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"{name} must be a float or a [{batch}] tensor, got shape {tuple(t.shape)}")
    return t


def sde_step(v, x, sigma, sigma_next, *, kind="flow", eta=0.7, prev_sample=None, generator=None, sigma_max=None):
    """One step from s = sigma to s' = sigma_next; returns SDEStep(prev_sample, log_prob, mean, std).

    Sampling (prev_sample None) draws x' from the transition; scoring (prev_sample given, as in
    training) returns the log-prob of that stored x' under the current v, with gradients through
    `mean` and `log_prob` to v. Everything is float32 whatever the dtype of v and x: in bf16, 1 - s
    rounds to 0 near s = 1 and (3) becomes inf, and the log-prob differences that make the ratio
    (~1e-4) are below its resolution. sigma and sigma_next are floats or per-sample [B] tensors
    (floats are checked; tensors are not, to keep the step free of device syncs). sigma_max
    replaces s in the 1 - s of (3) where s is within 1e-4 of 1; default sigma_next (= sigmas[1] at
    the first step, Flow-GRPO's choice). `ode`, and any kind with eta == 0, returns the Euler step
    (8) with log_prob None (no density exists; an inf would poison a batch silently) and std 0.
    Shapes: v, x, prev_sample, mean [B, ...]; log_prob, std [B].
    """
    if kind not in KINDS:
        raise ValueError(f"unknown SDE kind {kind!r}; choose one of {', '.join(KINDS)} (--sde)")
    if eta < 0:
        raise ValueError(f"--eta must be >= 0, got {eta}")
    if x.ndim < 2 or v.shape != x.shape:
        raise ValueError(f"v and x must have the same shape [B, ...], got {tuple(v.shape)} and {tuple(x.shape)}")
    if isinstance(sigma, (int, float)) and isinstance(sigma_next, (int, float)) and not 0 <= sigma_next < sigma <= 1:
        raise ValueError(f"a step needs 0 <= sigma_next < sigma <= 1, got sigma {sigma} -> {sigma_next}")
    if isinstance(sigma_max, (int, float)) and not 0 < sigma_max <= 1 - SIGMA_ONE:
        raise ValueError(f"sigma_max must be in (0, 1 - {SIGMA_ONE}] (use sigmas[1]), got {sigma_max}")
    v, x = v.float(), x.float()
    batch, dims = x.shape[0], tuple(range(1, x.ndim))
    view = (batch,) + (1,) * (x.ndim - 1)  # per-sample scalars broadcast over the latent
    s = _per_sample(sigma, batch, x.device, "sigma").view(view)
    s_next = _per_sample(sigma_next, batch, x.device, "sigma_next").view(view)
    dt = s_next - s  # < 0

    if kind == "ode" or eta == 0:
        euler = x + dt * v  # (8)
        prev = euler if prev_sample is None else prev_sample.float()
        return SDEStep(prev, None, euler, torch.zeros(batch, device=x.device))

    if kind == "flow":
        s_max = s_next if sigma_max is None else _per_sample(sigma_max, batch, x.device, "sigma_max").view(view)
        s_safe = torch.where(s > 1 - SIGMA_ONE, s_max, s)  # 1 - s = 0 at the first step
        std_dev_t = eta * torch.sqrt(s / (1 - s_safe))  # (3)
        mean = (x * (1 + std_dev_t**2 / (2 * s) * dt)
                + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt)  # (4)
        std = std_dev_t * torch.sqrt(-dt)  # (5)
    elif kind == "dance":
        x0_hat = x - s * v  # (1)
        score = -(x - (1 - s) * x0_hat) / s**2  # (2)
        mean = x + v * dt - 0.5 * eta**2 * score * dt  # (6)
        std = eta * torch.sqrt(-dt)
    else:  # cps
        std = s_next * math.sin(eta * math.pi / 2)  # (7)
        x0_hat, eps_hat = x - s * v, x + (1 - s) * v  # (1)
        mean = (1 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp_min(0)) * eps_hat  # (7)

    if prev_sample is None:  # drawn where the generator lives (a CPU generator is resumable), then moved
        device = generator.device if generator is not None else x.device
        noise = torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32).to(x.device)
        prev_sample = mean + std * noise  # (9)
    prev_sample = prev_sample.float()
    diff = prev_sample.detach() - mean  # the action is fixed; gradients reach v through mean only
    if kind == "cps":
        log_prob = -(diff**2).mean(dims)  # (10), Flow-CPS convention
    else:
        log_prob = (-diff**2 / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(dims)  # (10)
    return SDEStep(prev_sample, log_prob, mean, std.reshape(batch))


def sde_steps(num_steps, *, window="all", iteration=0, timestep_fraction=1.0, window_size=2, window_range=None,
              stride=1, iters_per_window=1, roll_back=False, seed=0):
    """Sorted indices of the steps that are stochastic AND trained (step i: sigmas[i] -> sigmas[i+1]).

    all:  the first floor(num_steps * timestep_fraction) steps (Flow-GRPO's timestep_fraction).
    fast: Flow-GRPO-Fast, `window_size` consecutive steps that all lie in steps lo .. hi - 1 of
          window_range = (lo, hi), as Flow-GRPO's sde_window_range (sd3_pipeline_with_logprob_fast.py:
          start = randint(lo, hi - window_size), both ends inclusive), so (0, 5) with size 3 trains
          steps 0..4 only; default (0, num_steps - 1), every window without the last step. The start
          comes from a generator seeded with (seed, iteration), seed an int or a tuple of ints: the
          same arguments draw the same window in any process and after a resume (train.py passes
          (seed, rank, rollout batch): each rollout batch its own window, as Flow-GRPO-Fast).
    mix:  MixGRPO (arXiv:2507.21802), a sliding window of `window_size` steps starting at step 0
          that moves `stride` steps later every `iters_per_window` iterations; its last position
          ends at the last trainable step (a position past it is clamped there). It then stays
          there, or with roll_back starts again at step 0.
    sparse: FlowDPPO's (UniRL AllSDEScheduler, unirl/utils/scheduler_utils.py L112-124), `window_size` steps
          drawn without replacement from steps lo .. hi - 1 of window_range, not necessarily adjacent, from a
          generator seeded with (seed, iteration); UniRL draws one set per rollout step, the same on every rank
          (seeded with the step alone: the same distribution, other draws).
    The last step (index num_steps - 1, into s = 0) is never included. Other steps are ODE steps.
    """
    trainable = num_steps - 1  # steps 0 .. num_steps - 2
    if trainable < 1:
        raise ValueError(f"--num-steps must be at least 2 (the last step is never trained), got {num_steps}")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if window == "all":
        if not 0 < timestep_fraction <= 1:
            raise ValueError(f"--timestep-fraction must be in (0, 1], got {timestep_fraction}")
        n = min(math.floor(num_steps * timestep_fraction), trainable)
        if n < 1:
            raise ValueError(f"--timestep-fraction {timestep_fraction} of {num_steps} steps trains no step; raise it")
        return list(range(n))
    if window not in WINDOWS:
        raise ValueError(f"--sde-window must be one of {', '.join(WINDOWS)}, got {window!r}")
    if not 1 <= window_size <= trainable:
        raise ValueError(f"--window-size must be in [1, {trainable}] (the trainable steps of --num-steps {num_steps}), "
                         f"got {window_size}")
    last_start = trainable - window_size
    if window in ("fast", "sparse"):
        lo, hi = (0, trainable) if window_range is None else window_range
        if not 0 <= lo <= hi - window_size or hi > trainable:
            raise ValueError(f"--window-range LO HI must hold the whole window: 0 <= LO, LO + --window-size "
                             f"{window_size} <= HI <= {trainable} (= num_steps - 1, the last step is never trained), "
                             f"got {lo} {hi}")
        if window == "sparse":
            return sorted(random.Random(f"sparse-steps/{seed}/{iteration}").sample(range(lo, hi), window_size))
        start = random.Random(f"fast-window/{seed}/{iteration}").randint(lo, hi - window_size)  # same in every process
    else:  # mix
        if stride < 1:
            raise ValueError(f"--window-stride must be at least 1, got {stride}")
        if iters_per_window < 1:
            raise ValueError(f"--iters-per-window must be at least 1, got {iters_per_window}")
        positions = math.ceil(last_start / stride) + 1  # starts 0, stride, 2 stride, ..., last_start
        move = iteration // iters_per_window
        move = move % positions if roll_back else min(move, positions - 1)
        start = min(move * stride, last_start)
    return list(range(start, start + window_size))


def renoise(x0, eps, sigma):
    """The forward (noising) process of rectified flow, x_s = (1 - s) x0 + s eps: where the forward-process
    losses re-noise a clean rollout sample with fresh noise. sigma: float or [B]; float32 like x0."""
    s = _per_sample(sigma, x0.shape[0], x0.device, "sigma").view((-1,) + (1,) * (x0.ndim - 1))
    return (1 - s) * x0.float() + s * eps.float()


def nft_timesteps(num_steps, batch, *, fraction=0.99, generator=None):
    """DiffusionNFT's training times (train_nft_sd3.py L569, L810-816): each sample takes its own random
    permutation of the schedule's num_steps sigmas (sigmas[0] = 1 included, the final 0 not) and keeps the
    first int(num_steps * fraction); at 10 steps and 0.99, 9 of the 10. Returns indices into sigmas, [batch, n]."""
    n = int(num_steps * fraction)
    if not 0 < fraction <= 1 or n < 1:
        raise ValueError(f"--timestep-fraction {fraction} of {num_steps} steps trains no sigma; use a value in "
                         f"[{1 / num_steps:.3g}, 1]")
    return torch.rand(batch, num_steps, generator=generator).argsort(dim=1)[:, :n]


def awm_timesteps(num_steps, n, *, fraction=0.9, kind="discrete_wo_init", generator=None):
    """AWM's stratified training times over the schedule (train_sd3_awm.py L1172-1205): the index range
    [lo, int(num_steps * fraction)] with lo = 1 (`discrete_wo_init`: never sigma = 1) or 0 (`discrete`) is cut
    into n strata at linspace(lo, hi, n + 1) (truncated to integers), and one index is drawn uniformly from
    each; at 14 steps, 0.9 and n = 6 the strata are {1}, {2, 3}, {4, 5}, ..., {10, 11}. The caller shares
    them across a micro-batch. Returns indices into sigmas, [n]."""
    if kind not in AWM_TIMESTEPS:
        raise ValueError(f"unknown AWM timestep sampling {kind!r}; choose one of {', '.join(AWM_TIMESTEPS)} "
                         "(--awm-timesteps)")
    lo, hi = (1 if kind == "discrete_wo_init" else 0), int(num_steps * fraction)
    if hi - lo < 1 or not 0 < fraction <= 1:  # no index at all: no --train-timesteps could fit
        raise ValueError(f"--timestep-fraction {fraction:g} of {num_steps} steps leaves no schedule index to train at; "
                         f"use --timestep-fraction {(lo + 1) / num_steps:.3g} or more, or raise --num-steps")
    if not 1 <= n <= hi - lo:
        raise ValueError(f"--train-timesteps {n} strata over schedule indices {lo} .. {hi - 1} (--timestep-fraction "
                         f"{fraction} of {num_steps} steps) leave a stratum empty: use 1 to {max(hi - lo, 0)} of them, "
                         "or raise --timestep-fraction or --num-steps")
    return stratified(lo, hi, n, generator)


def stratified(lo, hi, n, generator=None):
    """n strata of the schedule's indices at linspace(lo, hi, n + 1) (float32, as AWM's and Flow-Factory's code),
    truncated to integers, one index drawn uniformly in [lower, upper) of each (the lower one where a stratum is
    narrower than 1). [n] indices."""
    bounds = torch.linspace(lo, hi, n + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(n, generator=generator) * (upper - lower)).long()


def crd_timesteps(num_steps, n=None, *, fraction=0.99, generator=None):
    """CRD's training times (Flow-Factory TimeSampler.discrete, 'discrete', noise_schedule.py L185-259, as crd.py
    L242-259 calls it): n strata (default int(num_steps x fraction), its CRDTrainingArguments L894-919) of the indices
    0 .. int(num_steps x fraction) - 1 (`stratified`: more strata than steps repeat indices). Flow-Factory keeps the
    indices whose sigma is at least 1 - fraction: on SD3's shift-3 schedule at 10 steps and 0.99 the same 0 .. 8
    (0.278 >= 0.01 > 0.0089); on its own schedule, which ends at 0.25, 0 .. 9 (losses.crd, departure 3). The caller
    shares them across a micro-batch. Returns indices into sigmas, [n]."""
    hi = int(num_steps * fraction) - 1
    if hi < 0:
        raise ValueError(f"--timestep-fraction {fraction} of {num_steps} steps leaves no schedule index to train at: "
                         "raise it or --num-steps")
    return stratified(0, hi, n or max(1, hi + 1), generator)


def logit_normal_timesteps(num_steps, batch, *, fraction=0.99, generator=None):
    """flow_grpo's online DPO / SFT training times (train_sd3_dpo.py L890-898): int(num_steps x fraction) draws per
    sample, each u = sigmoid(n), n ~ N(0, 1) (compute_density_for_timestep_sampling 'logit_normal', mean 0, std 1), at
    index int(1000 u) of the 1000-step training grid from sigma 1 down. Returned as positions int(1000 u) / 1000 x
    num_steps in [0, num_steps) of the rollout schedule, between whose sigmas train.py interpolates linearly. Not
    flow_grpo's sigmas, not even at the schedule's own points: diffusers' schedule is not a subset of the 1000-step
    grid, so index 750 trains at sigma 0.477 here against flow_grpo's 0.500 at 40 steps, every sigma here at or below
    flow_grpo's (docs/departures.md, 15). [batch, n] float."""
    n = max(1, int(num_steps * fraction))
    u = torch.sigmoid(torch.randn(batch, n, generator=generator))
    return torch.floor(u * 1000).clamp(max=999) / 1000 * num_steps


def _dpm_solver_2m(velocity_fn, x, grid):
    """DPM-Solver++(2M) (Lu et al. 2022, arXiv:2211.01095, Alg. 2) in the flow parametrisation:
    alpha = 1 - s, sigma = s, data prediction x0_hat = x - s v, lambda = log((1 - s) / s).

        h  = lambda' - lambda,  r = h_prev / h
        D  = (1 + 1/(2r)) x0_hat - 1/(2r) x0_hat_prev      (first order, D = x0_hat, on the first step)
        x' = (s' / s) x - (1 - s') (exp(-h) - 1) D

    The first-order update is exactly the Euler step (8). Two steps are taken first order: the one
    into s' = 0 (lambda' = inf), x' = x0_hat, and any step more than twice as long in lambda as the
    one before (r < 1/2), where extrapolating x0_hat linearly overshoots; the SD3 schedule has one,
    its jump to the last nonzero sigma (0.15 -> 0.009 in lambda 1.7 -> 4.7 at 20 steps).
    From s = 1 (lambda = -inf) the first step is the Euler step too, and the second has r = inf, D = x0_hat
    (as DiffusionNFT's solver.py dpm_step). Yields the state at each grid[1:] point.
    """
    x0_prev = h_prev = None
    for s, s_next in zip(grid[:-1], grid[1:]):
        x0 = x - s * velocity_fn(x, s).float()
        if s_next == 0:
            x = x0
        else:
            h = math.log((1 - s_next) / s_next) - (math.log((1 - s) / s) if s < 1 else -math.inf)  # s = 1: h = inf
            d = x0
            if x0_prev is not None and h_prev / h >= 0.5:
                r = h_prev / h
                d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * x0_prev  # second order
            x = (s_next / s) * x - (1 - s_next) * math.expm1(-h) * d
            x0_prev, h_prev = x0, h
        yield x


def flash_grid(sigmas, start, ratio):
    """MixGRPO-Flash's compressed grid for the ODE steps after the window: from sigmas[start] to sigmas[-1],
    n = max(int((T - start + 1) ratio), 2) points evenly spaced in step index, T = len(sigmas) - 1
    (MixGRPO sampling_utils.py, run_sample_step with dpm_apply_strategy "post": its ratio is
    dpm_post_compress_ratio, 0.4 in its scripts). MixGRPO spaces them evenly in its unshifted time,
    which is linear in the step index of its schedule, and shifts them again; here a point between two
    steps gets sigma interpolated linearly between them, which serves any schedule (the same points
    where they fall on the grid). At least 2 points (one step): MixGRPO's max(..., 1) would leave the
    sample at sigmas[start] when the window ends within 1 / ratio steps of the end."""
    if not 0 < ratio <= 1:
        raise ValueError(f"--flash-ratio must be in (0, 1], got {ratio}")
    sigmas = torch.as_tensor(sigmas, dtype=torch.float64).cpu()
    num = len(sigmas) - 1
    n = max(int((num - start + 1) * ratio), 2)
    position = torch.linspace(start, num, n, dtype=torch.float64)
    low = position.floor().long().clamp(max=num - 1)
    grid = sigmas[low] + (position - low) * (sigmas[low + 1] - sigmas[low])
    grid[0], grid[-1] = sigmas[start], sigmas[-1]  # exact ends
    return grid.float()


@torch.no_grad()
def ode_sample(velocity_fn, x, sigmas, *, solver="euler"):
    """Deterministic sampling from the noise x through `sigmas` to the clean sample (float32, shape of x).

    The rollouts of the forward-process losses (DiffusionNFT, AWM, online SFT / DPO, DGPO, CRD), which need only
    the final sample: no per-step state, log-prob or mean is kept. `euler` takes the ODE step (8) at every step; `dpm2`
    is DPM-Solver++(2M) (_dpm_solver_2m), DiffusionNFT's rollout solver (solver.py dpm_step, order 2).
    Where they differ: the reference also takes its second-to-last step (0.28 -> 0.009 at 10 SD3 steps)
    second order, where _dpm_solver_2m takes that long jump in lambda first order (see its docstring). On
    Gaussian data with the exact velocity, the final RMS error at 10 steps is 0.05 this way, 0.39 with the
    reference's extrapolation there, 0.21 with Euler (tests/test_sde.py checks dpm2 against Euler).
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)} (--sampler)")
    grid = torch.as_tensor(sigmas, dtype=torch.float32).cpu().tolist()
    x = x.float()
    if solver == "dpm2":
        for x in _dpm_solver_2m(velocity_fn, x, grid):
            pass
        return x
    for s, s_next in zip(grid[:-1], grid[1:]):
        x = sde_step(velocity_fn(x, s), x, s, s_next, kind="ode").prev_sample  # (8)
    return x


@torch.no_grad()
def rollout(velocity_fn, x, sigmas, *, sde_steps, kind="flow", eta=0.7, generator=None, sigma_max=None, flash=False,
            flash_ratio=0.4):
    """Run one trajectory from the noise x through `sigmas`, stochastic on `sde_steps`, ODE elsewhere.

    velocity_fn(x, sigma: float) -> v is the only model-dependent part (CFG lives inside it).
    Returns a dict of float32 tensors, batch first (K = len(sde_steps)):
      latents       [B, N, ...]  the states; latents[:, k] and latents[:, k + 1] are the input and
                                 output of step k for every k in steps, latents[:, -1] the sample
      log_probs     [B, K]       of the stochastic steps, in `steps` order
      means         [B, K, ...]  transition means (GRPO-Guard, FlowDPPO, the KL penalty)
      stds          [B, K]       transition stds
      steps         [K] int64    the stochastic step indices
      sigmas        [T + 1]      the schedule as given
      latent_sigmas [N]          the noise level of each latents entry
    Without flash, N = T + 1 and latents[:, i] is at sigmas[i].

    flash (MixGRPO-Flash, arXiv:2507.21802): the ODE steps after the last stochastic step
    are replaced by DPM-Solver++(2M) on flash_grid(sigmas, e, flash_ratio), n points from
    sigmas[e] to 0 (n - 1 steps instead of R), where e is the last stochastic step + 1 and
    R = T - e. latents then holds the original grid up to the end of the window, followed by the
    solver's states, so N = e + n. Steps in `steps` index latents exactly as without flash.
    Never before the window: the window's states must be those of the base sampler's marginal.
    A different solver before it moves the states the SDE steps start from, so its error
    lands inside the trained steps' inputs, and the policy is trained (and its log-probs taken) at
    states the Euler sampler never visits. After the window no log-prob is taken; the solver only
    changes how the final image is reached, which the reward sees.
    """
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32).cpu()
    num = len(sigmas) - 1
    steps = sorted(set(int(k) for k in sde_steps))
    if steps and not 0 <= steps[0] <= steps[-1] < num:
        raise ValueError(f"sde_steps must lie in [0, {num - 1}] for {num} steps, got {steps}")
    if steps and (kind == "ode" or eta == 0):
        raise ValueError("kind 'ode' or --eta 0 has no log-prob: pass sde_steps=[] or an --eta above 0")
    if sigma_max is None and num >= 2:
        sigma_max = sigmas[1].item()  # Flow-GRPO: the first step uses sigmas[1] in place of s = 1

    x = x.float()
    latents, log_probs, means, stds = [x], [], [], []
    stochastic = set(steps)
    flash_from = steps[-1] + 1 if (flash and steps) else num  # first step left to the fast solver
    for i in range(flash_from):
        s, s_next = sigmas[i].item(), sigmas[i + 1].item()
        v = velocity_fn(x, s).float()
        if i in stochastic:
            out = sde_step(v, x, s, s_next, kind=kind, eta=eta, generator=generator, sigma_max=sigma_max)
            x = out.prev_sample
            log_probs.append(out.log_prob)
            means.append(out.mean)
            stds.append(out.std)
        else:
            x = sde_step(v, x, s, s_next, kind="ode").prev_sample  # (8)
        latents.append(x)
    latent_sigmas = sigmas[:flash_from + 1]
    if flash_from < num:
        grid = flash_grid(sigmas, flash_from, flash_ratio)
        latents.extend(_dpm_solver_2m(velocity_fn, x, grid.tolist()))
        latent_sigmas = torch.cat([latent_sigmas, grid[1:]])

    batch, shape = x.shape[0], tuple(x.shape[1:])
    return {
        "latents": torch.stack(latents, dim=1),  # [B, N, ...]
        "log_probs": torch.stack(log_probs, dim=1) if steps else x.new_zeros(batch, 0),  # [B, K]
        "means": torch.stack(means, dim=1) if steps else x.new_zeros((batch, 0) + shape),  # [B, K, ...]
        "stds": torch.stack(stds, dim=1) if steps else x.new_zeros(batch, 0),  # [B, K]
        "steps": torch.tensor(steps, dtype=torch.long),  # [K]
        "sigmas": sigmas,  # [T + 1]
        "latent_sigmas": latent_sigmas,  # [N]
    }
