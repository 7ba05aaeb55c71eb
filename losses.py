"""Group-relative advantages and the policy losses: GRPO, GRPO-Guard, FlowDPPO, KL penalty (reverse process);
DiffusionNFT and Advantage Weighted Matching (forward process).

Pure functions of tensors: no model, no args object, hyper-parameters as keywords. Each loss takes
the tensors of ONE trained denoising step k for a micro-batch and returns (loss, info), where loss
is a scalar to backpropagate and info a dict of detached floats to log.

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

import math

import torch


def _dims(x):
    return tuple(range(1, x.ndim))


def _per_sample(value, like):
    """float or [B] -> [B] float32 on like's device."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    return t.expand(like.shape[0]) if t.ndim == 0 else t.reshape(like.shape[0])


def _check(log_prob, old_log_prob, adv):
    if log_prob is None:
        raise ValueError("log_prob is None: the step was an ODE step (kind 'ode' or --eta 0) and has no log-prob")
    if not (log_prob.ndim == 1 and log_prob.shape == old_log_prob.shape == adv.shape):
        raise ValueError(f"log_prob, old_log_prob and adv must be [B] tensors of one shape, got "
                         f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(adv.shape)}")


def _ratio_stats(ratio, log_ratio):
    """The statistics a researcher watches; approx_kl is PPO's 0.5 E[(log r)^2] (as Flow-GRPO logs)."""
    r = ratio.detach().float()
    return {"ratio_mean": r.mean().item(), "ratio_std": r.std(unbiased=False).item(),
            "ratio_min": r.min().item(), "ratio_max": r.max().item(),
            "approx_kl": 0.5 * (log_ratio.detach().float() ** 2).mean().item()}


def _clipped_surrogate(log_ratio, adv, clip_range):
    """PPO's clipped surrogate per sample (arXiv:1707.06347, Eq. 7, negated to a loss):

        max(-A r, -A clip(r, 1 - eps, 1 + eps)),  r = exp(log_ratio)

    A term whose ratio has left [1 - eps, 1 + eps] in the advantage's direction is the clipped,
    constant branch and carries no gradient. Returns ([B], info with the ratio statistics and clipfrac)."""
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    info = _ratio_stats(ratio, log_ratio)
    info["clipfrac"] = ((ratio.detach() - 1).abs() > clip_range).float().mean().item()
    return torch.maximum(unclipped, clipped), info


def _sq_dist(a, b):
    """mean_dims((a - b)^2) per sample, float32 -> [B]."""
    return ((a.float() - b.float()) ** 2).mean(_dims(a))


def group_advantages(rewards, group_ids, *, global_std=False, eps=1e-4, clip=5.0):
    """A_i = (r_i - mean of i's group) / (std + eps), clipped to +-clip.

    GRPO (DeepSeekMath arXiv:2402.03300, Sec. 4.1.2; as used by Flow-GRPO arXiv:2505.05470): the std
    is that of i's group (population std), or with global_std one std over the whole batch (as
    Flow-GRPO's and FlowDPPO's recipes do). A group whose rewards are all equal gets advantages of exactly 0.
    rewards [N]; group_ids: N ints (list or tensor), equal for samples of the same prompt.
    """
    rewards = torch.as_tensor(rewards).float()
    ids = torch.as_tensor(group_ids, device=rewards.device).long()
    if rewards.ndim != 1 or ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be [N] of one length, got {tuple(rewards.shape)} "
                         f"and {tuple(ids.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"non-finite reward at sample(s) {torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()}")
    _, group = torch.unique(ids, return_inverse=True)  # 0 .. G-1
    n = torch.zeros(int(group.max()) + 1, device=rewards.device).index_add_(0, group, torch.ones_like(rewards))
    group_mean = torch.zeros_like(n).index_add_(0, group, rewards) / n
    centred = rewards - group_mean[group]
    # A group of equal rewards gets exactly 0, not the rounding residue of its mean (~1e-9 / (std + eps) ~ 1e-5):
    # train.py recognises saturated groups by advantage == 0 and leaves them out of the update.
    top = torch.full_like(n, -torch.inf).scatter_reduce(0, group, rewards, "amax")
    bottom = torch.full_like(n, torch.inf).scatter_reduce(0, group, rewards, "amin")
    centred = torch.where((top == bottom)[group], torch.zeros_like(centred), centred)
    if global_std:
        std = rewards.std(unbiased=False)
    else:
        std = (torch.zeros_like(n).index_add_(0, group, centred**2) / n).sqrt()[group]
    return (centred / (std + eps)).clamp(-clip, clip)


