"""What is not a loss but changes what any loss sees, at named points of the TRAINING phase: GARDO's rules (Gated and
Adaptive Regularization with Diversity-aware Optimization, arXiv:2512.24138; code tinnerhrhe/GARDO at 1cc77fb) and
the adaptive KL weight (Ziegler et al.'s controller, losses.adaptive_kl_beta, beside the KL it weighs).

    due = reference_due(step, last_reset, max_kl, reset_freq=15, kl_thres=3e-4)  # reset the KL anchor now?
    hyper, state = before_training(policy, hyper, args, carry, step)   # the step's KL weight; the anchor renewed
    before_optimizer_step(state, stats, n_terms, args)                 # the KL of each optimizer step kept
    info = after_training(info, hyper, state, args, carry, device)     # the next step's KL weight and renewal

Two of GARDO's rules act in the ADVANTAGES phase and live in advantages.py: the gate (uncertainty, gate_fraction,
kl_gate: which samples' KL counts, handed to the loss as t["kl_gate"] and applied by losses.gated_kl) and the
diversity-aware advantage (diversity_weights). What GARDO's code does for all three, and where this project departs:

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
  advantages.diversity_advantages is that formula as written. What runs (advantages.step_advantages) departs
  (departure 13): the weight scales this project's advantages, already divided by the std (group or --global-std)
  and clipped, and the product is clamped again to +-adv_clip, as G clamps after the weighting. The policy term is
  thereby 1 / sigma_r larger against the KL than GARDO's (sigma_r the reward's std; docs/departures.md, 13).

The flags (add_arguments; train.py composes them with every loss, departure 13): --gardo-gate AUX,... (the gated KL,
AUX naming components of --reward that are scored and not trained), --gardo-reference with --gardo-reset-freq and
--gardo-kl-thres (the adaptive reference: a third copy of the trained weights in policy.py, beside the EMA and the old
copy, saved with every checkpoint), --gardo-diversity (the advantage). The gate's share and the reference's last
renewal are carried from step to step in run.carry and resumed exactly.
"""
import argparse

import torch

import distributed
import losses


def reference_due(step, last_reset, max_kl, *, reset_freq, kl_thres):
    """Whether the KL anchor is reset to the current weights at the start of `step` (G L789): when an optimizer step
    since the last reset had a KL (the gated term's mean) above kl_thres (`max_kl`, G L1042-1043), or when more than
    reset_freq steps have passed since `last_reset`. Never at step 0."""
    return step != 0 and (max_kl > kl_thres or step - last_reset > reset_freq)


# ----------------------------------------------------------------------------- where train.py calls them
# Named points of a step, each a plain function that applies whichever rules the flags turn on; train.py names no
# rule. A rule's state across steps lives in `carry` (run.carry: saved with every checkpoint, resumed exactly).

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
        info["kl_beta"] = beta = hyper["kl_beta"]  # the weight this step trained with
        low, high = losses.kl_weight_bounds(args.kl_beta, args.kl_floor)
        carry["kl_beta"] = losses.adaptive_kl_beta(beta, kl, target=args.kl_target, rate=args.kl_rate, floor=low,
                                                   ceiling=high)
        if carry["kl_beta"] != beta and (carry["kl_beta"] == high or carry["kl_beta"] == low > args.kl_floor):
            distributed.print0(  # once, as it reaches the bound: held there while the KL stays on that side
                f"warning: the adaptive KL weight reached {carry['kl_beta']:.3g}, --kl-beta {args.kl_beta:g} "
                f"{'x' if carry['kl_beta'] == high else '/'} {losses.KL_SPAN:g}, and is held there: the KL {kl:.3g} "
                f"stays {'above' if carry['kl_beta'] == high else 'below'} --kl-target {args.kl_target:g} whatever "
                "the weight; lower --kl-rate or set --kl-target to the KL the run reaches")
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
