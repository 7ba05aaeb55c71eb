"""What is not a loss but changes what any loss sees: GARDO's three rules (Gated and Adaptive Regularization with
Diversity-aware Optimization, arXiv:2512.24138; code tinnerhrhe/GARDO at 1cc77fb), as pure functions of tensors.

    u = uncertainty(main_reward, [aux_reward, ...])         # per sample: rank under the trained reward - mean aux rank
    fraction, history = gate_fraction(fraction, history, u)  # the share of samples the KL is applied to, adapted
    flagged = kl_gate(u, fraction)                           # [B] bool: the samples whose KL counts
    due = reference_due(step, last_reset, max_kl, reset_freq=15, kl_thres=3e-4)  # reset the KL anchor now?
    adv = diversity_advantages(rewards, features, groups)    # positive advantages scaled by feature novelty

Sources (file:line at 1cc77fb): G = scripts/train_sd3_grpo_gardo.py, N = scripts/train_sd3_nft_gardo.py,
S = flow_grpo/stat_tracking.py, C = config/gardo.py. What they do, and where this module departs:

- Uncertainty (G L827-834, N L815-822): each of the auxiliary rewards (aesthetic, ImageReward) and the trained one
  ranked over the whole gathered batch, 1 = the highest (torch.sort descending); u = rank under the trained reward
  minus the mean of the auxiliary ranks. As written, u is large where the trained reward ranks a sample LOWER than
  the auxiliary rewards do; the KL goes on those (G L837, L954). Kept as written. Departure: an auxiliary score
  that is NaN (a sample its reward did not score) is not ranked first, as torch.sort would; see uncertainty.
- Adaptive share (G L219-238, class RiskCompensator; N L81-): fraction starts at 0.1; each step the mean of the
  non-negative u is compared with the last 20 steps' means: above their maximum, fraction x 1.1; below their
  minimum, x 0.9; clipped to [0.02, 0.2]. The gate (G L835-837): u > the (100 - 100 fraction)th percentile of the
  non-negative u (numpy's linear interpolation; N L823-825 the same).
- Gated KL (G L982-991): Flow-GRPO's KL, mean((mean - ref_mean)^2 / (2 std^2)) over the flagged samples only,
  times beta; no flagged sample, no KL term. DiffusionNFT (N L1049-1056): the squared velocity difference to the
  reference over the flagged samples, or over every sample when none is flagged (`empty="all"`).
- Adaptive reference (G L789-799, L1042-1043; C `reset_freq` 15, `kl_thres` 3e-4): the reference (the "old"
  adapter, a copy of the trained LoRA weights, not the base model) is set to the current weights at the start of an
  epoch when an optimizer step of the previous epoch had a KL above kl_thres, or when more than reset_freq epochs
  passed since the last reset. N L771-781: the same with reset_freq fixed at 15 and kl_thres starting at 0.15
  (N L616), nudged after each reset (-0.01 down to 0.1 after a long interval, +0.01 up to 0.05 after a short one;
  the two bounds cross, as written). Not reproduced here: the nudging. The reference starts as a copy of
  the trained weights (G L636-641).
- Diversity-aware advantage (S L101-135, type "gardo"; N uses PerPromptStatTrackerNFT, S L11-49, the same rule):
  features (DINOv3 ViT-L/16 of the images, G L625-631, L714) L2-normalised; within a prompt's group each sample's
  distance is the MINIMUM of 1 - cos to the others (S L120-124, named avg_distances); samples at or above the group
  mean reward get (r - mean) x d_i / mean_group(d), those below it (r - mean) x 1 (S L127); NOT divided by the
  group's std (S L135); the training loop then clamps the weighted advantage to +-adv_clip_max, 5 (G L967-971).
  diversity_advantages is that formula as written. What runs (shape_advantages) departs (departure 13): the weight
  scales this project's advantages, already divided by the std (group or --global-std) and clipped, and the product
  is clamped again to +-adv_clip, as G clamps after the weighting. The policy term is thereby 1 / sigma_r larger
  against the KL than GARDO's (sigma_r the reward's std; docs/departures.md, 13).

The flags (add_arguments; train.py composes them with every loss, departure 13): --gardo-gate AUX,... (the gated KL,
AUX naming components of --reward that are scored and not trained), --gardo-reference with --gardo-reset-freq and
--gardo-kl-thres (the adaptive reference: a third copy of the trained weights in policy.py, beside the EMA and the old
copy, saved with every checkpoint), --gardo-diversity (the advantage). The gate's share and the reference's last
renewal are carried from step to step in run.carry and resumed exactly.
"""
import argparse
import math

