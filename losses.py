"""The policy losses: GRPO, GRPO-Guard, FlowDPPO, KL penalty and its adaptive weight (reverse process); DiffusionNFT,
Advantage Weighted Matching, online SFT and DPO, DGPO and Centered Reward Distillation (forward process). The
advantages they train on come from advantages.py (each record names its rule). The few-step distillation losses, not
yet in the registry: DMD2 and its critic's, TDM (its re-noising, its critic's) and TDM-R1 (its surrogate's), DMDR and
on-policy distillation (DiffusionOPD).

Pure functions of tensors: no model, no args object, hyper-parameters as keywords. Each loss takes
the tensors of ONE trained denoising step k for a micro-batch and returns (loss, info), where loss
is a scalar to backpropagate and info a dict of detached 0-dim tensors to log (train.py fetches a step's
values from the device in one transfer: an .item() per statistic would wait for the GPU at every term).

    code            paper symbol
    ----            ------------
    log_prob        log pi_theta(x_{k+1} | x_k, c), mean over latent dims (sde.py (10))
    old_log_prob    log pi_theta_old(x_{k+1} | x_k, c), recorded by the rollout
    ratio           r = exp(log_prob - old_log_prob)
    adv             A_i, the group-relative advantage of sample i
    mean, old_mean  mu_theta, mu_theta_old: the Gaussian transition means
    std, sigma_t    the transition std (sde.py (5)), GRPO-Guard's c_t, FlowDPPO's sigma_t
    dt              s' - s < 0
    clip_range      PPO's epsilon (about 1e-4 with mean-reduced log-probs on image latents)

Shapes: log_prob, old_log_prob, adv [B]; mean, old_mean [B, ...]; std, sigma_t, dt float or [B].
Per-sample quantities stay per sample: nothing is averaged over the batch before the last mean.
`adv` is expected clipped already (group_advantages does it); `adv_clip` clamps again if given.

The forward-process losses (DiffusionNFT arXiv:2509.16117, AWM arXiv:2509.25050) take no log-prob of
a sampler step: they re-noise a clean rollout sample x0 with fresh noise eps at a noise level s,
x_s = (1 - s) x0 + s eps, and compare the velocity there with the flow-matching target eps - x0.

    code            paper symbol
    ----            ------------
    v, v_old        v_theta(x_t, t) and v_old(x_t, t) of the "old" (sampling) policy (NFT)
    v_ref           the base model's (LoRA off) or an EMA copy's velocity, for the velocity-space KL
    x_t, x0, eps    the re-noised input, the clean rollout sample, the fresh noise
    sigma           t in x_t = (1 - t) x0 + t eps
    r               DiffusionNFT's optimality probability, in [0, 1]
    beta            DiffusionNFT's guidance strength beta (not a KL weight)
"""

import argparse
import inspect
import math
from typing import Callable, NamedTuple

import torch

import flags
import sde
from advantages import best_of_group, group_advantages, preference_pairs


def _dims(x):
    return tuple(range(1, x.ndim))


def _per_sample(value, like):
    """float or [B] -> [B] float32 on like's device."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    return t.expand(like.shape[0]) if t.ndim == 0 else t.reshape(like.shape[0])


def _require(holds, message):
    """ValueError(message) unless every element of the bool tensor `holds` is True. On a GPU the check is an
    asynchronous device-side assert: a host-side `if` would wait for the GPU at every trained term."""
    if holds.device.type == "cpu":
        if not holds.all():
            raise ValueError(message)
    else:
        torch._assert_async(holds.all(), message)


def _check(log_prob, old_log_prob, adv):
    if log_prob is None:
        raise ValueError("log_prob is None: the step was an ODE step (kind 'ode' or --eta 0) and has no log-prob")
    if not (log_prob.ndim == 1 and log_prob.shape == old_log_prob.shape == adv.shape):
        raise ValueError(f"log_prob, old_log_prob and adv must be [B] tensors of one shape, got "
                         f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(adv.shape)}")


def _ratio_stats(ratio, log_ratio):
    """The statistics a researcher watches; approx_kl is PPO's 0.5 E[(log r)^2] (as Flow-GRPO logs)."""
    r = ratio.detach().float()
    return {"ratio_mean": r.mean(), "ratio_std": r.std(unbiased=False), "ratio_min": r.min(), "ratio_max": r.max(),
            "approx_kl": 0.5 * (log_ratio.detach().float() ** 2).mean().double()}


def _sq_dist(a, b):
    """mean_dims((a - b)^2) per sample, float32 -> [B]."""
    return ((a.float() - b.float()) ** 2).mean(_dims(a))


def grpo_loss(log_prob, old_log_prob, adv, *, clip_range, adv_clip=None, step_weight=None, dtype=torch.float32):
    """Flow-GRPO's policy term for one step (arXiv:2505.05470, Eq. 6): PPO's clipped surrogate (arXiv:1707.06347,
    Eq. 7), negated to a loss, per denoising step:

        loss = mean_i max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps)),   r_i = exp(log_prob_i - old_log_prob_i)

    A term whose ratio has left [1 - eps, 1 + eps] in the advantage's direction is the clipped, constant branch and
    carries no gradient. With r = 1 the loss is -mean(A). GRPO-Guard (guard_loss) and AWM (awm_loss) take the same
    clip of their own ratios: step_weight divides each term (Guard's reweight), dtype is the arithmetic's (AWM:
    float64). Returns (loss, info with the ratio statistics and clipfrac).
    """
    _check(log_prob, old_log_prob, adv)
    adv = adv.to(dtype) if adv_clip is None else adv.to(dtype).clamp(-adv_clip, adv_clip)
    log_ratio = log_prob.to(dtype) - old_log_prob.to(dtype)
    ratio = torch.exp(log_ratio)
    per_sample = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))  # [B]
    info = _ratio_stats(ratio, log_ratio)
    info["clipfrac"] = ((ratio.detach() - 1).abs() > clip_range).float().mean()
    if step_weight is not None:
        per_sample = per_sample / step_weight
    return per_sample.mean(), info


def kl_penalty(mean, ref_mean, std, *, dt=None, gate=None):
    """KL(pi_theta || pi_ref) of the step's Gaussian transitions against the frozen reference model,
    mean-reduced over latent dims like the log-probs. std is the transition std, float or [B].

    dt None: the exact KL of two Gaussians with equal covariance std^2 I, per sample
        kl = mean_dims((mean - ref_mean)^2) / (2 std^2)
    dt given (s' - s < 0, float or [B]): Flow-GRPO's form, which its published betas (0.04 OCR and
    GenEval, 0.01 PickScore) were tuned on. Its code (train_sd3.py, the kl_loss line) divides by
    2 std_dev_t^2, the diffusion coefficient before the sqrt(-dt) of the transition std
    (sd3_sde_with_logprob.py), so per sample
        kl = mean_dims((mean - ref_mean)^2) / (2 std^2 / |dt|) = exact KL x |dt|
    which weights the steps by their length. (Its cps sampler returns the transition std itself, so
    there its form is the exact one: pass dt=None.) gate [B] bool: GARDO's gated KL, the mean over the
    flagged samples only (gated_kl). Returns (mean over samples, info)."""
    kl = _sq_dist(mean, ref_mean) / (2 * _per_sample(std, mean) ** 2)  # [B]
    if dt is not None:
        dt = _per_sample(dt, mean)
        _require(dt < 0, "kl_penalty: dt = s' - s must be negative")
        kl = kl * -dt
    value = kl.mean() if gate is None else gated_kl(kl, gate, empty="zero")
    return value, {"kl_mean": kl.detach().mean(), "kl_max": kl.detach().max()}


KL_ERROR = 0.2  # Ziegler et al.'s clip of the controller's error: the weight moves by at most 1 +- 0.2 rate a step
KL_SPAN = 1e4  # the adapted weight stays within [--kl-beta / KL_SPAN, --kl-beta x KL_SPAN] (kl_weight_bounds)


def adaptive_kl_beta(beta, kl, *, target, rate, floor=0.0, ceiling=math.inf):
    """The KL weight of the next step from this step's KL (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences", Sec. 2.2: a log-space proportional controller), never below `floor`:

        e = clip(KL / target - 1, -0.2, 0.2),   beta <- max(floor, beta (1 + rate e))

    train.py floors it at the starting weight (--kl-beta; --kl-floor sets another), where Ziegler et al. let it fall:
    in the shapes world's long run the unfloored weight falls from 0.1 to 0.001-0.004 while the KL is under target,
    the KL to the start then runs 2-5 times the floored run's, and on GenEval's 0.9 rule the drift that came (the KL
    0.027 -> 0.11 in 40 steps) outran a weight that could not grow back in time (docs/long_run.md, "A KL weight that
    grows with the KL"). A KL that is not finite (a skipped step) leaves beta as it is. The rate must keep the factor
    1 + rate e within (0, 2] (rate below 1 / KL_ERROR = 5; config.py refuses others): at 10 one step below target
    sets the weight to 0, where a multiplicative controller can never raise it again, and at 1e30 one above takes it
    to 2e29 beta and the gradients to NaN. train.py also bounds the weight to [floor, ceiling] (kl_weight_bounds)."""
    if not math.isfinite(kl):
        return beta
    error = min(max(kl / target - 1, -KL_ERROR), KL_ERROR)
    return min(max(floor, beta * (1 + rate * error)), ceiling)


def kl_weight_bounds(kl_beta, kl_floor):
    """(low, high) of the adaptive KL weight that starts at kl_beta: never below --kl-floor, and never below kl_beta /
    KL_SPAN even with --kl-floor 0 (Ziegler et al.'s free fall; a weight of 0 could not grow back), never above kl_beta
    x KL_SPAN (where the KL term swamps the policy term: no longer a control). The long runs' unfloored weight spans
    0.001-2.0 from 0.1 (docs/long_run.md), well inside."""
    return max(kl_floor, kl_beta / KL_SPAN), kl_beta * KL_SPAN


def guard_loss(log_prob, old_log_prob, mean, old_mean, std, dt, adv, *, clip_range, adv_clip=None):
    """GRPO-Guard (arXiv:2510.22319): RatioNorm, the PPO clip, and the gradient reweight.

    With e = x' - mu_old, delta = mu_theta - mu_old and the transition std c (mean-reduced log-probs)
        log r = mean(e delta) / c^2 - mean(delta^2) / (2 c^2)
    is biased below 0 by mean(delta^2) / (2 c^2), and its spread grows as c shrinks (late steps).
    RatioNorm rescales by c and adds the bias back, per sample:
        log r_hat = (log_prob - old_log_prob) c + mean_dims(delta^2) / (2 c)  (= mean(noise delta))
    which is centred on 0 at every step when x' was drawn from pi_old. The clipped surrogate of r_hat
    is then divided by -dt (gradient reweight), so that steps contribute comparably.
    Departure: the authors' code (flow_grpo train_sd3.py, the ratio-norm branch) averages the bias term
    with `.mean(dim=tuple(range(1, log_prob.ndim)))` on a [B] tensor, i.e. over the whole batch; here it
    is each sample's own, which is what centres each sample's ratio on 1 (the derivation above).
    """
    _check(log_prob, old_log_prob, adv)
    adv = adv.float() if adv_clip is None else adv.float().clamp(-adv_clip, adv_clip)
    c = _per_sample(std, log_prob)  # [B]
    _require(c > 0, "guard_loss needs a positive transition std (an ODE step or --eta 0 has none)")
    mse = _sq_dist(mean, old_mean)  # [B], per sample
    log_ratio = (log_prob.float() - old_log_prob.float()) * c + mse / (2 * c)  # RatioNorm's
    value, info = grpo_loss(log_ratio, torch.zeros_like(log_ratio), adv, clip_range=clip_range,
                            step_weight=-_per_sample(dt, log_prob))  # GRPO's clip, each step divided by -dt
    info["mean_shift"] = mse.detach().mean()
    return value, info


def flowdppo_loss(log_prob, old_log_prob, mean, old_mean, sigma_t, adv, *, threshold=1e-5, adv_clip=None):
    """FlowDPPO's KL-ADV mask in place of the clip.

        kl   = mean_dims((mu_theta - mu_old)^2 / (2 sigma_t^2))       (exact Gaussian KL, Eq. 14,
                                                                       mean- not sum-reduced)
        drop = kl >= tau and ((r > 1 and A > 0) or (r < 1 and A < 0))  (Eq. 18)
        loss = mean(-A r [not drop])                                  (no clip)

    A term is dropped only when the policy has moved far (high KL) AND the step pushes it further
    the way the advantage wants; corrective terms always pass. tau (`threshold`) is calibrated for
    the mean-reduced KL; sigma_t is the transition std (ones to use the raw mean shift).
    info['clipfrac'] is the masked fraction, so one log line serves every loss.
    """
    _check(log_prob, old_log_prob, adv)
    adv = adv.float() if adv_clip is None else adv.float().clamp(-adv_clip, adv_clip)
    log_ratio = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(log_ratio)
    sigma = _per_sample(sigma_t, log_prob).view((-1,) + (1,) * (mean.ndim - 1))
    kl = ((mean.float() - old_mean.float()) ** 2 / (2 * sigma**2)).mean(_dims(mean)).detach()  # [B]
    high_kl = kl >= threshold
    pos_rm = high_kl & (ratio > 1) & (adv > 0)  # far away, and still pushing a good sample up
    neg_rm = high_kl & (ratio < 1) & (adv < 0)  # far away, and still pushing a bad sample down
    keep = ~(pos_rm | neg_rm)
    loss = torch.where(keep, -adv * ratio, torch.zeros_like(ratio)).mean()
    info = _ratio_stats(ratio, log_ratio)
    masked = (~keep).float().mean()
    info.update(clipfrac=masked, masked_fraction=masked, kl_mask_fraction=high_kl.float().mean(),
                kl_new_old_mean=kl.mean(), kl_new_old_max=kl.max(),
                pos_rm_fraction=pos_rm.float().mean(), neg_rm_fraction=neg_rm.float().mean())
    return loss, info


