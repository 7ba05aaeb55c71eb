"""Online RL for flow-matching text-to-image models: Flow-GRPO and its successors, in one script.

Launch
------
    python train.py                    # CPU: DiffusionNFT on the pretrained shapes model, GenEval prompts (~9 min)
    python train.py --loss grpo                                    # Flow-GRPO (SDE rollouts) on the same
    python train.py --model tiny --loss flowdppo --sde dance       # any loss / sampler on the random CPU model
    torchrun --standalone --nproc_per_node=8 train.py @recipes/sd3_nft_geneval.args   # DiffusionNFT, GenEval
    torchrun --standalone --nproc_per_node=8 train.py @recipes/sd3_ocr_grpo.args      # one node
    torchrun --nnodes 2 --nproc_per_node 8 --node-rank R --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 train.py @recipes/sd3_pickscore_grpo.args      # two nodes (R = 0, 1)
    torchrun --standalone --nproc_per_node=8 --max-restarts 3 train.py @recipes/... --resume auto   # preemptible
    torchrun --standalone --nproc_per_node=8 train.py @recipes/... --lora-rank 0 --kl-beta 0 --mixed-precision bf16 \
        --fsdp                                                     # full fine-tune, FSDP2 (no KL reference, no fp16)
    python train.py @recipes/wan_ocr_grpo.args                     # the recipes sized for one GPU (their authors'):
    python train.py @recipes/sd3_sft_geneval.args                  # Wan, flow_grpo's online SFT and its online DPO
    python train.py @recipes/sd3_dpo_geneval.args

One step = SAMPLING (SDE rollouts of `--group-size` images for each of `--prompts-per-step` prompts,
spread over all ranks) -> REWARDS -> ADVANTAGES (group-relative, after gathering every rank's rewards)
-> TRAINING (`--updates-per-batch` passes of a clipped / masked importance-ratio loss over the trained
denoising steps) -> LOG/EVAL/SAVE; main() is those phases, each a call. The algorithm is chosen in one place,
losses.LOSSES (a loss is a function and a registry line: README, "Adding a loss"). The plumbing lives
elsewhere: the trained weights, their optimizer and copies in policy.py, the run's folder, logs, checkpoints,
signals and the wait for rewards in run.py, ranks and FSDP in distributed.py.

The forward-process losses (`--loss nft`, DiffusionNFT arXiv:2509.16117; `--loss awm`, Advantage Weighted
Matching arXiv:2509.25050) go through the same phases with other contents: SAMPLING runs a deterministic
solver (`--sampler`, CFG 1 by default) and keeps only the clean samples; TRAINING re-noises each with fresh
noise at sigmas of the rollout schedule and trains on the flow-matching error there (losses.py). Both keep
an "old" float32 copy of the trained weights, soft-updated after each step, old <- d old + (1 - d) current
(`--old-decay`): DiffusionNFT samples with it and contrasts against its velocity; AWM samples with the
current weights and uses it as the anchor of its EMA-KL term (`--ema-kl-beta`; none when 0).

Where this departs from the papers, and why
-------------------------------------------
1. The noise of every rollout is seeded from (--seed, step, rank, batch), not drawn from a running RNG:
   a resumed run samples exactly what an uninterrupted one would, so stop/resume is bit-for-bit testable.
2. The old log-probs (and old means, for GRPO-Guard and FlowDPPO) are the rollout's own, frozen before
   the first update; the first optimizer step of each batch checks that the training forward reproduces
   them (ratio == 1). This catches rollout/train mismatches (CFG on one side only, dtype, a stale adapter)
   that otherwise train silently off-policy.
3. The last denoising step (sigma_{N-1} -> 0) is always an ODE step and never trained. On SD3's schedule
   (sigma ~0.009 at 10 steps, shift 3) its SDE std is ~0.006 and its log-prob would dominate the ratio.
   Flow-GRPO's timestep_fraction 0.99 leaves it out of training too (int(10 x 0.99) = 9 of 10 steps); only a
   Flow-GRPO-Fast window could reach it, which its default sde_window_range (0, T) allows and --window-range
   refuses. Flow-GRPO's rollouts still add SDE noise on it; on schedules that end at linspace(1, 1/N) that is not
   small: the Kontext recipe (6 steps, 512 px, FLUX's dynamic shift) goes from sigma 0.273 to 0, and the authors'
   step there has std 0.29 at noise level 0.9 (untrained), where this project's is deterministic, so its final
   samples are less noisy than the authors' (the rewards, and so the advantages, differ accordingly).
4. Groups whose reward service failed (`--reward-on-error skip`) are dropped from the advantages as
   whole groups (a partial group would shift the group mean of the others): advantage 0, below.
   Samples with advantage 0 (those, and saturated groups, whose rewards are all equal) leave the update,
   as in Flow-GRPO: the policy term is the mean over the samples that carry one, not diluted by the rest.
   Each rank keeps its number of micro-batches (the same forwards and backwards on every rank, as DDP and
   FSDP need) and trains its kept samples in smaller ones, topped up with advantage-0 samples to a multiple
   of that number as Flow-GRPO does. The departure: each rank's loss is weighted by its share of the
   trained samples, so the step is the mean over all of them; Flow-GRPO averages the GPUs' means, which
   weights a sample by 1 / (the count on its GPU) and so depends on where the samples landed.
5. Rewards are computed in a background thread while the next sample batch is generated; the result is
   identical to scoring afterwards, only earlier.
6. The EMA repeats its decay --ema-repeat times per update, fixed in the recipe. Flow-GRPO steps its EMA
   after every micro-batch, so the repeat count is its gradient accumulation, which changes with the GPU
   count (2 on general_ocr_sd3's 32 GPUs, 8 on 8 GPUs); stating it keeps a recipe's EMA the published
   one on any number of GPUs.
7. MixGRPO: the window slides to its last full position and stays there (or rolls back); MixGRPO's
   shrinks to nothing first (from its iteration 500 at 25 steps; its published runs stop at 300). Under
   --flash the solver after the window starts at first order; MixGRPO's carries the window's x0
   predictions into its second-order history.
8. --loss nft / awm: the old policy is a float32 copy of the trained weights exchanged in place for the
   forwards that need it (checkpoints.swapped), where DiffusionNFT and AWM keep a second peft adapter: one
   mechanism for LoRA, full fine-tunes and FSDP shards, and an exact exchange. Their samples with advantage 0
   stay in the update (4 leaves them out of the others), as both references train them: NFT's r is 1/2 there,
   a pull toward the old policy, and AWM's KL terms still act. Dropped groups (4) leave it, topped up alike.
9. --loss awm samples with a deterministic solver (DPM-Solver++(2M) by default) where the reference runs a
   stochastic SA-Solver (noise level 0.4 on GenEval and OCR, 0 on PickScore): the surrogate needs only
   clean samples, so any solver serves, and this project has no SA-Solver. It also trains from the first
   step, where the reference only samples in its first two epochs (a workaround in its code), and runs one
   forward per training sigma where the reference stacks the 6 into one batch (the same gradient).
10. --loss awm: the old log-probs of the PPO ratio are the current weights' on the first optimizer step of
   a step (ratio 1, as in every AWM recipe: one optimizer step per sampled batch); for later optimizer steps
   (--minibatches, --updates-per-batch) they are computed before the first one, at the same noise and
   sigmas (the reference's on-policy mode).
11. --sampler dpm2 takes the jump to the last nonzero sigma first order, where DiffusionNFT's solver
   extrapolates it second order (sde.ode_sample: an 8x smaller error at 10 steps on Gaussian data).
12. DiffusionNFT and AWM, smaller differences kept: DiffusionNFT's rollout conditions SD3 on integer timesteps
   int(1000 s) (diffusers_patch/pipeline_with_logprob.py L213) and trains on float ones; here both are float, so the
   rollout is the policy that trains. Its solver casts the latent to fp16 after every step (solver.py L23-68); here
   it stays float32. Both keep the frozen base in float32 (train_nft_sd3.py L417, train_sd3_awm.py L606-608); a LoRA
   run here loads it in --mixed-precision (half the memory; the matmuls run in that dtype either way). AWM draws its
   training noise in fp16 (L1215-1220), here float32. Both draw each step's prompts as a fresh random subset
   (DistributedKRepeatSampler), here every prompt once per epoch (data.step_prompt_ids); both group advantages by the
   prompt's text, here by its place in the step, so duplicate lines of a prompt file stay separate groups.
13. GARDO (regularizers.py; G = its scripts/train_sd3_grpo_gardo.py, N = train_sd3_nft_gardo.py) acts on every loss
   here, where its scripts wire it into GRPO and DiffusionNFT. --gardo-diversity scales this project's advantages
   (normalised by the group's std and clipped) where GARDO's tracker scales the raw centred reward, undivided
   (flow_grpo/stat_tracking.py L135), so its size stays that of every other loss's advantages; features come from
   --diversity (DINOv2 or CLIP through transformers), GARDO's from DINOv3 ViT-L/16 through timm; a group of identical
   images keeps weight 1 where GARDO divides 0 by 0. --gardo-gate ranks the kept samples (groups a failed reward
   service dropped never carry the KL), ties in the sort's stable order. --gardo-reference keeps its snapshot as a
   float32 copy of the trained weights exchanged in place (as the old copy of 8), where GARDO keeps a second peft
   adapter: it also serves full fine-tunes (N L990-991 asserts LoRA), and every reader of the reference (DGPO's
   --dgpo-reference base too) reads the snapshot. The renewal waits for a step that trains (a skipped step neither
   renews nor measures); its trigger is a fixed --gardo-kl-thres on the KL as --kl-form scales it, where N starts at
   0.15 and nudges it after each renewal (L777-780). At --kl-beta 0 both rules are off, where N still computes its
   reference velocity. The gate's share and the snapshot are saved and resumed; GARDO's scripts restart both.
14. Qwen-Image-Edit's VL encoder is shown the resized source image, as diffusers' pipeline shows it. Flow-GRPO hands
   it the preprocessed tensor in [-1, 1] (qwenimage_edit_pipeline_with_logprob.py L76-84), which the Qwen2-VL
   processor still rescales by 1/255: an almost uniform image (every pixel value within 0.015 of -mean/std), so its
   edits read the source through the VAE reference alone. --edit-vl-input authors reproduces that input.
15. --loss sft / dpo (flow_grpo's online SFT and DPO) sample with a deterministic --sampler where flow_grpo samples its
   SDE at noise level 0.7 (only the clean samples train). They train at sigmas interpolated between the rollout
   schedule's at logit-normal positions, where flow_grpo indexes its 1000-step training grid (the same sigmas at the
   schedule's own points). DPO leaves a group of equal rewards out; flow_grpo pairs its samples 1 and 0 there.
16. --loss dgpo: its micro-batches hold whole groups on one process, where Flow-Factory splits a group over GPUs and
   sums its preference across them (the same loss); its training sigmas are shared by a micro-batch, not by the
   whole step, and its group noise is drawn per micro-batch from the run's seed, not from the prompt's id.
"""
import argparse
import inspect
import math

