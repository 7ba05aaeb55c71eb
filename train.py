"""Online RL for flow-matching text-to-image models: Flow-GRPO and its successors, in one script.

Launch
------
    python train.py                    # CPU: RL of the pretrained shapes model on GenEval-style prompts (~2 min)
    python train.py --loss nft                                     # DiffusionNFT (forward process, ODE rollouts)
    python train.py --model tiny --loss flowdppo --sde dance       # any loss / sampler on the random CPU model
    torchrun --standalone --nproc_per_node=8 train.py @recipes/sd3_nft_geneval.args   # DiffusionNFT, GenEval
    torchrun --standalone --nproc_per_node=8 train.py @recipes/sd3_ocr_grpo.args      # one node
    torchrun --nnodes 2 --nproc_per_node 8 --node-rank R --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 train.py @recipes/sd3_pickscore_grpo.args      # two nodes (R = 0, 1)
    torchrun --standalone --nproc_per_node=8 --max-restarts 3 train.py @recipes/... --resume auto   # preemptible
    torchrun --standalone --nproc_per_node=8 train.py @recipes/... --lora-rank 0 --fsdp   # full fine-tune, FSDP2

One step = SAMPLING (SDE rollouts of `--group-size` images for each of `--prompts-per-step` prompts,
spread over all ranks) -> REWARDS -> ADVANTAGES (group-relative, after gathering every rank's rewards)
-> TRAINING (`--updates-per-batch` passes of a clipped / masked importance-ratio loss over the trained
denoising steps) -> LOG/SAVE. The plumbing lives elsewhere: ranks and FSDP in distributed.py, run folders
and checkpoints in checkpoints.py; this file is the algorithm and its flags.

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
3. The last denoising step (sigma ~0.01 -> 0) is always an ODE step and never trained: its transition
   std is ~0 and its log-prob would dominate the ratio. Flow-GRPO's timestep_fraction 0.99 leaves it out
   too (int(10 x 0.99) = 9 of 10 steps); only a Flow-GRPO-Fast window could reach it, which its default
   sde_window_range (0, T) allows and --window-range refuses.
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
   forwards that need it (models.swapped), where DiffusionNFT and AWM keep a second peft adapter: one
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
"""
import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import checkpoints
import data
import distributed
import eval as evaluation
import losses
import models
import rewards
import sde
from distributed import RANK, WORLD, is_main, print0

# Settings that differ between the CPU model and hub models; anything given on the command line wins.
# Hub settings are Flow-GRPO's SD3.5-M setup (arXiv:2505.05470, Sec. 5.1 and its config/grpo.py).
PRESETS = {
    "tiny": dict(resolution=64, num_steps=10, guidance_scale=1.0, eta=0.7, group_size=8, prompts_per_step=4,
                 sample_batch_size=16, train_batch_size=16, minibatches=1, lora_rank=0, lr=3e-3,
                 clip_range=0.2, kl_beta=0.0, steps=60, mixed_precision="no", prompts="prompts/tiny.txt",
                 reward="jpeg_compressibility", global_std=False, log_images_every=20, input_key="input",
                 eval_every=0, eval_steps=40, sde="flow", ema_decay=0.0),
    "hub": dict(resolution=512, num_steps=10, guidance_scale=4.5, eta=0.7, group_size=24, prompts_per_step=48,
                sample_batch_size=8, train_batch_size=8, minibatches=2, lora_rank=32, lora_alpha=64, lr=3e-4,
                clip_range=1e-4, kl_beta=0.04, steps=10000, mixed_precision="bf16",
                prompts="prompts/ocr_train.txt", reward="ocr", global_std=True, log_images_every=50,
                input_key="input", eval_every=0, eval_steps=40, sde="flow", ema_decay=0.0),
}
# The shapes world (shapes.py): its pretrained 32 px model learns to follow GenEval-style prompts in minutes on a CPU.
# Full fine-tune; coefficient-preserving steps (their rollouts score near the ODE's, Flow-GRPO's step at eta 0.7 well
# below), lr 1e-4 (2e-4 rose faster on seed 0 and collapsed on seed 2) and an evaluated EMA (README, "The shapes
# world").
PRESETS["shapes"] = dict(PRESETS["tiny"], resolution=32, prompts="prompts/shapes_train.jsonl",
                         eval_prompts="prompts/shapes_test.jsonl", input_key="prompt", reward="geneval",
                         geneval_detector="shapes", sde="cps", lr=1e-4, ema_decay=0.95, steps=40, eval_every=20,
                         eval_steps=10, log_images_every=20)
PRESETS["tiny-flux"] = dict(PRESETS["tiny"], guidance_scale=3.5)
PRESETS["tiny-wan"] = dict(PRESETS["tiny"], num_frames=5)  # 5 frames: 2 latent frames
PRESETS["tiny-qwen-image"] = PRESETS["tiny-flux2-klein"] = PRESETS["tiny-z-image"] = PRESETS["tiny"]
FLUX_HUB = dict(guidance_scale=3.5, num_steps=16)  # FLUX.1-dev: distilled guidance, no CFG (MixGRPO uses 16 steps)
GUIDANCE_EMBEDDED = ("flux", "tiny-flux")  # FLUX.1-dev takes its guidance scale through an embedding, not CFG
FORWARD_LOSSES = ("nft", "awm")  # trained on the forward (noising) process: no SDE, no log-prob of a sampler step
LOSSES = ("grpo", "guard", "flowdppo") + FORWARD_LOSSES
# Defaults a loss sets over the model's (the command line still wins). The forward-process losses are CFG-free
# (guidance 1 on CFG models; FLUX.1 keeps its distilled guidance), sample with a deterministic solver, and train
# at 9 of 10 (NFT, config/base.py L87) or 6 strata of 90 % (AWM, config/dgx_awm.py L56-60) of the schedule.
# On hub models their KL weights are their authors' (DiffusionNFT config/nft.py L24, AWM config/dgx_awm.py L55).
LOSS_PRESETS = {
    "nft": dict(sampler="dpm2", timestep_fraction=0.99, old_decay="nft", guidance_scale=1.0),
    "awm": dict(sampler="dpm2", timestep_fraction=0.9, old_decay="awm", guidance_scale=1.0, clip_range=1.0),
}
LOSS_HUB_PRESETS = {"nft": dict(kl_beta=1e-4), "awm": dict(kl_beta=1e-3)}
# The decay d(k) of the old policy after k optimizer steps, old <- d old + (1 - d) current (DiffusionNFT
# train_nft_sd3.py return_decay L169-189, applied L1034-1039; AWM train_sd3_awm.py L1409-1419).
OLD_DECAYS = {
    "nft": lambda k: min(0.001 * k, 0.5),  # DiffusionNFT decay_type 1 (GenEval, PickScore)
    "nft-ocr": lambda k: 0.0 if k < 75 else min(0.0075 * (k - 75), 0.999),  # decay_type 2 (OCR): more off-policy
    "awm": lambda k: min(0.3, 0.001 * k),  # AWM's EMA-KL anchor (kl_ema_decay 0.3, 'linear')
    "on-policy": lambda k: 0.0,  # decay_type 0: the old copy is the weights of the step before
}


def preset(model):
    """The defaults --model fills in: its own preset, else the hub preset (with FLUX's guidance and steps)."""
    return PRESETS.get(model, dict(PRESETS["hub"], **(FLUX_HUB if model == "flux" else {})))