def wan_step_weight(sigma, sigma_next, *, sigma_max, sigma_min):
    """Flow-GRPO's per-step weight of the policy loss on Wan 2.1, a scalar:

        w = mean_i(std_dev_t_i) / mean_i(sqrt(s_i - s'_i)),   std_dev_t = sigma_min + (sigma_max - sigma_min) s

    flow_grpo scripts/train_wan2_1.py (at 32b48fd; not at 9745241) multiplies the clipped surrogate by
    `std_dev_t.mean()` and divides it by `dt.mean()`, where its Wan SDE step returns the noise scale above
    (wan_pipeline_with_logprob.py L51, sigma_max and sigma_min the scheduler's sigmas[1] and sigmas[-1])
    and dt = sqrt(-dt) (L83). The KL term is added after, unweighted. On Wan's 20 UniPC flow steps (shift 3,
    sigmas[-1] = 0) w falls from 7.49 at the first step to 0.74 at the last trained one. Both means run over
    the micro-batch, as there (equal to the per-sample value when every sample is at the same step).
    sigma, sigma_next: float or [B].
    """
    s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
    s_next = torch.as_tensor(sigma_next, dtype=torch.float64).reshape(-1)
    if s.shape != s_next.shape and s.numel() != 1 and s_next.numel() != 1:
        raise ValueError(f"sigma and sigma_next must be floats or [B] of one shape, got {tuple(s.shape)} and "
                         f"{tuple(s_next.shape)}")
    _require(s > s_next, "wan_step_weight needs sigma > sigma_next (a denoising step)")
    std_dev_t = sigma_min + (sigma_max - sigma_min) * s
    return (std_dev_t.mean() / (s - s_next).sqrt().mean()).float()


# ----------------------------------------------------------------------------- forward process
AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
GHUBER_OFFSET = 1e-10  # AWM's epsilon inside the power: part of the definition, (1e-10)^0.25 = 3.2e-3


def _per_sample64(value, like):
    """float or [B] -> float64 [B, 1, ..., 1], broadcasting over like's non-batch dims."""
    t = torch.as_tensor(value, dtype=torch.float64, device=like.device)
    t = t.expand(like.shape[0]) if t.ndim == 0 else t.reshape(like.shape[0])
    return t.view((-1,) + (1,) * (like.ndim - 1))


def velocity_kl(v, v_ref):
    """The velocity-space penalty of DiffusionNFT and AWM: mean over samples of mean_dims((v - v_ref)^2),
    against the base model (LoRA off; NFT train_nft_sd3.py L966-970, AWM train_sd3_awm.py L1337) or AWM's
    EMA copy (L1346). Unlike kl_penalty there is no transition std: these losses have no SDE step."""
    kl = _sq_dist(v, v_ref)  # [B]
    return kl.mean(), {"kl_mean": kl.detach().mean(), "kl_max": kl.detach().max()}


def nft_optimality(adv, *, adv_clip=5.0):
    """DiffusionNFT's optimality probability (arXiv:2509.16117; train_nft_sd3.py L910-929):
    r = clip(A / adv_clip, -1, 1) / 2 + 1/2, so r = 1/2 at the group mean, 1 at A >= adv_clip, 0 at A <= -adv_clip."""
    if adv_clip <= 0:
        raise ValueError(f"--adv-clip must be positive, got {adv_clip}")
    return (adv.float() / adv_clip).clamp(-1, 1) / 2 + 0.5


def _normalised_sq(err, dims, adaptive):
    """mean over dims of err^2 / w per sample: DiffusionNFT's adaptive weight w = stopgrad(max(mean |err|, 1e-5)),
    each error normalised by its own L1 size (adaptive), else w = 1. [B]."""
    if not adaptive:
        return (err**2).mean(dims)
    with torch.no_grad():
        w = err.abs().mean(dims, keepdim=True).clamp_min(1e-5)
    return (err**2 / w).mean(dims)


def nft_loss(v, v_old, x_t, x0, sigma, r, *, beta, adaptive=True):
    """DiffusionNFT's policy loss on one re-noised batch (arXiv:2509.16117; train_nft_sd3.py L930-960):

        v+ = beta v + (1 - beta) v_old,   v- = (1 + beta) v_old - beta v        (implicit positive / negative
                                                                                 policies; v_old detached)
        x0+- = x_t - t v+-                                                      (their x0 estimates)
        w+-  = stopgrad(max(mean_dims |x0+- - x0|, 1e-5))                       ("adaptive" weight, per sample)
        L+-  = mean_dims (x0+- - x0)^2 / w+-
        l_i  = (r_i L+ + (1 - r_i) L-) / beta,   loss = mean_i l_i

    Since x0_hat - x0 = -t (v - (eps - x0)), L+ is t mean(e^2) / mean|e| with e = v+ - (eps - x0): a
    flow-matching error normalised by its own L1 size, so samples and noise levels train at comparable
    scale. adaptive=False uses w = 1 (plain x0-space MSE). The reference multiplies the batch mean by
    adv_clip (5) as well; that constant is applied by the caller (train.py), not here. Computed in
    float64 as the reference computes its weights. r from nft_optimality; sigma float or [B].
    At v = v_old the gradient on v_i is (2 r_i - 1) 2 t e_i / (D mean|e_i|) / B (tests/test_forward_losses.py):
    an advantage-signed flow-matching gradient, whatever beta.
    """
    if beta <= 0:
        raise ValueError(f"--nft-beta must be positive, got {beta}")
    if v.shape != v_old.shape or v.shape != x_t.shape or v.shape != x0.shape or v.ndim < 2:
        raise ValueError(f"v, v_old, x_t and x0 must be [B, ...] of one shape, got {tuple(v.shape)}, "
                         f"{tuple(v_old.shape)}, {tuple(x_t.shape)}, {tuple(x0.shape)}")
    dims = _dims(v)
    t = _per_sample64(sigma, v)
    r = torch.as_tensor(r, dtype=torch.float64, device=v.device).expand(v.shape[0])
    v, v_old, x_t, x0 = v.double(), v_old.detach().double(), x_t.double(), x0.double()
    v_plus = beta * v + (1 - beta) * v_old
    v_minus = (1 + beta) * v_old - beta * v
    err_plus = x_t - t * v_plus - x0  # x0+ - x0
    err_minus = x_t - t * v_minus - x0
    loss_plus = _normalised_sq(err_plus, dims, adaptive)  # [B]
    loss_minus = _normalised_sq(err_minus, dims, adaptive)
    per_sample = (r * loss_plus + (1 - r) * loss_minus) / beta
    info = {"nft_loss_plus": loss_plus.detach().mean(), "nft_loss_minus": loss_minus.detach().mean(),
            "old_deviate": ((v.detach() - v_old) ** 2).mean(), "r_mean": r.detach().mean()}
    return per_sample.mean().float(), info


def awm_log_prob(v, x0, eps, sigma, *, weighting="ghuber", p=0.25):
    """AWM's surrogate log-likelihood of a clean sample (arXiv:2509.25050; compute_log_prob_awm,
    train_sd3_awm.py L237-251): minus a t-weighted, robustified flow-matching error at x_t = (1 - t) x0 + t eps.

        mse     = mean_dims (v - (eps - x0))^2                       (float64)
        uniform : -mse
        t       : -t mse
        t2      : -t^2 mse
        huber   : -t (sqrt(mse + 1e-10) - 1e-5)
        ghuber  : -(t / p) ((mse + 1e-10)^p - (1e-10)^p)             (the AWM recipes: p = 0.25)

    Each is 0 at mse = 0; the 1e-10 offsets keep the robust forms' gradients finite there. The caller
    builds x_t and runs the model on it; v is that output. Returns float64 [B]; sigma float or [B].
    """
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"unknown AWM weighting {weighting!r}; choose one of {', '.join(AWM_WEIGHTINGS)} "
                         "(--awm-weighting)")
    if weighting == "ghuber" and p <= 0:
        raise ValueError(f"--ghuber-power must be positive, got {p}")
    if v.shape != x0.shape or v.shape != eps.shape or v.ndim < 2:
        raise ValueError(f"v, x0 and eps must be [B, ...] of one shape, got {tuple(v.shape)}, {tuple(x0.shape)}, "
                         f"{tuple(eps.shape)}")
    mse = ((v.double() - (eps.double() - x0.double())) ** 2).mean(_dims(v))  # [B]
    t = _per_sample64(sigma, mse)
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -t * mse
    if weighting == "t2":
        return -t**2 * mse
    if weighting == "huber":
        return -t * (torch.sqrt(mse + GHUBER_OFFSET) - GHUBER_OFFSET**0.5)
    return -(t / p) * ((mse + GHUBER_OFFSET) ** p - GHUBER_OFFSET**p)


def awm_loss(log_prob, old_log_prob, adv, *, clip_range=1.0, adv_clip=5.0):
    """AWM's policy loss (train_sd3_awm.py L1293-1327, loss_type 'exp_first'): the PPO clipped surrogate on
    awm_log_prob with A = clip(adv, -adv_clip, adv_clip) / adv_clip (advantage_max 1) and clip range 1:

        loss = mean_i max(-A_i r_i, -A_i clip(r_i, 0, 2)),   r_i = exp(log_prob_i - old_log_prob_i)

    One entry per (sample, training time): pass [T * B] with adv repeated, or call once per time. The AWM
    recipes are on-policy (old = current, detached): r = 1 and the gradient is A_i grad w(mse_i) / N, the
    weighted flow-matching loss descended on good samples and ascended on bad ones.
    """
    _check(log_prob, old_log_prob, adv)
    if adv_clip <= 0:
        raise ValueError(f"--adv-clip must be positive, got {adv_clip}")
    a = adv.double().clamp(-adv_clip, adv_clip) / adv_clip
    value, info = grpo_loss(log_prob, old_log_prob, a, clip_range=clip_range, dtype=torch.float64)
    return value.float(), info


def flow_matching_error(v, x0, eps):
    """mean_dims (v - (eps - x0))^2 per sample, float32 [B]: v's flow-matching error at x_t = (1 - t) x0 + t eps."""
    if v.shape != x0.shape or v.shape != eps.shape or v.ndim < 2:
        raise ValueError(f"v, x0 and eps must be [B, ...] of one shape, got {tuple(v.shape)}, {tuple(x0.shape)}, "
                         f"{tuple(eps.shape)}")
    return _sq_dist(v, eps - x0)


def sft_loss(v, x0, eps, weight):
    """flow_grpo's online SFT (scripts/train_sd3_sft.py L835-837): the flow-matching loss of the current velocity on
    the group's best samples,

        loss = mean_i w_i mean_dims (v_i - (eps_i - x0_i))^2,    w = best_of_group(rewards) in {0, 1}

    the mean over every sample of the batch (a weight-0 sample counts in the mean, as there). Its SD3 loss weighting
    (compute_loss_weighting_for_sd3, 'logit_normal') is 1. weight [B]."""
    err = flow_matching_error(v, x0, eps)  # [B]
    w = weight.float().reshape(err.shape)
    return (w * err).mean(), {"sft_error": err.detach().mean(), "sft_targets": w.detach().mean()}


def dpo_loss(v, v_ref, x0, eps, *, beta, weight=None):
    """Diffusion-DPO (Wallace et al. arXiv:2311.12908, Eq. 14) in flow-matching form, as flow_grpo's online DPO
    computes it (scripts/train_sd3_dpo.py L924-939). The batch is [chosen_1, rejected_1, chosen_2, rejected_2, ...],
    each pair re-noised with the same noise and sigma; with e(v) = mean_dims (v - (eps - x0))^2

        d_p  = (e(v)_w - e(v_ref)_w) - (e(v)_l - e(v_ref)_l)
        loss = mean_p -log sigmoid(-beta d_p / 2)

    (the 1/2 and the mean-reduced error are there; Eq. 14's T omega(lambda_t) is folded into beta). It falls when
    the current model fits the chosen sample better, and the rejected one worse, than the reference does. v_ref is the
    reference's velocity (detached). weight [P] (default 1) scales each pair's term: 0 for filler pairs.
    Returns (loss, info) with implicit_acc, the fraction of pairs with d_p < 0 (flow_grpo's implicit_acc)."""
    if v.shape[0] % 2:
        raise ValueError(f"dpo_loss needs [chosen, rejected] pairs, got an odd batch of {v.shape[0]}")
    err, ref_err = flow_matching_error(v, x0, eps), flow_matching_error(v_ref.detach(), x0, eps)
    diff = err - ref_err  # [2P]
    d = diff[0::2] - diff[1::2]  # [P]
    inside = -0.5 * beta * d
    per_pair = -torch.nn.functional.logsigmoid(inside)
    if weight is not None:
        per_pair = per_pair * weight.float().reshape(per_pair.shape)
    info = {"dpo_w_diff": diff[0::2].detach().mean(), "dpo_l_diff": diff[1::2].detach().mean(),
            "implicit_acc": (inside.detach() > 0).float().mean()}
    return per_pair.mean(), info


