"""Group-relative advantages and the per-step policy losses: GRPO, GRPO-Guard, FlowDPPO, KL penalty.

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
"""

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
    kl = ((mean.float() - ref_mean.float()) ** 2).mean(_dims(mean)) / (2 * _per_sample(std, mean) ** 2)  # [B]
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
    mse = ((mean.float() - old_mean.float()) ** 2).mean(_dims(mean))  # [B], per sample
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
