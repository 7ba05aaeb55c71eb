"""Online RL for flow-matching text-to-image models: Flow-GRPO and its successors; this file is the training loop.

Launch
------
    python train.py                    # CPU: DiffusionNFT on the pretrained shapes model, GenEval prompts (~9 min)
    python train.py --loss grpo                                    # Flow-GRPO (SDE rollouts) on the same
    python train.py --model tiny --loss flowdppo --sde dance       # any loss / sampler on the random CPU model
    python train.py @recipes/shapes_long.args --print-config       # every setting and where it came from, then exit
    torchrun --standalone --nproc_per_node=8 train.py @recipes/sd3_nft_geneval.args   # one node
    torchrun --nnodes 2 --nproc_per_node 8 --node-rank R --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 train.py @recipes/sd3_pickscore_grpo.args      # two nodes (R = 0, 1)
    torchrun --standalone --nproc_per_node=8 --max-restarts 3 train.py @recipes/... --resume auto   # preemptible
    torchrun --standalone --nproc_per_node=8 train.py @recipes/... --lora-rank 0 --kl-beta 0 --mixed-precision bf16 \
        --fsdp                                    # full fine-tune, FSDP2 (no KL reference, no fp16, one trained module)
    python train.py @recipes/wan_ocr_grpo.args                     # the recipes sized for one GPU (their authors'):
    python train.py @recipes/sd3_sft_geneval.args                  # Wan, flow_grpo's online SFT and its online DPO
    python train.py @recipes/sd3_dpo_geneval.args

One step = SAMPLING (rollouts of `--group-size` images for each of `--prompts-per-step` prompts, spread over all
ranks; sde.py) -> REWARDS (scored in a background thread while the next batch samples; rewards.py) -> ADVANTAGES
(group-relative, after gathering every rank's rewards, and GARDO's shaping; advantages.py) -> TRAINING
(`--updates-per-batch` passes of the loss over the trained denoising steps or re-noised samples, in `--minibatches`
optimizer steps; losses.py, with regularizers.py at named points) -> LOG/EVAL/SAVE. main() is those phases, each a
call. The algorithm is chosen in one place, losses.LOSSES (a loss is a function and a
registry line: README, "Adding a loss"); the flags and where each value comes from in config.py; the trained
weights, their optimizer and frozen copies in policy.py; the run's folder, logs, checkpoints, signals and the
reward wait in run.py; ranks and FSDP in distributed.py.

The reverse-process losses (GRPO, GRPO-Guard, FlowDPPO) train on the log-probs of stored SDE transitions
(sde.py). The forward-process losses (DiffusionNFT arXiv:2509.16117, AWM arXiv:2509.25050, online SFT / DPO,
DGPO, CRD) sample with a deterministic solver, keep only the clean samples and train on the flow-matching error at
re-noised points; their "old" float32 copy of the trained weights is soft-updated after each step,
old <- d old + (1 - d) current (`--old-decay`).

Where this departs from the papers and their authors' code, and why: docs/departures.md, numbered as the code
cites them ("departure 4"). The layers, the phases' modules, the registries and where a new loss, reward, model
family or role goes: docs/design.md.
"""
import signal
import sys

if __name__ == "__main__":  # a signal while the libraries import: one line (run.set_up_stop's), no traceback
    for _signum in (signal.SIGINT, signal.SIGTERM):  # run.Run takes both over from its first line
        signal.signal(_signum, lambda n, frame: sys.exit(
            f"error: {'interrupted (Ctrl-C)' if n == signal.SIGINT else 'stopped by SIGTERM'} during start-up, before "
            "the first step: nothing was trained; rerun the same command to start (or continue) the run"))

import math

import numpy as np
import torch

import data
import distributed
import diversity
import losses
import models
import regularizers
import rewards
import roles
import sde
from advantages import gardo_gate, step_advantages
from config import (check_args, forward_samples, guidance_scales, n_trained, parse_args, report, unit_width,
                    window_kwargs)
from distributed import RANK, WORLD, print0
from policy import Policy
from run import Run, check_rm_types, check_sources, mean_stats, setup_or_exit


