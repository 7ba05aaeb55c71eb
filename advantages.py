"""The ADVANTAGES phase: a step's rewards -> the advantages every loss trains on, as pure functions of tensors.

    adv = group_advantages(rewards, group_ids, global_std=False, eps=1e-4, clip=5.0)   # GRPO's group-relative rule
    adv, info = combined_advantages({name: rewards}, {name: weight}, group_ids)      # MixGRPO's sum of advantages
    weight = best_of_group(rewards, group_ids)       # online SFT's targets;  preference_pairs: online DPO's pairs
    adv, info = step_advantages(rewards, group_ids, keep, rule=..., mix=..., features=...)   # what train.py calls
    flagged, fraction, history = gardo_gate(rewards, aux, keep, fraction, history)  # the samples whose KL counts

A loss names its rule in its record (losses.LOSSES[name].advantages: group_advantages, best_of_group or
preference_pairs); every rule takes (rewards [N], group_ids [N], global_std=, clip=) and returns [N]. train.py gathers
every rank's rewards (and GARDO's image features) before calling here, and takes its own slice back after.

GARDO (Gated and Adaptive Regularization with Diversity-aware Optimization, arXiv:2512.24138; code tinnerhrhe/GARDO at
1cc77fb) shapes this phase twice; regularizers.py's docstring gives its sources (G, N, S, C) and where this project
departs from them:

    u = uncertainty(main_reward, [aux_reward, ...])         # per sample: rank under the trained reward - mean aux rank
    fraction, history = gate_fraction(fraction, history, u)  # the share of samples the KL is applied to, adapted
    flagged = kl_gate(u, fraction)                           # [B] bool: the samples whose KL counts (losses.gated_kl)
    adv = diversity_advantages(rewards, features, groups)    # positive advantages scaled by feature novelty

Sources (file:line at 1cc77fb): G = scripts/train_sd3_grpo_gardo.py, N = scripts/train_sd3_nft_gardo.py,
S = flow_grpo/stat_tracking.py.
"""
import math

import torch


def group_advantages(rewards, group_ids, *, global_std=False, eps=1e-4, clip=5.0):
    """A_i = (r_i - mean of i's group) / (std + eps), clipped to +-clip.

    GRPO (DeepSeekMath arXiv:2402.03300, Sec. 4.1.2; as used by Flow-GRPO arXiv:2505.05470): the std
    is that of i's group (population std), or with global_std one std over the whole batch (as
    Flow-GRPO's and FlowDPPO's recipes do). A group whose rewards are all equal gets advantages of exactly 0.
    rewards [N]; group_ids: N ints (list or tensor), equal for samples of the same prompt. The arithmetic is in
    float32 (float64 rewards stay float64, as a reference comparison needs); where a group's spread overflows float32
    (finite rewards near 1e38) it is redone in float64.
    """
    wide = torch.is_tensor(rewards) and rewards.dtype == torch.float64
    return _group_advantages(rewards, group_ids, global_std, eps, clip, torch.float64 if wide else torch.float32)


def _group_advantages(rewards, group_ids, global_std, eps, clip, dtype):
    rewards, group, groups = _groups(rewards, group_ids, dtype)  # group: 0 .. G-1
    n = torch.zeros(groups, device=rewards.device, dtype=dtype).index_add_(0, group, torch.ones_like(rewards))
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
    if not (torch.isfinite(centred).all() and torch.isfinite(std).all()) and dtype != torch.float64:
        # a spread beyond float32 (finite rewards near 1e38): the std is inf and every advantage would be 0
        return _group_advantages(rewards, group, global_std, eps, clip, torch.float64).float()
    return (centred / (std + eps)).clamp(-clip, clip)