def dgpo_loss(v, v_ref, x0, eps, adv, unit, *, beta, group_size, v_old=None, clip_range=None):
    """DGPO (Direct Group Preference Optimization, arXiv:2510.08425) on one training sigma, as Flow-Factory computes it
    (src/flow_factory/trainers/dgpo.py at a0b2bc5: _compute_dsm_loss L633-640, _maybe_clip_dsm L642-671,
    _compute_per_sample_preference L448-468, _compute_group_dgpo_loss L490-528). With the flow-matching errors
    e_i = mean_dims (v_i - (eps_i - x0_i))^2 of the current model and e_ref_i of the reference, in each group g of G:

        s_g  = sum_{i in g} A_i beta (e_i - e_ref_i) / G                   (stopgrad)
        loss = mean_i sigmoid(s_{g(i)}) A_i e_i

    Its gradient is that of the group's preference loss -log sigmoid(-s_g), up to the constant beta / G: samples of a
    positive advantage are fit better, of a negative one worse, weighted by how far the group still is from preferring
    its good samples over the reference's fit. With v_old and clip_range (its clip_dsm): r_i = exp(e_old_i - e_i) and
    e_i is held constant (no gradient) where A_i > 0 and r_i > 1 + clip_range or A_i <= 0 and r_i < 1 - clip_range.
    unit [B]: each sample's group (whole groups in the batch); adv [B]. Returns (loss, info)."""
    err = flow_matching_error(v, x0, eps)  # [B]
    with torch.no_grad():
        ref_err = flow_matching_error(v_ref, x0, eps)
    adv = adv.float()
    clipped = torch.zeros_like(adv, dtype=torch.bool)
    if v_old is not None and clip_range is not None:
        with torch.no_grad():
            clipped = _outside_trust_region(adv, flow_matching_error(v_old, x0, eps), err, clip_range)
        err = torch.where(clipped, err.detach(), err)
    weight = _group_preference_weight(adv, err.detach(), ref_err, unit, beta=beta, group_size=group_size)
    info = {"dgpo_weight": weight.detach().mean(), "dsm_loss": err.detach().mean(),
            "clipfrac": clipped.float().mean()}
    return (weight * adv * err).mean(), info


def _outside_trust_region(adv, old_err, err, clip_range):
    """DGPO's clip_dsm (Flow-Factory dgpo.py L642-671), TDM-R1's trust region: with r_i = exp(e_old_i - e_i), True
    where A_i > 0 and r_i > 1 + clip_range or A_i <= 0 and r_i < 1 - clip_range (the error there is held constant)."""
    ratio = torch.exp(old_err - err)
    return torch.where(adv > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)


def _group_preference_weight(adv, err, ref_err, unit, *, beta, group_size):
    """sigmoid(s_g(i)), s_g = sum_{i in g} A_i beta (e_i - e_ref_i) / G: DGPO's group preference weight (Flow-Factory
    dgpo.py L490-528), shared by TDM-R1's surrogate. err and ref_err without gradient; unit [B] each sample's group."""
    preference = adv * beta * (err - ref_err) / group_size  # [B]
    sums = torch.zeros(len(unit), dtype=preference.dtype, device=err.device).index_add_(0, unit, preference)
    return torch.sigmoid(sums)[unit]  # unit < B: no read of its max


CRD_KINDS = ("mse", "bce")


def crd_implicit_reward(v, v_old, x0, eps, *, adaptive=True):
    """CRD's implicit reward of each re-noised sample (arXiv:2603.14128, Sec. 3; Flow-Factory trainers/crd.py
    L753-777): how much better the current velocity fits the flow-matching target eps - x0 than the old copy's,

        e     = (v - (eps - x0))^2,   e_old = (v_old - (eps - x0))^2                    (per element)
        w     = stopgrad(max(mean_dims |v - (eps - x0)|, 1e-5)),  w_old likewise       (adaptive; else 1)
        r_i   = -mean_dims(e / w - e_old / w_old)

    a single-noise estimate of beta log(pi_theta / pi_old) up to a prompt-dependent constant, which the centring of
    crd_loss removes. The adaptive weights are DiffusionNFT's (nft_loss): each error normalised by its own L1 size.
    v_old is detached. float64, as the reference computes its weights. Returns [B]."""
    if v.shape != v_old.shape or v.shape != x0.shape or v.shape != eps.shape or v.ndim < 2:
        raise ValueError(f"v, v_old, x0 and eps must be [B, ...] of one shape, got {tuple(v.shape)}, "
                         f"{tuple(v_old.shape)}, {tuple(x0.shape)}, {tuple(eps.shape)}")
    dims, target = _dims(v), eps.double() - x0.double()
    err, err_old = v.double() - target, v_old.detach().double() - target
    return -(_normalised_sq(err, dims, adaptive) - _normalised_sq(err_old, dims, adaptive))


def _centring_weights(a, temperature):
    """The weights of the batch means CRD centres on (crd.py L550-600): [(1/B,)] for temperature < 0 (uniform, one
    direction); else two directions, softmax(a / T) towards the high rewards and softmax(-a / T) towards the low
    ones, T = 0 softmax(a) over the samples above (below) 0, uniform where there are none. As in Flow-Factory, 0 is
    compared with the [0, 1] reward a, not with its middle 1/2: "above" is every sample but those at A <= -adv_clip,
    "below" none (its hard choice reads as written for advantages centred on 0)."""
    if temperature < 0:
        return [torch.full_like(a, 1 / len(a))]
    if temperature > 0:
        return [torch.softmax(a / temperature, 0), torch.softmax(-a / temperature, 0)]
    out = []
    for side in (a > 0, a < 0):
        masked = torch.where(side, a, torch.full_like(a, -torch.inf))
        out.append(torch.softmax(masked, 0) if side.any() else torch.full_like(a, 1 / len(a)))
    return out


def crd_loss(r, a, *, beta, temperature=-1.0, kind="mse"):
    """CRD's centred reward matching (arXiv:2603.14128, Sec. 3: the normalising constant of the KL-regularised
    optimum cancels under centring; Flow-Factory trainers/crd.py _compute_crd_loss L522-629): with r the implicit
    rewards (crd_implicit_reward) and a the external rewards, both [B], and centring weights p over the batch

        R_i  = a_i - sum_j p_j a_j,    R_theta_i = r_i - stopgrad(sum_j p_j r_j)
        mse: l = mean_i (beta R_theta_i - R_i)^2
        bce: l = mean_i BCE(logit beta R_theta_i, target sigmoid(R_i))

    averaged over the one (uniform p, temperature < 0) or two (softmax towards the high and the low rewards)
    centrings of _centring_weights. The centre of r carries no gradient: each r_i is pulled to beta^-1 R_i alone.
    Returns (l, info)."""
    if kind not in CRD_KINDS:
        raise ValueError(f"unknown CRD loss {kind!r}; choose one of {', '.join(CRD_KINDS)} (--crd-loss-type)")
    if r.ndim != 1 or r.shape != a.shape:
        raise ValueError(f"r and a must be [B] of one shape, got {tuple(r.shape)} and {tuple(a.shape)}")
    a = a.double()
    terms = []
    for p in _centring_weights(a, temperature):
        centred_a = a - (p * a).sum()
        centred_r = r.double() - (p * r.detach().double()).sum()
        if kind == "mse":
            terms.append(((beta * centred_r - centred_a) ** 2).mean())
        else:
            terms.append(torch.nn.functional.binary_cross_entropy_with_logits(beta * centred_r,
                                                                              torch.sigmoid(centred_a)))
    info = {"crd_r_mean": r.detach().mean(), "crd_r_std": r.detach().std(unbiased=False)}
    return (sum(terms) / len(terms)).float(), info


# ----------------------------------------------------------------------------- few-step distillation
# DMD2, TDM, TDM-R1, DMDR and on-policy distillation (DiffusionOPD). A few-step generator is trained against a
# frozen teacher (the "real" score) and, for the distribution-matching losses, a second trained network, the fake
# score or critic, which models the generator's own samples. The losses below are pure functions of what those
# networks returned; which network ran where (and with which guidance) is the loop's business: roles.py, with the
# trained critic and the frozen teachers of policy.py (docs/design.md, "A role"; their records in LOSSES below).
#
#     code            paper symbol
#     ----            ------------
#     x0              the generator's clean sample (or its clean prediction at a trajectory point), with its graph
#     x_t             x_t = (1 - t) x0 + t eps, the generator's sample re-noised at t (flow matching's forward process)
#     x0_real         the teacher's clean estimate at x_t (its "real" score; with CFG where the method guides it)
#     x0_fake         the fake score's (critic's) clean estimate at x_t
#     x0 from v       x0_hat = x_t - t v for a velocity v at x_t (x0_from_velocity); the score is then
#                     s(x_t) = -(x_t - (1 - t) x0_hat) / t^2, so s_fake - s_real = (1 - t) / t^2 (x0_fake - x0_real)
#     mean, teacher_mean   the student's and the teacher's Gaussian transition means at the student's own state (OPD)
#
# Distribution matching minimises KL(p_gen,t || p_teacher,t) averaged over t; its gradient on a sample is the score
# difference s_fake - s_real at x_t (DMD arXiv:2311.18828, Sec. 3.2), applied as a stop-gradient MSE whose gradient on
# x0 is a normalised x0_fake - x0_real.


def x0_from_velocity(x_t, v, sigma):
    """The clean-sample estimate of a velocity v at x_t = (1 - t) x0 + t eps: x0_hat = x_t - t v (float32).
    sigma: t, float or [B]."""
    return (x_t.double() - _per_sample64(sigma, x_t) * v.double()).float()


def _check_like(x0, **others):
    for name, value in others.items():
        if value.shape != x0.shape:
            raise ValueError(f"{name} must have x0's shape {tuple(x0.shape)}, got {tuple(value.shape)}")
    if x0.ndim < 2:
        raise ValueError(f"x0 must be [B, ...], got shape {tuple(x0.shape)}")


def _x0_normaliser(x0, reference, eps):
    """max(mean_dims |x0 - reference|, eps) per sample, float64 [B, 1, ...], without gradient: DMD's normalisation of
    its gradient by the L1 distance of the sample to the teacher's estimate (arXiv:2311.18828, Sec. 3.2's weight)."""
    with torch.no_grad():
        return (x0.double() - reference.double()).abs().mean(_dims(x0), keepdim=True).clamp_min(eps)


def dmd2_generator_loss(x0, x0_real, x0_fake, *, eps=1e-6):
    """DMD's distribution-matching gradient as a surrogate loss (DMD2 arXiv:2405.14867, Sec. 3; tianweiy/DMD2
    main/sd_guidance.py L235-241, compute_distribution_matching_loss):

        w_i  = max(mean_dims |x0_i - x0_real_i|, eps)               (stopgrad; mean |p_real| there)
        g_i  = (x0_fake_i - x0_real_i) / w_i                         (= (p_real - p_fake) / w, p = x0 - x0_hat)
        loss = 0.5 mean_i mean_dims (x0_i - stopgrad(x0_i - g_i))^2  (= 0.5 mean(g^2) in value)

    x0 [B, ...] is the generator's sample with its graph; x0_real and x0_fake (no gradient) the teacher's (with CFG,
    DMD2's real_guidance_scale) and the fake score's clean estimates at x_t = (1 - t) x0 + t eps, one t per sample
    (DMD2: uniform over 2 % .. 98 % of the schedule, train_sd.py L634-635). The gradient on x0_i is g_i / (B D): along
    the score difference, since s_fake - s_real = (1 - t) / t^2 (x0_fake - x0_real), so that over the generator's
    samples E[g dx0/dtheta] = t^2 / ((1 - t)^2 w) grad_theta KL(p_gen,t || p_real,t) (tests/test_distill_losses.py,
    on Gaussians). DMDR's generator term (dmdr_loss) is this one. float64 as DMD2 computes its x0 estimates
    (L199-201, L231-233). Departure 19 (docs/departures.md): w is clamped at eps (Flow-Factory's dmd_generator_loss)
    where DMD2 divides unclamped and replaces NaN by 0. Returns (loss, info)."""
    _check_like(x0, x0_real=x0_real, x0_fake=x0_fake)
    w = _x0_normaliser(x0, x0_real, eps)  # [B, 1, ...]
    g = (x0_fake.detach().double() - x0_real.detach().double()) / w
    target = (x0.double() - g).detach()
    per_sample = 0.5 * ((x0.double() - target) ** 2).mean(_dims(x0))  # [B]
    info = {"dmd_grad_rms": (g**2).mean(_dims(g)).sqrt().mean().float(), "dmd_weight": w.mean().float()}
    return per_sample.mean().float(), info