def parse_args(argv=None):
    """The flags, grouped as the phases of a step (flag types and the recipe-file parser are at the end of the file);
    unset flags take --model's preset."""
    p = RecipeParser(description=__doc__.split("\n")[0], fromfile_prefix_chars="@", formatter_class=HelpFormatter)
    # model
    p.add_argument("--model", default="shapes", choices=list(models.MODELS),
                   help="model family (shapes: pretrained, learns on a CPU in minutes; tiny: random, the fastest)")
    p.add_argument("--model-path", default=None,
                   help="hub id or local folder of the pipeline (default: the family's hub id)")
    p.add_argument("--resolution", type=resolution_arg, default=None,
                   help="image side in pixels, or HEIGHTxWIDTH (sd3, wan, z-image)")
    p.add_argument("--num-frames", type=POSITIVE_INT, default=None,
                   help="video models (wan): frames per sample, 4 k + 1 (default: the pipeline's 81)")
    p.add_argument("--fps", type=POSITIVE_INT, default=16,
                   help="video models: frames per second of the saved sample GIFs")
    p.add_argument("--lora-rank", type=NONNEG_INT, default=None, help="LoRA rank; 0 trains the full transformer")
    p.add_argument("--lora-alpha", type=NONNEG, default=None,
                   help="LoRA alpha (scale = alpha / rank; default: the preset's, else the rank)")
    p.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16"],
                   help="autocast dtype of model forwards; the SDE step and log-probs are always float32")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute transformer activations in the backward pass (less memory, ~30%% more compute)")
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer")
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=False,
                   help="full fine-tune (--lora-rank 0) under torchrun: shard weights, gradients and Adam state over "
                        "the processes (FSDP2) instead of replicating them (DDP)")
    # data
    p.add_argument("--prompts", default=None, help="training prompts: .txt (one per line) or .jsonl")
    p.add_argument("--eval-prompts", default=None, help="held-out prompts for --eval-every (default: none)")
    p.add_argument("--input-key", default=None, help="JSONL key of the prompt")
    p.add_argument("--metadata-key", default="metadata",
                   help="JSONL key of the per-sample metadata (rm_type, ...); '' takes the whole row (GenEval's files)")
    p.add_argument("--no-shuffle", action="store_true",
                   help="keep file order instead of a seeded permutation per epoch")
    # sampling
    p.add_argument("--num-steps", type=bounded(int, 2, 1000), default=None,
                   help="denoising steps of a training rollout (at most the 1000 of the training grid)")
    p.add_argument("--shift", type=POSITIVE, default=None,
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
    p.add_argument("--sde-window", default="all", choices=["all", "fast", "mix"],
                   help="which steps are stochastic and trained: all, Flow-GRPO-Fast random window, "
                        "MixGRPO sliding window")
    p.add_argument("--window-size", type=POSITIVE_INT, default=2, help="steps in the fast/mix window")
    p.add_argument("--window-range", type=NONNEG_INT, nargs=2, default=None, metavar=("LO", "HI"),
                   help="--sde-window fast: the window lies in steps LO .. HI - 1 (Flow-GRPO's sde_window_range; "
                        "its start is drawn from LO .. HI - --window-size); default 0 and --num-steps - 1")
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
    # reward
    p.add_argument("--reward", default=None, help='reward spec: a name or weighted mix, e.g. "ocr=0.8,pickscore=0.2"; '
                   "choices: " + ", ".join(rewards.REWARDS))
    p.add_argument("--reward-key", default="reward",
                   help="which reward entry trains (a component name or the weighted total 'reward')")
    rewards.add_arguments(p)  # the reward options, declared and defaulted in rewards.py
    # loss
    p.add_argument("--loss", default="grpo", choices=LOSSES,
                   help="GRPO (PPO clip), GRPO-Guard (RatioNorm), FlowDPPO (KL-ADV mask); forward process: "
                        "DiffusionNFT, Advantage Weighted Matching")
    p.add_argument("--clip-range", type=POSITIVE, default=None,
                   help="PPO clip range of the ratio (log-probs are means over latent dims, hence ~1e-4 on hub models; "
                        "--loss awm: 1)")
    p.add_argument("--adv-clip", type=POSITIVE, default=5.0, help="advantages clipped to +-this")
    p.add_argument("--kl-beta", type=NONNEG, default=None,
                   help="weight of the KL to the frozen base model (0: no reference forward; --loss nft / awm: "
                        "mean squared velocity difference, 1e-4 / 1e-3 on hub models)")
    p.add_argument("--kl-form", default="flow-grpo", choices=["flow-grpo", "exact"],
                   help="the KL penalty's scale: flow-grpo = the exact Gaussian KL x |dt| per step, as Flow-GRPO's "
                        "code computes it; the default because every published --kl-beta (0.04 OCR/GenEval, 0.01 "
                        "PickScore) was tuned on it; exact = the KL itself, about 1/|dt| (~10x at 10 steps) larger "
                        "for the same beta (--sde cps: both are its exact form, as in Flow-GRPO)")
    p.add_argument("--kl-mask-threshold", type=POSITIVE, default=1e-5,
                   help="FlowDPPO: KL above which a term pushing the ratio further is masked")
    p.add_argument("--global-std", action=argparse.BooleanOptionalAction, default=None,
                   help="normalise advantages by the batch-wide reward std instead of each group's")
    p.add_argument("--old-decay", default=None, choices=list(OLD_DECAYS),
                   help="--loss nft / awm: schedule of the old copy's decay d, old <- d old + (1 - d) current after "
                        "each step (default: nft, awm)")
    p.add_argument("--nft-beta", type=POSITIVE, default=1.0,
                   help="DiffusionNFT's beta: v+ = beta v + (1 - beta) v_old (its OCR setup: 0.1)")
    p.add_argument("--nft-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="DiffusionNFT: normalise each sample's x0 error by its own mean absolute error")
    p.add_argument("--awm-weighting", default="ghuber", choices=losses.AWM_WEIGHTINGS,
                   help="AWM: weighting of the flow-matching error in its surrogate log-likelihood")
    p.add_argument("--ghuber-power", type=POSITIVE, default=0.25, help="AWM: the power p of the ghuber weighting")
    p.add_argument("--train-timesteps", type=POSITIVE_INT, default=6,
                   help="AWM: stratified schedule sigmas per micro-batch (one forward + backward each)")
    p.add_argument("--awm-timesteps", default="discrete_wo_init", choices=sde.AWM_TIMESTEPS,
                   help="AWM: strata over schedule indices 1.. (never sigma = 1) or 0..")
    p.add_argument("--ema-kl-beta", type=NONNEG, default=1.0,
                   help="AWM: weight of the velocity-space KL to the old copy (its EMA-KL anchor; 0: none)")
    # optim
    p.add_argument("--lr", type=POSITIVE, default=None, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=NONNEG, default=1e-4, help="AdamW weight decay")
    p.add_argument("--max-grad-norm", type=POSITIVE, default=1.0, help="gradient clipping norm")
    p.add_argument("--train-batch-size", type=POSITIVE_INT, default=None, help="samples per training forward, per GPU")
    p.add_argument("--minibatches", type=POSITIVE_INT, default=None, help="optimizer steps per pass over the batch")
    p.add_argument("--updates-per-batch", type=POSITIVE_INT, default=1, help="passes over each sampled batch")
    p.add_argument("--ema-decay", type=bounded(float, 0, 1, high_open=True), default=None,
                   help="EMA of the trained weights (0: off), warmed up as flow_grpo/ema.py: the decay after n "
                        "optimizer steps is min((1 + n) / (10 + n), this). Evaluation (--eval-every) and the "
                        "exported lora/ use the EMA; trainable.safetensors keeps the live weights to resume from")
    p.add_argument("--ema-every", type=POSITIVE_INT, default=1,
                   help="update the EMA after optimizer steps n with (n + 1) %% this == 0, as flow_grpo/ema.py")
    p.add_argument("--ema-repeat", type=POSITIVE_INT, default=1,
                   help="apply the decay this many times per update: Flow-GRPO steps its EMA after every micro-batch, "
                        "so each due update repeats once per accumulated micro-batch (2 in its 32-GPU configs, 4 in "
                        "GRPO-Guard's 16-GPU ones)")
    # logging and checkpoints
    p.add_argument("--steps", type=POSITIVE_INT, default=None, help="training steps (each: one sampled batch)")
    p.add_argument("--seed", type=SEED, default=0, help="seed; rank r samples with seed-derived noise per step")
    p.add_argument("--out", default="runs/default", help="run folder: args.json, metrics.jsonl, samples/, checkpoints/")
    p.add_argument("--save-every", type=NONNEG_INT, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=POSITIVE_INT, default=3, help="checkpoints kept in --out/checkpoints")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run in an --out that already holds one, deleting its run files first")
    p.add_argument("--resume", default=None,
                   help="checkpoint folder, run folder, or 'auto' (the newest checkpoint in --out that verifies, if "
                        "any; default: a fresh run)")
    p.add_argument("--eval-every", type=NONNEG_INT, default=None,
                   help="steps between ODE evaluations on --eval-prompts (0: off)")
    p.add_argument("--eval-steps", type=POSITIVE_INT, default=None, help="ODE steps of an evaluation")
    p.add_argument("--log-images-every", type=NONNEG_INT, default=None,
                   help="steps between saved sample grids (0: never)")
    p.add_argument("--max-bad-steps", type=POSITIVE_INT, default=5,
                   help="stop after this many consecutive skipped (non-finite) steps")
    p.add_argument("--wandb", action="store_true", help="also log to Weights & Biases")
    try:
        args = p.parse_args(argv)
    except UnicodeDecodeError as e:
        p.error(f"a recipe file is not UTF-8 text ({e.reason} at byte {e.start}); re-save it as UTF-8")
    except RecursionError:
        p.error("a recipe file includes itself (an @file line that leads back to it)")

    defaults = dict(preset(args.model), timestep_fraction=1.0)
    if args.loss in LOSS_PRESETS:  # the loss's defaults win over the model's
        loss_defaults = dict(LOSS_PRESETS[args.loss], **(LOSS_HUB_PRESETS[args.loss] if args.model not in PRESETS
                                                          else {}))
        if args.model in GUIDANCE_EMBEDDED:  # FLUX.1-dev's guidance is a distilled embedding, not CFG: the model's
            loss_defaults.pop("guidance_scale")
        defaults.update(loss_defaults)
    for key, value in defaults.items():  # fill what the command line left unset
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.lora_alpha is None:  # a rank given without alpha: scale alpha / rank = 1
        args.lora_alpha = float(args.lora_rank)
    if args.train_cfg is None:
        args.train_cfg = args.guidance_scale > 1 and args.model not in GUIDANCE_EMBEDDED
    return p, args


def window_kwargs(args, step, draw=()):
    """sde.sde_steps' arguments at `step`; `draw` (rank, rollout batch) picks the batch's own fast window."""
    return dict(window=args.sde_window, iteration=step, timestep_fraction=args.timestep_fraction,
                window_size=args.window_size, window_range=args.window_range, stride=args.window_stride,
                iters_per_window=args.iters_per_window, roll_back=args.roll_back, seed=(args.seed, *draw))


def guidance_scales(args):
    """(sampling, training forward) guidance: the training forward drops CFG unless --train-cfg (FLUX.1-dev's
    embedded guidance is part of the model, always)."""
    return args.guidance_scale, args.guidance_scale if (args.train_cfg or args.model in GUIDANCE_EMBEDDED) else 1.0


def seeded(*parts):
    """A CPU generator seeded from integers (seed, step, rank, ...): the same numbers after a resume."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % 2**63
    return torch.Generator().manual_seed(seed)


def starting_noise(pipe, args, step, group_ids, generator):
    """x at sigma = 1 for one rollout batch, [len(group_ids), ...]. With --same-noise-per-group every sample of a
    group starts from one x_T drawn from (seed, step, group): the same on every rank that holds part of the group
    and after a resume (MixGRPO draws one per GPU, which holds whole groups there); `generator` then draws
    only the SDE noise, which still differs from sample to sample."""
    size = dict(resolution=args.resolution, num_frames=args.num_frames)
    if not args.same_noise_per_group:
        return models.initial_noise(pipe, len(group_ids), generator=generator, **size)
    return torch.cat([models.initial_noise(pipe, 1, generator=seeded(args.seed, step, -1, g), **size)
                      for g in group_ids])


def main(argv=None):
    p, args = parse_args(argv)
    per_rank, components = check_args(p, args, WORLD)
    device = distributed.init()
    torch.manual_seed(args.seed + RANK)  # per-rank seed for anything not explicitly seeded below
    np.random.seed(args.seed + RANK)
    amp_dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.mixed_precision]
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext

    # Derived totals, printed and checked once so a wrong recipe fails here and not at step 3000.
    samples = args.prompts_per_step * args.group_size  # global samples per step
    num_sample_batches = per_rank // args.sample_batch_size
    n_micro = per_rank // args.train_batch_size  # training micro-batches per update, the same on every rank
    forward_process = args.loss in FORWARD_LOSSES
    print0(f"{WORLD} processes | {args.prompts_per_step} prompts x {args.group_size} = {samples} samples/step "
           f"({per_rank} per GPU, {num_sample_batches} rollout batches of {args.sample_batch_size}) | "
           f"{args.updates_per_batch * args.minibatches} optimizer steps/step"
           + (f" | {args.sampler} rollouts, {forward_times(args)} training sigmas per sample"
              if forward_process else ""))

    resume_from = checkpoints.prepare(args)  # refuses a used --out without --resume / --overwrite; verifies checkpoints
    prompt_keys = dict(input_key=args.input_key, metadata_key=args.metadata_key)
    prompts, metadata = setup_or_exit(data.load_prompts, args.prompts, **prompt_keys)
    check_rm_types(args.prompts, prompts, metadata)
    eval_prompts, eval_meta = ([], [])
    if args.eval_prompts:
        eval_prompts, eval_meta = setup_or_exit(data.load_prompts, args.eval_prompts, **prompt_keys)
    if components == ["ocr"] and (missing := data.ocr_targets_missing(prompts)):
        print0(f"warning: {missing} of {len(prompts)} prompts in {args.prompts} have no quoted target; "
               "the OCR reward scores them 0")
    reward_fn = setup_or_exit(rewards.build_reward, args.reward, device=device,
                              **{name: getattr(args, name) for name in rewards.option_defaults()})  # reward flags

    # The policy: the pipeline, its trainable weights (LoRA adapter or all), the wrapper the training forward calls.
    pipe, model, trainable, optimizer, copies = build_policy(args, device, amp_dtype)
    # fp16 (as Flow-GRPO's configs, through accelerate) needs loss scaling: the tiny gradients of mean-reduced
    # log-probs underflow its range (26 % of the gradient norm lost on the tiny model). Disabled: every call a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    transformer = pipe.transformer

    start_step, bad_in_a_row, optimizer_steps = 0, 0, 0  # optimizer_steps: all of the run's, for the EMA
    if resume_from:
        state, saved = checkpoints.load(resume_from, args, trainable, optimizer,
                                        fsdp_model=transformer if args.fsdp else None)
        start_step, bad_in_a_row = state["step"], state.get("bad_in_a_row", 0)
        optimizer_steps = state.get("optimizer_steps", 0)
        for name in copies:  # the EMA and the old policy continue where they were (if this run keeps them)
            if copies[name] is not None and name in saved:
                copies[name] = saved[name]
        print0(f"resumed from {resume_from} at step {start_step}")
        if start_step >= args.steps:
            print0(f"the run is already at step {start_step} of --steps {args.steps}: nothing to train; "
                   "raise --steps to continue it")
            return distributed.finish()
        checkpoints.trim_metrics(args.out, start_step)  # a killed run's rows after the checkpoint are redone
    ema, old = copies["ema"], copies["old"]  # {name: float32 tensor} or None
    checkpoints.start_run(args)
    wandb_run = None
    if args.wandb and is_main:
        import wandb
        wandb_run = wandb.init(config=vars(args), dir=args.out, resume="allow")

    stop = {"signal": None}  # preemption: finish the step on every rank, save, exit 0

    def on_signal(signum, frame):
        stop["signal"] = signal.Signals(signum).name
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    setup_or_exit(models.latent_shape, pipe, args.resolution, num_frames=args.num_frames)  # one line if they don't fit
    sigmas = setup_or_exit(models.sigmas, pipe, args.num_steps, args.resolution, shift=args.shift)  # [T+1], 1 -> 0
    sigma_max = sigmas[1].item()  # stands in for s = 1 in 1 - s (sde.py (3)), as in the rollout
    sample_guidance, train_guidance = guidance_scales(args)
    reward_pool = ThreadPoolExecutor(max_workers=1)  # scores batch b while batch b+1 is sampled
    step, ratio_warned = start_step, False
    from tqdm import tqdm
    # A live bar on rank 0's terminal; none in log files, where the per-step lines already say everything.
    bar = tqdm(total=args.steps, initial=start_step, disable=not (is_main and sys.stderr.isatty()), dynamic_ncols=True)

    def log_metrics(info):  # one line per step in metrics.jsonl (and wandb), rank 0
        bar.update(1)
        checkpoints.append_metrics(args.out, info)
        if wandb_run:
            wandb_run.log(info, step=info["step"])

    def run_state():  # what a checkpoint's state.json carries besides the step
        return dict(bad_in_a_row=bad_in_a_row, optimizer_steps=optimizer_steps)

    def check_and_checkpoint(info):  # stop on too many bad steps; save when due or preempted; True = end the run
        if bad_in_a_row >= args.max_bad_steps:
            raise SystemExit(f"error: {bad_in_a_row} consecutive steps were skipped (last: {info.get('skip_reason')}); "
                             "fix the reward, or lower --lr for non-finite gradients (see --max-bad-steps)")
        stopping = distributed.any_rank(stop["signal"] is not None, device)
        if (args.save_every and step % args.save_every == 0) or step == args.steps or stopping:
            checkpoints.write(args, step, pipe, trainable, optimizer, copies, device, run_state())
        if stopping:
            print0(f"stopped by {stop['signal'] or 'a signal on another rank'} after step {step}; "
                   f"checkpoint saved, continue with --resume auto --out {args.out}")
        return stopping

    def evaluate_held_out(step):
        """Held-out ODE samples, fixed noise, scored into eval.jsonl. Under FSDP every forward is collective: all
        ranks sample, rank 0 scores. With --ema-decay the EMA weights are evaluated, as Flow-GRPO does."""
        if not (is_main or args.fsdp):
            return
        pipe.transformer.eval()
        with checkpoints.ema_weights(dict(trainable), ema):
            eval_images = evaluation.sample_images(pipe, eval_prompts, resolution=args.resolution,
                                                   num_steps=args.eval_steps, guidance_scale=sample_guidance,
                                                   seed=args.seed, device=device, batch_size=args.sample_batch_size,
                                                   negative_prompt=args.negative_prompt, shift=args.shift,
                                                   num_frames=args.num_frames,
                                                   max_sequence_length=args.max_sequence_length)
        if is_main:
            eval_scores = evaluation.score(reward_fn, eval_images, eval_prompts, eval_meta)
            evaluation.append_scores(os.path.join(args.out, "eval.jsonl"), step, eval_scores)
            bar.write(f"eval  {step:5d} | " + evaluation.summary_line(eval_scores))

    if args.eval_every and start_step == 0:  # the model before training, as Flow-GRPO evaluates at epoch 0
        evaluate_held_out(0)
    trained_here = 0  # steps of this process that updated the weights
    while step < args.steps:
        t0 = time.time()
        info = {"step": step + 1}
        # ===================================================================== SAMPLING
        prompt_ids = data.step_prompt_ids(len(prompts), step, prompts_per_step=args.prompts_per_step,
                                          seed=args.seed, shuffle=not args.no_shuffle)
        my_prompt_ids, my_groups = data.rank_samples(prompt_ids, group_size=args.group_size, rank=RANK,
                                                     world_size=WORLD)
        my_prompts = [prompts[i] for i in my_prompt_ids]
        my_meta = [metadata[i] for i in my_prompt_ids]
        unique = sorted(set(my_prompt_ids))
        embeds = models.encode_prompts(pipe, [prompts[i] for i in unique], negative_prompt=args.negative_prompt,
                                       guidance_scale=max(sample_guidance, train_guidance),
                                       max_sequence_length=args.max_sequence_length)
        row = torch.tensor([unique.index(i) for i in my_prompt_ids])
        embeds = {k: v[row.to(v.device)] for k, v in embeds.items()}  # one row per sample, [per_rank, ...]
        pipe.transformer.eval()
        batches, futures = [], []
        # DiffusionNFT samples with the old policy (train_nft_sd3.py L640); the other losses with the weights.
        with models.swapped(trainable, old) if args.loss == "nft" else contextlib.nullcontext():
            for b in range(num_sample_batches):
                idx = slice(b * args.sample_batch_size, (b + 1) * args.sample_batch_size)
                gen = seeded(args.seed, step, RANK, b)  # resumable noise
                x = starting_noise(pipe, args, step, my_groups[idx], gen).to(device)
                sub = {k: v[idx] for k, v in embeds.items()}

                def velocity(x_, s_, sub=sub):  # what the sampler calls; CFG lives inside
                    return models.velocity(pipe, x_, s_, sub, guidance_scale=sample_guidance)
                with autocast():
                    if forward_process:  # a deterministic solver; only the clean sample is kept: [b, 1, ...]
                        traj = {"latents": sde.ode_sample(velocity, x, sigmas, solver=args.sampler)[:, None]}
                    else:  # the stochastic, trained steps; --sde-window fast draws them per rollout batch (Fast)
                        trained_steps = sde.sde_steps(args.num_steps, **window_kwargs(args, step, (RANK, b)))
                        traj = sde.rollout(velocity, x, sigmas, sde_steps=trained_steps, kind=args.sde, eta=args.eta,
                                           generator=gen, flash=args.flash, flash_ratio=args.flash_ratio)
                    images = models.decode(pipe, traj["latents"][:, -1])  # uint8 [b, H, W, 3] (video [b, F, H, W, 3])
                batches.append(traj)
                futures.append(reward_pool.submit(reward_fn, images, my_prompts[idx], my_meta[idx]))
                if b == 0 and is_main:
                    first_images = images
        # latents [n, T+1, ...] (forward process: [n, 1, ...]), log_probs [n, K], means [n, K, ...], stds [n, K],
        # steps [n, K] (each sample's)
        batch = {k: torch.cat([t[k] for t in batches]) for k in ("latents", "log_probs", "means", "stds")
                 if k in batches[0]}
        if forward_process:
            n_trained = forward_times(args)  # training sigmas per sample
        else:
            batch["steps"] = torch.cat([t["steps"].expand(len(t["latents"]), -1) for t in batches])
            n_trained = len(trained_steps)  # K, the same for every batch and rank

        # ===================================================================== REWARDS
        t_sampled = time.time()
        scores, failed, bad = collect_rewards(futures, my_prompts, args, step, device, reward_pool, stop)
        if scores is None:  # a signal arrived while waiting: keep the last complete step, redo this one on resume
            if not os.path.isfile(os.path.join(args.out, "checkpoints", str(step), "state.json")):
                checkpoints.write(args, step, pipe, trainable, optimizer, copies, device, run_state())
            print0(f"stopped by {stop['signal'] or 'a signal on another rank'} while waiting for rewards in step "
                   f"{step + 1}; checkpoint {step} saved, continue with --resume auto --out {args.out}")
            reward_pool.shutdown(wait=False, cancel_futures=True)
            distributed.finish()
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)  # a reward request may still be blocked on the network: do not wait for its thread
        # Groups with a sample whose reward service gave up (--reward-on-error skip) are dropped whole (departure 4).
        all_groups = torch.arange(args.prompts_per_step, device=device).repeat_interleave(args.group_size)  # [samples]
        bad_groups = torch.zeros(args.prompts_per_step, dtype=torch.bool, device=device)  # [prompts_per_step]
        if bad is None:
            bad_groups[all_groups[distributed.all_gather_cat(failed.to(device))]] = True
            if bad_groups.all():  # not one reward: an update would only replay Adam's momentum and weight decay
                info["dropped_groups"] = int(bad_groups.sum())
                bad = f"every group lost its reward ({args.reward} gave up on every sample)"
        if bad is not None:  # skip the update, not the bookkeeping: the step is logged, counted, checkpointed
            bad_in_a_row += 1
            info.update(skipped=1, skip_reason=bad, bad_in_a_row=bad_in_a_row, seconds=time.time() - t0)
            print0(f"step {step + 1}: skipped ({bad})")
            step += 1
            log_metrics(info)
            if check_and_checkpoint(info):
                break
            continue
        train_reward = scores[args.reward_key].to(device)

        t_rewarded = time.time()  # the wait for rewards not hidden behind sampling
        # ===================================================================== ADVANTAGES
        # Gather every rank's rewards so each group is normalised over all its members, then take our slice.
        all_rewards = distributed.all_gather_cat(train_reward)  # [samples]
        keep = ~bad_groups[all_groups]  # [samples]; at least one group (a step without any is skipped above)
        all_adv = torch.zeros_like(all_rewards)
        all_adv[keep] = losses.group_advantages(all_rewards[keep], all_groups[keep], global_std=args.global_std,
                                                clip=args.adv_clip)
        adv = all_adv[RANK * per_rank:(RANK + 1) * per_rank]  # [per_rank]
        # Samples with advantage 0 (saturated groups, dropped groups) carry no policy gradient and leave the update
        # (departure 4); each rank keeps its micro-batch count and trains its kept samples in smaller micro-batches.
        # The forward-process losses train every sample of the kept groups, as their references (departure 8).
        live = keep[RANK * per_rank:(RANK + 1) * per_rank].float() if forward_process else adv  # [per_rank]
        train_ids = trained_samples(live, n_micro, seeded(args.seed, step, RANK, 2))
        counts = distributed.all_gather_cat(torch.tensor([len(train_ids)], device=device))  # [WORLD]
        rank_weight = WORLD * len(train_ids) / counts.sum().item()  # DDP's mean over ranks -> the mean over samples
        info.update(reward_mean=all_rewards[keep].mean().item(),
                    reward_std=all_rewards[keep].std().item() if keep.sum() > 1 else 0.0,
                    dropped_groups=int(bad_groups.sum()), zero_adv_fraction=(all_adv == 0).float().mean().item())
        for name, value in scores.items():
            if name != "reward":
                info[f"reward/{name}_mean"] = torch.nanmean(distributed.all_gather_cat(value.to(device))).item()
        if args.reward_key != "reward":
            info["reward/total_mean"] = torch.nanmean(distributed.all_gather_cat(scores["reward"].to(device))).item()

        # ===================================================================== TRAINING
        model.train()
        stats, optim_steps, skipped_updates, overflows = {}, 0, 0, 0
        micro_size = len(train_ids) // n_micro  # --train-batch-size when no sample has advantage 0
        orders = [train_ids[torch.randperm(len(train_ids), generator=seeded(args.seed, step, RANK, update, 1))]
                  for update in range(args.updates_per_batch)]  # the order of the trained samples in each pass

        def micro_batches(update, m):  # the micro-batches (sample indices) of optimizer step (update, m)
            micros = orders[update].split(micro_size)  # n_micro of them
            return micros[m * n_micro // args.minibatches:(m + 1) * n_micro // args.minibatches]

        def renoised(ids, update, m, i):
            """Forward process: micro-batch i's clean samples x0 [b, ...], training sigmas s [b, n] of the schedule,
            fresh noise [n, b, ...] and inputs x_t = (1 - s) x0 + s eps (n of [b, ...]), seeded per micro-batch."""
            gen = seeded(args.seed, step, RANK, update, m, i, 2)
            x0 = batch["latents"][ids, -1]  # the clean rollout samples
            if args.loss == "nft":  # each sample its own permutation of the schedule
                times = sde.nft_timesteps(args.num_steps, len(ids), fraction=args.timestep_fraction, generator=gen)
            else:  # stratified, shared by the micro-batch
                times = sde.awm_timesteps(args.num_steps, args.train_timesteps, fraction=args.timestep_fraction,
                                          kind=args.awm_timesteps, generator=gen).expand(len(ids), -1)
            s = sigmas[times].to(device)  # [b, n]
            noise = torch.randn((times.shape[1],) + tuple(x0.shape), generator=gen).to(device)  # [n, b, ...]
            return dict(x0=x0, s=s, noise=noise, x_t=[sde.renoise(x0, eps, s[:, j]) for j, eps in enumerate(noise)])

        def frozen_velocities(fp, sub):
            """No-grad velocities at each x_t of the old copy (NFT's v_old, AWM's EMA-KL anchor) and of the base
            model (the KL to it); each frozen model is set up once per micro-batch, not once per sigma."""
            v_old = v_ref = None
            with torch.no_grad():
                if old is not None:
                    with models.swapped(trainable, old), autocast():
                        v_old = [models.velocity(pipe, x, fp["s"][:, j], sub, guidance_scale=train_guidance)
                                 for j, x in enumerate(fp["x_t"])]
                if args.kl_beta > 0:
                    with models.reference(pipe), autocast():
                        v_ref = [models.velocity(pipe, x, fp["s"][:, j], sub, guidance_scale=train_guidance)
                                 for j, x in enumerate(fp["x_t"])]
            return dict(v_old=v_old, v_ref=v_ref)

        def forward_process_loss(v, j, ids, fp):
            """DiffusionNFT or AWM at the j-th training sigma of a micro-batch, plus the velocity-space KL terms."""
            x0, sigma, x_t = fp["x0"], fp["s"][:, j], fp["x_t"][j]
            if args.loss == "nft":
                loss, loss_info = losses.nft_loss(v, fp["v_old"][j], x_t, x0, sigma, r[ids], beta=args.nft_beta,
                                                  adaptive=args.nft_adaptive)
                loss = args.adv_clip * loss  # the reference's constant factor adv_clip_max (train_nft_sd3.py L960)
            else:
                log_prob = losses.awm_log_prob(v, x0, fp["noise"][j], sigma, weighting=args.awm_weighting,
                                               p=args.ghuber_power)
                old_log_prob = log_prob.detach() if fp["old_log_probs"] is None else fp["old_log_probs"][j]  # (10.)
                loss, loss_info = losses.awm_loss(log_prob, old_log_prob, adv[ids], clip_range=args.clip_range,
                                                  adv_clip=args.adv_clip)
                if args.ema_kl_beta > 0:  # EMA-KL to the slowly updated old copy (train_sd3_awm.py L1341-1350)
                    ema_kl, _ = losses.velocity_kl(v, fp["v_old"][j])
                    loss = loss + args.ema_kl_beta * ema_kl
                    loss_info["ema_kl"] = ema_kl.item()
            if args.kl_beta > 0:  # KL to the frozen base, in velocity space (NFT L966-970, AWM L1337)
                kl, _ = losses.velocity_kl(v, fp["v_ref"][j])
                loss = loss + args.kl_beta * kl
                loss_info["kl"] = kl.item()
            return loss, loss_info

        if forward_process:
            r = losses.nft_optimality(adv, adv_clip=args.adv_clip)  # [per_rank] DiffusionNFT's optimality probability
        awm_old = {}  # (update, m, i) -> [n, b]: AWM's old log-probs of the optimizer steps after the first (10.)
        if args.loss == "awm" and args.updates_per_batch * args.minibatches > 1:
            for update in range(args.updates_per_batch):
                for m in range(args.minibatches):
                    for i, ids in enumerate(micro_batches(update, m) if (update, m) != (0, 0) else []):
                        sub = {k: v[ids.to(v.device)] for k, v in embeds.items()}
                        fp = renoised(ids, update, m, i)
                        with torch.no_grad(), autocast():
                            awm_old[update, m, i] = torch.stack([losses.awm_log_prob(
                                models.velocity(pipe, x, fp["s"][:, j], sub, guidance_scale=train_guidance),
                                fp["x0"], fp["noise"][j], fp["s"][:, j], weighting=args.awm_weighting,
                                p=args.ghuber_power) for j, x in enumerate(fp["x_t"])])

        for update in range(args.updates_per_batch):
            for m in range(args.minibatches):
                micro = micro_batches(update, m)
                n_backward, done = len(micro) * n_trained, 0
                for i, ids in enumerate(micro):
                    sub = {k: v[ids.to(v.device)] for k, v in embeds.items()}
                    if forward_process:  # fresh noise at the training sigmas, and the frozen models' velocities
                        fp = renoised(ids, update, m, i)
                        fp.update(frozen_velocities(fp, sub), old_log_probs=awm_old.get((update, m, i)))
                    for j in range(n_trained):
                        if forward_process:  # the j-th training sigma of each sample
                            x, sigma = fp["x_t"][j], fp["s"][:, j]
                        else:  # each sample's j-th trained step and its stored transition
                            k = batch["steps"][ids, j]  # [b]
                            x, x_next = batch["latents"][ids, k], batch["latents"][ids, k + 1]  # [b, ...]
                            sigma, sigma_next = sigmas[k], sigmas[k + 1]  # [b]
                        last = (done == n_backward - 1)
                        if args.fsdp:  # FSDP's no_sync: accumulate unsharded, reduce-scatter after the last backward
                            transformer.set_requires_gradient_sync(last)
                        sync = contextlib.nullcontext() if (last or WORLD == 1 or args.fsdp) else model.no_sync()
                        with sync:
                            with autocast():
                                v = models.velocity(pipe, x, sigma, sub, guidance_scale=train_guidance,
                                                    transformer=model)
                            if forward_process:
                                loss, loss_info = forward_process_loss(v, j, ids, fp)
                            else:
                                out = sde.sde_step(v, x, sigma, sigma_next, kind=args.sde, eta=args.eta,
                                                   prev_sample=x_next, sigma_max=sigma_max)
                                old_log_prob, adv_mb = batch["log_probs"][ids, j], adv[ids]
                                if args.loss == "grpo":
                                    loss, loss_info = losses.grpo_loss(out.log_prob, old_log_prob, adv_mb,
                                                                       clip_range=args.clip_range)
                                elif args.loss == "guard":
                                    loss, loss_info = losses.guard_loss(out.log_prob, old_log_prob, out.mean,
                                                                        batch["means"][ids, j], out.std,
                                                                        sigma_next - sigma, adv_mb,
                                                                        clip_range=args.clip_range)
                                else:
                                    loss, loss_info = losses.flowdppo_loss(out.log_prob, old_log_prob, out.mean,
                                                                           batch["means"][ids, j], out.std, adv_mb,
                                                                           threshold=args.kl_mask_threshold)
                                if args.kl_beta > 0:  # KL to the frozen base: the same transformer, adapter off
                                    with torch.no_grad(), models.reference(pipe), autocast():
                                        v_ref = models.velocity(pipe, x, sigma, sub, guidance_scale=train_guidance)
                                    ref = sde.sde_step(v_ref, x, sigma, sigma_next, kind=args.sde, eta=args.eta,
                                                       prev_sample=x_next, sigma_max=sigma_max)
                                    kl_dt = None if args.kl_form == "exact" or args.sde == "cps" else sigma_next - sigma
                                    kl, _ = losses.kl_penalty(out.mean, ref.mean, out.std, dt=kl_dt)
                                    loss = loss + args.kl_beta * kl
                                    loss_info["kl"] = kl.item()
                            scaler.scale(loss * rank_weight / n_backward).backward()
                        done += 1
                        if not forward_process and optim_steps == 0 and update == 0:  # on-policy: ratio 1 at first
                            log_ratio = (out.log_prob.detach() - old_log_prob).abs().max()
                            loss_info["first_ratio_dev"] = log_ratio.exp().item() - 1
                            loss_info["first_clip_dev"] = max(loss_info["ratio_max"] - 1, 1 - loss_info["ratio_min"])
                        loss_info["loss"] = loss.item()
                        for key, val in loss_info.items():
                            stats.setdefault(key, []).append(val)
                # One optimizer step per minibatch; a non-finite gradient (NaN loss, log-prob or reward) skips it.
                scaler.unscale_(optimizer)  # fp16: the loss-scaled gradients back to their size (else a no-op)
                grad_norm = torch.nn.utils.clip_grad_norm_([q for _, q in trainable], args.max_grad_norm)
                if args.fsdp:  # the norm over all shards, as a DTensor: a plain tensor, the same on every rank
                    grad_norm = grad_norm.full_tensor()
                if not math.isfinite(grad_norm.item()):
                    if scaler.get_scale() > 1:  # fp16: the loss scale overflowed; update() lowers it, not a bad step
                        overflows += 1
                    else:
                        skipped_updates += 1
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
                    continue
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                optim_steps += 1
                optimizer_steps += 1
                stats.setdefault("grad_norm", []).append(grad_norm.item())
                if ema is not None and (optimizer_steps + 1) % args.ema_every == 0:  # flow_grpo/ema.py's schedule
                    decay = min((1 + optimizer_steps) / (10 + optimizer_steps), args.ema_decay) ** args.ema_repeat
                    with torch.no_grad():
                        for name, param in trainable:
                            ema[name].lerp_(param.detach().float(), 1 - decay)

        # The ratio check (departure 2): exact forwards must reproduce the rollout's log-probs.
        first_ratio_dev = max(stats.get("first_ratio_dev", [0.0]))
        same_forward = amp_dtype is None and train_guidance == sample_guidance
        if distributed.any_rank(same_forward and first_ratio_dev > 1e-3, device):  # all ranks stop together
            raise SystemExit(f"error: ratio on the first update of an on-policy batch is off by {first_ratio_dev:.2e} "
                             "(must be 1): the training forward differs from the rollout's (CFG, dtype or adapter)")
        # The loss's own ratio (GRPO-Guard's RatioNorm one) against the clip: beyond it, rollout/train mismatch alone
        # (e.g. bf16 kernels that differ with the batch shape, 1e-3 on the tiny model) is clipped. Warned once.
        first_clip_dev = max(stats.get("first_clip_dev", [0.0]))
        clip_limit = args.clip_range if args.loss in ("grpo", "guard") else 0.1  # FlowDPPO has no clip
        if first_clip_dev > clip_limit and not ratio_warned:
            ratio_warned = True
            cause = ("--train-cfg is off while sampling uses CFG" if train_guidance != sample_guidance
                     else f"{args.mixed_precision} rounding")
            print0(f"warning: on-policy ratio deviates from 1 by {first_clip_dev:.2e}, more than the clip range "
                   f"{clip_limit:g}: the training forward does not match the rollout ({cause}); try --mixed-precision "
                   "fp16 or no, or --train-cfg")
        if old is not None:  # old <- d old + (1 - d) current; d from the run's optimizer steps so far (resumed)
            decay = OLD_DECAYS[args.old_decay](optimizer_steps)
            with torch.no_grad():
                for name, param in trainable:
                    old[name].lerp_(param.detach().float(), 1 - decay)  # weight 1 (d = 0) copies exactly
            info["old_decay"] = decay

        t_trained = time.time()
        # ===================================================================== LOG / SAVE
        if overflows:
            info["fp16_overflows"] = overflows
        if skipped_updates:
            bad_in_a_row += 1
            info.update(skipped=1, skip_reason="non-finite gradient", skipped_updates=skipped_updates)
        else:
            bad_in_a_row = 0
        trained_here += optim_steps > 0
        info.update({k: float(np.mean(v)) for k, v in stats.items() if k not in ("first_ratio_dev", "first_clip_dev")})
        if not forward_process:
            info.update(first_ratio_dev=first_ratio_dev, first_clip_dev=first_clip_dev)
        info.update(bad_in_a_row=bad_in_a_row, trained_steps=n_trained, seconds=time.time() - t0,
                    seconds_sampling=t_sampled - t0, seconds_reward_wait=t_rewarded - t_sampled,
                    seconds_training=t_trained - t_rewarded)
        step += 1
        log_metrics(info)
        if is_main:
            accuracy = info.get("reward/geneval_correct_mean")  # GenEval: the share of samples officially correct
            bar.write(f"step {step:5d} | reward {info['reward_mean']:+.4f} +- {info['reward_std']:.4f} | "
                      + (f"accuracy {accuracy:.3f} | " if accuracy is not None else "") +
                      f"loss {info.get('loss', float('nan')):+.5f} | "
                      + ("" if args.loss == "nft" else  # NFT has no ratio (AWM's is PPO's)
                         f"ratio {info.get('ratio_mean', float('nan')):.5f} | "
                         f"clipfrac {info.get('clipfrac', float('nan')):.3f} | "
                         f"approx_kl {info.get('approx_kl', float('nan')):.2e} | ") + f"{info['seconds']:.1f}s")
            if args.log_images_every and step % args.log_images_every == 0:  # prompt, reward and verdict per sample
                captions = sample_captions(my_prompts, scores, args.reward_key, len(first_images))
                evaluation.save_sample_grid(os.path.join(args.out, "samples", f"{step:06d}.png"), first_images,
                                            captions, fps=args.fps)
            warn_divergence(info, args)
        if args.eval_every and step % args.eval_every == 0:
            evaluate_held_out(step)
        if check_and_checkpoint(info):
            break
    bar.close()
    reward_pool.shutdown()
    distributed.finish()
    if step == args.steps > start_step and trained_here == 0:  # every step skipped: say so, not exit 0 silently
        raise SystemExit(f"error: none of the {step - start_step} steps of this run updated the weights (last skip: "
                         f"{info.get('skip_reason')}); checkpoint {step} holds the weights it started from")


# ----------------------------------------------------------------------------- plumbing of the phases above
def check_args(p, args, world_size):
    """Refuse flag combinations that cannot work, before any model is loaded."""
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
    if args.sde == "cps" and args.loss == "guard":
        p.error("--loss guard needs a Gaussian transition log-prob; --sde cps scores -mean(delta^2) instead: "
                "use --sde flow or dance")
    if args.eval_every and not args.eval_prompts:
        p.error("--eval-every needs --eval-prompts (a held-out prompt file)")
    if args.fsdp and args.mixed_precision == "fp16":
        p.error("--mixed-precision fp16 needs loss scaling, which is not wired for --fsdp: use bf16")
    if args.fsdp and (args.lora_rank > 0 or world_size == 1):
        p.error("--fsdp shards a full fine-tune over processes: use it with --lora-rank 0 under torchrun "
                "--nproc_per_node N > 1 (LoRA runs use DDP)")
    if args.kl_beta > 0 and args.lora_rank == 0:
        p.error("--kl-beta > 0 needs a LoRA adapter (the reference is the base model with it disabled): "
                "set --lora-rank > 0 or --kl-beta 0")
    if args.loss in FORWARD_LOSSES:
        if args.sde_window != "all" or args.flash:
            p.error(f"--sde-window / --flash choose the SDE steps of the reverse-process losses; --loss {args.loss} "
                    "samples with a deterministic --sampler and trains at re-noised samples: drop them")
        try:  # the training sigmas must fit the schedule (one-line errors naming the flags)
            if args.loss == "nft":
                sde.nft_timesteps(args.num_steps, 1, fraction=args.timestep_fraction)
            else:
                sde.awm_timesteps(args.num_steps, args.train_timesteps, fraction=args.timestep_fraction,
                                  kind=args.awm_timesteps)
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
    return per_rank, components


def forward_times(args):
    """Training sigmas per sample of --loss nft (int(T x fraction)) or awm (--train-timesteps)."""
    return int(args.num_steps * args.timestep_fraction) if args.loss == "nft" else args.train_timesteps


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


def build_policy(args, device, amp_dtype):
    """Load the model, add LoRA (or train everything), shard (FSDP) or wrap (DDP), compile; build AdamW and the
    copies of the trained weights: the evaluation EMA, and the old policy of --loss nft (and of awm with EMA-KL)."""
    load_dtype = amp_dtype if (amp_dtype and args.lora_rank > 0) else torch.float32  # LoRA: frozen base in half
    pipe = setup_or_exit(models.load_pipeline, args.model, args.model_path, dtype=load_dtype, device=device)
    if load_dtype == torch.float16:  # decode in float32, as Flow-GRPO keeps its VAE: fp16 VAE activations can overflow
        pipe.vae.to(torch.float32)
    transformer = pipe.transformer
    models.add_lora(pipe, args.lora_rank, args.lora_alpha)  # the adapter (float32) trains, or all weights for rank 0
    trainable = [(n, q) for n, q in transformer.named_parameters() if q.requires_grad]
    print0(f"model {args.model}: {sum(q.numel() for q in transformer.parameters()) / 1e6:.2f} M params, "
           f"{sum(q.numel() for _, q in trainable) / 1e6:.3f} M trained "
           f"({'LoRA r%d' % args.lora_rank if args.lora_rank else 'full'})")
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if args.fsdp:  # pipe.transformer itself becomes sharded, so rollouts and evaluations run through FSDP too
        distributed.shard_transformer(transformer, device)
        trainable = [(n, q) for n, q in transformer.named_parameters() if q.requires_grad]  # same names, shards
    optimizer = torch.optim.AdamW([q for _, q in trainable], lr=args.lr, weight_decay=args.weight_decay)
    model = transformer  # what the training forward calls
    if WORLD > 1 and not args.fsdp:
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(transformer, device_ids=device_ids)
    if args.compile:
        model = torch.compile(model)

    def copy():  # float32, sharded like trainable under FSDP
        return {n: q.detach().float().clone() for n, q in trainable}
    needs_old = args.loss == "nft" or (args.loss == "awm" and args.ema_kl_beta > 0)
    copies = {"ema": copy() if args.ema_decay > 0 else None, "old": copy() if needs_old else None}
    return pipe, model, trainable, optimizer, copies


def collect_rewards(futures, my_prompts, args, step, device, reward_pool, stop):
    """Wait for this rank's reward batches -> (scores {name: [per_rank]}, failed [per_rank] bool, skip reason or None).

    A NaN / inf reward skips the step on every rank; a reward service that failed after its retries
    (--reward-on-error raise) stops every rank with one line naming the service, the step and the prompts.
    A SIGTERM / SIGINT during the wait returns (None, None, None) on every rank at once."""
    bad = fatal = None
    scores, failed, interrupted = {}, None, False
    try:
        results = []
        for b, future in enumerate(futures):
            try:
                while not interrupted:
                    try:
                        results.append(future.result(timeout=0.2))
                        break
                    except TimeoutError:
                        interrupted = stop["signal"] is not None
                if interrupted:
                    break
            except rewards.RewardServiceError as e:  # its "sample i" counts within rollout batch b
                batch_prompts = my_prompts[b * args.sample_batch_size:(b + 1) * args.sample_batch_size]
                names = list(dict.fromkeys(batch_prompts))
                names = ", ".join(repr(q) for q in names[:3]) + (", ..." if len(names) > 3 else "")
                raise rewards.RewardServiceError(f"step {step + 1}, rank {RANK}, rollout batch {b} "
                                                 f"(prompts {names}): {e}") from None
        if interrupted:
            raise InterruptedError
        failed = torch.cat([r.get("failed", torch.zeros(len(r["reward"]), dtype=torch.bool)) for r in results]).bool()
        names = sorted({k for r in results for k in r} - {"failed"})  # rm_type overrides may leave a component out
        scores = {k: torch.cat([r[k].float() if k in r else torch.full((len(r["reward"]),), float("nan"))
                                for r in results]) for k in names}  # each [per_rank]
        if not torch.isfinite(scores[args.reward_key][~failed]).all():
            bad = f"--reward-key {args.reward_key} is NaN for some samples (an rm_type override without it?)"
    except rewards.NonFiniteReward as e:
        bad = str(e)
    except rewards.RewardServiceError as e:  # after the retries, with --reward-on-error raise
        fatal = (" ".join(str(e).split()) + "; retry later, raise --reward-retries / --reward-timeout, or use "
                 "--reward-on-error skip")  # one line, even when the service sent a multi-line error page
    except (ValueError, TypeError) as e:  # a scorer returned something unusable (wrong length, strings): no retry helps
        fatal = " ".join(str(e).split())
    except InterruptedError:
        pass
    if distributed.any_rank(interrupted, device):  # every rank stops waiting, saves and exits together
        return None, None, None
    if distributed.any_rank(fatal is not None, device):  # every rank stops, not only the one whose reward failed
        reward_pool.shutdown(wait=False, cancel_futures=True)  # later batches' requests are not sent
        raise SystemExit(f"error: {fatal or 'the reward failed on another rank'}")
    if distributed.any_rank(bad is not None, device):
        bad = bad or "non-finite reward on another rank"
    return scores, failed, bad


def check_rm_types(path, prompts, metadata):
    """Every row's metadata.rm_type must name known rewards: a typo fails now, not at the step that draws it."""
    for i, meta in enumerate(metadata):
        if meta.get("rm_type"):
            try:
                rewards.parse_spec(meta["rm_type"])
            except ValueError as e:
                raise SystemExit(f"error: {path}, prompt {i + 1} ({prompts[i][:40]!r}): metadata rm_type: {e}")


def sample_captions(prompts, scores, reward_key, n):
    """Captions of the first n samples: the prompt, the trained reward and, for GenEval, the official verdict."""
    captions = []
    for i in range(n):
        line = f"{reward_key} {scores[reward_key][i].item():.3f}"
        if "geneval_correct" in scores:
            line += " | " + ("correct" if scores["geneval_correct"][i] > 0.5 else "wrong")
        captions.append(f"{prompts[i]}\n{line}")
    return captions


def warn_divergence(info, args):
    """One actionable line when the statistics say the policy is running away (FlowDPPO's debug checklist)."""
    if info.get("clipfrac", 0) > 0.8:
        print0(f"warning: clipfrac {info['clipfrac']:.2f} ~ 1: the policy moves too far per step; "
               "lower --lr or raise --clip-range")
    if info.get("masked_fraction", 0) > 0.8:
        print0(f"warning: FlowDPPO masked_fraction {info['masked_fraction']:.2f} ~ 1: most terms are masked; "
               "raise --kl-mask-threshold or lower --lr")
    if abs(info.get("ratio_mean", 1) - 1) > 0.5:
        print0(f"warning: ratio mean {info['ratio_mean']:.3f} far from 1; lower --lr")


def setup_or_exit(fn, *a, **k):
    """Run a set-up call; its errors (a missing model offline, an unknown reward, a bad config) become one line."""
    try:
        return fn(*a, **k)
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        raise SystemExit(f"error: {e}")


# ----------------------------------------------------------------------------- flag types, recipe files, --help
class RecipeParser(argparse.ArgumentParser):
    """argparse with @recipe files: shell-quoted flags, several per line, '#' starts a comment."""

    def convert_arg_line_to_args(self, line):
        try:
            return shlex.split(line, comments=True)
        except ValueError as e:  # unbalanced quotes
            self.error(f"recipe line {line.strip()!r}: {e}")


def bounded(cast, low=None, high=None, *, low_open=False, high_open=False):
    """An argparse type: int or finite float within [low, high] (either end open or absent), with a one-line error."""
    what = "an integer" if cast is int else "a number"
    interval = ("(" if low_open else "[") + ("-inf" if low is None else str(low)) + ", " + \
               ("inf" if high is None else str(high)) + (")" if high_open or high is None else "]")

    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or (low is not None and (value < low or (low_open and value == low))) or \
                (high is not None and (value > high or (high_open and value == high))):
            raise argparse.ArgumentTypeError(f"must be {what} in {interval}, got {text}")
        return value
    return parse


POSITIVE_INT, NONNEG_INT = bounded(int, 1), bounded(int, 0)
POSITIVE, NONNEG = bounded(float, 0, low_open=True), bounded(float, 0)
FRACTION = bounded(float, 0, 1, low_open=True)  # (0, 1]
SEED = bounded(int, 0, 2**32 - 1)  # numpy's seed range


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows, for a flag whose default depends on --model, the value each preset gives it."""

    def _get_help_string(self, action):
        if action.default is None and action.dest in PRESETS["hub"]:
            values = {"shapes": PRESETS["shapes"].get(action.dest, "unset"),
                      "tiny": PRESETS["tiny"].get(action.dest, "unset"), "sd3": preset("sd3")[action.dest],
                      "flux": preset("flux")[action.dest]}
            return action.help + " (default by --model: " + ", ".join(f"{k} {v}" for k, v in values.items()) + ")"
        if action.default is None and "default" in (action.help or ""):  # the help says what unset means
            return action.help
        return super()._get_help_string(action)


def resolution_arg(text):
    """--resolution: a side in pixels, or HEIGHTxWIDTH (for models with unpacked latents: sd3, wan, z-image)."""
    try:
        sides = [int(v) for v in text.lower().split("x")]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) <= 0:
        raise argparse.ArgumentTypeError(f"--resolution takes a side or HEIGHTxWIDTH in pixels, e.g. 512 or 240x416, "
                                         f"got {text!r}")
    return sides[0] if len(sides) == 1 else tuple(sides)



if __name__ == "__main__":
    main()
