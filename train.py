"""Online RL for flow-matching text-to-image models: Flow-GRPO and its successors, in one script.

Launch
------
    python train.py                                   # CPU: tiny random SD3 + JPEG compressibility, a few minutes
    python train.py --model tiny --loss flowdppo --sde dance       # any loss / sampler on the CPU model
    torchrun --standalone --nproc_per_node=8 train.py @recipes/sd3_ocr_grpo.args      # one node
    torchrun --nnodes 2 --nproc_per_node 8 --node-rank R --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 train.py @recipes/sd3_pickscore_grpo.args      # two nodes (R = 0, 1)
    torchrun --standalone --nproc_per_node=8 --max-restarts 3 train.py @recipes/... --resume auto   # survives preemption
    torchrun --standalone --nproc_per_node=8 train.py @recipes/... --lora-rank 0 --fsdp   # full fine-tune, sharded (FSDP2)

One step = SAMPLING (SDE rollouts of `--group-size` images for each of `--prompts-per-step` prompts,
spread over all ranks) -> REWARDS -> ADVANTAGES (group-relative, after gathering every rank's rewards)
-> TRAINING (`--updates-per-batch` passes of a clipped / masked importance-ratio loss over the trained
denoising steps) -> LOG/SAVE.

Where this departs from the papers, and why
-------------------------------------------
1. The noise of every rollout is seeded from (--seed, step, rank, batch), not drawn from a running RNG:
   a resumed run samples exactly what an uninterrupted one would, so stop/resume is bit-for-bit testable.
2. The old log-probs (and old means, for GRPO-Guard and FlowDPPO) are the rollout's own, frozen before
   the first update; the first optimizer step of each batch checks that the training forward reproduces
   them (ratio == 1). This catches rollout/train mismatches (CFG on one side only, dtype, a stale adapter)
   that otherwise train silently off-policy.
3. The last denoising step (sigma ~0.01 -> 0) is always an ODE step and never trained: its transition
   std is ~0 and its log-prob would dominate the ratio (Flow-GRPO trains it with timestep_fraction 0.99).
4. Groups whose reward service failed (`--reward-on-error skip`) are dropped from the advantages as
   whole groups (a partial group would shift the group mean of the others); their samples still run
   with advantage 0, so every rank does the same number of backward passes, and the loss is scaled by
   samples / kept samples so that a partial outage does not shrink the step.
5. Rewards are computed in a background thread while the next sample batch is generated; the result is
   identical to scoring afterwards, only earlier.
"""
import argparse
import contextlib
import datetime
import glob
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

import data
import eval as evaluation
import geneval
import losses
import models
import rewards
import sde

# Settings that differ between the CPU model and hub models; anything given on the command line wins.
# Hub settings are Flow-GRPO's SD3.5-M setup (arXiv:2505.05470, Sec. 5.1 and its config/grpo.py).
PRESETS = {
    "tiny": dict(resolution=64, num_steps=10, guidance_scale=1.0, eta=0.7, group_size=8, prompts_per_step=4,
                 sample_batch_size=16, train_batch_size=16, minibatches=1, lora_rank=0, lora_alpha=0, lr=3e-3,
                 clip_range=0.2, kl_beta=0.0, steps=60, mixed_precision="no", prompts="prompts/tiny.txt",
                 reward="jpeg_compressibility", global_std=False, log_images_every=20),
    "hub": dict(resolution=512, num_steps=10, guidance_scale=4.5, eta=0.7, group_size=24, prompts_per_step=48,
                sample_batch_size=8, train_batch_size=8, minibatches=2, lora_rank=32, lora_alpha=64, lr=3e-4,
                clip_range=1e-4, kl_beta=0.04, steps=10000, mixed_precision="bf16",
                prompts="prompts/ocr_train.txt", reward="ocr", global_std=True, log_images_every=50),
}
PRESETS["tiny-flux"] = dict(PRESETS["tiny"], guidance_scale=3.5)
FLUX_HUB = dict(guidance_scale=3.5, num_steps=16)  # FLUX.1-dev: distilled guidance, no CFG (MixGRPO uses 16 steps)


class RecipeParser(argparse.ArgumentParser):
    """argparse with @recipe files: shell-quoted flags, several per line, '#' starts a comment."""

    def convert_arg_line_to_args(self, line):
        try:
            return shlex.split(line, comments=True)
        except ValueError as e:  # unbalanced quotes
            self.error(f"recipe line {line.strip()!r}: {e}")