def dmd2_critic_loss(v, x0, noise):
    """The fake score's (critic's) flow-matching loss on the generator's samples, which it must model (DMD2
    main/sd_guidance.py L257-297, compute_loss_fake; Flow-Factory trainers/distillation/distribution_matching.py
    flow_matching_loss; DMDR train_cc/sit/train_sitxl_refl_deepspeed.py L457-471):

        loss = mean_i mean_dims (v_i - (noise_i - x0_i))^2,    v = v_fake(x_t, t),  x_t = (1 - t) x0 + t noise

    x0 is detached: the critic's loss trains the critic only. t uniform over the whole schedule (DMD2 L271-277) or
    logit-normal (DMDR's Beta(4, 1.5) annealed to uniform). Departure 20: a velocity target, as Flow-Factory and DMDR;
    DMD2's UNets regress the noise, whose error is (1 - t) times this one at a point. Returns (loss, info)."""
    _check_like(x0, v=v, noise=noise)
    err = flow_matching_error(v, x0.detach(), noise)  # [B]
    return err.mean(), {"critic_loss": err.detach().mean()}


def tdm_renoise(x0, noise_mid, fresh, sigma_mid, sigma, *, importance_clip=20.0):
    """TDM's conditional re-noising of a trajectory point (arXiv:2503.06674, Sec. 3; Luo-Yihong/TDM
    train_tdm_demo.py L1036-1057 and L1121-1124, in flow form as Flow-Factory's tdm_conditional_renoise). A
    generator step from sigma_k left the clean prediction x0 and the noise it implies, noise_mid, so the trajectory
    point at the stage's end sigma_mid is x_mid = (1 - s_mid) x0 + s_mid noise_mid; it is carried to a noisier t = sigma
    by the forward process's own transition from s_mid to t:

        r     = (1 - t) / (1 - s_mid),   beta = sqrt(t^2 - (r s_mid)^2)
        x_t   = r x_mid + beta fresh = (1 - t) x0 + t mixed,   mixed = (r s_mid noise_mid + beta fresh) / t
        w_IS  = clip(exp(-mean_dims(mixed^2) / 2 + mean_dims(fresh^2) / 2), 1 / c, c)

    w_IS is TDM's importance weight of the fake score's loss (L1129), the density of the mixed noise against that of
    fresh noise (mean- not sum-reduced, as there). Departure 21: clipped to [1/c, c] (Flow-Factory's
    importance_clip, 20); TDM leaves it unclipped. At s_mid = 0 (a one-step stage) mixed = fresh and w_IS = 1.
    Needs 0 <= s_mid < t < 1 per sample. Returns (x_t, mixed, w_IS [B]), float32, without gradient."""
    _check_like(x0, noise_mid=noise_mid, fresh=fresh)
    s_mid, t = _per_sample64(sigma_mid, x0), _per_sample64(sigma, x0)
    _require((s_mid >= 0) & (s_mid < t) & (t < 1), "tdm_renoise needs 0 <= sigma_mid < sigma < 1")
    with torch.no_grad():
        r = (1 - t) / (1 - s_mid)
        beta = (t**2 - (r * s_mid) ** 2).clamp_min(0).sqrt()
        mixed = (r * s_mid * noise_mid.double() + beta * fresh.double()) / t
        x_t = (1 - t) * x0.double() + t * mixed
        log_w = -0.5 * (mixed**2).mean(_dims(x0)) + 0.5 * (fresh.double() ** 2).mean(_dims(x0))
        log_c = math.log(importance_clip)
        weight = log_w.clamp(-log_c, log_c).exp()
    return x_t.float(), mixed.float(), weight.float()


def tdm_critic_loss(x0_fake, x0, sigma, importance, *, snr_gamma=5.0):
    """TDM's fake-score loss (Luo-Yihong/TDM train_tdm_demo.py L1127-1134; Flow-Factory tdm_fake_loss): the
    critic's clean estimate at the re-noised point (tdm_renoise) regressed on the generator's clean prediction,
    min-SNR weighted (Hang et al. arXiv:2303.09556, gamma 5) and importance weighted:

        loss = mean_i min(snr_i, gamma) w_IS_i mean_dims (x0_fake_i - x0_i)^2,   snr = ((1 - t) / t)^2

    x0 is detached (the generator's prediction, the critic's target). sigma: t, float or [B]; importance [B] from
    tdm_renoise. Returns (loss, info)."""
    _check_like(x0, x0_fake=x0_fake)
    t = _per_sample64(sigma, importance.reshape(-1, 1)).reshape(-1)
    snr = ((1 - t) / t) ** 2
    weight = snr.clamp(max=snr_gamma) * importance.double()  # [B]
    err = _sq_dist(x0_fake, x0.detach()).double()  # [B]
    return (weight * err).mean().float(), {"critic_loss": err.mean().float(), "importance": importance.mean()}


def _revised_x0(x0, correction, reference, *, huber_c, eps):
    """mean_i mean_dims rho(x0_i - stopgrad(x0_i + correction_i)) / max(mean_dims |x0_i - reference_i|, eps) [B]:
    x0 pulled along `correction`, normalised by its L1 distance to `reference`. rho(d) = d^2, or with huber_c the
    pseudo-Huber sqrt(d^2 + c^2) - c (TDM train_tdm_demo.py L1178-1187). float64."""
    w = _x0_normaliser(x0, reference, eps)
    d = x0.double() - (x0.double() + correction.double()).detach()
    rho = d**2 if huber_c is None else torch.sqrt(d**2 + huber_c**2) - huber_c
    return (rho / w).mean(_dims(x0))


def tdm_loss(x0, x0_real, x0_fake, *, huber_c=1e-3, eps=1e-6):
    """TDM's generator loss at one trajectory stage (Trajectory Distribution Matching, arXiv:2503.06674, Sec. 3;
    Luo-Yihong/TDM train_tdm_demo.py L1161-1187):

        target = x0 + (x0_real - x0_fake)                      (stopgrad; coop_samples, L1174-1176)
        w_i    = max(mean_dims |x0_i - x0_real_i|, eps)         (stopgrad; weighting_factor, L1178)
        loss   = mean_i mean_dims rho(x0_i - target_i) / w_i    (rho(d) = d^2, or pseudo-Huber sqrt(d^2 + c^2) - c)

    x0 [B, ...] is the generator's clean prediction at the stage (with its graph), x0_real the teacher's guided clean
    estimate (its cond + (cfg - 1)(cond - uncond), L1177) and x0_fake the fake score's, both at the point tdm_renoise
    carries the stage's trajectory point to. The squared form's gradient on x0 is 2 (x0_fake - x0_real) / (w B D):
    DMD's direction (dmd2_generator_loss) at each stage of the few-step trajectory. huber_c: TDM's --use_huber,
    c = 1e-3 (L1180; Flow-Factory's default); None: squared error. Departure 19 (the clamp). Returns (loss, info)."""
    _check_like(x0, x0_real=x0_real, x0_fake=x0_fake)
    correction = x0_real.detach().double() - x0_fake.detach().double()
    per_sample = _revised_x0(x0, correction, x0_real, huber_c=huber_c, eps=eps)  # [B]
    info = {"tdm_loss": per_sample.detach().mean().float(),
            "tdm_gap": (correction**2).mean(_dims(x0)).sqrt().mean().float()}
    return per_sample.mean().float(), info


def tdm_r1_loss(x0, x0_real, x0_fake, x0_surrogate, x0_cond=None, *, tdm_weight=0.3, guidance_scale=1.0,
                cfg_reward_scale=3.5, huber_c=None, eps=1e-6):
    """TDM-R1's generator loss (arXiv:2603.07700; its authors' repository, Luo-Yihong/TDM-R1 at 6b4c455, ships
    inference only, so the source is Flow-Factory's trainer: trainers/distillation/tdm_r1.py at 1593258,
    _generator_boundary_loss, _guidance_reward_direction, _surrogate_reward_direction; distribution_matching.py
    revised_x0_loss): TDM's term plus two rewards, each an x0 pulled along a detached direction (_revised_x0):

        L_tdm  = revised(x0, x0_real - x0_fake,               reference x0_real)       (tdm_loss)
        L_cfg  = revised(x0, k (x0_real - x0_cond) / (s - 1), reference x0_real)       (the teacher's guidance as a
                                                                                         reward; none at s <= 1 or k 0)
        L_sur  = revised(x0, x0_surrogate - x0_real,          reference x0_surrogate)  (the learned reward)
        loss   = L_tdm + w L_cfg + (1 - w) L_sur

    x0_real is the teacher at guidance s (guidance_scale), x0_cond the teacher unguided (scale 1), x0_surrogate the
    surrogate reward model (tdm_r1_surrogate_loss trains it on the rewards) queried with the teacher's guidance; all
    at the point tdm_renoise gives. k = cfg_reward_scale (3.5), w = tdm_weight (0.3), huber_c None (Flow-Factory's
    TDM-R1 defaults, hparams/training_args/tdm_r1.py L37-49). Departure 22: rho(d) = d^2 as in TDM's code (tdm_loss);
    Flow-Factory's revised_x0_loss uses d^2 / 2, which scales all three terms alike. Returns (loss, info)."""
    _check_like(x0, x0_real=x0_real, x0_fake=x0_fake, x0_surrogate=x0_surrogate)
    if not 0 < tdm_weight < 1:
        raise ValueError(f"tdm_weight must be in (0, 1), got {tdm_weight}")
    real = x0_real.detach().double()
    l_tdm = _revised_x0(x0, real - x0_fake.detach().double(), real, huber_c=huber_c, eps=eps)  # [B]
    l_cfg = torch.zeros_like(l_tdm)
    if guidance_scale > 1 and cfg_reward_scale != 0:
        if x0_cond is None:
            raise ValueError("tdm_r1_loss with guidance_scale > 1 needs x0_cond, the teacher's unguided estimate")
        direction = cfg_reward_scale / (guidance_scale - 1) * (real - x0_cond.detach().double())
        l_cfg = _revised_x0(x0, direction, real, huber_c=huber_c, eps=eps)
    surrogate = x0_surrogate.detach().double()
    l_sur = _revised_x0(x0, surrogate - real, surrogate, huber_c=huber_c, eps=eps)
    per_sample = l_tdm + tdm_weight * l_cfg + (1 - tdm_weight) * l_sur
    info = {"tdm_loss": l_tdm.detach().mean().float(), "cfg_reward_loss": l_cfg.detach().mean().float(),
            "surrogate_reward_loss": l_sur.detach().mean().float()}
    return per_sample.mean().float(), info


def tdm_r1_surrogate_loss(err, ref_err, adv, unit, *, beta=1.0, group_size, slow_err=None, clip_range=1e-3,
                          reference_beta=1e-3, reference_threshold=0.05, time_weight=1.0):
    """TDM-R1's surrogate reward model, trained on non-differentiable rewards through their group advantages
    (arXiv:2603.07700; Flow-Factory trainers/distillation/tdm_r1.py at 1593258, _surrogate_boundary_loss,
    _clip_outside_trust_region, _clip_runaway_surrogate; group_preference.py group_preference_loss). With e_i the
    surrogate's flow-matching error at a stored trajectory boundary of sample i re-noised (flow_matching_error; a
    lower error is a higher likelihood), e_ref_i the frozen reference's (the teacher's) at the same point, e_slow_i a
    slowly decayed copy's:

        trust  : e_i held constant where A_i > 0 and exp(e_slow_i - e_i) > 1 + eps_clip, or A_i <= 0 and < 1 - eps_clip
        runaway: e_i held constant where it moved past the reference the way A_i asks (A_i > 0: e_i < e_ref_i;
                 else e_i > e_ref_i) and (e_i - e_ref_i)^2 > reference_threshold
        s_g    = sum_{i in g} A_i beta (e_i - e_ref_i) / G                               (stopgrad)
        loss   = time_weight (mean_i sigmoid(s_g(i)) A_i e_i + reference_beta mean_i (e_i - e_ref_i)^2)

    The preference is DGPO's (dgpo_loss, arXiv:2510.08425): good samples fit better, bad ones worse, weighted by how
    far the group still is from preferring them over the reference; the penalty keeps the surrogate near the
    reference. err, ref_err, adv [B]; unit [B]: each sample's group index in the micro-batch (whole groups);
    time_weight: (k + 1) / K at boundary k of K (its use_time_weighting). Defaults: Flow-Factory's (tdm_r1.py L37-49);
    slow_err None: no trust region. Returns (loss, info)."""
    if not (err.ndim == 1 and err.shape == ref_err.shape == adv.shape == unit.shape):
        raise ValueError(f"err, ref_err, adv and unit must be [B] tensors of one shape, got {tuple(err.shape)}, "
                         f"{tuple(ref_err.shape)}, {tuple(adv.shape)}, {tuple(unit.shape)}")
    adv, ref_err = adv.detach().double(), ref_err.detach().double()
    e = err.double()
    held = torch.zeros_like(adv, dtype=torch.bool)
    if slow_err is not None:
        held = _outside_trust_region(adv, slow_err.detach().double(), e.detach(), clip_range)
    improved = torch.where(adv > 0, e.detach() < ref_err, e.detach() > ref_err)
    runaway = improved & ((e.detach() - ref_err) ** 2 > reference_threshold)
    e_held = torch.where(held | runaway, e.detach(), e)
    weight = _group_preference_weight(adv, e.detach(), ref_err, unit, beta=beta, group_size=group_size)
    penalty = ((e - ref_err) ** 2).mean()
    loss = time_weight * ((weight * adv * e_held).mean() + reference_beta * penalty)
    info = {"surrogate_weight": weight.mean().float(), "surrogate_penalty": penalty.detach().float(),
            "surrogate_delta": (e.detach() - ref_err).mean().float(), "clipfrac": held.double().mean().float(),
            "runaway_fraction": runaway.double().mean().float()}
    return loss.float(), info