def main(argv=None, *, on_step=None):
    """Train: SAMPLING -> REWARDS -> ADVANTAGES -> TRAINING -> LOG/EVAL/SAVE per step. on_step(info) is called after
    each step is logged (scripts/bench.py times the model's calls there)."""
    p, args = parse_args(argv)
    loss = losses.LOSSES[args.loss]
    per_rank = check_args(p, args, WORLD)
    if args.print_config:  # every setting and where it came from, before anything loads
        return print0(report(p, args))
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
                           sampling_copy=bool(loss.sampling_copy and loss.sampling_copy(vars(args))), roles=loss.roles)
    policy.pipe.guidance_scale_2 = args.guidance_scale_2  # Wan 2.2's low-noise expert (families/wan.py velocity)
    policy.pipe.guidance_scale_audio = args.audio_guidance_scale  # LTX-2's soundtrack (families/ltx2.py velocity)
    policy.pipe.forward_samples = forward_samples(args, reference_guidance(loss, args))  # the video token bound's batch
    setup_or_exit(models.latent_shape, policy.pipe, args.resolution, num_frames=args.num_frames)  # one line if not
    cache_prompts(policy, args, prompts, held_out)  # each prompt encoded once; --offload-text-encoders
    sigmas = setup_or_exit(models.sigmas, policy.pipe, args.num_steps, args.resolution, shift=args.shift,
                           num_frames=args.num_frames)  # [T+1]
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
    batch = dict(embeds=embeds, prompts=[texts[i] for i in my_ids], trajectories=[], groups=torch.tensor(my_groups),
                 metadata=[metadata[i] for i in my_ids])  # the distillation losses' teacher and group per sample
    pending, size, preempted = [], args.sample_batch_size, False
    policy.train(False)
    with rollout_weights(policy, loss, step, args), policy.gathered():  # NFT: train_nft_sd3.py L640; FSDP: one gather
        for b in range(len(my_ids) // size):
            if run.signalled():  # preempted: the step is redone on resume, nothing of it is kept
                preempted = True
                break
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
    if preempted:  # saved once the rollouts' copy (exchanged in place with the trained weights) is back in its place
        run.stop_in_sampling(step)
    trajs, batch["images"] = batch.pop("trajectories"), torch.cat(batch["images"])  # uint8 [n, H, W, 3]
    batch.update({k: torch.cat([t[k] for t in trajs]) for k in ("latents", "log_probs", "means", "stds")
                  if k in trajs[0]})
    if loss.process == "reverse":
        steps = torch.cat([t["steps"].expand(len(t["latents"]), -1) for t in trajs])  # [n, K]
        batch["steps"] = steps.to(policy.device)  # beside the latents it indexes
        batch["host_steps"] = steps  # and on the CPU, for the forwards' sigmas (models.velocity: Wan 2.2 routes there)
    return batch, pending


def cache_prompts(policy, args, prompts, held_out):
    """The prompt-embedding cache (models.prompt_cache): with --offload-text-encoders every training and held-out
    prompt without source images is encoded ahead and the text encoders leave the GPU."""
    texts = [t for part in (prompts, held_out) for t, m in zip(*part) if not (m or {}).get(data.SOURCE_KEY)]
    line = setup_or_exit(models.prompt_cache, policy.pipe, args.prompt_cache_gb, offload=args.offload_text_encoders,
                         texts=texts, guidance_scales=(*guidance_scales(args), args.guidance_scale,
                                                       reference_guidance(losses.LOSSES[args.loss], args)),
                         negative_prompt=args.negative_prompt, max_sequence_length=args.max_sequence_length)
    if getattr(policy.pipe, "prompt_store", None) is not None:  # a damaged row mid-run: a warning, then its encode
        policy.pipe.prompt_store.encode_damaged = True
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
    return loss.reference_guidance(**vars(args)) if loss.reference_guidance else guidance_scales(args)[1]


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


# ----------------------------------------------------------------------------- ADVANTAGES
def advantages(got, loss, args, step, per_rank, batch, carry):
    """Every rank's rewards gathered, their advantages (advantages.step_advantages: the loss's rule or MixGRPO's mix,
    GARDO's diversity weight; GARDO's gate with its share carried in `carry`), then this rank's slice -> ({adv
    [per_rank], ids: the samples to train, rank_weight, kl_gate: [per_rank] bool or None}, the step's reward
    statistics)."""
    device = got.dropped.device
    scores = {name: distributed.all_gather_cat(v.to(device)) for name, v in got.scores.items()}  # each [samples]
    groups = torch.arange(args.prompts_per_step, device=device).repeat_interleave(args.group_size)  # [samples]
    keep = ~got.dropped[groups]  # [samples]; at least one group (a step without any is skipped)
    all_rewards, mix, features = scores[args.reward_key], None, None
    if args.reward_combine == "advantage":  # each component's own group advantage, their weighted sum (MixGRPO)
        spec = dict(rewards.parse_spec(args.reward))
        mix = ({name: scores[name] for name in spec}, spec)
    if args.gardo_diversity:  # image features of this rank's samples; run.log's feature diversity reads them too
        batch["features"] = diversity.featurizer(args.diversity, args.diversity_path, device)(batch["images"])  # [n, D]
        features = distributed.all_gather_cat(batch["features"].to(device))  # [samples, D]
    all_adv, info = step_advantages(all_rewards, groups, keep, rule=loss.advantages, global_std=args.global_std,
                                    clip=args.adv_clip, mix=mix, features=features)
    mine, gate = slice(RANK * per_rank, (RANK + 1) * per_rank), None
    if args.gardo_gate:  # the KL only where the auxiliary rewards rank a sample well above the trained one
        flagged, carry["gate_fraction"], carry["gate_history"] = gardo_gate(
            all_rewards, [scores[name] for name in args.gardo_gate], keep, carry.get("gate_fraction"),
            carry.get("gate_history", []))
        gate = flagged[mine]  # [per_rank]: the loss's KL term reads it (losses.gated_kl)
        info.update(gardo_fraction=carry["gate_fraction"], gardo_flagged=flagged[keep].float().mean().item())
    # Samples with advantage 0 (saturated groups, dropped groups) carry no policy gradient and leave the update
    # (departure 4); each rank keeps its micro-batch count and trains its kept samples in smaller micro-batches.
    # The forward-process losses train every sample of the kept groups, as their references (departure 8).
    n_micro, gen = per_rank // args.train_batch_size, data.seeded(args.seed, step, RANK, 2)
    ids = trained_ids(loss, all_adv[mine], keep[mine], n_micro, gen, args.group_size)
    counts = distributed.all_gather_cat(torch.tensor([len(ids)], device=device))  # [WORLD]
    info.update(reward_mean=all_rewards[keep].mean().item(),
                reward_std=all_rewards[keep].std().item() if keep.sum() > 1 else 0.0,
                dropped_groups=int(got.dropped.sum()), zero_adv_fraction=(all_adv == 0).float().mean().item())
    for name, value in scores.items():  # every component, and the total where it is not the trained key
        if name != "reward" or args.reward_key != "reward":
            info[f"reward/{name}_mean" if name != "reward" else "reward/total_mean"] = torch.nanmean(value).item()
    # DDP averages the ranks' gradients: weighting each rank by its share makes the step the mean over all samples.
    return dict(adv=all_adv[mine], ids=ids, rank_weight=WORLD * len(ids) / counts.sum().item(), kl_gate=gate), info


def trained_ids(loss, adv, keep, n_micro, generator, group_size):
    """This rank's trained samples, in the loss's units: [n] samples, [P, 2] (chosen, rejected) pairs, or [groups, G]
    whole groups (check_args: whole groups on each rank). adv, keep: this rank's advantages and kept samples."""
    if loss.unit == "pair":
        return trained_pairs(adv, n_micro, generator)
    if loss.unit == "group":
        return torch.arange(len(adv)).reshape(-1, group_size)
    return trained_samples(keep.float() if loss.process == "forward" or loss.terms else adv, n_micro, generator)


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
    policy.train()
    train_guidance = guidance_scales(args)[1]
    hyper, state = regularizers.before_training(policy, loss.hyper(vars(args)), args, run.carry, step)  # its flags
    n_micro = len(batch["prompts"]) // args.train_batch_size  # micro-batches per pass, the same on every rank
    # Where an optimizer step (a role's too) comes before the step's last micro-batch, the state the step starts
    # from, so that a preemption can go back to it (policy.snapshot: None where too large; a signal then finishes it).
    snapshot = policy.snapshot() if args.updates_per_batch * args.minibatches > 1 or loss.roles else None
    stats = roles.train_roles(policy, loss, batch, adv, sigmas, args, step, train_guidance)  # the critic's update
    optim_steps, failed = 0, {"overflow": 0, "skipped": 0}
    # The trained samples' order in each pass, on the CPU and on the device: CPU indices into GPU tensors would copy
    # them over (and wait) at every indexing; the CPU order indexes the prompt masks, which stay there (embed_rows).
    on_cpu = [adv["ids"][torch.randperm(len(adv["ids"]), generator=data.seeded(args.seed, step, RANK, u, 1))]
              for u in range(args.updates_per_batch)]
    orders = [o.to(policy.device) for o in on_cpu]

    def micro_batches(update, m):  # the micro-batches of optimizer step (update, m): (device ids, the same on the CPU)
        micros = list(zip(*(o.split(len(adv["ids"]) // n_micro) for o in (orders[update], on_cpu[update]))))
        micros = micros[m * n_micro // args.minibatches:(m + 1) * n_micro // args.minibatches]  # n_micro in a pass
        return [(ids.reshape(-1), rows.reshape(-1)) for ids, rows in micros]  # [units, width]: a unit's in a row

    old_stats = {}  # (update, m, i) -> [n, b]: the forward-process statistic of later optimizer steps (departure 10)
    if loss.old_stat is not None and args.updates_per_batch * args.minibatches > 1:
        old_stats = frozen_stats(policy, loss, batch, sigmas, micro_batches, args, step)
    for update in range(args.updates_per_batch):
        for m in range(args.minibatches):
            micro = micro_batches(update, m)
            n_terms, done = len(micro) * n_trained(loss, batch, args), 0
            stepped = update or m  # an optimizer step of this step came before
            for i, (ids, rows) in enumerate(micro):
                sub = embed_rows(batch["embeds"], ids, rows)
                gate = None if adv.get("kl_gate") is None else adv["kl_gate"][ids]  # [b]: --gardo-gate's samples
                terms = roles.TERMS[loss.terms](policy, loss, batch, ids, rows, sub, adv["adv"][ids], sigmas, args,
                                                (step, update, m, i), train_guidance) if loss.terms else \
                    reverse_terms(policy, batch, ids, sub, adv["adv"][ids], sigmas, args, rows, gate) \
                    if loss.process == "reverse" else forward_terms(policy, loss, batch, ids, sub, adv["adv"][ids],
                                                                    sigmas, args, (step, update, m, i), old_stats, gate)
                for x, sigma, complete in terms:  # one trained step (or sigma) of every sample of the micro-batch
                    if (not stepped or snapshot is not None) and run.signalled():  # preempted: within a forward
                        run.stop_in_training(step, snapshot)  # the step's start (unchanged where nothing stepped)
                    policy.sync_gradients(last=done == n_terms - 1)
                    t = complete(policy.velocity(x, sigma, sub, train_guidance, train=True))
                    value, info = loss.fn(t, **hyper)
                    policy.backward(value * adv["rank_weight"] / n_terms)  # the mean over all trained samples
                    done += 1
                    first = optim_steps == 0 and update == 0  # the weights the batch was sampled with
                    if first and "old_log_prob" in t:  # on-policy: ratio 1 (departure 2)
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
    stats |= regularizers.statistics(state, args)  # fetched with the loss's, in one transfer
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


def reverse_terms(policy, batch, ids, sub, adv, sigmas, args, rows=None, gate=None):
    """The trained sampler steps of micro-batch `ids`, the j-th of every sample at a time: its input x and sigma, and
    complete(v), the step's tensors for the loss from the current velocity v (losses.py, "the algorithms"): the
    stored transition scored by sde.sde_step, and with --kl-beta the frozen reference's mean of it (policy.frozen).
    rows: `ids` on the CPU; with the rollout's host_steps, the forwards take their sigma from the host. gate [b] bool:
    --gardo-gate's samples whose KL counts (the advantage phase's kl_gate), or None."""
    train_guidance = guidance_scales(args)[1]
    step = dict(kind=args.sde, eta=args.eta, sigma_max=sigmas[1].item())  # sigmas[1] stands in for s = 1, as in rollout
    on_device = sigmas.to(batch["latents"].device)  # indexed by the steps k, which live there
    for j in range(batch["steps"].shape[1]):
        k = batch["steps"][ids, j]  # [b]: each sample's j-th trained step
        x, x_next = batch["latents"][ids, k], batch["latents"][ids, k + 1]  # [b, ...]: its stored transition
        sigma, sigma_next = on_device[k], on_device[k + 1]  # [b]
        at = sigma if rows is None or "host_steps" not in batch else sigmas[batch["host_steps"][rows, j]]  # [b]
        ref = {}
        if args.kl_beta > 0:  # the frozen reference, before the training forward: the base (the adapter off), or
            with policy.frozen("reference"):  # GARDO's snapshot, exchanged in place with weights a graph would hold
                v_ref = policy.velocity(x, at, sub, train_guidance)
            ref["ref_mean"] = sde.sde_step(v_ref, x, sigma, sigma_next, prev_sample=x_next, **step).mean

        def complete(v):  # called before the generator moves on: x, sigma, ... are this step's
            out = sde.sde_step(v, x, sigma, sigma_next, prev_sample=x_next, **step)
            return dict(log_prob=out.log_prob, old_log_prob=batch["log_probs"][ids, j], mean=out.mean,
                        old_mean=batch["means"][ids, j], std=out.std, dt=sigma_next - sigma, adv=adv, sigma=sigma,
                        sigma_next=sigma_next, schedule=sigmas, kl_gate=gate, **ref)
        yield x, at, complete


def forward_terms(policy, loss, batch, ids, sub, adv, sigmas, args, key, old_stats, gate=None):
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
                frozen[name] = [policy.velocity(x, fp["s_host"][:, j], sub, guidance)
                                for j, x in enumerate(fp["x_t"])]
    old_stat = old_stats.get(key[1:])  # [n, b] on the optimizer steps after the batch's first, else None
    for j, x_t in enumerate(fp["x_t"]):
        def complete(v):
            return dict(v=v, x_t=x_t, x0=fp["x0"], noise=fp["noise"][j], sigma=fp["s"][:, j], adv=adv, unit=fp["unit"],
                        v_old=frozen["old"][j] if "old" in frozen else None,
                        v_ref=frozen["reference"][j] if "reference" in frozen else None,
                        old_stat=None if old_stat is None else old_stat[j], kl_gate=gate)
        yield x_t, fp["s_host"][:, j], complete


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
    host = schedule_at(sigmas, times)  # [b, n] on the CPU, where the forwards take it (Wan 2.2 routes there)
    s, noise = host.to(x0.device), noise.to(x0.device)
    return dict(x0=x0, s=s, s_host=host, noise=noise, unit=unit.to(x0.device),
                x_t=[sde.renoise(x0, eps, s[:, j]) for j, eps in enumerate(noise)])


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
                        v=policy.velocity(x, fp["s_host"][:, j], sub, train_guidance), x0=fp["x0"],
                        noise=fp["noise"][j], sigma=fp["s"][:, j]), **losses.keywords(loss.old_stat, vars(args)))
                        for j, x in enumerate(fp["x_t"])])
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
                check=rewards.rows_check(args.reward, args.geneval_detector, args.reward_combine == "advantage",
                                         model=args.model, sound=models.MODELS[args.model].sound))
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

if __name__ == "__main__":
    main()