def parse_args(argv=None):
    p = RecipeParser(description=__doc__.split("\n")[0], fromfile_prefix_chars="@",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # model
    p.add_argument("--model", default="tiny", choices=list(models.MODELS), help="model family (tiny runs on a CPU)")
    p.add_argument("--model-path", default=None, help="hub id or local folder of the pipeline (default: the family's hub id)")
    p.add_argument("--resolution", type=int, default=None, help="image side in pixels")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank; 0 trains the full transformer")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (scale = alpha / rank)")
    p.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16"], help="autocast dtype of model forwards; the SDE step and log-probs are always float32")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute transformer activations in the backward pass (less memory, ~30%% more compute)")
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer")
    p.add_argument("--fsdp", action="store_true", help="full fine-tune (--lora-rank 0) under torchrun: shard weights, gradients and Adam state over the processes (FSDP2) instead of replicating them (DDP)")
    # data
    p.add_argument("--prompts", default=None, help="training prompts: .txt (one per line) or .jsonl")
    p.add_argument("--eval-prompts", default=None, help="held-out prompts for --eval-every (default: none)")
    p.add_argument("--input-key", default="input", help="JSONL key of the prompt")
    p.add_argument("--metadata-key", default="metadata", help="JSONL key of the per-sample metadata (rm_type, ...); '' takes the whole row (GenEval's files)")
    p.add_argument("--no-shuffle", action="store_true", help="keep file order instead of a seeded permutation per epoch")
    # sampling
    p.add_argument("--num-steps", type=int, default=None, help="denoising steps of a training rollout")
    p.add_argument("--shift", type=float, default=3.0, help="time shift of the sigma schedule (SD3: 3)")
    p.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (FLUX: distilled guidance value)")
    p.add_argument("--negative-prompt", default="", help="negative prompt for CFG")
    p.add_argument("--train-cfg", action=argparse.BooleanOptionalAction, default=None, help="use CFG in the training forward too (default: when sampling uses CFG)")
    p.add_argument("--sde", default="flow", choices=["flow", "dance", "cps"], help="stochastic step: Flow-GRPO, DanceGRPO or coefficient-preserving")
    p.add_argument("--eta", type=float, default=None, help="noise level of the SDE step")
    p.add_argument("--sde-window", default="all", choices=["all", "fast", "mix"], help="which steps are stochastic and trained: all, Flow-GRPO-Fast random window, MixGRPO sliding window")
    p.add_argument("--window-size", type=int, default=2, help="steps in the fast/mix window")
    p.add_argument("--window-range", type=int, nargs=2, default=None, metavar=("LO", "HI"), help="range of window starts for --sde-window fast")
    p.add_argument("--window-stride", type=int, default=1, help="steps the mix window slides each time")
    p.add_argument("--iters-per-window", type=int, default=25, help="training steps before the mix window slides")
    p.add_argument("--roll-back", action="store_true", help="mix window returns to step 0 after reaching the end")
    p.add_argument("--flash", action="store_true", help="MixGRPO-Flash: second-order solver on a compressed schedule after the window")
    p.add_argument("--timestep-fraction", type=float, default=1.0, help="fraction of steps trained with --sde-window all")
    p.add_argument("--group-size", type=int, default=None, help="images per prompt (a group; may span GPUs)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="prompts per training step, global")
    p.add_argument("--sample-batch-size", type=int, default=None, help="images per rollout forward, per GPU")
    # reward
    p.add_argument("--reward", default=None, help='reward spec: a name or weighted mix, e.g. "ocr=0.8,pickscore=0.2"; choices: ' + ", ".join(rewards.REWARDS))
    p.add_argument("--reward-key", default="reward", help="which reward entry trains (a component name or the weighted total 'reward')")
    p.add_argument("--pickscore-processor-path", default="laion/CLIP-ViT-H-14-laion2B-s32B-b79K", help="PickScore processor")
    p.add_argument("--pickscore-model-path", default="yuvalkirstain/PickScore_v1", help="PickScore CLIP model")
    p.add_argument("--pickscore-batch-size", type=int, default=8, help="images per PickScore forward")
    p.add_argument("--pickscore-num-frames", type=int, default=None, help="video: evenly spaced frames scored (default every frame)")
    p.add_argument("--hps-version", default="v2.1", choices=["v2.0", "v2.1"], help="HPSv2 checkpoint version")
    p.add_argument("--hps-checkpoint-path", default=None, help="HPS checkpoint file (default: the xswu/HPSv2 hub file)")
    p.add_argument("--hps-model-name", default="ViT-H-14", help="open_clip architecture of the HPS checkpoint")
    p.add_argument("--hps-batch-size", type=int, default=8, help="images per HPS forward")
    p.add_argument("--ocr-backend", default="rapidocr", choices=["rapidocr", "paddle"], help="OCR engine")
    p.add_argument("--ocr-workers", type=int, default=2, help="OCR worker pool size, per GPU")
    p.add_argument("--openai-api-rm-config", default=None, help="YAML file or base64:<yaml> for the openai_api judge")
    p.add_argument("--custom-api-rm-config", default=None, help="YAML file or base64:<yaml> for custom_api")
    p.add_argument("--rm-url", default=None, help="URL of a remote reward server (the 'remote' reward)")
    p.add_argument("--remote-batch-size", type=int, default=0, help="samples per POST to --rm-url (0: the whole rollout batch)")
    p.add_argument("--remote-max-concurrency", type=int, default=8, help="POSTs in flight to --rm-url")
    p.add_argument("--custom-rm-path", default=None, help="module.function scoring a batch; RUNS THAT USER CODE")
    p.add_argument("--custom-rm-args", default=None, help="opaque string passed to --custom-rm-path")
    p.add_argument("--reward-retries", type=int, default=3, help="attempts per request to a reward service")
    p.add_argument("--reward-timeout", type=float, default=60.0, help="seconds per reward service request")
    p.add_argument("--reward-backoff", type=float, default=1.0, help="seconds before the first retry; doubles each time")
    p.add_argument("--reward-on-error", default="raise", choices=["raise", "skip"], help="after the retries: stop the run, or drop the affected groups from the update")
    geneval.add_arguments(p)  # --geneval-* (detector, checkpoints, which score trains)
    # loss
    p.add_argument("--loss", default="grpo", choices=["grpo", "guard", "flowdppo"], help="GRPO (PPO clip), GRPO-Guard (RatioNorm), FlowDPPO (KL-ADV mask)")
    p.add_argument("--clip-range", type=float, default=None, help="PPO clip range of the ratio (log-probs are means over latent dims, hence ~1e-4 on hub models)")
    p.add_argument("--adv-clip", type=float, default=5.0, help="advantages clipped to +-this")
    p.add_argument("--kl-beta", type=float, default=None, help="weight of the KL to the frozen base model (0: no reference forward)")
    p.add_argument("--kl-mask-threshold", type=float, default=1e-5, help="FlowDPPO: KL above which a term pushing the ratio further is masked")
    p.add_argument("--global-std", action=argparse.BooleanOptionalAction, default=None, help="normalise advantages by the batch-wide reward std instead of each group's")
    # optim
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="AdamW weight decay")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--train-batch-size", type=int, default=None, help="samples per training forward, per GPU")
    p.add_argument("--minibatches", type=int, default=None, help="optimizer steps per pass over the batch")
    p.add_argument("--updates-per-batch", type=int, default=1, help="passes over each sampled batch")
    p.add_argument("--ema-decay", type=float, default=0.0, help="EMA of trained weights (0: off)")
    p.add_argument("--ema-every", type=int, default=1, help="optimizer steps between EMA updates")
    # logging and checkpoints
    p.add_argument("--steps", type=int, default=None, help="training steps (each: one sampled batch)")
    p.add_argument("--seed", type=int, default=0, help="seed; rank r samples with seed-derived noise per step")
    p.add_argument("--out", default="runs/default", help="run folder: args.json, metrics.jsonl, samples/, checkpoints/")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints kept in --out/checkpoints")
    p.add_argument("--resume", default=None, help="checkpoint folder, run folder, or 'auto' (newest complete checkpoint in --out, if any)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between ODE evaluations on --eval-prompts (0: off)")
    p.add_argument("--eval-steps", type=int, default=40, help="ODE steps of an evaluation")
    p.add_argument("--log-images-every", type=int, default=None, help="steps between saved sample grids (0: never)")
    p.add_argument("--max-bad-steps", type=int, default=5, help="stop after this many consecutive skipped (non-finite) steps")
    p.add_argument("--wandb", action="store_true", help="also log to Weights & Biases")
    args = p.parse_args(argv)

    preset = PRESETS.get(args.model, dict(PRESETS["hub"], **(FLUX_HUB if args.model == "flux" else {})))
    for key, value in preset.items():  # fill what the command line left unset
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.train_cfg is None:
        args.train_cfg = args.guidance_scale > 1 and "flux" not in args.model
    return p, args