def dmdr_loss(x0, x0_real, x0_fake, reward_loss=None, *, reward_weight=0.05, eps=1e-8):
    """DMDR's generator loss (Distribution Matching Distillation Meets Reinforcement Learning, arXiv:2511.13649;
    vvvvvjdy/dmdr train_cc/sit/train_sitxl_refl_deepspeed.py L495-566): DMD's term (dmd2_generator_loss) on the
    generator's one-step x0 plus a weighted reward loss of the same x0, backpropagated together:

        loss = dmd2_generator_loss(x0, x0_real, x0_fake) + reward_weight mean_i reward_loss_i

    reward_loss [B] is differentiable in x0 (there the cross-entropy of a DINOv2 classifier on the decoded x0, L503-511,
    weight 0.05, dmdr_sitxl_refl.sh; e.g. -r(x0) for a differentiable reward r); None before the cold start
    (--cold-start-iter, L498). DMDR's real score is the teacher with the critic's LoRA at a scale annealed to 0 (its
    dynamic distribution guidance, L517-521, L542-549): the caller's x0_real. The normaliser is DMDR's + 1e-8 (L557-558)
    taken as a clamp at eps (departure 19). Returns (loss, info)."""
    value, info = dmd2_generator_loss(x0, x0_real, x0_fake, eps=eps)
    info["dmd_loss"] = value.detach()
    if reward_loss is not None:
        if reward_loss.shape != x0.shape[:1]:
            raise ValueError(f"reward_loss must be [B] like x0's batch, got {tuple(reward_loss.shape)}")
        reward = reward_loss.float().mean()
        value = value + reward_weight * reward
        info["reward_loss"] = reward.detach()
    return value, info


def opd_loss(mean, teacher_mean, denom, *, teacher=None, num_teachers=None):
    """On-policy distillation (DiffusionOPD arXiv:2605.15055): the student's Gaussian transition at its own rollout's
    state matched to a frozen teacher's, per step (Flow-Factory trainers/opd/trainer.py L338-351 at 3ae5aa0, a fork
    of X-GenGroup/Flow-Factory; scheduler/abc.py L196-212; UniRL unirl/algorithms/diffusionopd.py
    compute_loss_and_backward with base.py _gaussian_kl_div):

        kl_i = 0.5 mean_dims (mu_S_i - mu_T_i)^2 / denom_i,   loss = mean_i kl_i

    the Gaussian KL(pi_S || pi_T) of two transitions of variance denom, mean-reduced over latent dims. denom: float or
    [B], the transition variance: the transition std^2 of an SDE step (sde.sde_step's std; Flow-Factory's
    std_dev_t^2 (-dt) on flow SDEs, std_dev_t^2 on CPS), or 1 on ODE rollouts (mean matching; Flow-Factory's and
    UniRL's defaults). With denom = std^2 it is kl_penalty's exact KL against the teacher in place of the base.
    teacher_mean [B, ...]: each sample's own teacher's mean; or [K, B, ...], the K teachers' means, with teacher [B]
    each sample's teacher index (chosen by a prompt field: Flow-Factory routes by dataset, UniRL by metadata
    "domain"). info has kl_teacher{k}, the mean over teacher k's samples (NaN where it has none), for k < K
    (num_teachers; default K = max(teacher) + 1, read from the device). Departure 23: a micro-batch may mix
    teachers, as in Flow-Factory (trainer.py L334-336); UniRL requires one domain per batch. Returns (loss, info)."""
    if teacher is not None and teacher_mean.ndim == mean.ndim + 1:
        teacher_mean = teacher_mean[teacher, torch.arange(mean.shape[0], device=mean.device)]
    if teacher_mean.shape != mean.shape:
        raise ValueError(f"teacher_mean must be [B, ...] like mean {tuple(mean.shape)}, or [K, B, ...] with teacher "
                         f"[B]; got {tuple(teacher_mean.shape)}")
    var = torch.as_tensor(denom, dtype=torch.float32, device=mean.device)
    var = var.expand(mean.shape[0]) if var.ndim == 0 else var.reshape(mean.shape[0])
    _require(var > 0, "opd_loss needs a positive transition variance denom (1 on ODE steps)")
    kl = 0.5 * _sq_dist(mean, teacher_mean.detach()) / var  # [B]
    info = {"kl_mean": kl.detach().mean(), "kl_max": kl.detach().max()}
    if teacher is not None:
        k = num_teachers or int(teacher.max()) + 1
        sums = torch.zeros(k, device=kl.device).index_add_(0, teacher, kl.detach())
        counts = torch.zeros(k, device=kl.device).index_add_(0, teacher, torch.ones_like(kl))
        per_teacher = sums / counts  # NaN where a teacher has no sample
        for j in range(k):
            info[f"kl_teacher{j}"] = per_teacher[j]
    return kl.mean(), info


# ----------------------------------------------------------------------------- the algorithms, as train.py runs them
# A loss is one function of the tensors of ONE trained term of a micro-batch, `t`, and of the flags it reads, each a
# keyword-only parameter named as its flag (Loss.hyper passes exactly those; config.py refuses a flag of another loss):
#
#   reverse process (one trained sampler step k of each of b samples; train.py's reverse_terms):
#     log_prob [b]       the step's log-prob under the current weights (sde.sde_step with prev_sample)
#     old_log_prob [b]   ... recorded by the rollout;   mean, old_mean [b, ...]: the transition means, now and then
#     std [b]            the transition std;   dt [b]: s' - s < 0;   adv [b]
#     sigma, sigma_next [b]   the step's noise levels s, s';   schedule [T + 1]: the rollout's sigmas
#     ref_mean [b, ...]  the frozen reference's transition mean (--kl-beta > 0; the base, or --gardo-reference)
#   forward process (one training sigma of each of b samples; train.py's forward_terms):
#     v [b, ...]         the current velocity at x_t = (1 - sigma) x0 + sigma noise;   x_t, x0, noise [b, ...]
#     sigma [b]          the training sigma;   adv [b]
#     v_old [b, ...]     the old copy's velocity at x_t (Loss.old_copy);   v_ref [b, ...]: the reference's (--kl-beta)
#     old_stat [b]       Loss.old_stat of the weights before the batch's first optimizer step (after it; else None)
#     unit [b]           each sample's pair or group in the micro-batch (Loss.unit; 0 .. b - 1 for "sample")
#   both, with --gardo-gate: kl_gate [b] bool, the samples whose KL term counts (advantages.gardo_gate; else None)
#
# and returns (loss, info) as the functions above. Everything else about an algorithm that train.py needs is a field
# of its record in LOSSES, so that adding one is a function, a registry line and its flags (README, "Adding a loss").


def _gated(kl, t, empty):
    """The KL term from the per-sample kl [b]: their mean, or with GARDO's gate (t["kl_gate"] [b] bool, the samples
    whose KL counts: advantages.gardo_gate) the mean over the flagged samples."""
    gate = t.get("kl_gate")
    return kl.mean() if gate is None else gated_kl(kl, gate, empty=empty)


def gated_kl(kl, flagged, *, empty="zero"):
    """GARDO's gated KL term (regularizers.py's docstring): kl [N] per sample, flagged [N] bool -> the mean over the
    flagged ones. No flagged sample: 0 (GRPO, G L988-989) or the mean over all (`empty="all"`, DiffusionNFT, N
    L1054-1056).
    Written as a weighted sum, without a branch on the flags: no wait for the GPU (G L983 reads them on the host)."""
    weight = flagged.to(kl.dtype)  # [N]
    if empty == "all":  # none flagged: every sample
        weight = torch.where(weight.sum() > 0, weight, torch.ones_like(weight))
    return (kl * weight).sum() / weight.sum().clamp(min=1)  # none flagged, "zero": 0, the graph kept


def _reference_kl(value, info, t, kl_beta, kl_form, sde):
    """+ kl_beta KL to the frozen reference (the base model, LoRA off; GARDO's snapshot) of the step's Gaussian
    transitions (kl_penalty; Flow-GRPO's |dt|-weighted form unless --kl-form exact; the cps step's own form is the
    exact one, as in Flow-GRPO). Gated: no flagged sample, no KL term (GARDO's GRPO)."""
    if kl_beta > 0:
        dt = None if kl_form == "exact" or sde == "cps" else t["dt"]
        kl, _ = kl_penalty(t["mean"], t["ref_mean"], t["std"], dt=dt, gate=t.get("kl_gate"))
        value = value + kl_beta * kl
        info["kl"] = kl.detach()
    return value, info


def _velocity_reference_kl(value, info, t, kl_beta):
    """+ kl_beta velocity-space KL to the frozen reference (DiffusionNFT L966-970, AWM L1337; velocity_kl). Gated: no
    flagged sample, every sample's (GARDO's DiffusionNFT)."""
    if kl_beta > 0:
        kl = _gated(_sq_dist(t["v"], t["v_ref"]), t, "all")
        value = value + kl_beta * kl
        info["kl"] = kl.detach()
    return value, info


def _step_weighted(value, t, step_loss_weight):
    """The policy term times --step-loss-weight's weight of the step: none, or Flow-GRPO's Wan 2.1 weight
    (wan_step_weight of the micro-batch's sigmas, its SDE's noise range the schedule's sigmas[1] .. sigmas[-1])."""
    if step_loss_weight == "wan":
        value = value * wan_step_weight(t["sigma"], t["sigma_next"], sigma_max=t["schedule"][1].item(),
                                        sigma_min=t["schedule"][-1].item())
    return value


def grpo(t, *, clip_range, kl_beta, kl_form, sde, step_loss_weight):
    """Flow-GRPO: the PPO clip of each step's ratio (grpo_loss), + the KL to the base."""
    value, info = grpo_loss(t["log_prob"], t["old_log_prob"], t["adv"], clip_range=clip_range)
    return _reference_kl(_step_weighted(value, t, step_loss_weight), info, t, kl_beta, kl_form, sde)


def guard(t, *, clip_range, kl_beta, kl_form, sde, step_loss_weight):
    """GRPO-Guard: RatioNorm, the clip and the gradient reweight (guard_loss), + the KL to the base."""
    value, info = guard_loss(t["log_prob"], t["old_log_prob"], t["mean"], t["old_mean"], t["std"], t["dt"], t["adv"],
                             clip_range=clip_range)
    return _reference_kl(_step_weighted(value, t, step_loss_weight), info, t, kl_beta, kl_form, sde)


def flowdppo(t, *, kl_mask_threshold, kl_beta, kl_form, sde, step_loss_weight):
    """FlowDPPO: the KL-ADV mask in place of the clip (flowdppo_loss, sigma_t the transition std), + the KL to the
    base."""
    value, info = flowdppo_loss(t["log_prob"], t["old_log_prob"], t["mean"], t["old_mean"], t["std"], t["adv"],
                                threshold=kl_mask_threshold)
    return _reference_kl(_step_weighted(value, t, step_loss_weight), info, t, kl_beta, kl_form, sde)


def nft(t, *, nft_beta, nft_adaptive, adv_clip, kl_beta, nft_fm=0.0):
    """DiffusionNFT at one training sigma: nft_loss against the old copy's velocity with r = nft_optimality(A), times
    the reference's constant adv_clip (train_nft_sd3.py L960), + the velocity KL to the base; with --nft-fm c
    (ours, 0 in DiffusionNFT) + c times the velocity's own flow-matching error, normalised as nft_loss's:

        loss = adv_clip mean_i l_i + c mean_i L_i,   L_i = l_i at r_i = 1, beta = 1   (the error of v itself)

    On-policy (v = v_old) the gradient on sample i is then (A_i + c) g_i where DiffusionNFT's is A_i g_i (A_i within
    +-adv_clip, g_i the flow-matching gradient): group-centred advantages average 0, so DiffusionNFT's update has
    no net pull on the denoising error, and the negative samples push theirs up without bound; c > 0 adds a
    restoring pull of c. Measured in the shapes world, it holds the error and ruins the run (c = 0.3: held-out
    accuracy under the base's by step 25; docs/long_run.md, "A pull on the denoising error").

    Where each piece lives: the old copy (a float32 copy of the trained weights; policy.py's copies "old") samples
    the rollouts (Loss.samples_with_old) and gives v_old (train.forward_terms); its decay after each step is
    OLD_DECAYS["nft"]; the training times are _nft_times, the re-noising x_t = (1 - s) x0 + s eps train.renoised;
    r = nft_optimality(A); the implicit positive / negative velocities and the adaptive weight are nft_loss."""
    r = nft_optimality(t["adv"], adv_clip=adv_clip)
    value, info = nft_loss(t["v"], t["v_old"], t["x_t"], t["x0"], t["sigma"], r, beta=nft_beta, adaptive=nft_adaptive)
    value = adv_clip * value
    if nft_fm > 0:
        fm, _ = nft_loss(t["v"], t["v"], t["x_t"], t["x0"], t["sigma"], 1.0, beta=1.0, adaptive=nft_adaptive)
        value = value + nft_fm * fm
        info["nft_fm"] = fm.detach()
    return _velocity_reference_kl(value, info, t, kl_beta)