def combined_advantages(components, weights, group_ids, *, global_std=False, eps=1e-4, clip=5.0):
    """Several rewards combined by their advantages, as MixGRPO does (arXiv:2507.21802; its code,
    Tencent-Hunyuan/MixGRPO fastvideo/train_grpo_flux.py, `multi_reward_mix == "advantage_aggr"`, lines 429-456):

        A_k = group_advantages(r_k) without its clip            each reward normalised in its group on its own
        A   = clip(sum_k (w_k / sum_j w_j) A_k, -clip, clip)    the weights normalised by their sum; the clip acts
                                                                on the sum

    (MixGRPO divides its reward weights by their sum, "Normalize weights", lines 765-767, so "a=2,b=1" and
    "a=0.67,b=0.33" train alike; it clips the summed advantage in the loss, `adv_clip_max`, line 567.) The weights
    must sum to a positive number (train.py refuses others). Each A_k follows `group_advantages`:
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
    weight_sum = sum(float(w) for w in weights.values())
    if not weight_sum > 0:  # all 0: every advantage 0, nothing would train
        raise ValueError(f"the reward weights {dict(weights)} must sum to a positive number")
    total, info, size = 0.0, {}, {}
    for name, rewards in components.items():
        rewards = torch.as_tensor(rewards).float()
        ids = torch.as_tensor(group_ids, device=rewards.device).long()
        if rewards.ndim != 1 or rewards.shape != ids.shape:
            raise ValueError(f"reward {name!r} must be [N] like group_ids, got {tuple(rewards.shape)} and "
                             f"{tuple(ids.shape)}")
        scored = ~torch.isnan(rewards)
        adv = torch.zeros_like(rewards)  # a reward that scores no sample of the batch adds nothing to it
        if scored.any():
            adv[scored] = group_advantages(rewards[scored], ids[scored], global_std=global_std, eps=eps, clip=math.inf)
        weighted = float(weights[name]) / weight_sum * adv
        total = total + weighted
        size[name] = weighted.abs().mean().item()
        info[f"{name}_mean"] = rewards[scored].mean().item() if scored.any() else math.nan
        info[f"{name}_std"] = rewards[scored].std(unbiased=False).item() if scored.any() else math.nan
    scale = sum(size.values())
    for name in components:
        info[f"{name}_share"] = size[name] / scale if scale > 0 else 0.0
    return total.clamp(-clip, clip), info


def _groups(rewards, group_ids, dtype=torch.float32):
    """rewards [N] in dtype, group index 0 .. G-1 of each sample [N], G; one line for mismatched or non-finite input."""
    rewards = torch.as_tensor(rewards).to(dtype)
    ids = torch.as_tensor(group_ids, device=rewards.device).long()
    if rewards.ndim != 1 or ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be [N] of one length, got {tuple(rewards.shape)} "
                         f"and {tuple(ids.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"non-finite reward at sample(s) {torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()}")
    _, group = torch.unique(ids, return_inverse=True)
    return rewards, group, int(group.max()) + 1


def best_of_group(rewards, group_ids, *, global_std=False, clip=None):
    """Online SFT's sample weights (flow_grpo flow_grpo/stat_tracking.py L39-40, type 'sft'): 1 for every sample whose
    reward equals its group's maximum, 0 for the rest. A group of equal rewards is all "best": each of its samples
    is a target (as there). Returns [N] float. global_std and clip: a rule's keywords (step_advantages), unused."""
    rewards, group, n = _groups(rewards, group_ids)
    top = torch.full((n,), -torch.inf, device=rewards.device).scatter_reduce(0, group, rewards, "amax")
    return (rewards == top[group]).float()


def preference_pairs(rewards, group_ids, *, global_std=False, clip=None):
    """Online DPO's pairs (flow_grpo flow_grpo/stat_tracking.py L41-55, type 'dpo'): in each group +1 for the first
    sample of the highest reward (chosen), -1 for the first of the lowest (rejected), 0 for the rest. Returns [N]
    float with exactly one +1 and one -1 per group whose rewards differ.

    Departure: a group of equal rewards gets no pair (all 0) and leaves the update, as a saturated group leaves every
    loss here; flow_grpo pairs its samples 1 (chosen) and 0 (rejected) there, a preference between equals. global_std
    and clip: a rule's keywords (step_advantages), unused."""
    rewards, group, n = _groups(rewards, group_ids)
    out = torch.zeros_like(rewards)
    for g in range(n):
        members = torch.nonzero(group == g).flatten()
        r = rewards[members]
        if r.max() > r.min():  # argmax / argmin return the first of equal values, as torch.argmax there
            out[members[torch.argmax(r)]], out[members[torch.argmin(r)]] = 1.0, -1.0
    return out