def check_args(p, args, world_size):
    """Refuse flag combinations that cannot work, before any model is loaded."""
    samples = args.prompts_per_step * args.group_size  # global samples per step
    if samples % world_size:
        p.error(f"--prompts-per-step x --group-size = {samples} is not divisible by the {world_size} processes")
    per_rank = samples // world_size
    if per_rank % args.sample_batch_size:
        p.error(f"{per_rank} samples per GPU are not divisible by --sample-batch-size {args.sample_batch_size}")
    if per_rank % (args.train_batch_size * args.minibatches):
        p.error(f"{per_rank} samples per GPU are not divisible by --train-batch-size x --minibatches = {args.train_batch_size * args.minibatches}")
    if args.train_cfg and args.guidance_scale <= 1:
        p.error("--train-cfg needs CFG at sampling: set --guidance-scale > 1 or drop --train-cfg")
    if args.train_cfg and "flux" in args.model:
        p.error("FLUX.1-dev uses a guidance embedding, not CFG: drop --train-cfg")
    if args.sde == "cps" and args.loss == "guard":
        p.error("--loss guard needs a Gaussian transition log-prob; --sde cps scores -mean(delta^2) instead: use --sde flow or dance")
    if args.eval_every and not args.eval_prompts:
        p.error("--eval-every needs --eval-prompts (a held-out prompt file)")
    if args.fsdp and (args.lora_rank > 0 or world_size == 1):
        p.error("--fsdp shards a full fine-tune over processes: use it with --lora-rank 0 under torchrun --nproc_per_node N > 1 (LoRA runs use DDP)")
    if args.kl_beta > 0 and args.lora_rank == 0:
        p.error("--kl-beta > 0 needs a LoRA adapter (the reference is the base model with it disabled): set --lora-rank > 0 or --kl-beta 0")
    if args.eta <= 0:
        p.error("--eta must be > 0 for training: with no noise the step is an ODE and has no log-prob")
    try:
        components = [name for name, _ in rewards.parse_spec(args.reward)]  # unknown names fail here, before any model
    except ValueError as e:
        p.error(str(e))
    if args.reward_key != "reward" and args.reward_key not in components and "custom" not in components:
        p.error(f"--reward-key {args.reward_key!r} is not a component of --reward {args.reward!r}")
    if args.clip_range <= 0 or args.updates_per_batch < 1 or args.steps < 1:
        p.error("--clip-range, --updates-per-batch and --steps must be positive")
    # Raises a one-line ValueError naming the window flag when the window does not fit the schedule.
    try:
        sde.sde_steps(args.num_steps, **window_kwargs(args, 0))
    except ValueError as e:
        p.error(str(e))
    return per_rank, components


def window_kwargs(args, step):
    return dict(window=args.sde_window, iteration=step, timestep_fraction=args.timestep_fraction,
                window_size=args.window_size, window_range=args.window_range, stride=args.window_stride,
                iters_per_window=args.iters_per_window, roll_back=args.roll_back, seed=args.seed)


# ----------------------------------------------------------------------------- distributed helpers
RANK, WORLD, LOCAL_RANK = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
is_main = RANK == 0


def print0(*a, **k):
    if is_main:
        print(*a, **k, flush=True)


def all_gather_cat(t):
    """Concatenate a per-rank tensor [n, ...] over ranks in rank order -> [WORLD * n, ...]."""
    if WORLD == 1:
        return t
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def seeded(*parts):
    """A CPU generator seeded from integers (seed, step, rank, ...): the same numbers after a resume."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % 2**63
    return torch.Generator().manual_seed(seed)


def any_rank(flag, device):
    """True on every rank when flag is True on any rank (keeps ranks in lockstep on skips and stops)."""
    if WORLD == 1:
        return bool(flag)
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shard_transformer(transformer, device):
    """FSDP2, in place: each transformer block is one all-gather unit; the root holds embeddings and output layers.

    Every forward all-gathers, so every rank must call the transformer the same number of times.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (WORLD,))
    for blocks in ("transformer_blocks", "single_transformer_blocks"):  # SD3: joint blocks; FLUX: double + single stream
        for block in getattr(transformer, blocks, []):
            fully_shard(block, mesh=mesh)
    # The root reshards after each forward too: by default, after a no_grad forward (rollout, eval) it keeps its gathered
    # weights registered in place of its shards until the next backward. This way, outside a forward, named_parameters()
    # are always the shards the optimizer holds. Costs one extra gather of the small root (embeddings, output layer).
    fully_shard(transformer, mesh=mesh, reshard_after_forward=True)