def _awm_log_prob(t, *, awm_weighting, ghuber_power):
    return awm_log_prob(t["v"], t["x0"], t["noise"], t["sigma"], weighting=awm_weighting, p=ghuber_power)


def awm(t, *, clip_range, adv_clip, ema_kl_beta, kl_beta, awm_weighting, ghuber_power):
    """AWM at one training sigma: the clipped surrogate of awm_log_prob, on-policy (ratio 1) on the batch's first
    optimizer step and against old_stat on later ones (train.py departure 10), + the EMA-KL to the slowly updated
    old copy (train_sd3_awm.py L1341-1350) and the velocity KL to the base: both only with --kl-beta > 0, as AWM
    computes its EMA-KL inside its `if config.train.beta > 0` block (L1330-1351).

    Where each piece lives: the rollouts by the current weights (a deterministic --sampler), the training times
    _awm_times, the re-noising train.renoised, the weighted flow-matching log-prob awm_log_prob, the clip grpo_loss
    (through awm_loss), the old copy policy.py's "old" with OLD_DECAYS["awm"], old_stat train.frozen_stats."""
    log_prob = _awm_log_prob(t, awm_weighting=awm_weighting, ghuber_power=ghuber_power)
    old_log_prob = log_prob.detach() if t.get("old_stat") is None else t["old_stat"]
    value, info = awm_loss(log_prob, old_log_prob, t["adv"], clip_range=clip_range, adv_clip=adv_clip)
    if ema_kl_beta > 0 and kl_beta > 0:
        ema_kl, _ = velocity_kl(t["v"], t["v_old"])
        value = value + ema_kl_beta * ema_kl
        info["ema_kl"] = ema_kl.detach()
    return _velocity_reference_kl(value, info, t, kl_beta)


def sft(t, *, kl_beta):
    """Online SFT: the flow-matching loss on each group's best samples (sft_loss; t["adv"] is best_of_group's 0 / 1),
    + the velocity KL to the base with --kl-beta (0 in flow_grpo's configs)."""
    value, info = sft_loss(t["v"], t["x0"], t["noise"], t["adv"])
    return _velocity_reference_kl(value, info, t, kl_beta)


def dpo(t, *, dpo_beta, kl_beta):
    """Online DPO: Diffusion-DPO on each group's (best, worst) pair (dpo_loss) against the old copy, flow_grpo's "ref"
    adapter, which also samples and is refreshed every --ref-update-every optimizer steps (OLD_DECAYS "copy");
    t["adv"] is preference_pairs' +1 (chosen) / -1 (rejected), 0 on both samples of a filler pair."""
    value, info = dpo_loss(t["v"], t["v_old"], t["x0"], t["noise"], beta=dpo_beta, weight=t["adv"][0::2].abs())
    return _velocity_reference_kl(value, info, t, kl_beta)


def dgpo(t, *, dpo_beta, group_size, dgpo_reference, dgpo_clip, clip_range, kl_beta, lora_rank=0):
    """DGPO: dgpo_loss against the base model (--dgpo-reference base, Flow-Factory's default) or the old copy (old,
    its use_ema_ref), clipped against the old copy with --dgpo-clip (its clip_dsm), + the velocity KL to the base
    (dgpo.py L689-702, 'v-based').

    Departures (F = Flow-Factory src/flow_factory/trainers/dgpo.py at a0b2bc5, the recipe's source; A = the authors'
    Luo-Yihong/DGPO scripts/train_sd3_dgpo.py at 01ceb4b), beside docs/departures.md 16 (micro-batches of whole
    groups) and 17 (SD3's own rollout schedule, where F and A sample shift(linspace(1, 1/N, N))):
    1. The training times are strata of the schedule's indices 0 .. int(num_steps x --timestep-fraction) (_dgpo_times).
       F keeps the indices whose timestep is at least 1000 (1 - timestep_range) and stratifies over those
       (noise_schedule.py L185-259): its timestep_range 0.6 is --timestep-fraction 0.7 on SD3's 10-step schedule, the
       recipe's strata {0}, {1, 2}, {3, 4}, {5, 6} (mean sigma 0.854, lowest 0.602), where 0.6 here reads {0}, {1, 2},
       {3}, {4, 5} (0.886, 0.707). A draws 4 distinct indices of 0 .. trunc_steps 6 uniformly, without replacement
       (random.sample, L52-74, L1062-1064; mean sigma 0.856 on its schedule), where F and this project draw one per
       stratum.
    2. A micro-batch's group noise serves all its training times, as in F (_make_shared_noise L403-445, whose
       docstring calls that the reference's way); A draws a new noise per group at every time (L1102-1105, inside
       the loop over the times from L1089).
    3. Euler rollouts (--sampler euler), as F's ODE dynamics; A samples with diffusers' DPMSolverMultistepScheduler
       (DPM-Solver++, second order: L557-559), which --sampler dpm2 follows up to its last step (docs/departures.md,
       11), and trains at its integer timesteps / 1000 (L1099-1100: 0.999 at the first), here and in F the sigmas.
    4. The evaluation EMA (--ema-decay 0.9 --ema-every 8) is stepped once per optimizer step, as F steps its once per
       epoch (start() L804); A steps its after every micro-batch (L1214-1215), so a due update is applied once per
       micro-batch: 12 times at 24 groups x 24 on 4 GPUs (F's geometry; 4 at its config's 8 groups), which
       --ema-repeat 12 reproduces (docs/departures.md, 6)."""
    v_ref = t["v_ref"] if _dgpo_reference(dict(dgpo_reference=dgpo_reference, lora_rank=lora_rank)) == "base" \
        else t["v_old"]
    value, info = dgpo_loss(t["v"], v_ref, t["x0"], t["noise"], t["adv"], t["unit"], beta=dpo_beta,
                            group_size=group_size, v_old=t["v_old"] if dgpo_clip else None, clip_range=clip_range)
    return _velocity_reference_kl(value, info, t, kl_beta)


def crd(t, *, crd_beta, crd_temperature, crd_loss_type, crd_adaptive, crd_old, crd_adaptive_kl, adv_clip, kl_beta):
    """Centered Reward Distillation (arXiv:2603.14128) at one training sigma, as Flow-Factory computes it:

        a_i  = clip(A_i, -5, 5) / 10 + 1/2                                  (nft_optimality; the external reward)
        r_i  = crd_implicit_reward(v, v_old)_i                              (the implicit reward, old copy)
        l    = crd_loss(r, a) x adv_clip / beta                             (centred reward matching, Sec. 3)
        loss = l + kl_beta mean_i (c + a_i (1 - c)) mean_dims (v_i - v_base,cfg_i)^2,  c = 1e-4 / kl_beta

    with the base's velocity at CFG --crd-kl-cfg (Loss.reference_guidance; the paper's KL anchor to a CFG-guided
    base), the weight c + a_i (1 - c) only with --crd-adaptive-kl (else 1), rollouts by the sampling copy
    (Loss.sampling_copy, --sampling-decay) and the implicit reward against the old copy (--old-decay crd; the base
    with --no-crd-old). The paper's equations were not at hand: the formulas above are Flow-Factory's, cited by line.

    Where each piece lives: the sampling copy and its decay (policy.py's copies "sampling", OLD_DECAYS "nft-ocr"), the
    old copy's velocity v_old and the base's v_ref at --crd-kl-cfg (train.forward_terms), the training times
    (_crd_times), the re-noising (train.renoised), the implicit reward (crd_implicit_reward), the centring and the
    matching (crd_loss). tests/test_crd.py holds the line-by-line reading of Flow-Factory's crd.py it checks.

    Where Flow-Factory reads differently from the paper's abstract, followed here for the recipe: its
    "reward-adaptive" KL weight is each sample's [0, 1] advantage a_i (its comment calls it the raw reward), whose
    mean is about 1/2 at every step, not a strength that follows the reward over training.

    Departures, on purpose:
    1. The centring is over the micro-batch of one process: a loss here is a function of one term's tensors (no
       collective). Flow-Factory centres the micro-batches of all processes together (8 x 8 = 64 samples in its
       SD3.5 example); the same set on one GPU with --train-batch-size 64, 8 per GPU on 8.
    2. Micro-batches draw their samples in a shuffled order (train.py's), where Flow-Factory takes consecutive
       samples, 8 of one group per process; neither centres within a prompt's group, as the paper's derivation does.
    3. Its training times keep the schedule indices 0 .. int(num_steps x fraction) - 1 (_crd_times), where
       Flow-Factory keeps those whose sigma is at least 1 - fraction: the same indices on the schedule sampled here
       (SD3's, 10 steps, 0.99: 0 .. 8, drawn 0 .. 7), but not the same sigmas as Flow-Factory's run, which samples
       shift(linspace(1, 1/N, N)) (docs/departures.md, 17): its rule keeps 0 .. 9 there (0.25 >= 0.01) and draws
       0 .. 8, down to sigma 0.4286 (mean 0.790 over the 20 strata), here down to 0.465 (mean 0.795).
    4. With --no-crd-old the implicit reward reads the base's velocity at --crd-kl-cfg, where Flow-Factory's
       (use_old_for_loss false, C L695-698) is at the training forward's guidance."""
    a = nft_optimality(t["adv"], adv_clip=adv_clip)  # [b], in [0, 1] (crd.py L785-791)
    v_old = t["v_old"] if crd_old else t["v_ref"]
    r = crd_implicit_reward(t["v"], v_old, t["x0"], t["noise"], adaptive=crd_adaptive)  # [b]
    value, info = crd_loss(r, a, beta=crd_beta, temperature=crd_temperature, kind=crd_loss_type)
    value = value * adv_clip / max(crd_beta, 1e-8)
    if crd_old:
        info["old_deviate"] = _sq_dist(t["v"].detach(), t["v_old"]).mean()
    if kl_beta > 0:
        kl = _sq_dist(t["v"], t["v_ref"])  # [b]
        floor = 1e-4 / kl_beta
        weight = floor + a * (1 - floor) if crd_adaptive_kl else torch.ones_like(a)
        value = value + kl_beta * _gated(weight * kl, t, "all")  # GARDO's gate as the other forward-process KLs
        info["kl"] = _gated(kl.detach(), t, "all")
    return value, info


# The few-step distillation losses as train.py runs them (roles.py builds their terms and trains their roles). A
# generator term is one stored stage k of the rollout (roles.x0_terms): x0 the policy's clean prediction at the stored
# x_k (with its graph), re-noised at a drawn t (DMD2: uniform over 2 % .. 98 %, train_sd.py L634-635; TDM: carried
# from the stage's end by tdm_renoise), x0_real the teacher's and x0_fake the critic's clean estimates there; an OPD
# term the student's and its teacher's transition means at the stored x_k (roles.mean_terms). A role's term
# (roles.train_roles) holds v, the role's velocity at x_t with its graph, x_t, x0 and the noise it was re-noised with,
# sigma (t), importance [b] (TDM's weight; 1 elsewhere), v_real (the teacher's, no graph), adv and unit.


def dmd2(t):
    """DMD2's generator term (dmd2_generator_loss): the critic's and the teacher's clean estimates' difference."""
    return dmd2_generator_loss(t["x0"], t["x0_real"], t["x0_fake"])


def tdm(t, *, huber_c):
    """TDM's generator term at each stored stage (tdm_loss), pseudo-Huber at c = --huber-c (its --use_huber)."""
    return tdm_loss(t["x0"], t["x0_real"], t["x0_fake"], huber_c=huber_c or None)


def tdm_r1(t, *, tdm_weight, cfg_reward_scale):
    """TDM-R1's generator term (tdm_r1_loss): TDM's plus the teacher's guidance and the surrogate's learned reward."""
    return tdm_r1_loss(t["x0"], t["x0_real"], t["x0_fake"], t["x0_surrogate"], t.get("x0_cond"),
                       tdm_weight=tdm_weight, guidance_scale=t["guidance"], cfg_reward_scale=cfg_reward_scale)


def dmdr(t, *, reward_weight):
    """DMDR's generator term (dmdr_loss): DMD's term; its reward term reads t["reward_loss"], a differentiable
    reward's loss of x0, where the run has one (none of REWARDS is differentiable yet: the rewards are logged)."""
    return dmdr_loss(t["x0"], t["x0_real"], t["x0_fake"], t.get("reward_loss"), reward_weight=reward_weight)


def opd(t):
    """DiffusionOPD (opd_loss) at the student's stored state, against each sample's teacher; the transition variance
    std^2 of an SDE step, 1 on ODE steps (Flow-Factory scheduler/abc.py L196-212)."""
    std = t["std"]
    denom = torch.where(std > 0, std**2, torch.ones_like(std)) if torch.is_tensor(std) else (std**2 if std else 1.0)
    return opd_loss(t["mean"], t["teacher_mean"], denom, teacher=t["teacher"], num_teachers=t["num_teachers"])