import numpy as np
import torch

import data
import distributed
import diversity
import flags
import losses
import models
import policy as policy_mod
import regularizers
import rewards
import run as run_mod
import sde
from distributed import RANK, WORLD, print0
from flags import FRACTION, NONNEG_INT, POSITIVE, POSITIVE_INT, SEED, bounded
from policy import Policy
from presets import GUIDANCE_EMBEDDED, LOSS_PRESETS, PRESETS, preset
from run import Run, check_rm_types, check_sources, mean_stats, setup_or_exit


def main(argv=None, *, on_step=None):
    """Train: SAMPLING -> REWARDS -> ADVANTAGES -> TRAINING -> LOG/EVAL/SAVE per step. on_step(info) is called after
    each step is logged (bench.py times the model's calls there)."""
    p, args = parse_args(argv)
    loss = losses.LOSSES[args.loss]
    per_rank = check_args(p, args, WORLD)
    device = distributed.init()
    torch.manual_seed(args.seed + RANK)  # per-rank seed for anything not explicitly seeded below
    np.random.seed(args.seed + RANK)
    print_totals(args, loss, per_rank)
    run = Run(args, device, on_step)  # refuses a used --out without --resume / --overwrite; verifies checkpoints
    prompts, held_out = load_prompt_sets(args)
    reward_fn = setup_or_exit(rewards.build_reward, args.reward, device=device,
                              **{name: getattr(args, name) for name in rewards.option_defaults()})  # reward flags
    setup_or_exit(diversity.featurizer, args.diversity, args.diversity_path, device)  # its weights, or one line
    policy = setup_or_exit(Policy, args, device, old_copy=bool(loss.old_copy and loss.old_copy(vars(args))),
                           sampling_copy=bool(loss.sampling_copy and loss.sampling_copy(vars(args))))
    setup_or_exit(models.latent_shape, policy.pipe, args.resolution, num_frames=args.num_frames)  # one line if not
    cache_prompts(policy, args, prompts, held_out)  # each prompt encoded once; --offload-text-encoders
    sigmas = setup_or_exit(models.sigmas, policy.pipe, args.num_steps, args.resolution, shift=args.shift)  # [T+1]
    if not run.start(policy, held_out, reward_fn):  # resumed a run that is already done
        return distributed.finish()
    for step in range(run.step, args.steps):
        run.lap()
        # ===================================================================== SAMPLING
        batch, pending = sample(policy, loss, args, prompts, sigmas, step, reward_fn, run)
        # ===================================================================== REWARDS
        got = run.wait_for_rewards(pending, step)
        info = {"skip_reason": got.skip} if got.skip else {}
        if not got.skip:
            # ================================================================= ADVANTAGES
            adv, info = advantages(got, loss, args, step, per_rank, batch, run.carry)
            # ================================================================= TRAINING
            info |= train_on_batch(policy, loss, batch, adv, sigmas, args, step, run)
        # ===================================================================== LOG / EVAL / SAVE
        run.log(step + 1, info, batch, got)
        if run.checkpoint_or_stop(step + 1):
            break
    run.finish()