def fsdp_full_state(model, optimizer, trainable, ema):
    """Gather the shards into the checkpoint format of an unsharded run. Collective: every rank calls it,
    rank 0 receives (weights by parameter name, optimizer.state_dict() keyed by position, ema); others get empties."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0's CPU only
    names = [n for n, _ in trainable]
    full = get_model_state_dict(model, options=options)
    weights = {n: full[n] for n in names} if is_main else {}  # parameters only, no buffers: as without FSDP
    osd = get_optimizer_state_dict(model, optimizer, options=options)  # keyed by parameter name
    position = {n: i for i, n in enumerate(names)}  # the optimizer was built over trainable, in this order
    optim_state = {"state": {position[n]: s for n, s in osd["state"].items()},
                   "param_groups": [dict(g, params=[position[n] for n in g["params"]]) for g in osd["param_groups"]]} if is_main else {}
    ema_full = None
    if ema is not None:
        ema_full = {}
        for n, t in ema.items():  # one tensor at a time: at most one full tensor on the device
            t = t.full_tensor()
            if is_main:
                ema_full[n] = t.cpu()
    return weights, optim_state, ema_full


def fsdp_load(model, optimizer, trainable, path):
    """Load an (unsharded-format) checkpoint into the shards: rank 0 reads the files and scatters them."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    names = [n for n, _ in trainable]
    weights, optim_state = {}, {}
    if is_main:
        weights = load_file(os.path.join(path, "trainable.safetensors"))
        if missing := [n for n in names if n not in weights]:
            raise SystemExit(f"error: --resume {path} lacks {len(missing)} trained tensors (e.g. {missing[0]}): resume with the flags it was saved with")
        saved = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)  # keyed by position -> by name
        optim_state = {"state": {names[i]: s for i, s in saved["state"].items()},
                       "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in saved["param_groups"]]}
    # strict=False: the file holds parameters only; the buffers (fixed positional tables) stay as built.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_dirs(out):
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = sorted(int(d) for d in os.listdir(root) if d.isdigit() and os.path.isfile(os.path.join(root, d, "state.json")))
    return [os.path.join(root, str(s)) for s in steps]


def resolve_resume(resume, out):
    """'auto' -> newest complete checkpoint in out (or None); a run folder -> its newest; else the folder itself."""
    if resume is None:
        return None
    if resume == "auto":
        found = checkpoint_dirs(out)
        return found[-1] if found else None
    if os.path.isfile(os.path.join(resume, "state.json")):
        return resume
    found = checkpoint_dirs(resume)
    if not found:
        raise SystemExit(f"error: --resume {resume}: no complete checkpoint there (expected <run>/checkpoints/<step>/state.json)")
    return found[-1]


def save_checkpoint(args, step, pipe, weights, optim_state, ema, extra):
    """Write <out>/checkpoints/<step>/ under a temporary name, then rename: a crash never leaves a half checkpoint.

    weights: {name: full tensor} of the trained parameters; optim_state: optimizer.state_dict() of an unsharded run."""
    from safetensors.torch import save_file
    root = os.path.join(args.out, "checkpoints")
    final, tmp = os.path.join(root, str(step)), os.path.join(root, f".tmp-{step}")
    for torn in glob.glob(os.path.join(root, ".tmp-*")):  # left by a run killed while saving
        shutil.rmtree(torn, ignore_errors=True)
    os.makedirs(tmp)
    save_file({n: p.detach().float().cpu().contiguous() for n, p in weights.items()}, os.path.join(tmp, "trainable.safetensors"))
    if args.lora_rank > 0:
        models.save_lora(pipe, os.path.join(tmp, "lora"))  # loads with pipe.load_lora_weights(<step>/lora)
    if ema is not None:
        save_file({n: t.cpu().contiguous() for n, t in ema.items()}, os.path.join(tmp, "ema.safetensors"))
    torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, os.path.join(tmp, "rng.pt"))
    if os.environ.get("FLOWRL_TEST_SAVE_DELAY"):  # fault-injection hook for the kill-during-save test
        time.sleep(float(os.environ["FLOWRL_TEST_SAVE_DELAY"]))
    state = dict(step=step, model=args.model, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, seed=args.seed, **extra)
    with open(os.path.join(tmp, "state.json"), "w") as f:  # written last: its presence marks a complete checkpoint
        json.dump(state, f, indent=1)
    for name in os.listdir(tmp):  # flush to disk before the rename makes the checkpoint visible
        if os.path.isfile(os.path.join(tmp, name)):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoint_dirs(args.out)[:-args.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_checkpoint(args, step, pipe, trainable, optimizer, ema, device, extra):
    """Called on every rank: checks that replicas agree, gathers FSDP shards, and rank 0 writes <out>/checkpoints/<step>."""
    # Replicas must hold identical weights; a checksum per rank is cheap and catches a desync early.
    local = [q.detach().to_local() if args.fsdp else q.detach() for _, q in trainable]  # FSDP: this rank's shards
    checksum = torch.stack([t.double().sum() + t.double().abs().sum() for t in local]).sum()
    if args.fsdp:  # shards are disjoint, nothing to desync: their sum is the full model's checksum, on every rank
        dist.all_reduce(checksum)
    sums = all_gather_cat(checksum.reshape(1).to(device)).tolist()
    if max(sums) != min(sums):
        raise SystemExit(f"error: the {WORLD} replicas hold different weights (checksums {sums}); not saving")
    if args.fsdp:  # every rank takes part in the gathers; rank 0 gets the full tensors
        full_state = fsdp_full_state(pipe.transformer, optimizer, trainable, ema)
    else:
        full_state = (dict(trainable), optimizer.state_dict(), ema) if is_main else None
    if is_main:
        try:
            save_checkpoint(args, step, pipe, *full_state, dict(extra, rank_checksums=sums))
        except OSError as e:  # full disk, lost mount: the previous checkpoint is untouched
            raise SystemExit(f"error: could not write checkpoint {step} in {args.out}/checkpoints ({e.strerror or e}); "
                             "the previous checkpoint is intact: free space and rerun with --resume auto")
    if WORLD > 1:
        dist.barrier()


def load_checkpoint(path, args, trainable, optimizer, fsdp_model=None):
    """Restore weights, optimizer, EMA and RNG; fsdp_model: the sharded transformer (collective, every rank calls)."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    if state["model"] != args.model or state["lora_rank"] != args.lora_rank:
        raise SystemExit(f"error: --resume {path} holds --model {state['model']} --lora-rank {state['lora_rank']}, "
                         f"this run is --model {args.model} --lora-rank {args.lora_rank}: resume with the same flags")
    if fsdp_model is not None:
        fsdp_load(fsdp_model, optimizer, trainable, path)
    else:
        weights = load_file(os.path.join(path, "trainable.safetensors"))
        with torch.no_grad():
            for name, param in trainable:
                param.copy_(weights[name])
        optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
    ema = None
    if os.path.isfile(os.path.join(path, "ema.safetensors")):
        ema = load_file(os.path.join(path, "ema.safetensors"))
        if fsdp_model is not None:  # full tensors -> this rank's shards, cut locally (every rank read the file)
            from torch.distributed.tensor import distribute_tensor
            ema = {n: distribute_tensor(ema[n].to(q.device), q.device_mesh, q.placements, src_data_rank=None) for n, q in trainable}
    torch.set_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=True)["torch"])
    return state, ema


# ----------------------------------------------------------------------------- logging helpers
def metrics_step(line):
    """The step of a metrics.jsonl line; 0 for a torn line (a run killed while writing it)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


def run_info():
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    import diffusers, transformers, peft
    return dict(commit=commit or "unknown", python=sys.version.split()[0], torch=torch.__version__,
                diffusers=diffusers.__version__, transformers=transformers.__version__, peft=peft.__version__,
                world_size=WORLD, started=datetime.datetime.now().isoformat(timespec="seconds"))


def save_sample_grid(path, images, prompts, values, n=8):
    """A row of up to n samples, each captioned 'prompt | reward'."""
    from PIL import Image, ImageDraw
    images = images[:n].numpy()
    h, w = images.shape[1:3]
    cap = 28
    grid = Image.new("RGB", (w * len(images), h + cap), "white")
    draw = ImageDraw.Draw(grid)
    for i, img in enumerate(images):
        grid.paste(Image.fromarray(img), (i * w, 0))
        draw.text((i * w + 2, h + 2), f"{prompts[i][:max(4, w // 7)]}", fill="black")
        draw.text((i * w + 2, h + 14), f"| {values[i]:.4f}", fill="black")
    grid.save(path)


def setup_or_exit(fn, *a, **k):
    """Run a set-up call; its errors (a missing model offline, an unknown reward, a bad config) become one line."""
    try:
        return fn(*a, **k)
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        raise SystemExit(f"error: {e}")


def main(argv=None):
    p, args = parse_args(argv)
    per_rank, components = check_args(p, args, WORLD)
    if WORLD > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(minutes=30))
    device = torch.device(f"cuda:{LOCAL_RANK}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed + RANK)  # per-rank seed for anything not explicitly seeded below
    np.random.seed(args.seed + RANK)
    amp_dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.mixed_precision]
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext

    # Derived totals, printed and checked once so a wrong recipe fails here and not at step 3000.
    samples = args.prompts_per_step * args.group_size  # global samples per step
    num_sample_batches = per_rank // args.sample_batch_size
    minibatch = per_rank // args.minibatches  # per-rank samples per optimizer step
    print0(f"{WORLD} processes | {args.prompts_per_step} prompts x {args.group_size} = {samples} samples/step "
           f"({per_rank} per GPU, {num_sample_batches} rollout batches of {args.sample_batch_size}) | "
           f"{args.updates_per_batch * args.minibatches} optimizer steps/step")

    keys = dict(input_key=args.input_key, metadata_key=args.metadata_key)
    prompts, metadata = setup_or_exit(data.load_prompts, args.prompts, **keys)
    eval_prompts, eval_meta = setup_or_exit(data.load_prompts, args.eval_prompts, **keys) if args.eval_prompts else ([], [])
    if components == ["ocr"] and (missing := data.ocr_targets_missing(prompts)):
        print0(f"warning: {missing} of {len(prompts)} prompts in {args.prompts} have no quoted target; the OCR reward scores them 0")
    reward_fn = setup_or_exit(rewards.build_reward, args.reward, device=device,
                              **{name: getattr(args, name) for name in rewards.OPTIONS})  # the flags of the reward group

    # ------------------------------------------------------------------------- model, LoRA, optimizer
    load_dtype = amp_dtype if (amp_dtype and args.lora_rank > 0) else torch.float32  # frozen base in half precision under LoRA
    pipe = setup_or_exit(models.load_pipeline, args.model, args.model_path, dtype=load_dtype, device=device)
    transformer = pipe.transformer
    models.add_lora(pipe, args.lora_rank, args.lora_alpha)  # the adapter (float32) trains, or all weights for rank 0
    trainable = [(n, q) for n, q in transformer.named_parameters() if q.requires_grad]
    print0(f"model {args.model}: {sum(q.numel() for _, q in transformer.named_parameters()) / 1e6:.2f} M params, "
           f"{sum(q.numel() for _, q in trainable) / 1e6:.3f} M trained ({'LoRA r%d' % args.lora_rank if args.lora_rank else 'full'})")
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if args.fsdp:  # pipe.transformer itself becomes sharded, so rollouts and evaluations run through FSDP too
        shard_transformer(transformer, device)
        trainable = [(n, q) for n, q in transformer.named_parameters() if q.requires_grad]  # same names, DTensor shards
    optimizer = torch.optim.AdamW([q for _, q in trainable], lr=args.lr, weight_decay=args.weight_decay)
    model = transformer  # what the training forward calls
    if WORLD > 1 and not args.fsdp:
        model = torch.nn.parallel.DistributedDataParallel(transformer, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        model = torch.compile(model)
    ema = {n: q.detach().float().clone() for n, q in trainable} if args.ema_decay > 0 else None

    start_step, bad_in_a_row = 0, 0
    resume_from = resolve_resume(args.resume, args.out)
    if resume_from:
        state, saved_ema = load_checkpoint(resume_from, args, trainable, optimizer, fsdp_model=transformer if args.fsdp else None)
        start_step, bad_in_a_row = state["step"], state.get("bad_in_a_row", 0)
        ema = saved_ema if ema is not None and saved_ema is not None else ema
        print0(f"resumed from {resume_from} at step {start_step}")
        metrics_path = os.path.join(args.out, "metrics.jsonl")
        if is_main and os.path.isfile(metrics_path):  # drop rows of steps after the checkpoint (a killed run's tail)
            with open(metrics_path) as f:
                kept = [line for line in f if 0 < metrics_step(line) <= start_step]
            with open(metrics_path, "w") as f:
                f.writelines(kept)
    if is_main:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(dict(args=vars(args), **run_info()), f, indent=1)  # keys live in env vars, never in args
    wandb_run = None
    if args.wandb and is_main:
        import wandb
        wandb_run = wandb.init(config=vars(args), dir=args.out, resume="allow")

    stop = {"signal": None}  # preemption: finish the step on every rank, save, exit 0
    def on_signal(signum, frame):
        stop["signal"] = signal.Signals(signum).name
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    sigmas = sde.sd3_sigmas(args.num_steps, shift=args.shift)  # [T+1], 1 -> 0
    sigma_max = sigmas[1].item()  # stands in for s = 1 in 1 - s (sde.py (3)), as in the rollout
    sample_guidance = args.guidance_scale
    train_guidance = args.guidance_scale if (args.train_cfg or "flux" in args.model) else 1.0
    reward_pool = ThreadPoolExecutor(max_workers=1)  # scores batch b while batch b+1 is sampled
    step = start_step
    from tqdm import tqdm
    # A live bar on rank 0's terminal; none in log files, where the per-step lines already say everything.
    bar = tqdm(total=args.steps, initial=start_step, disable=not (is_main and sys.stderr.isatty()), dynamic_ncols=True)

    def log_metrics(info):  # one line per step in metrics.jsonl (and wandb), rank 0
        bar.update(1)
        if is_main:
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(info) + "\n")
            if wandb_run:
                wandb_run.log(info, step=info["step"])

    def check_and_checkpoint(info):  # stop on too many bad steps; save when due or preempted; True = end the run
        if bad_in_a_row >= args.max_bad_steps:
            raise SystemExit(f"error: {bad_in_a_row} consecutive steps were skipped (last: {info.get('skip_reason')}); "
                             "fix the reward, or lower --lr for non-finite gradients (see --max-bad-steps)")
        stopping = any_rank(stop["signal"] is not None, device)
        if (args.save_every and step % args.save_every == 0) or step == args.steps or stopping:
            write_checkpoint(args, step, pipe, trainable, optimizer, ema, device, dict(bad_in_a_row=bad_in_a_row))
        if stopping:
            print0(f"stopped by {stop['signal'] or 'a signal on another rank'} after step {step}; "
                   f"checkpoint saved, continue with --resume auto --out {args.out}")
        return stopping

    while step < args.steps:
        t0 = time.time()
        info = {"step": step + 1}
        # ===================================================================== SAMPLING
        prompt_ids = data.step_prompt_ids(len(prompts), step, prompts_per_step=args.prompts_per_step,
                                          seed=args.seed, shuffle=not args.no_shuffle)
        my_prompt_ids, _ = data.rank_samples(prompt_ids, group_size=args.group_size, rank=RANK, world_size=WORLD)
        my_prompts = [prompts[i] for i in my_prompt_ids]
        my_meta = [metadata[i] for i in my_prompt_ids]
        unique = sorted(set(my_prompt_ids))
        embeds = models.encode_prompts(pipe, [prompts[i] for i in unique], negative_prompt=args.negative_prompt,
                                       guidance_scale=max(sample_guidance, train_guidance))
        row = torch.tensor([unique.index(i) for i in my_prompt_ids])
        embeds = {k: v[row.to(v.device)] for k, v in embeds.items()}  # one row per sample, [per_rank, ...]
        steps = sde.sde_steps(args.num_steps, **window_kwargs(args, step))  # trained (stochastic) step indices
        pipe.transformer.eval()
        batches, futures = [], []
        for b in range(num_sample_batches):
            idx = slice(b * args.sample_batch_size, (b + 1) * args.sample_batch_size)
            gen = seeded(args.seed, step, RANK, b)  # resumable noise
            x = models.initial_noise(pipe, args.sample_batch_size, args.resolution, generator=gen).to(device)
            sub = {k: v[idx] for k, v in embeds.items()}
            with autocast():
                traj = sde.rollout(lambda x_, s_: models.velocity(pipe, x_, s_, sub, guidance_scale=sample_guidance),
                                   x, sigmas, sde_steps=steps, kind=args.sde, eta=args.eta, generator=gen, flash=args.flash)
                images = models.decode(pipe, traj["latents"][:, -1])  # uint8 [b, H, W, 3]
            batches.append(traj)
            futures.append(reward_pool.submit(reward_fn, images, my_prompts[idx], my_meta[idx]))
            if b == 0 and is_main:
                first_images = images
        # latents [n, T+1, ...], log_probs [n, K], means [n, K, ...], stds [n, K]
        batch = {k: torch.cat([t[k] for t in batches]) for k in ("latents", "log_probs", "means", "stds")}

        # ===================================================================== REWARDS
        t_sampled = time.time()
        bad = fatal = None
        try:
            results = []
            for b, future in enumerate(futures):
                try:
                    results.append(future.result())
                except rewards.RewardServiceError as e:  # its "sample i" counts within rollout batch b
                    names = list(dict.fromkeys(my_prompts[b * args.sample_batch_size:(b + 1) * args.sample_batch_size]))
                    names = ", ".join(repr(q) for q in names[:3]) + (", ..." if len(names) > 3 else "")
                    raise rewards.RewardServiceError(f"step {step + 1}, rank {RANK}, rollout batch {b} (prompts {names}): {e}") from None
            failed = torch.cat([r.get("failed", torch.zeros(len(r["reward"]), dtype=torch.bool)) for r in results]).bool()
            keys = sorted({k for r in results for k in r} - {"failed"})  # rm_type overrides may leave a component out
            scores = {k: torch.cat([r[k].float() if k in r else torch.full((len(r["reward"]),), float("nan"))
                                    for r in results]) for k in keys}  # each [per_rank]
            if not torch.isfinite(scores[args.reward_key][~failed]).all():
                bad = f"--reward-key {args.reward_key} is NaN for some samples (an rm_type override without it?)"
        except rewards.NonFiniteReward as e:
            bad = str(e)
        except rewards.RewardServiceError as e:  # after the retries, with --reward-on-error raise
            fatal = " ".join(str(e).split())  # one line, even when the service sent a multi-line error page
        if any_rank(fatal is not None, device):  # every rank stops, not only the one whose service failed
            reward_pool.shutdown(wait=False, cancel_futures=True)  # later batches' requests are not sent
            raise SystemExit(f"error: {fatal or 'a reward service failed on another rank'}; "
                             "retry later, raise --reward-retries / --reward-timeout, or use --reward-on-error skip")
        if any_rank(bad is not None, device):
            bad = bad or "non-finite reward on another rank"
        else:
            # Groups with a sample whose reward service gave up (--reward-on-error skip) are dropped whole (departure 4).
            all_failed = all_gather_cat(failed.to(device))  # [samples]
            all_groups = torch.arange(args.prompts_per_step, device=device).repeat_interleave(args.group_size)  # [samples]
            bad_groups = torch.zeros(args.prompts_per_step, dtype=torch.bool, device=device).index_put_((all_groups[all_failed],), torch.tensor(True, device=device))
            if bad_groups.all():  # not one reward: an update would only replay Adam's momentum and weight decay
                info["dropped_groups"] = int(bad_groups.sum())
                bad = f"every group lost its reward: {args.reward} failed after --reward-retries {args.reward_retries}"
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
        all_rewards = all_gather_cat(train_reward)  # [samples]
        keep = ~bad_groups[all_groups]  # [samples]; at least one group (a step without any is skipped above)
        all_adv = torch.zeros_like(all_rewards)
        all_adv[keep] = losses.group_advantages(all_rewards[keep], all_groups[keep], global_std=args.global_std, clip=args.adv_clip)
        adv = all_adv[RANK * per_rank:(RANK + 1) * per_rank]  # [per_rank]
        drop_scale = keep.numel() / keep.sum().item()  # dropped samples train with A = 0: keep the step size (departure 4)
        info.update(reward_mean=all_rewards[keep].mean().item(),
                    reward_std=all_rewards[keep].std().item() if keep.sum() > 1 else 0.0,
                    dropped_groups=int(bad_groups.sum()))
        for name, value in scores.items():
            if name != "reward":
                info[f"reward/{name}_mean"] = torch.nanmean(all_gather_cat(value.to(device))).item()
        if args.reward_key != "reward":
            info["reward/total_mean"] = torch.nanmean(all_gather_cat(scores["reward"].to(device))).item()

        # ===================================================================== TRAINING
        model.train()
        n_steps = len(steps)
        stats, optim_steps, skipped_updates = {}, 0, 0
        for update in range(args.updates_per_batch):
            perm = torch.randperm(per_rank, generator=seeded(args.seed, step, RANK, update, 1))
            for m in range(args.minibatches):
                mb = perm[m * minibatch:(m + 1) * minibatch]
                micro = [mb[i:i + args.train_batch_size] for i in range(0, minibatch, args.train_batch_size)]
                n_backward, done = len(micro) * n_steps, 0
                for ids in micro:
                    sub = {k: v[ids.to(v.device)] for k, v in embeds.items()}
                    for j, k in enumerate(steps):
                        x, x_next = batch["latents"][ids, k], batch["latents"][ids, k + 1]  # [b, ...]
                        sigma, sigma_next = sigmas[k].item(), sigmas[k + 1].item()
                        last = (done == n_backward - 1)
                        if args.fsdp:  # FSDP's no_sync: accumulate unsharded, reduce-scatter after the last backward only
                            transformer.set_requires_gradient_sync(last)
                        sync = contextlib.nullcontext() if (last or WORLD == 1 or args.fsdp) else model.no_sync()
                        with sync:
                            with autocast():
                                v = models.velocity(pipe, x, sigma, sub, guidance_scale=train_guidance, transformer=model)
                            out = sde.sde_step(v, x, sigma, sigma_next, kind=args.sde, eta=args.eta, prev_sample=x_next,
                                               sigma_max=sigma_max)
                            old_lp, a = batch["log_probs"][ids, j], adv[ids]
                            if args.loss == "grpo":
                                loss, li = losses.grpo_loss(out.log_prob, old_lp, a, clip_range=args.clip_range)
                            elif args.loss == "guard":
                                loss, li = losses.guard_loss(out.log_prob, old_lp, out.mean, batch["means"][ids, j], out.std,
                                                             sigma_next - sigma, a, clip_range=args.clip_range)
                            else:
                                loss, li = losses.flowdppo_loss(out.log_prob, old_lp, out.mean, batch["means"][ids, j], out.std,
                                                                a, threshold=args.kl_mask_threshold)
                            if args.kl_beta > 0:  # KL to the frozen base: the same transformer with the adapter off
                                with torch.no_grad(), models.reference(pipe), autocast():
                                    v_ref = models.velocity(pipe, x, sigma, sub, guidance_scale=train_guidance)
                                ref = sde.sde_step(v_ref, x, sigma, sigma_next, kind=args.sde, eta=args.eta,
                                                   prev_sample=x_next, sigma_max=sigma_max)
                                kl, _ = losses.kl_penalty(out.mean, ref.mean, out.std)
                                loss = loss + args.kl_beta * kl
                                li["kl"] = kl.item()
                            if os.environ.get("FLOWRL_TEST_NAN_STEP") == str(step + 1):  # fault-injection hook
                                loss = loss * float("nan")
                            (loss * drop_scale / n_backward).backward()
                        done += 1
                        if optim_steps == 0 and update == 0:  # on-policy: the ratio must be 1 before the first step
                            li["first_ratio_dev"] = (out.log_prob.detach() - old_lp).abs().max().exp().item() - 1
                        li["loss"] = loss.item()
                        for key, val in li.items():
                            stats.setdefault(key, []).append(val)
                # One optimizer step per minibatch; a non-finite gradient (NaN loss, log-prob or reward) skips it.
                grad_norm = torch.nn.utils.clip_grad_norm_([q for _, q in trainable], args.max_grad_norm)
                if args.fsdp:  # the norm over all shards, as a DTensor: a plain tensor, the same on every rank
                    grad_norm = grad_norm.full_tensor()
                if not math.isfinite(grad_norm.item()):
                    skipped_updates += 1
                    optimizer.zero_grad(set_to_none=True)
                    continue
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                optim_steps += 1
                stats.setdefault("grad_norm", []).append(grad_norm.item())
                if ema is not None and optim_steps % args.ema_every == 0:
                    with torch.no_grad():
                        for name, param in trainable:
                            ema[name].lerp_(param.detach().float(), 1 - args.ema_decay)

        # The ratio check (departure 2): exact forwards must reproduce the rollout's log-probs.
        dev = max(stats.get("first_ratio_dev", [0.0]))
        same_forward = amp_dtype is None and train_guidance == sample_guidance
        if any_rank(same_forward and dev > 1e-3, device):  # all ranks stop together
            raise SystemExit(f"error: ratio on the first update of an on-policy batch is off by {dev:.2e} (must be 1): "
                             "the training forward differs from the rollout's (CFG, dtype or adapter mismatch)")
        if dev > 0.1:
            print0(f"warning: first-update ratio deviates from 1 by {dev:.2e}: the training forward does not match the rollout "
                   f"({'--train-cfg is off while sampling uses CFG' if train_guidance != sample_guidance else 'mixed-precision noise'}); "
                   "try --mixed-precision no or --train-cfg")

        t_trained = time.time()
        # ===================================================================== LOG / SAVE
        if skipped_updates:
            bad_in_a_row += 1
            info.update(skipped=1, skip_reason="non-finite gradient", skipped_updates=skipped_updates)
        else:
            bad_in_a_row = 0
        info.update({k: float(np.mean(v)) for k, v in stats.items() if k != "first_ratio_dev"})
        info["first_ratio_dev"] = dev
        info.update(bad_in_a_row=bad_in_a_row, trained_steps=n_steps, seconds=time.time() - t0,
                    seconds_sampling=t_sampled - t0, seconds_reward_wait=t_rewarded - t_sampled,
                    seconds_training=t_trained - t_rewarded)
        step += 1
        log_metrics(info)
        if is_main:
            bar.write(f"step {step:5d} | reward {info['reward_mean']:+.4f} +- {info['reward_std']:.4f} | "
                      f"loss {info.get('loss', float('nan')):+.5f} | ratio {info.get('ratio_mean', float('nan')):.5f} | "
                      f"clipfrac {info.get('clipfrac', float('nan')):.3f} | approx_kl {info.get('approx_kl', float('nan')):.2e} | "
                      f"{info['seconds']:.1f}s")
            if args.log_images_every and step % args.log_images_every == 0:
                save_sample_grid(os.path.join(args.out, "samples", f"{step:06d}.png"), first_images,
                                 my_prompts, train_reward.tolist())
            warn_divergence(info, args)
        # Held-out ODE samples, fixed noise. Under FSDP every forward is collective: all ranks sample, rank 0 scores.
        if args.eval_every and step % args.eval_every == 0 and (is_main or args.fsdp):
            pipe.transformer.eval()
            eval_images = evaluation.sample_images(pipe, eval_prompts, resolution=args.resolution, num_steps=args.eval_steps,
                                                   guidance_scale=sample_guidance, seed=args.seed, device=device,
                                                   batch_size=args.sample_batch_size, negative_prompt=args.negative_prompt)
            if is_main:
                eval_scores = evaluation.score(reward_fn, eval_images, eval_prompts, eval_meta)
                with open(os.path.join(args.out, "eval.jsonl"), "a") as f:
                    f.write(json.dumps({"step": step, **eval_scores}) + "\n")
                bar.write(f"eval  {step:5d} | " + " | ".join(f"{k} {v:+.4f}" for k, v in eval_scores.items()))
        if check_and_checkpoint(info):
            break
    bar.close()
    reward_pool.shutdown()
    if WORLD > 1:
        dist.destroy_process_group()


def warn_divergence(info, args):
    """One actionable line when the statistics say the policy is running away (FlowDPPO's debug checklist)."""
    if info.get("clipfrac", 0) > 0.8:
        print0(f"warning: clipfrac {info['clipfrac']:.2f} ~ 1: the policy moves too far per step; lower --lr or raise --clip-range")
    if info.get("masked_fraction", 0) > 0.8:
        print0(f"warning: FlowDPPO masked_fraction {info['masked_fraction']:.2f} ~ 1: most terms are masked; raise --kl-mask-threshold or lower --lr")
    if abs(info.get("ratio_mean", 1) - 1) > 0.5:
        print0(f"warning: ratio mean {info['ratio_mean']:.3f} far from 1; lower --lr")


if __name__ == "__main__":
    main()