def dmd_critic(t):
    """The fake score's flow-matching loss on the generator's samples (dmd2_critic_loss): DMD2's, DMDR's."""
    return dmd2_critic_loss(t["v"], t["x0"], t["noise"])


def tdm_critic(t, *, snr_gamma):
    """TDM's fake-score loss at the re-noised stage (tdm_critic_loss), min-SNR gamma --snr-gamma."""
    return tdm_critic_loss(x0_from_velocity(t["x_t"], t["v"], t["sigma"]), t["x0"], t["sigma"], t["importance"],
                           snr_gamma=snr_gamma)


def tdm_r1_surrogate(t, *, group_size, surrogate_beta):
    """TDM-R1's surrogate reward model (tdm_r1_surrogate_loss) on the group advantages: its flow-matching error and
    the teacher's at the same re-noised point. Without its slow copy (no trust region: slow_err None)."""
    err, ref_err = flow_matching_error(t["v"], t["x0"], t["noise"]), flow_matching_error(t["v_real"], t["x0"],
                                                                                         t["noise"])
    return tdm_r1_surrogate_loss(err, ref_err, t["adv"], t["unit"], beta=surrogate_beta, group_size=group_size)


def _dgpo_times(batch, generator, *, num_steps, train_timesteps, timestep_fraction, **_):
    """DGPO's training times (Flow-Factory TimeSampler.discrete, 'discrete', noise_schedule.py L185-259):
    --train-timesteps strata over schedule indices 0 .. int(num_steps x fraction) at linspace(0, hi, n + 1), one index
    drawn in [lower, upper) of each and shared by the micro-batch (dgpo.py L764). The fraction reads the indices:
    Flow-Factory's timestep_range reads the timesteps, keeping those >= 1000 (1 - range), so its 0.6 is 0.7 here on
    SD3's 10-step schedule (indices 0 .. 7: 0.465 >= 0.4 > 0.278), the recipe's; its example's comment takes 0.6 for
    the authors' trunc_steps 6 (indices 0 .. 6), which on its own schedule keeps 0 .. 8 (dgpo departure 1).
    [batch, n] indices."""
    return sde.awm_timesteps(num_steps, train_timesteps, fraction=timestep_fraction, kind="discrete",
                             generator=generator).expand(batch, -1)


def _dgpo_reference(h):
    """DGPO's reference: --dgpo-reference, else the base model where a LoRA adapter makes one (Flow-Factory's default,
    the adapter switched off) and the old copy on a full fine-tune (its use_ema_ref), which keeps no base model."""
    return h.get("dgpo_reference") or ("base" if (h.get("lora_rank") or 0) > 0 else "old")


def _crd_times(batch, generator, *, num_steps, train_timesteps, timestep_fraction, **_):
    """CRD's training times (sde.crd_timesteps), --train-timesteps strata shared by the micro-batch (crd.py L238).
    [batch, n] indices."""
    return sde.crd_timesteps(num_steps, train_timesteps, fraction=timestep_fraction,
                             generator=generator).expand(batch, -1)


def _crd_kl_cfg(*, crd_kl_cfg, **_):
    """CRD's guidance of the base model's velocity in its KL (--crd-kl-cfg; Loss.reference_guidance)."""
    return crd_kl_cfg


def _dgpo_samples_with_old(step, *, dgpo_switch_step, **_):
    """DGPO samples with the current weights, and with the old copy once past --dgpo-switch-step steps (its
    switch_ema_ref 200: sampling_context, dgpo.py L191-207)."""
    return step > dgpo_switch_step


def _logit_normal_times(batch, generator, *, num_steps, timestep_fraction, **_):
    return sde.logit_normal_timesteps(num_steps, batch, fraction=timestep_fraction, generator=generator)  # each its own


def _nft_times(batch, generator, *, num_steps, timestep_fraction, **_):
    return sde.nft_timesteps(num_steps, batch, fraction=timestep_fraction, generator=generator)  # each its own


def _awm_times(batch, generator, *, num_steps, timestep_fraction, train_timesteps, awm_timesteps, **_):
    return sde.awm_timesteps(num_steps, train_timesteps, fraction=timestep_fraction, kind=awm_timesteps,
                             generator=generator).expand(batch, -1)  # stratified, shared by the micro-batch


# The decay d(k) of the old copy after k optimizer steps, old <- d old + (1 - d) current (DiffusionNFT
# train_nft_sd3.py return_decay L169-189, applied L1034-1039; AWM train_sd3_awm.py L1409-1419).
# d(k, **flags): the flags as keywords, for a schedule that has its own (--ref-update-every).
OLD_DECAYS = {
    "nft": lambda k, **_: min(0.001 * k, 0.5),  # DiffusionNFT decay_type 1 (GenEval, PickScore)
    "nft-ocr": lambda k, **_: 0.0 if k < 75 else min(0.0075 * (k - 75), 0.999),  # decay_type 2 (OCR): more off-policy
    "awm": lambda k, **_: min(0.3, 0.001 * k),  # AWM's EMA-KL anchor (kl_ema_decay 0.3, 'linear')
    "on-policy": lambda k, **_: 0.0,  # decay_type 0: the old copy is the weights of the step before
    "dgpo": lambda k, **_: min(0.3, 0.001 * k),  # DGPO's ema_ref (ema_ref_max_decay 0.3, ramp 0.001; dgpo.py L220-239)
    # flow_grpo's online DPO / SFT "ref" adapter (train_sd3_dpo.py L614-615, copy_learner_to_ref L136-140): a hard
    # copy of the trained weights every --ref-update-every optimizer steps, untouched in between.
    "copy": lambda k, ref_update_every=40, **_: 0.0 if k % ref_update_every == 0 else 1.0,
    # CRD's old copy, the implicit reward's reference (Flow-Factory crd.py compute_decay L67-102, old_model_decay
    # "0-0.25-0.005-0.999": CRDTrainingArguments L851-854, examples/crd/lora/sd3_5/default.yaml L55). Its sampling copy
    # decays as "nft-ocr" (sampling_model_decay "75-0.0-0.0075-0.999", L855-858 and yaml L56: its preset 2).
    "crd": lambda k, **_: min(0.25 + 0.005 * k, 0.999),
}
SDE_KINDS = ("flow", "dance", "cps")


class Loss(NamedTuple):
    """What train.py needs to know of an algorithm beyond its loss function."""
    fn: Callable  # fn(t, *, <the flags it reads>) -> (loss, info), one trained term (above)
    process: str  # "reverse": trains the sampler's own stochastic steps; "forward": clean samples re-noised
    defaults: dict = {}  # flag values it sets over the model's preset (the command line still wins)
    hub_defaults: dict = {}  # ... and over those on hub models
    clip: bool = True  # its ratio is clipped at --clip-range: the on-policy deviation is compared with that
    sde_kinds: tuple = SDE_KINDS  # reverse: the --sde steps whose log-prob it can use
    old_copy: Callable = None  # flags -> True when it keeps an old copy of the weights, decayed by --old-decay
    samples_with_old: object = False  # rollouts run the old copy: a bool, or (step, **flags) -> bool
    times: Callable = None  # forward: (b, generator, **flags) -> [b, n] indices into the schedule to train at
    old_stat: Callable = None  # forward: (t, **flags) -> [b], frozen for the optimizer steps after the batch's first
    advantages: Callable = group_advantages  # (rewards [N], group_ids [N], global_std=, clip=) -> t["adv"] [N]
    unit: str = "sample"  # forward: what a micro-batch holds whole, re-noised with one noise and sigmas (t["unit"]:
    # each sample's unit in the micro-batch): "sample"; "pair", the +1 and -1 of `advantages` in each group, as
    # [chosen, rejected] rows; "group", every sample of a group (one noise for all its sigmas)
    old_velocity: bool = True  # forward, with an old copy: the loss reads its velocity v_old (a forward per term)
    reference: Callable = None  # flags -> True when it reads the base model's v_ref / ref_mean even at --kl-beta 0
    reference_guidance: Callable = None  # forward: (**flags) -> the guidance scale of the base model's v_ref, where it
    # is not the training forward's (CRD's KL anchor: the base with CFG)
    sampling_copy: Callable = None  # flags -> True when rollouts run a copy of their own, neither the trained weights
    # nor the old copy, decayed after each step by --sampling-decay (CRD's sampling snapshot)
    terms: str = None  # distillation: roles.TERMS' builder of its terms ("x0": a stage's clean prediction against the
    # teacher and the critic; "mean": the transition mean against the teacher), in reverse_terms' place
    roles: dict = {}  # {role name: its loss fn(t, **flags)}: the trained roles beside the policy (roles.train_roles)
    point: Callable = None  # x0 terms: (x0, noise_mid, fresh, sigma_mid, t) -> (x_t, noise, weight) (TDM's);
    # None: x_t = (1 - t) x0 + t fresh, t uniform over DMD2's 2 % .. 98 %

    def reads(self):
        """The flags the algorithm reads: the keyword-only parameters of its loss function and of its schedules (times,
        old_stat, samples_with_old, reference_guidance). config.py refuses a loss's flag that the chosen loss does not
        read."""
        return {name for f in (self.fn, self.times, self.old_stat, self.samples_with_old, self.reference_guidance,
                                *self.roles.values()) if callable(f) for name in keywords(f)}

    def hyper(self, flags):
        """The loss function's keyword arguments from `flags` (a dict such as vars(args)): exactly the flags its
        signature names, those with a default only where `flags` has them."""
        return keywords(self.fn, flags)