def ranks(x):
    """Ranks of a [N] tensor, 1 for the largest (G L828-830: torch.sort descending, ranks[indices] = 1..N); ties in
    the sort's stable order."""
    order = torch.sort(x, descending=True, stable=True).indices
    out = torch.empty(len(x), dtype=torch.float64)
    out[order] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    return out


def uncertainty(main, aux):
    """GARDO's per-sample uncertainty (G L834): rank under the trained reward `main` [N] minus the mean rank under the
    auxiliary rewards `aux` (a list of [N]); ranks over the whole batch.

    Departure: an auxiliary reward may leave samples unscored (NaN: prompt rows that choose their own components), which
    torch.sort would rank first. Each one ranks the samples it scored, stretched onto 1..N (the identity when it scored
    all, so GARDO's ranks exactly), and a sample is judged by the auxiliary rewards that scored it; one that none scored
    gets u = NaN, which the gate never flags (kl_gate, gate_fraction: only u >= 0 counts)."""
    if not aux:
        raise ValueError("GARDO's gate needs at least one auxiliary reward beside the trained one")
    n = len(main)
    total, count = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for a in aux:
        a = torch.as_tensor(a, dtype=torch.float64)
        scored = torch.isfinite(a)
        k = int(scored.sum())
        if k == 0:
            continue
        r = ranks(a[scored])
        total[scored] += 1 + (r - 1) * (n - 1) / (k - 1) if k > 1 else torch.full_like(r, (n + 1) / 2)
        count[scored] += 1
    return ranks(main) - total / count  # 0 / 0: NaN where no auxiliary reward scored the sample


GATE = dict(base=0.1, rate=0.1, low=0.02, high=0.2, window=20)  # RiskCompensator's defaults (G L220-226)


def gate_fraction(fraction, history, u, *, base=GATE["base"], rate=GATE["rate"], low=GATE["low"],
                  high=GATE["high"], window=GATE["window"]):
    """One update of the share of samples the KL applies to (G L227-238): -> (fraction, history). `history` holds the
    last `window` means of the non-negative u; the first update sets `base`."""
    u = torch.as_tensor(u, dtype=torch.float64)
    level = u[u >= 0].mean().item() if (u >= 0).any() else float("nan")
    if not history:
        fraction = base
    elif level > max(history):
        fraction = fraction * (1 + rate)
    elif level < min(history):
        fraction = fraction * (1 - rate)
    fraction = min(max(fraction, low), high)
    return fraction, (list(history) + [level])[-window:]


def kl_gate(u, fraction):
    """[N] bool: the samples whose KL counts (G L836-837): u above the (100 - 100 fraction)th percentile of the
    non-negative u; none when no u is non-negative (where numpy's percentile would raise)."""
    u = torch.as_tensor(u, dtype=torch.float64)
    pool = u[u >= 0]
    if len(pool) == 0:
        return torch.zeros(len(u), dtype=torch.bool)
    threshold = torch.quantile(pool, 1 - fraction)  # linear interpolation, as np.percentile's default
    return u > threshold


def nearest_distances(features, groups):
    """Per sample, the minimum cosine distance 1 - cos to another member of its group (S L117-124); 0 for a sample
    alone in its group. features [N, D], groups [N] ints."""
    f = torch.as_tensor(features, dtype=torch.float64)
    f = f / f.norm(dim=1, keepdim=True)
    out = torch.zeros(len(f), dtype=torch.float64)
    for g in torch.unique(groups):
        members = (groups == g).nonzero().flatten()
        if len(members) < 2:
            continue
        d = 1 - (f[members] @ f[members].T).clamp(-1, 1)  # [m, m]
        d.fill_diagonal_(float("inf"))
        out[members] = d.min(dim=1).values
    return out