import torch

import distributed
import diversity


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


def reference_due(step, last_reset, max_kl, *, reset_freq, kl_thres):
    """Whether the KL anchor is reset to the current weights at the start of `step` (G L789): when an optimizer step
    since the last reset had a KL (the gated term's mean) above kl_thres (`max_kl`, G L1042-1043), or when more than
    reset_freq steps have passed since `last_reset`. Never at step 0."""
    return step != 0 and (max_kl > kl_thres or step - last_reset > reset_freq)


def adaptive_kl_beta(beta, kl, *, target, rate, floor=0.0):
    """The KL weight of the next step from this step's KL (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences", Sec. 2.2: a log-space proportional controller), never below `floor`:

        e = clip(KL / target - 1, -0.2, 0.2),   beta <- max(floor, beta (1 + rate e))

    train.py floors it at the starting weight (--kl-beta; --kl-floor sets another), where Ziegler et al. let it fall:
    in the shapes world's long run the unfloored weight falls from 0.1 to 0.001-0.004 while the KL is under target,
    the KL to the start then runs 2-5 times the floored run's, and on GenEval's 0.9 rule the drift that came (the KL
    0.027 -> 0.11 in 40 steps) outran a weight that could not grow back in time (docs/long_run.md, "A KL weight that
    grows with the KL"). A KL that is not finite (a skipped step) leaves beta as it is."""
    if not math.isfinite(kl):
        return beta
    error = min(max(kl / target - 1, -0.2), 0.2)
    return max(floor, beta * (1 + rate * error))


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
    advantages instead (shape_advantages, departure 13)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    centred = r.clone()
    for g in torch.unique(groups):
        members = groups == g
        centred[members] = r[members] - r[members].mean()
    return centred * diversity_weights(centred, features, groups)


# ----------------------------------------------------------------------------- where train.py calls them
# Named points of a step, each a plain function that applies whichever rules the flags turn on; train.py names no
# rule. A rule's state across steps lives in `carry` (run.carry: saved with every checkpoint, resumed exactly).

def shape_advantages(adv, keep, groups, rewards, scores, batch, args, carry, mine):
    """ADVANTAGES, after the loss's rule, over every rank's samples (adv, keep, groups, rewards [samples]; scores: this
    rank's reward components; mine: this rank's slice): --gardo-diversity scales the positive advantages in place by
    their images' novelty in the group (the features of batch["images"], kept as batch["features"]) and clamps the
    product to +-args.adv_clip (a near-collapsed group's one novel image would otherwise pass 10); --gardo-gate sets
    batch["kl_gate"] [per rank], the samples whose KL counts. -> statistics."""
    info = {}
    if args.gardo_diversity:  # a positive advantage grows with how unlike its group's others the image is
        featurize = diversity.featurizer(args.diversity, args.diversity_path, adv.device)
        batch["features"] = featurize(batch["images"])  # [n, D]: run.log's feature diversity reads them too
        features = distributed.all_gather_cat(batch["features"].to(adv.device))  # [samples, D]
        weight = diversity_weights(adv[keep], features[keep], groups[keep]).to(adv)
        adv[keep] = (adv[keep] * weight).clamp(-args.adv_clip, args.adv_clip)  # clipped again after it (G L967-971)
        info["gardo_weight_max"] = weight.max().item()
    if args.gardo_gate:  # the KL only where the auxiliary rewards rank a sample well above the trained one
        aux = [distributed.all_gather_cat(scores[name].to(rewards.device))[keep].cpu() for name in args.gardo_gate]
        u = uncertainty(rewards[keep].cpu(), aux)  # [kept], ranks over the whole step (G L827-837)
        carry["gate_fraction"], carry["gate_history"] = gate_fraction(
            carry.get("gate_fraction", GATE["base"]), carry.get("gate_history", []), u)
        flagged = torch.zeros_like(keep)  # dropped groups: never flagged (they do not train)
        flagged[keep] = kl_gate(u, carry["gate_fraction"]).to(keep.device)
        batch["kl_gate"] = flagged[mine]  # [per rank]: read by the loss's KL term (losses.gated_kl)
        info.update(gardo_fraction=carry["gate_fraction"], gardo_flagged=flagged[keep].float().mean().item())
    return info