def keywords(fn, flags=None):
    """The keyword-only parameters of fn (a loss, or one of its record's schedules): their names, or with `flags` (a
    dict) the values fn reads from it. A name fn requires and `flags` lacks is a KeyError naming it."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    if flags is None:
        return [p.name for p in params]
    return {p.name: flags[p.name] for p in params if p.name in flags or p.default is p.empty}


# Defaults of the forward-process losses: CFG-free (guidance 1 on CFG models; FLUX.1 keeps its distilled guidance),
# a deterministic solver, and 9 of 10 (NFT, config/base.py L87) or 6 strata of 90 % (AWM, config/dgx_awm.py L56-60)
# of the schedule. On hub models their KL weights are their authors' (DiffusionNFT config/nft.py L24, AWM
# config/dgx_awm.py L55).
LOSSES = {
    "grpo": Loss(grpo, "reverse"),
    "guard": Loss(guard, "reverse", sde_kinds=("flow", "dance")),  # RatioNorm needs a Gaussian transition log-prob
    "flowdppo": Loss(flowdppo, "reverse", clip=False),
    "nft": Loss(nft, "forward", dict(sampler="dpm2", timestep_fraction=0.99, old_decay="nft", guidance_scale=1.0),
                dict(kl_beta=1e-4), old_copy=lambda h: True, samples_with_old=True, times=_nft_times),
    "awm": Loss(awm, "forward", dict(sampler="dpm2", timestep_fraction=0.9, old_decay="awm", guidance_scale=1.0,
                                     clip_range=1.0, train_timesteps=6), dict(kl_beta=1e-3),
                old_copy=lambda h: h["ema_kl_beta"] > 0 and h["kl_beta"] > 0,
                times=_awm_times, old_stat=_awm_log_prob),
    # flow_grpo's online SFT and DPO (scripts/train_sd3_sft.py, train_sd3_dpo.py; config/sft.py, dpo.py): the
    # rollouts of the "ref" snapshot (the old copy, hard-copied every --ref-update-every steps), its best samples
    # (SFT) or best-worst pair (DPO) of each group re-noised at logit-normal sigmas, no CFG in the training forward.
    "sft": Loss(sft, "forward", dict(sampler="dpm2", timestep_fraction=0.99, old_decay="copy", train_cfg=False),
                dict(kl_beta=0.0), old_copy=lambda h: True, samples_with_old=True, times=_logit_normal_times,
                advantages=best_of_group, old_velocity=False),
    "dpo": Loss(dpo, "forward", dict(sampler="dpm2", timestep_fraction=0.99, old_decay="copy", train_cfg=False,
                                     dpo_beta=100.0),
                dict(kl_beta=0.0), old_copy=lambda h: True, samples_with_old=True, times=_logit_normal_times,
                advantages=preference_pairs, unit="pair"),
    # DGPO (Flow-Factory trainers/dgpo.py; examples/dgpo/lora/sd3_5/default.yaml): deterministic Euler rollouts with
    # CFG (the model's guidance), whole groups re-noised with one noise per group, 4 shared strata of the schedule's
    # indices 0 .. int(0.6 N) (the recipe's 0.7 is Flow-Factory's 0.6: _dgpo_times), an old copy (its ema_ref) to clip
    # against and, after --dgpo-switch-step, to sample with.
    "dgpo": Loss(dgpo, "forward", dict(sampler="euler", timestep_fraction=0.6, train_timesteps=4, old_decay="dgpo",
                                       train_cfg=False, dpo_beta=100.0, clip_range=0.05),
                 dict(kl_beta=1e-3), old_copy=lambda h: True,
                 samples_with_old=_dgpo_samples_with_old, times=_dgpo_times, unit="group",
                 reference=lambda h: _dgpo_reference(h) == "base"),
    # CRD (arXiv:2603.14128; Flow-Factory trainers/crd.py, examples/crd/lora/sd3_5/default.yaml): deterministic Euler
    # rollouts without CFG by a sampling copy of their own (decayed as "nft-ocr"), the implicit reward against the old
    # copy ("crd"), strata of 99 % of the schedule, and the velocity KL to the CFG-guided base (0.1 on hub models).
    "crd": Loss(crd, "forward", dict(sampler="euler", timestep_fraction=0.99, old_decay="crd", sampling_decay="nft-ocr",
                                     guidance_scale=1.0),
                dict(kl_beta=0.1), old_copy=lambda h: h["crd_old"], sampling_copy=lambda h: True, times=_crd_times,
                reference=lambda h: not h["crd_old"], reference_guidance=_crd_kl_cfg),
    # Few-step distillation (docs/algorithms.md, "Few-step distillation"): the frozen teacher (--teacher, the base by
    # default), a trained critic with its own AdamW, --critic-updates of it per policy update (Flow-Factory's
    # ttur_fake_updates 5; TDM's own code 1). Learning rates: DMD2's 1e-5 for both (train_sd.py L624), TDM's 4e-6
    # generator / 2e-5 critic (train_tdm_demo.py L782-795), TDM-R1's 7.5e-5 / 3e-4 (Flow-Factory tdm_r1.py), DMDR's
    # 1e-5 (dmdr_sitxl_refl.sh L30-31), OPD's 3e-4 (DiffusionOPD_aligned.yaml L127).
    "dmd2": Loss(dmd2, "reverse", dict(teacher=["base"], critic_updates=5, critic_lr=1e-5), dict(lr=1e-5), clip=False,
                 terms="x0", roles={"critic": dmd_critic}),
    "tdm": Loss(tdm, "reverse", dict(teacher=["base"], critic_updates=5, critic_lr=2e-5), dict(lr=4e-6), clip=False,
                terms="x0", roles={"critic": tdm_critic}, point=tdm_renoise),
    "tdm_r1": Loss(tdm_r1, "reverse", dict(teacher=["base"], critic_updates=5, critic_lr=3e-4), dict(lr=7.5e-5),
                   clip=False, terms="x0", roles={"critic": tdm_critic, "surrogate": tdm_r1_surrogate},
                   point=tdm_renoise),
    "dmdr": Loss(dmdr, "reverse", dict(teacher=["base"], critic_updates=5, critic_lr=1e-5), dict(lr=1e-5), clip=False,
                 terms="x0", roles={"critic": dmd_critic}),
    "opd": Loss(opd, "reverse", dict(teacher=["base"]), dict(lr=3e-4), clip=False, terms="mean"),
}


def add_arguments(parser):
    """The loss flags, declared once (train.py, bench.py and scripts take them); None means the model's or the
    loss's preset."""
    g = parser.add_argument_group("loss")
    g.add_argument("--loss", default=None, choices=list(LOSSES),
                   help="GRPO (PPO clip), GRPO-Guard (RatioNorm), FlowDPPO (KL-ADV mask); forward process: "
                        "DiffusionNFT, Advantage Weighted Matching, online SFT and DPO (flow_grpo), DGPO, Centered "
                        "Reward Distillation")
    g.add_argument("--clip-range", type=flags.POSITIVE, default=None,
                   help="PPO clip range of the ratio (log-probs are means over latent dims, hence ~1e-4 on hub models; "
                        "--loss awm: 1)")
    g.add_argument("--adv-clip", type=flags.POSITIVE, default=5.0, help="advantages clipped to +-this")
    g.add_argument("--reward-combine", default="score", choices=["score", "advantage"],
                   help="several rewards (--reward a=w,b=w): score = the group advantage of their weighted sum; "
                        "advantage = the weighted sum of each one's group advantage, the weights divided by their sum "
                        "(MixGRPO, combined_advantages), "
                        "so that no reward's range drowns the others")
    g.add_argument("--kl-beta", type=flags.NONNEG, default=None,
                   help="weight of the KL to the frozen base model (0: no reference forward; --loss nft / awm: "
                        "mean squared velocity difference, 1e-4 / 1e-3 on hub models)")
    g.add_argument("--kl-target", type=flags.NONNEG, default=0.0,
                   help="adaptive KL weight (Ziegler et al. 2019): after each step the weight (from --kl-beta) is "
                        "multiplied by 1 + --kl-rate x clip(KL / target - 1, -0.2, 0.2), never below --kl-floor, "
                        "carried across checkpoints (0: --kl-beta fixed)")
    g.add_argument("--kl-rate", type=flags.POSITIVE, default=0.1,
                   help="--kl-target: the controller's gain K (0.1 in Ziegler et al.: at most 2 %% a step); below "
                        "5, so that the weight's factor per step, 1 +- 0.2 K, stays within (0, 2]; the weight stays "
                        "within 1e-4 to 1e4 times --kl-beta, warned where it reaches either end")
    g.add_argument("--kl-floor", type=flags.NONNEG, default=None,
                   help="--kl-target: the weight never falls below this (default: --kl-beta; 0: Ziegler et al.'s "
                        "controller, free to fall: docs/long_run.md, \"A KL weight that grows with the KL\")")
    g.add_argument("--kl-reference", default="base", choices=["base", "start"],
                   help="the KL's anchor: base = the base model, the LoRA adapter off (a full fine-tune has none); "
                        "start = a float32 snapshot of the starting weights, never renewed (a full fine-tune's base, "
                        "at the memory of one more copy of the trained weights; --gardo-reference renews one instead)")
    g.add_argument("--kl-form", default="flow-grpo", choices=["flow-grpo", "exact"],
                   help="the KL penalty's scale: flow-grpo = the exact Gaussian KL x |dt| per step, as Flow-GRPO's "
                        "code computes it; the default because every published --kl-beta (0.04 OCR/GenEval, 0.01 "
                        "PickScore) was tuned on it; exact = the KL itself, about 1/|dt| (~10x at 10 steps) larger "
                        "for the same beta (--sde cps: both are its exact form, as in Flow-GRPO)")
    g.add_argument("--kl-mask-threshold", type=flags.POSITIVE, default=1e-5,
                   help="FlowDPPO: KL above which a term pushing the ratio further is masked")
    g.add_argument("--global-std", action=argparse.BooleanOptionalAction, default=None,
                   help="normalise advantages by the batch-wide reward std instead of each group's")
    g.add_argument("--old-decay", default=None, choices=list(OLD_DECAYS),
                   help="forward-process losses: schedule of the old copy's decay d, old <- d old + (1 - d) current "
                        "after each step (default: nft, awm; copy for sft / dpo; dgpo, crd)")
    g.add_argument("--nft-beta", type=flags.POSITIVE, default=1.0,
                   help="DiffusionNFT's beta: v+ = beta v + (1 - beta) v_old (its OCR setup: 0.1)")
    g.add_argument("--nft-fm", type=flags.NONNEG, default=0.0,
                   help="DiffusionNFT: + this x the current velocity's own flow-matching error on every trained sample "
                        "(an advantage offset in standard deviations: the mean update then lowers the denoising error "
                        "instead of leaving it to drift; 0: DiffusionNFT's loss)")
    g.add_argument("--nft-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="DiffusionNFT: normalise each sample's x0 error by its own mean absolute error")
    g.add_argument("--awm-weighting", default="ghuber", choices=AWM_WEIGHTINGS,
                   help="AWM: weighting of the flow-matching error in its surrogate log-likelihood")
    g.add_argument("--ghuber-power", type=flags.POSITIVE, default=0.25, help="AWM: the power p of the ghuber weighting")
    g.add_argument("--train-timesteps", type=flags.POSITIVE_INT, default=None,
                   help="AWM / DGPO: stratified schedule sigmas per micro-batch (one forward + backward each; default "
                        "6 / 4)")
    g.add_argument("--awm-timesteps", default="discrete_wo_init", choices=sde.AWM_TIMESTEPS,
                   help="AWM: strata over schedule indices 1.. (never sigma = 1) or 0..")
    g.add_argument("--ema-kl-beta", type=flags.NONNEG, default=1.0,
                   help="AWM: weight of the velocity-space KL to the old copy (its EMA-KL anchor; 0: none); as in "
                        "AWM's code, only with --kl-beta > 0")
    g.add_argument("--dpo-beta", type=flags.POSITIVE, default=None,
                   help="--loss dpo: Diffusion-DPO's beta in -log sigmoid(-beta d / 2) (flow_grpo config/dpo.py: 100); "
                        "dgpo: the beta of its group preference (Flow-Factory: 100, its PickScore recipe 10)")
    g.add_argument("--dgpo-reference", default=None, choices=["base", "old"],
                   help="--loss dgpo: the reference of its preference, the base model (LoRA off; Flow-Factory's "
                        "default, and the default of LoRA runs) or the old copy (its use_ema_ref; the default of full "
                        "fine-tunes, which keep no base model)")
    g.add_argument("--dgpo-clip", action=argparse.BooleanOptionalAction, default=True,
                   help="--loss dgpo: hold the flow-matching error constant where its ratio to the old copy's leaves "
                        "1 +- --clip-range in the advantage's direction (its clip_dsm)")
    g.add_argument("--dgpo-switch-step", type=flags.NONNEG_INT, default=200,
                   help="--loss dgpo: sample with the old copy after this many steps (its switch_ema_ref)")
    g.add_argument("--sampling-decay", default=None, choices=list(OLD_DECAYS),
                   help="--loss crd: schedule of the decay d of the rollouts' own copy, sampling <- d sampling + "
                        "(1 - d) current after each step (default: nft-ocr, Flow-Factory's sampling_model_decay)")
    g.add_argument("--crd-beta", type=flags.POSITIVE, default=1.0,
                   help="--loss crd: the beta its centred implicit rewards are scaled by to match the external ones")
    g.add_argument("--crd-loss-type", default="mse", choices=CRD_KINDS,
                   help="--loss crd: squared error of the centred rewards, or cross-entropy of beta x the implicit one "
                        "against the sigmoid of the external one")
    g.add_argument("--crd-temperature", type=float, default=-1.0,
                   help="--loss crd: negative: centre on the micro-batch mean; T > 0: average the centrings on the "
                        "softmax(a / T) and softmax(-a / T) weighted means (a the [0, 1] advantage); 0: on softmax(a) "
                        "over the samples with a > 0 and with a < 0 (losses._centring_weights)")
    g.add_argument("--crd-old", action=argparse.BooleanOptionalAction, default=True,
                   help="--loss crd: implicit reward against the old copy (--old-decay crd); off: against the base "
                        "model (LoRA off)")
    g.add_argument("--crd-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="--loss crd: divide each flow-matching error of the implicit reward by its own mean absolute "
                        "size (as DiffusionNFT)")
    g.add_argument("--crd-adaptive-kl", action=argparse.BooleanOptionalAction, default=True,
                   help="--loss crd: weight each sample's KL by its [0, 1] advantage, from 1e-4 to --kl-beta")
    g.add_argument("--crd-kl-cfg", type=flags.POSITIVE, default=4.5,
                   help="--loss crd: CFG scale of the base model's velocity in the KL (1: none; its negative prompt is "
                        "--negative-prompt)")
    g.add_argument("--ref-update-every", type=flags.POSITIVE_INT, default=40,
                   help="--loss sft / dpo (--old-decay copy): optimizer steps between copies of the trained weights "
                        "into the sampling and reference snapshot (flow_grpo's ref_update_step: 40 online; its "
                        "published configs 10000000, i.e. never)")
    g.add_argument("--huber-c", type=flags.NONNEG, default=1e-3,
                   help="--loss tdm: pseudo-Huber c of its generator loss (TDM's --use_huber, "
                        "train_tdm_demo.py L1180); 0: squared error")
    g.add_argument("--snr-gamma", type=flags.POSITIVE, default=5.0,
                   help="--loss tdm / tdm_r1: the min-SNR gamma of the critic's loss (train_tdm_demo.py L1131-1132)")
    g.add_argument("--tdm-weight", type=flags.bounded(float, 0, 1), default=0.3,
                   help="--loss tdm_r1: the weight w in (0, 1) of the guidance reward, 1 - w the surrogate's "
                        "(Flow-Factory 0.3)")
    g.add_argument("--cfg-reward-scale", type=flags.NONNEG, default=3.5,
                   help="--loss tdm_r1: the scale k of the teacher's guidance as a reward (Flow-Factory 3.5)")
    g.add_argument("--surrogate-beta", type=flags.POSITIVE, default=1.0,
                   help="--loss tdm_r1: the surrogate's preference beta (Flow-Factory's surrogate_preference_beta 1)")
    g.add_argument("--reward-weight", type=flags.NONNEG, default=0.05,
                   help="--loss dmdr: the weight of its differentiable reward's loss (dmdr_sitxl_refl.sh L41-42)")
    g.add_argument("--step-loss-weight", default="none", choices=["none", "wan"],
                   help="per-step weight of the reverse-process policy term: none (1), or wan: Flow-GRPO's Wan 2.1 "
                        "weight std_dev_t / sqrt(-dt) of its Wan SDE (losses.wan_step_weight), 7.49 at the first of "
                        "20 steps to 0.74 at the last trained one")
    return g