def combined_advantages(components, weights, group_ids, *, global_std=False, eps=1e-4, clip=5.0):
    """Several rewards combined by their advantages, as MixGRPO does (arXiv:2507.21802; its code,
    Tencent-Hunyuan/MixGRPO fastvideo/train_grpo_flux.py, `multi_reward_mix == "advantage_aggr"`, lines 429-456):

        A_k = group_advantages(r_k) without its clip            each reward normalised in its group on its own
        A   = clip(sum_k w_k A_k, -clip, clip)                  not re-normalised; the clip acts on the sum

    (MixGRPO clips the summed advantage in the loss, `adv_clip_max`, line 567.) Each A_k follows `group_advantages`:
    the same std rule (per group, or one batch-wide std of that reward with global_std), the same eps, and exactly
    0 for a group whose rewards are all equal. MixGRPO itself divides by the sample std + 1e-8. Unlike a weighted
    sum of raw scores, A does not change when one reward is rescaled or shifted (a w_k r_k + b: up to eps), so a
    reward with a wide range does not drown the others.

    components: {name: [N] tensor}; a NaN marks a sample that reward does not score (a per-sample rm_type): it gets
    A_k = 0 there, and its group is normalised over the samples it scores. weights: {name: float} for the same
    names. Returns (A [N], info): info[f"{name}_mean"], [f"{name}_std"] are the reward's mean and population std
    over the samples it scores, and info[f"{name}_share"] its share of the final advantage,

        share_k = mean_i |w_k A_k,i| / sum_j mean_i |w_j A_j,i|      (the shares sum to 1; all 0 if every A_k is 0)

    measured before the clip.
    """
    if not components or set(components) != set(weights):
        raise ValueError(f"components {sorted(components)} and weights {sorted(weights)} must name the same rewards")
    total, info, size = 0.0, {}, {}
    for name, rewards in components.items():
        rewards = torch.as_tensor(rewards).float()
        ids = torch.as_tensor(group_ids, device=rewards.device).long()
        if rewards.ndim != 1 or rewards.shape != ids.shape:
            raise ValueError(f"reward {name!r} must be [N] like group_ids, got {tuple(rewards.shape)} and "
                             f"{tuple(ids.shape)}")
        scored = ~torch.isnan(rewards)
        if not scored.any():
            raise ValueError(f"reward {name!r} scores no sample (all NaN)")
        adv = torch.zeros_like(rewards)
        adv[scored] = group_advantages(rewards[scored], ids[scored], global_std=global_std, eps=eps, clip=math.inf)
        weighted = float(weights[name]) * adv
        total = total + weighted
        size[name] = weighted.abs().mean().item()
        info[f"{name}_mean"] = rewards[scored].mean().item()
        info[f"{name}_std"] = rewards[scored].std(unbiased=False).item()
    scale = sum(size.values())
    for name in components:
        info[f"{name}_share"] = size[name] / scale if scale > 0 else 0.0
    return total.clamp(-clip, clip), info


def grpo_loss(log_prob, old_log_prob, adv, *, clip_range, adv_clip=None):
    """Flow-GRPO's clipped surrogate for one step (PPO arXiv:1707.06347, Eq. 7, per denoising step):

        loss = mean_i max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps))

    A term whose ratio has left [1 - eps, 1 + eps] in the advantage's direction is the clipped,
    constant branch and carries no gradient. With r = 1 the loss is -mean(A).
    """
    _check(log_prob, old_log_prob, adv)
    adv = adv.float() if adv_clip is None else adv.float().clamp(-adv_clip, adv_clip)
    log_ratio = log_prob.float() - old_log_prob.float()
    per_sample, info = _clipped_surrogate(log_ratio, adv, clip_range)
    return per_sample.mean(), info


def kl_penalty(mean, ref_mean, std, *, dt=None):
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
    there its form is the exact one: pass dt=None.) Returns (mean over samples, info)."""
    kl = _sq_dist(mean, ref_mean) / (2 * _per_sample(std, mean) ** 2)  # [B]
    if dt is not None:
        dt = _per_sample(dt, mean)
        if (dt >= 0).any():
            raise ValueError("kl_penalty: dt = s' - s must be negative")
        kl = kl * -dt
    return kl.mean(), {"kl_mean": kl.detach().mean().item(), "kl_max": kl.detach().max().item()}


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
    if (c <= 0).any():
        raise ValueError("guard_loss needs a positive transition std (an ODE step or --eta 0 has none)")
    mse = _sq_dist(mean, old_mean)  # [B], per sample
    log_ratio = (log_prob.float() - old_log_prob.float()) * c + mse / (2 * c)
    per_sample, info = _clipped_surrogate(log_ratio, adv, clip_range)
    per_sample = per_sample / -_per_sample(dt, log_prob)  # the gradient reweight
    info["mean_shift"] = mse.detach().mean().item()
    return per_sample.mean(), info


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
    masked = (~keep).float().mean().item()
    info.update(clipfrac=masked, masked_fraction=masked, kl_mask_fraction=high_kl.float().mean().item(),
                kl_new_old_mean=kl.mean().item(), kl_new_old_max=kl.max().item(),
                pos_rm_fraction=pos_rm.float().mean().item(), neg_rm_fraction=neg_rm.float().mean().item())
    return loss, info


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
    return kl.mean(), {"kl_mean": kl.detach().mean().item(), "kl_max": kl.detach().max().item()}


def nft_optimality(adv, *, adv_clip=5.0):
    """DiffusionNFT's optimality probability (arXiv:2509.16117; train_nft_sd3.py L910-929):
    r = clip(A / adv_clip, -1, 1) / 2 + 1/2, so r = 1/2 at the group mean, 1 at A >= adv_clip, 0 at A <= -adv_clip."""
    if adv_clip <= 0:
        raise ValueError(f"--adv-clip must be positive, got {adv_clip}")
    return (adv.float() / adv_clip).clamp(-1, 1) / 2 + 0.5


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
    if adaptive:
        with torch.no_grad():
            w_plus = err_plus.abs().mean(dims, keepdim=True).clamp_min(1e-5)
            w_minus = err_minus.abs().mean(dims, keepdim=True).clamp_min(1e-5)
    else:
        w_plus = w_minus = 1.0
    loss_plus = (err_plus**2 / w_plus).mean(dims)  # [B]
    loss_minus = (err_minus**2 / w_minus).mean(dims)
    per_sample = (r * loss_plus + (1 - r) * loss_minus) / beta
    info = {"nft_loss_plus": loss_plus.detach().mean().item(), "nft_loss_minus": loss_minus.detach().mean().item(),
            "old_deviate": ((v.detach() - v_old) ** 2).mean().item(), "r_mean": r.mean().item()}
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
    per_term, info = _clipped_surrogate(log_prob.double() - old_log_prob.double(), a, clip_range)
    return per_term.mean().float(), info