# ----------------------------------------------------------------------------- SAMPLING
def sample(policy, loss, args, prompts, sigmas, step, reward_fn, run):
    """This rank's rollouts of the step -> (batch, pending rewards). batch: latents [n, N, ...] (the forward process
    keeps only the clean sample: [n, 1, ...]), log_probs [n, K], means [n, K, ...], stds [n, K], steps [n, K] (each
    sample's trained steps), embeds {k: [n, ...]}, prompts, images; pending: one
    [(future of the reward, prompts)] per rollout batch, scored while the next is sampled."""
    texts, metadata = prompts
    prompt_ids = data.step_prompt_ids(len(texts), step, prompts_per_step=args.prompts_per_step, seed=args.seed,
                                      shuffle=not args.no_shuffle)
    my_ids, my_groups = data.rank_samples(prompt_ids, group_size=args.group_size, rank=RANK, world_size=WORLD)
    unique = sorted(set(my_ids))  # each prompt encoded once, then one row per sample
    sample_guidance, train_guidance = guidance_scales(args)
    embeds = models.encode_prompts(policy.pipe, [texts[i] for i in unique], negative_prompt=args.negative_prompt,
                                   guidance_scale=max(sample_guidance, train_guidance, reference_guidance(loss, args)),
                                   max_sequence_length=args.max_sequence_length, resolution=args.resolution,
                                   images=[data.source_images(metadata[i]) for i in unique])  # edits: references
    row = torch.tensor([unique.index(i) for i in my_ids])
    embeds = {k: v[row.to(v.device)] for k, v in embeds.items()}  # [n, ...]
    batch = dict(embeds=embeds, prompts=[texts[i] for i in my_ids], trajectories=[])
    pending, size = [], args.sample_batch_size
    policy.transformer.eval()
    with rollout_weights(policy, loss, step, args):  # NFT: train_nft_sd3.py L640
        for b in range(len(my_ids) // size):
            idx = slice(b * size, (b + 1) * size)
            gen = data.seeded(args.seed, step, RANK, b)  # resumable noise
            x = starting_noise(policy.pipe, args, step, my_groups[idx], gen).to(policy.device)
            if loss.process == "forward":  # a deterministic solver, only the clean sample kept
                rollout = dict(solver=args.sampler)
            else:  # the stochastic, trained steps; --sde-window fast draws them per rollout batch (Fast)
                draw = (RANK, b) if args.sde_window == "fast" else ()  # Fast: a window per rollout batch
                rollout = dict(sde_steps=sde.sde_steps(args.num_steps, **window_kwargs(args, step, draw)),
                               kind=args.sde, eta=args.eta, generator=gen, flash=args.flash,
                               flash_ratio=args.flash_ratio)
            traj, images = models.generate(policy.pipe, x, sigmas, {k: v[idx] for k, v in embeds.items()},
                                           guidance_scale=sample_guidance, autocast=policy.autocast, **rollout)
            batch["trajectories"].append(traj)
            pending.append((run.submit(reward_fn, images, batch["prompts"][idx], [metadata[i] for i in my_ids[idx]]),
                            batch["prompts"][idx]))
            batch.setdefault("images", []).append(images)  # for the sample grid
    trajs, batch["images"] = batch.pop("trajectories"), torch.cat(batch["images"])  # uint8 [n, H, W, 3]
    batch.update({k: torch.cat([t[k] for t in trajs]) for k in ("latents", "log_probs", "means", "stds")
                  if k in trajs[0]})
    if loss.process == "reverse":
        steps = torch.cat([t["steps"].expand(len(t["latents"]), -1) for t in trajs])  # [n, K]
        batch["steps"] = steps.to(policy.device)  # beside the latents it indexes
    return batch, pending


def cache_prompts(policy, args, prompts, held_out):
    """The prompt-embedding cache (models.prompt_cache): with --offload-text-encoders every training and held-out
    prompt without source images is encoded ahead and the text encoders leave the GPU."""
    texts = [t for part in (prompts, held_out) for t, m in zip(*part) if not (m or {}).get(data.SOURCE_KEY)]
    line = setup_or_exit(models.prompt_cache, policy.pipe, args.prompt_cache_gb, offload=args.offload_text_encoders,
                         texts=texts, guidance_scales=(*guidance_scales(args), args.guidance_scale,
                                                       reference_guidance(losses.LOSSES[args.loss], args)),
                         negative_prompt=args.negative_prompt, max_sequence_length=args.max_sequence_length)
    if line:
        print0(line)


def samples_with_old(loss, step, args):
    """Whether step's rollouts run the old copy (loss.samples_with_old: a bool, or a function of the step and flags)."""
    use = loss.samples_with_old
    return bool(use(step, **vars(args)) if callable(use) else use)


def rollout_weights(policy, loss, step, args):
    """Context, without gradients: the weights step's rollouts run, the loss's own sampling copy (Loss.sampling_copy),
    the old copy (samples_with_old) or the trained weights."""
    if policy.copies.get("sampling") is not None:
        return policy.frozen("sampling")
    return policy.frozen("old") if samples_with_old(loss, step, args) else torch.no_grad()


def reference_guidance(loss, args):
    """The base model's guidance in the training forward: the loss's own (Loss.reference_guidance) or the training
    forward's."""
    return loss.reference_guidance(vars(args)) if loss.reference_guidance else guidance_scales(args)[1]


def starting_noise(pipe, args, step, group_ids, generator):
    """x at sigma = 1 for one rollout batch, [len(group_ids), ...]. With --same-noise-per-group every sample of a
    group starts from one x_T drawn from (seed, step, group): the same on every rank that holds part of the group
    and after a resume (MixGRPO draws one per GPU, which holds whole groups there); `generator` then draws
    only the SDE noise, which still differs from sample to sample."""
    size = dict(resolution=args.resolution, num_frames=args.num_frames)
    if not args.same_noise_per_group:
        return models.initial_noise(pipe, len(group_ids), generator=generator, **size)
    return torch.cat([models.initial_noise(pipe, 1, generator=data.seeded(args.seed, step, -1, g), **size)
                      for g in group_ids])


def window_kwargs(args, step, draw=()):
    """sde.sde_steps' arguments at `step`; `draw` (rank, rollout batch) picks the batch's own fast window."""
    return dict(window=args.sde_window, iteration=step, timestep_fraction=args.timestep_fraction,
                window_size=args.window_size, window_range=args.window_range, stride=args.window_stride,
                iters_per_window=args.iters_per_window, roll_back=args.roll_back, seed=(args.seed, *draw))


def guidance_scales(args):
    """(sampling, training forward) guidance: the training forward drops CFG unless --train-cfg (FLUX.1-dev's
    embedded guidance is part of the model, always)."""
    return args.guidance_scale, args.guidance_scale if (args.train_cfg or args.model in GUIDANCE_EMBEDDED) else 1.0


# ----------------------------------------------------------------------------- ADVANTAGES
def advantages(got, loss, args, step, per_rank, batch, carry):
    """Group-relative advantages over every rank's rewards (each group normalised over all its members, shaped by the
    regularizers the flags turn on, their state in `carry`), then this rank's slice -> ({adv [per_rank], ids: the
    samples to train, rank_weight}, the step's reward statistics)."""
    device = got.dropped.device
    all_rewards = distributed.all_gather_cat(got.scores[args.reward_key].to(device))  # [samples]
    groups = torch.arange(args.prompts_per_step, device=device).repeat_interleave(args.group_size)  # [samples]
    keep = ~got.dropped[groups]  # [samples]; at least one group (a step without any is skipped)
    all_adv, info = torch.zeros_like(all_rewards), {}
    if args.reward_combine == "advantage":  # each reward normalised in its group, their advantages summed (MixGRPO)
        spec = dict(rewards.parse_spec(args.reward))
        parts = {name: distributed.all_gather_cat(got.scores[name].to(device))[keep] for name in spec}  # [kept]
        all_adv[keep], combined = losses.combined_advantages(parts, spec, groups[keep], global_std=args.global_std,
                                                             clip=args.adv_clip)
        info.update({f"reward/{k}": v for k, v in combined.items() if not k.endswith("_mean")})  # std, share
    else:  # the loss's rule: group-relative advantages, or its own (the best of each group, its best-worst pair)
        all_adv[keep] = loss.advantages(all_rewards[keep], groups[keep], global_std=args.global_std,
                                        clip=args.adv_clip)
    mine = slice(RANK * per_rank, (RANK + 1) * per_rank)
    info |= regularizers.shape_advantages(all_adv, keep, groups, all_rewards, got.scores, batch, args, carry, mine)
    # Samples with advantage 0 (saturated groups, dropped groups) carry no policy gradient and leave the update
    # (departure 4); each rank keeps its micro-batch count and trains its kept samples in smaller micro-batches.
    # The forward-process losses train every sample of the kept groups, as their references (departure 8).
    n_micro, gen = per_rank // args.train_batch_size, data.seeded(args.seed, step, RANK, 2)
    ids = trained_ids(loss, all_adv[mine], keep[mine], n_micro, gen, args.group_size)
    counts = distributed.all_gather_cat(torch.tensor([len(ids)], device=device))  # [WORLD]
    info.update(reward_mean=all_rewards[keep].mean().item(),
                reward_std=all_rewards[keep].std().item() if keep.sum() > 1 else 0.0,
                dropped_groups=int(got.dropped.sum()), zero_adv_fraction=(all_adv == 0).float().mean().item())
    for name, value in got.scores.items():  # every component, and the total where it is not the trained key
        if name != "reward" or args.reward_key != "reward":
            key = f"reward/{name}_mean" if name != "reward" else "reward/total_mean"
            info[key] = torch.nanmean(distributed.all_gather_cat(value.to(device))).item()
    # DDP averages the ranks' gradients: weighting each rank by its share makes the step the mean over all samples.
    return dict(adv=all_adv[mine], ids=ids, rank_weight=WORLD * len(ids) / counts.sum().item()), info


def trained_ids(loss, adv, keep, n_micro, generator, group_size):
    """This rank's trained samples, in the loss's units: [n] samples, [P, 2] (chosen, rejected) pairs, or [groups, G]
    whole groups (check_args: whole groups on each rank). adv, keep: this rank's advantages and kept samples."""
    if loss.unit == "pair":
        return trained_pairs(adv, n_micro, generator)
    if loss.unit == "group":
        return torch.arange(len(adv)).reshape(-1, group_size)
    return trained_samples(keep.float() if loss.process == "forward" else adv, n_micro, generator)


def trained_samples(adv, n_micro, generator):
    """Indices of this rank's samples that the update trains: those with a nonzero advantage, as Flow-GRPO's
    train_sd3.py keeps (its `mask = advantages.abs().sum(dim=1) != 0` block), topped up with randomly drawn
    advantage-0 samples to a multiple of n_micro, at least n_micro, as it does (to num_batches_per_epoch). Every
    rank then runs its n_micro micro-batches (the same forwards and backwards everywhere, as FSDP and DDP need),
    each of len / n_micro samples. Returns an int64 CPU tensor."""
    adv = adv.cpu()
    live, zero = torch.nonzero(adv != 0).flatten(), torch.nonzero(adv == 0).flatten()
    size = max(1, math.ceil(len(live) / n_micro))  # size * n_micro <= len(adv): enough zeros to top up
    return torch.cat([live, zero[torch.randperm(len(zero), generator=generator)[:size * n_micro - len(live)]]])


def trained_pairs(adv, n_micro, generator):
    """The (chosen, rejected) pairs of this rank's samples for Loss.unit "pair": [P, 2] int64 CPU indices of its
    +1 and -1 samples, group by group (whole groups per rank: check_args), topped up to a multiple of n_micro (at
    least n_micro) with randomly drawn copies of its pairs, as flow_grpo's train_sd3_dpo.py pads its pairs to the
    process count (L801-815); a rank without a pair trains filler pairs of advantage-0 samples, which the loss
    weights 0."""
    adv = adv.cpu()
    pairs = torch.stack([torch.nonzero(adv > 0).flatten(), torch.nonzero(adv < 0).flatten()], dim=1)  # in group order
    if len(pairs) == 0:
        zero = torch.nonzero(adv == 0).flatten()
        return zero[torch.randperm(len(zero), generator=generator)[:2 * n_micro]].reshape(n_micro, 2)
    extra = max(n_micro, math.ceil(len(pairs) / n_micro) * n_micro) - len(pairs)
    return torch.cat([pairs, pairs[torch.randint(len(pairs), (extra,), generator=generator)]])


# ----------------------------------------------------------------------------- TRAINING
def train_on_batch(policy, loss, batch, adv, sigmas, args, step, run):
    """--updates-per-batch passes over the trained samples, each in --minibatches optimizer steps of micro-batches;
    one loss term per micro-batch and trained step (or training sigma), built by reverse_terms / forward_terms and
    scored by loss.fn. Then the on-policy check (departure 2) and the old copy's decay; the regularizers act before
    the first forward, before each optimizer step and at the end. -> the step's statistics."""
    policy.model.train()
    train_guidance = guidance_scales(args)[1]
    hyper, state = regularizers.before_training(policy, vars(args), args, run.carry, step)  # before any forward
    n_micro = len(batch["prompts"]) // args.train_batch_size  # micro-batches per pass, the same on every rank
    stats, optim_steps, failed = {}, 0, {"overflow": 0, "skipped": 0}
    on_cpu = [adv["ids"][torch.randperm(len(adv["ids"]), generator=data.seeded(args.seed, step, RANK, u, 1))]
              for u in range(args.updates_per_batch)]  # the trained samples' order in each pass, also on the
    orders = [o.to(policy.device) for o in on_cpu]  # device: CPU indices into GPU tensors would copy them over (and
    # wait) at every indexing; the CPU order indexes the prompt masks, which stay on the CPU (embed_rows)

    def micro_batches(update, m):  # the micro-batches of optimizer step (update, m): (device ids, the same on the CPU)
        micros = list(zip(*(o.split(len(adv["ids"]) // n_micro) for o in (orders[update], on_cpu[update]))))
        micros = micros[m * n_micro // args.minibatches:(m + 1) * n_micro // args.minibatches]  # n_micro in a pass
        return [(ids.reshape(-1), rows.reshape(-1)) for ids, rows in micros]  # pairs and groups ([units, width]):
        # each unit's samples in a row

    old_stats = {}  # (update, m, i) -> [n, b]: the forward-process statistic of later optimizer steps (departure 10)
    if loss.old_stat is not None and args.updates_per_batch * args.minibatches > 1:
        old_stats = frozen_stats(policy, loss, batch, sigmas, micro_batches, args, step)
    for update in range(args.updates_per_batch):
        for m in range(args.minibatches):
            micro = micro_batches(update, m)
            n_terms, done = len(micro) * n_trained(loss, batch, args), 0
            for i, (ids, rows) in enumerate(micro):
                sub = embed_rows(batch["embeds"], ids, rows)
                terms = reverse_terms(policy, batch, ids, sub, adv["adv"][ids], sigmas, args) \
                    if loss.process == "reverse" else forward_terms(policy, loss, batch, ids, sub, adv["adv"][ids],
                                                                    sigmas, args, (step, update, m, i), old_stats)
                for x, sigma, complete in terms:  # one trained step (or sigma) of every sample of the micro-batch
                    policy.sync_gradients(last=done == n_terms - 1)
                    t = complete(policy.velocity(x, sigma, sub, train_guidance, train=True))
                    value, info = loss.fn(t, **hyper)
                    policy.backward(value * adv["rank_weight"] / n_terms)  # the mean over all trained samples
                    done += 1
                    first = optim_steps == 0 and update == 0  # the weights the batch was sampled with
                    if first and loss.process == "reverse":  # on-policy: ratio 1 (departure 2)
                        log_ratio = (t["log_prob"].detach() - t["old_log_prob"]).abs().max()
                        info["first_ratio_dev"] = log_ratio.exp().double() - 1
                        if "ratio_max" in info:  # the loss's own ratio (GRPO-Guard's RatioNorm one)
                            info["first_clip_dev"] = torch.maximum(info["ratio_max"].double() - 1,
                                                                   1 - info["ratio_min"].double())
                    elif not first and "ratio_mean" in info:  # the ratio that moves: off-policy updates
                        info.update(off_policy_ratio_mean=info["ratio_mean"], off_policy_clipfrac=info["clipfrac"])
                    info["loss"] = value.detach()
                    for key, val in info.items():  # 0-dim tensors, fetched once per step (host_stats)
                        stats.setdefault(key, []).append(val)
            regularizers.before_optimizer_step(state, stats, n_terms, args)
            status, grad_norm = policy.step()  # one optimizer step per minibatch; a non-finite gradient skips it
            if status != "ok":
                failed[status] += 1
                continue
            optim_steps += 1
            stats.setdefault("grad_norm", []).append(grad_norm)
    info = after_update(policy, loss, batch, host_stats(stats), optim_steps, failed, args, run)
    return regularizers.after_training(info, hyper, state, args, run.carry, policy.device)


def host_stats(stats):
    """{name: [0-dim tensors or floats]} -> {name: [floats]}: the values on each device fetched in one transfer, the
    step's one wait for the GPU instead of one per statistic and trained term."""
    by_device = {}
    for values in stats.values():
        for v in values:
            if torch.is_tensor(v):
                by_device.setdefault(v.device, []).append(v)
    fetched = {device: iter(torch.stack([v.detach().double() for v in vs]).tolist())
               for device, vs in by_device.items()}
    return {k: [next(fetched[v.device]) if torch.is_tensor(v) else float(v) for v in values]
            for k, values in stats.items()}


def reverse_terms(policy, batch, ids, sub, adv, sigmas, args):
    """The trained sampler steps of micro-batch `ids`, the j-th of every sample at a time: its input x and sigma, and
    complete(v), the step's tensors for the loss from the current velocity v (losses.py, "the algorithms"): the
    stored transition scored by sde.sde_step, and with --kl-beta the frozen reference's mean of it (policy.frozen)."""
    train_guidance = guidance_scales(args)[1]
    step = dict(kind=args.sde, eta=args.eta, sigma_max=sigmas[1].item())  # sigmas[1] stands in for s = 1, as in rollout
    gate = batch["kl_gate"][ids] if "kl_gate" in batch else None  # [b]: --gardo-gate's samples whose KL counts
    on_device = sigmas.to(batch["latents"].device)  # indexed by the steps k, which live there
    for j in range(batch["steps"].shape[1]):
        k = batch["steps"][ids, j]  # [b]: each sample's j-th trained step
        x, x_next = batch["latents"][ids, k], batch["latents"][ids, k + 1]  # [b, ...]: its stored transition
        sigma, sigma_next = on_device[k], on_device[k + 1]  # [b]
        ref = {}
        if args.kl_beta > 0:  # the frozen reference, before the training forward: the base (the adapter off), or
            with policy.frozen("reference"):  # GARDO's snapshot, exchanged in place with weights a graph would hold
                v_ref = policy.velocity(x, sigma, sub, train_guidance)
            ref["ref_mean"] = sde.sde_step(v_ref, x, sigma, sigma_next, prev_sample=x_next, **step).mean

        def complete(v):  # called before the generator moves on: x, sigma, ... are this step's
            out = sde.sde_step(v, x, sigma, sigma_next, prev_sample=x_next, **step)
            return dict(log_prob=out.log_prob, old_log_prob=batch["log_probs"][ids, j], mean=out.mean,
                        old_mean=batch["means"][ids, j], std=out.std, dt=sigma_next - sigma, adv=adv, sigma=sigma,
                        sigma_next=sigma_next, schedule=sigmas, kl_gate=gate, **ref)
        yield x, sigma, complete


def forward_terms(policy, loss, batch, ids, sub, adv, sigmas, args, key, old_stats):
    """The training sigmas of micro-batch `ids` (key: step, update, minibatch, micro-batch): each clean sample
    re-noised there with fresh noise (renoised), the frozen models' no-grad velocities at every x_t first (the old
    copy's, the base's with --kl-beta: each set up once per micro-batch), then per sigma its input and complete(v)."""
    fp, train_guidance, frozen = renoised(loss, batch, ids, sigmas, args, key), guidance_scales(args)[1], {}
    old = policy.copies["old"] is not None and loss.old_velocity  # the loss reads the old copy's velocity
    reference = args.kl_beta > 0 or bool(loss.reference and loss.reference(vars(args)))  # the base model's velocity
    for name, needed in (("old", old), ("reference", reference)):
        if needed:
            guidance = reference_guidance(loss, args) if name == "reference" else train_guidance
            with policy.frozen(name):
                frozen[name] = [policy.velocity(x, fp["s"][:, j], sub, guidance) for j, x in enumerate(fp["x_t"])]
    old_stat = old_stats.get(key[1:])  # [n, b] on the optimizer steps after the batch's first, else None
    gate = batch["kl_gate"][ids] if "kl_gate" in batch else None  # [b]: --gardo-gate's samples whose KL counts
    for j, x_t in enumerate(fp["x_t"]):
        def complete(v):
            return dict(v=v, x_t=x_t, x0=fp["x0"], noise=fp["noise"][j], sigma=fp["s"][:, j], adv=adv, unit=fp["unit"],
                        v_old=frozen["old"][j] if "old" in frozen else None,
                        v_ref=frozen["reference"][j] if "reference" in frozen else None,
                        old_stat=None if old_stat is None else old_stat[j], kl_gate=gate)
        yield x_t, fp["s"][:, j], complete


def renoised(loss, batch, ids, sigmas, args, key):
    """Micro-batch `ids`' clean samples x0 [b, ...], its training sigmas s [b, n] of the schedule (loss.times), fresh
    noise [n, b, ...] and the inputs x_t = (1 - s) x0 + s eps (n of [b, ...]), seeded by key (step, update,
    minibatch, micro-batch): the same draws wherever they are needed again."""
    step, update, m, i = key
    gen = data.seeded(args.seed, step, RANK, update, m, i, 2)
    x0 = batch["latents"][ids, -1]  # the clean rollout samples
    times = loss.times(len(ids), gen, **vars(args))  # [b, n]: indices into the schedule, or positions between them
    noise = torch.randn((times.shape[1],) + tuple(x0.shape), generator=gen)
    unit = torch.arange(len(ids)) // unit_width(loss, args)  # [b]: each sample's pair or group in the micro-batch
    first = unit * unit_width(loss, args)  # ... and that unit's first sample, whose draws the unit shares
    times, noise = times[first], noise[:, first]  # Diffusion-DPO's pair (train_sd3_dpo.py L885-899), DGPO's group
    if loss.unit == "group":  # one noise per group for all its sigmas (Flow-Factory dgpo.py L403-445)
        noise = noise[:1].expand_as(noise)
    s, noise = schedule_at(sigmas, times).to(x0.device), noise.to(x0.device)
    return dict(x0=x0, s=s, noise=noise, unit=unit.to(x0.device),
                x_t=[sde.renoise(x0, eps, s[:, j]) for j, eps in enumerate(noise)])


def unit_width(loss, args):
    """Samples per unit of loss.unit: 1, a pair's 2, or a group's --group-size."""
    return {"sample": 1, "pair": 2, "group": args.group_size}[loss.unit]


def schedule_at(sigmas, times):
    """The schedule's sigmas at integer indices, or linearly interpolated at float positions in [0, T)."""
    if not times.is_floating_point():
        return sigmas[times]
    low = times.floor().long()
    return torch.lerp(sigmas[low], sigmas[low + 1], (times - low).to(sigmas.dtype))


def embed_rows(embeds, ids, rows):
    """The micro-batch's rows of the prompt embeddings: `ids` (on the device) for the tensors on the device, `rows`
    (the same on the CPU) for the prompt masks, which stay on the CPU (families.py: read there without a sync)."""
    return {k: v[rows if v.device.type == "cpu" else ids] for k, v in embeds.items()}


def frozen_stats(policy, loss, batch, sigmas, micro_batches, args, step):
    """loss.old_stat under the current weights for every micro-batch of the optimizer steps after the batch's first
    (AWM's old log-probs, departure 10), before the first step moves them: {(update, m, i): [n, b]}."""
    out, train_guidance = {}, guidance_scales(args)[1]
    for update in range(args.updates_per_batch):
        for m in range(args.minibatches):
            for i, (ids, rows) in enumerate(micro_batches(update, m) if (update, m) != (0, 0) else []):
                sub = embed_rows(batch["embeds"], ids, rows)
                fp = renoised(loss, batch, ids, sigmas, args, (step, update, m, i))
                with torch.no_grad():
                    out[update, m, i] = torch.stack([loss.old_stat(dict(
                        v=policy.velocity(x, fp["s"][:, j], sub, train_guidance), x0=fp["x0"], noise=fp["noise"][j],
                        sigma=fp["s"][:, j]), **vars(args)) for j, x in enumerate(fp["x_t"])])
    return out


def after_update(policy, loss, batch, stats, optim_steps, failed, args, run):
    """The step's statistics (means over its micro-steps), the on-policy check of departure 2, the old copy's decay."""
    info = mean_stats({k: v for k, v in stats.items() if not k.startswith("first_")})
    sample_guidance, train_guidance = guidance_scales(args)
    first_ratio_dev = max(stats.get("first_ratio_dev", [0.0]))  # exact forwards must reproduce the rollout's log-probs
    same_forward = policy.amp_dtype is None and train_guidance == sample_guidance
    if distributed.any_rank(same_forward and first_ratio_dev > 1e-3, policy.device):  # all ranks stop together
        raise SystemExit(f"error: ratio on the first update of an on-policy batch is off by {first_ratio_dev:.2e} "
                         "(must be 1): the training forward differs from the rollout's (CFG, dtype or adapter)")
    # The loss's own ratio (GRPO-Guard's RatioNorm one) against the clip: beyond it, rollout/train mismatch alone
    # (e.g. bf16 kernels that differ with the batch shape, 1e-3 on the tiny model) is clipped. Warned once.
    first_clip_dev = max(stats.get("first_clip_dev", [0.0]))
    run.warn_ratio(first_clip_dev, args.clip_range if loss.clip else 0.1,  # FlowDPPO has no clip
                   "--train-cfg is off while sampling uses CFG" if train_guidance != sample_guidance
                   else f"{args.mixed_precision} rounding")
    if getattr(args, "lr_schedule", "constant") != "constant":
        info["lr"] = policy.optimizer.param_groups[0]["lr"]  # the rate of the step's last update
    if policy.copies["old"] is not None:  # old <- d old + (1 - d) current; d from the run's optimizer steps (resumed)
        info["old_decay"] = decay = losses.OLD_DECAYS[args.old_decay](policy.optimizer_steps, **vars(args))
        policy.update_old(decay)
    if policy.copies.get("sampling") is not None:  # the rollouts' own copy, on its own schedule (Loss.sampling_copy)
        info["sampling_decay"] = decay = losses.OLD_DECAYS[args.sampling_decay](policy.optimizer_steps, **vars(args))
        policy.update_old(decay, "sampling")
    if loss.process == "reverse":
        info.update(first_ratio_dev=first_ratio_dev, first_clip_dev=first_clip_dev)
    if failed["overflow"]:  # fp16: the loss scale overflowed and was lowered, not a bad step
        info["fp16_overflows"] = failed["overflow"]
    if failed["skipped"]:
        info.update(skipped=1, skip_reason="non-finite gradient", skipped_updates=failed["skipped"])
    return dict(info, updates=optim_steps, trained_steps=n_trained(loss, batch, args))


def n_trained(loss, batch, args):
    """Loss terms per sample: its trained steps K (reverse process) or training sigmas (forward)."""
    if loss.process == "reverse":
        return batch["steps"].shape[1]
    return loss.times(1, torch.Generator(), **vars(args)).shape[1]


# ----------------------------------------------------------------------------- set-up
def print_totals(args, loss, per_rank):
    """Derived totals, printed once so that a wrong recipe shows here and not at step 3000 (check_args asserts them)."""
    print0(f"{WORLD} processes | {args.prompts_per_step} prompts x {args.group_size} = "
           f"{args.prompts_per_step * args.group_size} samples/step ({per_rank} per GPU, "
           f"{per_rank // args.sample_batch_size} rollout batches of {args.sample_batch_size}) | "
           f"{args.updates_per_batch * args.minibatches} optimizer steps/step"
           + (f" | {args.sampler} rollouts, {n_trained(loss, None, args)} training sigmas per sample"
              if loss.process == "forward" else ""))


def load_prompt_sets(args):
    """((texts, metadata) of --prompts, of --eval-prompts or empty), malformed files refused in one line."""
    keys = dict(input_key=args.input_key, metadata_key=args.metadata_key,  # GenEval rows checked before any model
                check=rewards.rows_check(args.reward, args.geneval_detector, args.reward_combine == "advantage"))
    prompts = setup_or_exit(data.load_prompts, args.prompts, **keys)
    check_rm_types(args.prompts, *prompts)
    held_out = setup_or_exit(data.load_prompts, args.eval_prompts, **keys) if args.eval_prompts else ([], [])
    for path, (_, metadata) in ((args.prompts, prompts), (args.eval_prompts, held_out)):
        check_sources(path, args.model, metadata)  # source images need an edit model, and some models need them
    if [name for name, _ in rewards.parse_spec(args.reward)] == ["ocr"] and \
            (missing := data.ocr_targets_missing(prompts[0])):
        print0(f"warning: {missing} of {len(prompts[0])} prompts in {args.prompts} have no quoted target; "
               "the OCR reward scores them 0")
    return prompts, held_out

def parse_args(argv=None):
    """The flags (add_arguments); unset flags take --model's preset, then the loss's. -> (parser, args)"""
    shown = {name: preset(name) for name in ("shapes", "tiny", "sd3", "flux")}  # --help: each one's value
    p = flags.RecipeParser(description=__doc__.split("\n")[0], fromfile_prefix_chars="@",
                           formatter_class=flags.preset_help(shown, PRESETS["hub"]))
    add_arguments(p)
    args = p.parse_args(argv)
    args.loss = args.loss or preset(args.model).get("loss", "grpo")
    loss = losses.LOSSES[args.loss]
    if loss.process == "forward" and args.sde is not None:  # flags that would be silently ignored
        p.error(f"--sde chooses the stochastic step of the reverse-process losses; --loss {args.loss} samples with a "
                "deterministic --sampler: drop --sde")
    if args.window_range is not None and args.sde_window not in ("fast", "sparse"):
        p.error("--window-range bounds the drawn steps of --sde-window fast or sparse: use one of them, or drop it")
    defaults = dict(preset(args.model), timestep_fraction=1.0)  # the loss's defaults win over the model's
    loss_defaults = dict(loss.defaults, **(loss.hub_defaults if args.model not in PRESETS else {}))
    if args.model in GUIDANCE_EMBEDDED:  # FLUX.1-dev's guidance is a distilled embedding, not CFG: the model's
        loss_defaults.pop("guidance_scale", None)
    defaults.update(loss_defaults)
    defaults.update(LOSS_PRESETS.get((args.model, args.loss), {}))
    for key, value in defaults.items():  # fill what the command line left unset
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.lora_alpha is None:  # a rank given without alpha: scale alpha / rank = 1
        args.lora_alpha = float(args.lora_rank)
    if args.train_cfg is None:
        args.train_cfg = args.guidance_scale > 1 and args.model not in GUIDANCE_EMBEDDED
    if args.kl_beta == 0 and (args.gardo_gate or args.gardo_reference):  # e.g. a GARDO recipe + --kl-beta 0 (a full
        print0("warning: --kl-beta 0 leaves no KL term for --gardo-gate / --gardo-reference to shape: both are off")
        args.gardo_gate, args.gardo_reference = None, False  # fine-tune without a snapshot): nothing to gate or renew
    if args.kl_beta == 0 and args.kl_reference == "start":  # no KL term: no snapshot to keep
        args.kl_reference = "base"
    return p, args


def add_arguments(p):
    """Every flag, grouped as the phases of a step: the sampling and batching here, the rest declared where the code
    that reads it is (models.py, policy.py, data.py, rewards.py, losses.py, run.py); flag types and @recipe files in
    flags.py."""
    models.add_arguments(p)  # the model family, its weights and sizes
    policy_mod.add_arguments(p)  # what trains and how: LoRA or full, precision, sharding; AdamW, clipping, the EMA
    data.add_arguments(p)  # the prompt files
    add_sampling_arguments(p)
    # reward
    p.add_argument("--reward", default=None, help='reward spec: a name or weighted mix, e.g. "ocr=0.8,pickscore=0.2"; '
                   "choices: " + ", ".join(rewards.REWARDS))
    p.add_argument("--reward-key", default="reward",
                   help="which reward entry trains (a component name or the weighted total 'reward')")
    rewards.add_arguments(p)  # the reward options, declared and defaulted in rewards.py
    diversity.add_arguments(p)  # --diversity: feature diversity per step and evaluation
    regularizers.add_arguments(p)  # GARDO's rules, for every loss
    losses.add_arguments(p)  # the loss flags, declared in losses.py: --loss takes choices=LOSSES
    # the update's batching
    p.add_argument("--train-batch-size", type=POSITIVE_INT, default=None, help="samples per training forward, per GPU")
    p.add_argument("--minibatches", type=POSITIVE_INT, default=None, help="optimizer steps per pass over the batch")
    p.add_argument("--updates-per-batch", type=POSITIVE_INT, default=1, help="passes over each sampled batch")
    # the run: its length and seed here; its folder, logs, checkpoints and evaluation in run.py
    p.add_argument("--steps", type=POSITIVE_INT, default=None, help="training steps (each: one sampled batch)")
    p.add_argument("--seed", type=SEED, default=0, help="seed; rank r samples with seed-derived noise per step")
    run_mod.add_arguments(p)


def add_sampling_arguments(p):
    """The rollout: the schedule, guidance, the stochastic step and which steps train, the batch of groups."""
    p.add_argument("--num-steps", type=bounded(int, 2, 1000), default=None,
                   help="denoising steps of a training rollout (at most the 1000 of the training grid)")
    p.add_argument("--shift", type=bounded(float, 0, 100, low_open=True), default=None,
                   help="static time shift of the sigma schedule (default: the model's own schedule, models.sigmas; "
                        "only for models with a static shift: sd3, wan, z-image)")
    p.add_argument("--max-sequence-length", type=POSITIVE_INT, default=None,
                   help="text tokens per prompt (default: the model family's, see models.py)")
    p.add_argument("--guidance-scale", type=POSITIVE, default=None,
                   help="CFG scale (FLUX: distilled guidance value); --loss nft / awm: 1 on CFG models")
    p.add_argument("--negative-prompt", default="", help="negative prompt for CFG")
    p.add_argument("--train-cfg", action=argparse.BooleanOptionalAction, default=None,
                   help="use CFG in the training forward too (default: when sampling uses CFG)")
    p.add_argument("--sde", default=None, choices=["flow", "dance", "cps"],
                   help="stochastic step: Flow-GRPO, DanceGRPO or coefficient-preserving")
    p.add_argument("--eta", type=POSITIVE, default=None, help="noise level of the SDE step")
    p.add_argument("--sde-window", default="all", choices=sde.WINDOWS,
                   help="which steps are stochastic and trained: all, Flow-GRPO-Fast random window, "
                        "MixGRPO sliding window, or FlowDPPO's sparse random steps (one set per step)")
    p.add_argument("--window-size", type=POSITIVE_INT, default=2, help="steps in the fast/mix window")
    p.add_argument("--window-range", type=NONNEG_INT, nargs=2, default=None, metavar=("LO", "HI"),
                   help="--sde-window fast: the window lies in steps LO .. HI - 1 (Flow-GRPO's sde_window_range; "
                        "its start is drawn from LO .. HI - --window-size); sparse: its steps are drawn from them; "
                        "default 0 and --num-steps - 1")
    p.add_argument("--window-stride", type=POSITIVE_INT, default=1, help="steps the mix window slides each time")
    p.add_argument("--iters-per-window", type=POSITIVE_INT, default=25,
                   help="training steps before the mix window slides")
    p.add_argument("--roll-back", action=argparse.BooleanOptionalAction, default=False,
                   help="mix window returns to step 0 after reaching the end")
    p.add_argument("--flash", action=argparse.BooleanOptionalAction, default=False,
                   help="MixGRPO-Flash: second-order solver on a compressed schedule after the window")
    p.add_argument("--flash-ratio", type=FRACTION, default=0.4,
                   help="--flash: the steps after the window are compressed to about this fraction "
                        "(MixGRPO's dpm_post_compress_ratio; sde.flash_grid)")
    p.add_argument("--timestep-fraction", type=FRACTION, default=None,
                   help="fraction of steps trained with --sde-window all; --loss nft: of the schedule's sigmas each "
                        "sample trains at, int(T x fraction); awm: the range its strata cover (default: 1; nft 0.99, "
                        "awm 0.9)")
    p.add_argument("--sampler", default=None, choices=sde.SOLVERS,
                   help="--loss nft / awm: deterministic rollout solver, Euler or DPM-Solver++(2M) (default: dpm2)")
    p.add_argument("--group-size", type=POSITIVE_INT, default=None, help="images per prompt (a group; may span GPUs)")
    p.add_argument("--prompts-per-step", type=POSITIVE_INT, default=None, help="prompts per training step, global")
    p.add_argument("--sample-batch-size", type=POSITIVE_INT, default=None, help="images per rollout forward, per GPU")
    p.add_argument("--same-noise-per-group", action=argparse.BooleanOptionalAction, default=False,
                   help="every image of a prompt's group starts from the same noise x_T (MixGRPO's --init_same_noise; "
                        "Flow-GRPO's same_latent); the SDE noise still differs")


def check_args(p, args, world_size):
    """Refuse flag combinations that cannot work, before any model is loaded."""
    if args.gardo_diversity and args.diversity == "off":
        p.error("--gardo-diversity scales advantages by image-feature distances: choose the features with "
                "--diversity dinov2, clip or pixels")
    if args.diversity == "pixels" and args.diversity_path:
        p.error("--diversity pixels reads the images themselves, no model: drop --diversity-path")
    if args.group_size < 2:  # every loss here is group-relative
        p.error(f"--group-size {args.group_size}: each sample would be its own group mean, so every advantage is 0 and "
                "nothing trains; use --group-size 2 or more")
    samples = args.prompts_per_step * args.group_size  # global samples per step
    if samples % world_size:
        p.error(f"--prompts-per-step x --group-size = {samples} is not divisible by the {world_size} processes")
    per_rank = samples // world_size
    if per_rank % args.sample_batch_size:
        p.error(f"{per_rank} samples per GPU are not divisible by --sample-batch-size {args.sample_batch_size}")
    if per_rank % (args.train_batch_size * args.minibatches):
        p.error(f"{per_rank} samples per GPU are not divisible by --train-batch-size x --minibatches = "
                f"{args.train_batch_size * args.minibatches}")
    if args.train_cfg and args.guidance_scale <= 1:
        p.error("--train-cfg needs CFG at sampling: set --guidance-scale > 1 or drop --train-cfg")
    if args.train_cfg and args.model in GUIDANCE_EMBEDDED:
        p.error("FLUX.1-dev uses a guidance embedding, not CFG: drop --train-cfg")
    loss = losses.LOSSES[args.loss]
    if loss.process == "reverse" and args.sde not in loss.sde_kinds:
        p.error(f"--loss {args.loss} needs a Gaussian transition log-prob, which --sde {args.sde} does not have "
                f"(cps scores -mean(delta^2)): use --sde {' or '.join(loss.sde_kinds)}")
    if args.edit_vl_input != "diffusers" and args.model not in models.families.EDIT_VL_MODELS:
        p.error(f"--edit-vl-input {args.edit_vl_input} changes what Qwen-Image-Edit's VL encoder sees; --model "
                f"{args.model} has no such input: drop the flag or use --model qwen-image-edit")
    if args.eval_every and not args.eval_prompts:
        p.error("--eval-every needs --eval-prompts (a held-out prompt file)")
    # fp16 needs a loss scale whose overflow check agrees across the shards of every rank (FSDP1's ShardedGradScaler);
    # policy.py's GradScaler sees its own shard only. bf16 needs no scale, and Flow-GRPO's FSDP configs use it
    # (config/grpo.py pickscore_qwenimage, counting_qwenimage_edit: mixed_precision "bf16"); the SD3.5 recipes keep
    # the fp16 of its LoRA runs (config/base.py), so a full fine-tune from them adds --mixed-precision bf16.
    if args.fsdp and args.mixed_precision == "fp16":
        p.error("--mixed-precision fp16 needs loss scaling, which is not wired for --fsdp: add --mixed-precision bf16 "
                "after the recipe")
    if args.fsdp and (args.lora_rank > 0 or world_size == 1):
        p.error("--fsdp shards a full fine-tune over processes: use it with --lora-rank 0 under torchrun "
                "--nproc_per_node N > 1 (LoRA runs use DDP)")
    if args.kl_beta > 0 and args.lora_rank == 0 and not args.gardo_reference and args.kl_reference == "base":
        p.error("--kl-beta > 0 with --lora-rank 0 has no base model to anchor the KL (it is the LoRA adapter off): add "
                "--kl-reference start (a snapshot of the starting weights), or set --lora-rank > 0 or --kl-beta 0")
    if args.kl_target > 0 and not args.kl_beta:
        p.error("--kl-target adapts the weight of a KL term: give its starting weight with --kl-beta > 0")
    if args.nft_fm > 0 and "nft_fm" not in inspect.signature(losses.LOSSES[args.loss].fn).parameters:
        p.error(f"--nft-fm adds a flow-matching term to DiffusionNFT's loss, which --loss {args.loss} does not read: "
                "use --loss nft or drop it")
    if args.kl_reference == "start" and args.gardo_reference:
        p.error("--kl-reference start and --gardo-reference are two snapshots as the KL's anchor, one never renewed, "
                "one renewed on GARDO's schedule: pick one")
    if args.gardo_reset_freq < 1 or args.gardo_kl_thres < 0:
        p.error(f"--gardo-reset-freq {args.gardo_reset_freq} / --gardo-kl-thres {args.gardo_kl_thres:g}: a number of "
                "steps >= 1 and a KL >= 0")
    if loss.reference and loss.reference(vars(args)) and args.lora_rank == 0:
        p.error(f"--loss {args.loss} compares with the base model, which is the LoRA adapter disabled: set "
                "--lora-rank > 0, or point the loss's reference at the old copy (its flags: --help)")
    width = unit_width(loss, args)  # a pair or group must sit on one process, whole in each micro-batch
    if loss.unit != "sample" and (per_rank % args.group_size or args.train_batch_size % width):
        p.error(f"--loss {args.loss} trains whole {loss.unit}s of one group's samples: make the {per_rank} samples per "
                f"process a multiple of --group-size {args.group_size} and --train-batch-size a multiple of {width}")
    if args.sampling_decay is not None and not (loss.sampling_copy and loss.sampling_copy(vars(args))):
        p.error(f"--sampling-decay schedules the rollouts' own copy, which --loss {args.loss} does not keep: drop it")
    if loss.advantages is not losses.group_advantages and args.reward_combine == "advantage":
        p.error(f"--loss {args.loss} turns the rewards into its own sample weights: drop --reward-combine advantage")
    if loss.process == "forward":
        if args.sde_window != "all" or args.flash or args.step_loss_weight != "none":
            p.error(f"--sde-window / --flash / --step-loss-weight concern the SDE steps of the reverse-process losses; "
                    f"--loss {args.loss} samples with a deterministic --sampler and trains at re-noised samples: drop "
                    "them")
        try:  # the training sigmas must fit the schedule (one-line errors naming the flags)
            n_trained(loss, None, args)
        except ValueError as e:
            p.error(str(e))
    else:
        if args.sampler is not None or args.old_decay is not None:
            p.error(f"--sampler and --old-decay belong to --loss nft / awm; --loss {args.loss} samples with --sde")
        if args.eta <= 0:
            p.error("--eta must be > 0 for training: with no noise the step is an ODE and has no log-prob")
    try:
        components = [name for name, _ in rewards.parse_spec(args.reward)]  # unknown names fail here, before any model
    except ValueError as e:
        p.error(str(e))
    if args.reward_key != "reward" and args.reward_key not in components and "custom" not in components:
        p.error(f"--reward-key {args.reward_key!r} is not a component of --reward {args.reward!r}")
    for name in args.gardo_gate or []:  # scored beside the trained reward, never trained on
        if name not in components or name == args.reward_key:
            p.error(f"--gardo-gate {name}: name components of --reward {args.reward!r} other than the trained one "
                    f"(--reward-key {args.reward_key}), e.g. --reward ocr=1,aesthetic=0,imagereward=0 --reward-key ocr "
                    "--gardo-gate aesthetic,imagereward")
    if args.reward_combine == "advantage" and args.reward_key != "reward":
        p.error("--reward-combine advantage trains on every component of --reward: drop --reward-key")
    if args.reward_combine == "advantage" and not sum(w for _, w in rewards.parse_spec(args.reward)) > 0:
        p.error(f"--reward-combine advantage divides the weights of --reward {args.reward!r} by their sum (MixGRPO), "
                "which must be positive: give a positive weight")
    if args.lr >= 1:  # Adam moves every weight by about lr a step: the first update overflows the weights
        p.error(f"--lr {args.lr:g}: Adam moves each weight by about --lr per step; use a rate below 1 (the recipes "
                "train LoRA at 1e-4 to 3e-4)")
    if args.lora_rank > 0 and args.lora_alpha <= 0:
        p.error("--lora-alpha must be > 0 with a LoRA adapter (its scale is alpha / rank)")
    multiple = models.RESOLUTION_MULTIPLE.get(args.model)
    sides = args.resolution if isinstance(args.resolution, tuple) else (args.resolution,)
    if multiple and any(side % multiple for side in sides):
        p.error(f"--resolution {args.resolution} must be a multiple of {multiple} for --model {args.model} "
                "(VAE down-sampling x transformer patch)")
    if args.overwrite and args.resume:
        p.error("--overwrite starts the run over and --resume continues it: give one of them")
    # Raises a one-line ValueError naming the window flag when the window does not fit the schedule.
    try:
        sde.sde_steps(args.num_steps, **window_kwargs(args, 0))
    except ValueError as e:
        p.error(str(e))
    return per_rank



if __name__ == "__main__":
    main()
