"""Run folders and checkpoints: what train.py leaves on disk, written so that a crash never loses or mixes it.

A run folder (`--out`) holds

    args.json             the flags, git commit and library versions (run_info)
    metrics.jsonl         one JSON object per step (append_metrics); trimmed back to the checkpoint on resume
    samples/              sample grids
    checkpoints/<step>/   trainable.safetensors (weights by parameter name), optimizer.pt, rng.pt, state.json,
                          ema.safetensors (EMA on), lora/ (LoRA runs: loads with diffusers' load_lora_weights)

A checkpoint is written under checkpoints/.tmp-<step>, flushed, and renamed: its folder appears complete or not
at all, and state.json (written last) marks it complete. Everything is safetensors or loadable with
torch.load(weights_only=True).

    write(args, step, pipe, trainable, optimizer, ema, device, extra)   every rank calls it; rank 0 writes
    load(path, args, trainable, optimizer, fsdp_model=None) -> (state, ema)
    resolve_resume(resume, out) -> checkpoint folder or None
"""
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys

import torch

import distributed
import models


def checkpoint_dirs(out):
    """Complete checkpoints of a run folder (those with state.json), oldest first."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = sorted(int(d) for d in os.listdir(root)
                   if d.isdigit() and os.path.isfile(os.path.join(root, d, "state.json")))
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
        raise SystemExit(f"error: --resume {resume}: no complete checkpoint there "
                         "(expected <run>/checkpoints/<step>/state.json)")
    return found[-1]


def save(args, step, pipe, weights, optim_state, ema, extra):
    """Write <out>/checkpoints/<step>/ under a temporary name, then rename: a crash never leaves a half checkpoint.

    weights: {name: full tensor} of the trained parameters; optim_state: optimizer.state_dict() of an unsharded run."""
    from safetensors.torch import save_file
    root = os.path.join(args.out, "checkpoints")
    final, tmp = os.path.join(root, str(step)), os.path.join(root, f".tmp-{step}")
    for torn in glob.glob(os.path.join(root, ".tmp-*")):  # left by a run killed while saving
        shutil.rmtree(torn, ignore_errors=True)
    os.makedirs(tmp)
    save_file({n: p.detach().float().cpu().contiguous() for n, p in weights.items()},
              os.path.join(tmp, "trainable.safetensors"))
    if args.lora_rank > 0:
        models.save_lora(pipe, os.path.join(tmp, "lora"))  # loads with pipe.load_lora_weights(<step>/lora)
    if ema is not None:
        save_file({n: t.cpu().contiguous() for n, t in ema.items()}, os.path.join(tmp, "ema.safetensors"))
    torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, os.path.join(tmp, "rng.pt"))
    state = dict(step=step, model=args.model, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, seed=args.seed,
                 **extra)
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


def write(args, step, pipe, trainable, optimizer, ema, device, extra):
    """Called on every rank: checks that replicas agree, gathers FSDP shards, and rank 0 writes the checkpoint."""
    sums = distributed.check_replicas(trainable, args.fsdp, device)
    if args.fsdp:  # every rank takes part in the gathers; rank 0 gets the full tensors
        full_state = distributed.fsdp_full_state(pipe.transformer, optimizer, trainable, ema)
    else:
        full_state = (dict(trainable), optimizer.state_dict(), ema) if distributed.is_main else None
    if distributed.is_main:
        try:
            save(args, step, pipe, *full_state, dict(extra, rank_checksums=sums))
        except OSError as e:  # full disk, lost mount: the previous checkpoint is untouched
            raise SystemExit(f"error: could not write checkpoint {step} in {args.out}/checkpoints "
                             f"({e.strerror or e}); the previous checkpoint is intact: free space and rerun "
                             "with --resume auto")
    distributed.barrier()


def load(path, args, trainable, optimizer, fsdp_model=None):
    """Restore weights, optimizer, EMA and RNG; fsdp_model: the sharded transformer (collective, every rank calls)."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    if state["model"] != args.model or state["lora_rank"] != args.lora_rank:
        raise SystemExit(f"error: --resume {path} holds --model {state['model']} --lora-rank {state['lora_rank']}, "
                         f"this run is --model {args.model} --lora-rank {args.lora_rank}: resume with the same flags")
    names = [n for n, _ in trainable]
    weights, optim_state = {}, {}
    if fsdp_model is None or distributed.is_main:  # under FSDP rank 0 reads and scatters
        weights = load_file(os.path.join(path, "trainable.safetensors"))
        if missing := [n for n in names if n not in weights]:
            raise SystemExit(f"error: --resume {path} lacks {len(missing)} trained tensors (e.g. {missing[0]}): "
                             "resume with the flags it was saved with")
        optim_state = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)
    if fsdp_model is not None:
        distributed.fsdp_load(fsdp_model, optimizer, trainable, weights, optim_state)
    else:
        with torch.no_grad():
            for name, param in trainable:
                param.copy_(weights[name])
        optimizer.load_state_dict(optim_state)
    ema = None
    if os.path.isfile(os.path.join(path, "ema.safetensors")):
        ema = load_file(os.path.join(path, "ema.safetensors"))
        if fsdp_model is not None:  # full tensors -> this rank's shards, cut locally (every rank read the file)
            ema = distributed.shard_like(ema, trainable)
    torch.set_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=True)["torch"])
    return state, ema


# ----------------------------------------------------------------------------- the run folder
def metrics_step(line):
    """The step of a metrics.jsonl line; 0 for a torn line (a run killed while writing it)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


def trim_metrics(out, step):
    """Keep the metrics rows of steps 1..step: a killed run's rows after its last checkpoint are redone."""
    path = os.path.join(out, "metrics.jsonl")
    if distributed.is_main and os.path.isfile(path):
        with open(path) as f:
            kept = [line for line in f if 0 < metrics_step(line) <= step]
        with open(path, "w") as f:
            f.writelines(kept)


def append_metrics(out, info):
    """One line per step in metrics.jsonl, rank 0."""
    if distributed.is_main:
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(info) + "\n")


def run_info():
    """The git commit and library versions of this run, for args.json."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    import diffusers
    import peft
    import transformers
    return dict(commit=commit or "unknown", python=sys.version.split()[0], torch=torch.__version__,
                diffusers=diffusers.__version__, transformers=transformers.__version__, peft=peft.__version__,
                world_size=distributed.WORLD, started=datetime.datetime.now().isoformat(timespec="seconds"))


def start_run(args):
    """Create the run folder and write args.json (rank 0). API keys live in environment variables, never in args."""
    if distributed.is_main:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(dict(args=vars(args), **run_info()), f, indent=1)