def diversity_weights(adv, features, groups):
    """GARDO's weight of each advantage (S L127): 1 where adv < 0, else d_i / the mean of d over the group (d:
    `nearest_distances`). A group whose distances are all 0 (identical images, up to rounding) keeps weight 1, where
    GARDO's division is 0 / 0."""
    adv = torch.as_tensor(adv, dtype=torch.float64)
    d = nearest_distances(features, groups)
    scale = torch.zeros_like(d)
    for g in torch.unique(groups):
        members = groups == g
        scale[members] = d[members].mean()
    novelty = torch.where(scale > 1e-9, d / scale.clamp(min=1e-9), torch.ones_like(d))  # 1e-9: float rounding
    return torch.where(adv < 0, torch.ones_like(d), novelty)


def diversity_advantages(rewards, features, groups):
    """GARDO's diversity-aware advantage as its tracker writes it (S L110-135, type "gardo"): (r - group mean) x
    `diversity_weights`, not divided by the std. The reference of the tests: training scales the std-normalised
    advantages instead (step_advantages, departure 13)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    centred = r.clone()
    for g in torch.unique(groups):
        members = groups == g
        centred[members] = r[members] - r[members].mean()
    return centred * diversity_weights(centred, features, groups)

# ----------------------------------------------------------------------------- the phase, as train.py calls it
def step_advantages(rewards, group_ids, keep, *, rule=group_advantages, global_std=False, clip=5.0, mix=None,
                    features=None):
    """The step's advantages over every rank's samples: rewards [N] of the trained key, group_ids [N], keep [N] bool
    (the samples of groups whose rewards all arrived; the others get 0). The loss's `rule` on the kept samples, or with
    mix = ({name: [N] rewards}, {name: weight}) MixGRPO's combined_advantages of the components (--reward-combine
    advantage); with features [N, D] (--gardo-diversity) each positive advantage then times its image's novelty in its
    group (diversity_weights), clamped to +-clip again, as G clamps after the weighting (L967-971): a near-collapsed
    group's one novel image would otherwise pass 10 (departure 13). -> (adv [N], statistics)."""
    adv, info = torch.zeros_like(rewards), {}
    if mix is not None:  # each reward normalised in its group, their advantages summed (MixGRPO)
        components, weights = mix
        adv[keep], combined = combined_advantages({name: r[keep] for name, r in components.items()}, weights,
                                                  group_ids[keep], global_std=global_std, clip=clip)
        info.update({f"reward/{k}": v for k, v in combined.items() if not k.endswith("_mean")})  # std, share
    else:  # the loss's rule: group-relative advantages, or its own (the best of each group, its best-worst pair)
        adv[keep] = rule(rewards[keep], group_ids[keep], global_std=global_std, clip=clip)
    if features is not None:  # a positive advantage grows with how unlike its group's others the image is
        weight = diversity_weights(adv[keep], features[keep], group_ids[keep]).to(adv)
        adv[keep] = (adv[keep] * weight).clamp(-clip, clip)
        info["gardo_weight_max"] = weight.max().item()
    return adv, info


def gardo_gate(rewards, aux, keep, fraction=None, history=()):
    """GARDO's gated KL for one step (G L827-837): the uncertainty of the kept samples (ranks over the whole step, the
    trained rewards [N] against the auxiliary ones, a list of [N]), the share of flagged samples adapted from
    `fraction` and `history` (None and () at the first step) -> (flagged [N] bool, never a dropped sample; fraction;
    history), the last two carried to the next step."""
    u = uncertainty(rewards[keep].cpu(), [a[keep].cpu() for a in aux])  # [kept]
    fraction, history = gate_fraction(GATE["base"] if fraction is None else fraction, history, u)
    flagged = torch.zeros_like(keep)  # dropped groups: never flagged (they do not train)
    flagged[keep] = kl_gate(u, fraction).to(keep.device)
    return flagged, fraction, history