def before_training(policy, hyper, args, carry, step):
    """TRAINING, before its first forward: the loss's hyper-parameters with the adaptive KL weight (--kl-target), and
    GARDO's adaptive reference renewed when due (--gardo-reference; G L788-799). -> (hyper, the step's state)."""
    if args.kl_target > 0:  # carried from step to step (and in checkpoints)
        hyper = dict(hyper, kl_beta=carry.setdefault("kl_beta", args.kl_beta))
    renewed = False
    if args.gardo_reference:
        carry.setdefault("last_reset", 0)
        carry.setdefault("max_kl", 0.0)
        renewed = reference_due(step, carry["last_reset"], carry["max_kl"], reset_freq=args.gardo_reset_freq,
                                kl_thres=args.gardo_kl_thres)
        if renewed:
            policy.reset_reference()
            carry.update(last_reset=step, max_kl=0.0)
    return hyper, dict(renewed=renewed, step_kls=[])


def before_optimizer_step(state, stats, n_terms, args):
    """TRAINING, after a minibatch's backward passes: --gardo-reference keeps its KL term, the mean over its n_terms
    micro-steps (G L1040)."""
    if args.gardo_reference:
        state["step_kls"].append(torch.stack(stats["kl"][-n_terms:]).mean())


def statistics(state, args):
    """TRAINING, after the step's updates: the regularizers' statistics as tensors, fetched from the device with the
    loss's (train.host_stats): --gardo-reference's largest KL of the step, each optimizer step's averaged over the
    ranks (G L1041). -> {name: [0-dim tensor]}."""
    if not args.gardo_reference:
        return {}
    kls = distributed.all_gather_cat(torch.stack(state["step_kls"])).view(distributed.WORLD, -1)
    return {"gardo_kl_max": [kls.mean(0).max()]}


def after_training(info, hyper, state, args, carry, device):
    """TRAINING, at its end: --gardo-reference renews the snapshot at the next step when the step's largest KL was above
    --gardo-kl-thres (G L1042-1043, L789); --kl-target sets the next step's KL weight from this step's KL, the mean
    over the ranks. -> info, with theirs."""
    if args.gardo_reference:
        carry["max_kl"] = max(carry["max_kl"], info["gardo_kl_max"])
        info["gardo_reset"] = int(state["renewed"])
    if args.kl_target > 0 and "kl" in info:
        kl = distributed.all_gather_cat(torch.tensor([info["kl"]], device=device)).mean().item()
        info["kl_beta"] = hyper["kl_beta"]  # the weight this step trained with
        carry["kl_beta"] = adaptive_kl_beta(hyper["kl_beta"], kl, target=args.kl_target, rate=args.kl_rate,
                                            floor=args.kl_floor)
    return info


def add_arguments(parser):
    """GARDO's flags (train.py composes them with every loss and checks their values: flags.py's types sit beside
    this module, in its layer)."""
    group = parser.add_argument_group("GARDO (regularizers.py)")
    group.add_argument("--gardo-diversity", action="store_true",
                       help="diversity-aware advantage (GARDO): each positive advantage times its sample's nearest "
                            "feature distance in its group over the group's mean; the features of --diversity")
    group.add_argument("--gardo-gate", type=_names, default=None, metavar="AUX[,AUX...]",
                       help="gated KL (GARDO): the KL term (--kl-beta) only on the samples that the trained reward "
                            "(--reward-key) ranks furthest below where these auxiliary rewards rank them on average: "
                            "components of --reward, scored and not trained (GARDO: aesthetic,imagereward); their "
                            "share adapts from 0.1 within [0.02, 0.2], carried across steps and checkpoints")
    group.add_argument("--gardo-reference", action="store_true",
                       help="adaptive reference (GARDO): the KL anchor (--kl-beta) is a snapshot of the trained "
                            "weights, taken at the start and renewed at the start of a step once an optimizer step's "
                            "KL since the last renewal exceeded --gardo-kl-thres, or more than --gardo-reset-freq "
                            "steps after it; with LoRA in place of the base model, and possible without LoRA")
    group.add_argument("--gardo-reset-freq", type=int, default=15,
                       help="--gardo-reference: steps after which the snapshot is renewed at the latest (GARDO: 15)")
    group.add_argument("--gardo-kl-thres", type=float, default=3e-4,
                       help="--gardo-reference: a KL term (an optimizer step's mean, over ranks) above this renews the "
                            "snapshot at the next step (GARDO's GRPO: 3e-4 in Flow-GRPO's KL form; its DiffusionNFT "
                            "script: 0.15 on the velocity KL)")
    return group


def _names(text):
    """'aesthetic,imagereward' -> ['aesthetic', 'imagereward']."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one auxiliary reward, e.g. aesthetic,imagereward")
    return names
