"""Run folders and checkpoints: what train.py leaves on disk, written so that a crash never loses or mixes it.

A run folder (`--out`) holds

    args.json             the flags, git commit and library versions (run_info)
    metrics.jsonl         one JSON object per step (append_metrics); trimmed back to the checkpoint on resume
    samples/              sample grids
    checkpoints/<step>/   trainable.safetensors (weights by parameter name), optimizer.pt, rng.pt, state.json,
                          ema.safetensors (EMA on), old.safetensors (the old policy of --loss nft / awm),
                          lora/ (LoRA runs: loads with diffusers' load_lora_weights; it holds the EMA weights
                          when the run keeps an EMA, the live ones otherwise)

A checkpoint is written under checkpoints/.tmp-<step>, flushed, and renamed: its folder appears complete or not
at all. manifest.json (the size and SHA-256 of every file) is written after the files and state.json (the
step, the run's flags) last; a checkpoint is trusted only when every file matches its manifest, so a
truncated, emptied or garbled file is found before it is loaded, and resuming falls back to the newest
checkpoint that verifies. Everything is safetensors or loadable with torch.load(weights_only=True).

    prepare(args) -> checkpoint to resume or None    before any model loads: refuses what would lose or mix runs
    write(args, step, pipe, trainable, optimizer, copies, device, extra)   every rank calls it; rank 0 writes
    load(path, args, trainable, optimizer, fsdp_model=None) -> (state, copies)
    verify(path) -> None, or why the checkpoint cannot be trusted
    ema_weights(params, ema)   context: the trained parameters hold their EMA inside, their live values after

`copies` are further {name: tensor} copies of the trained weights, kept beside them: {"ema": ..., "old": ...}
(COPIES), None where a run keeps none; each is saved as <name>.safetensors and restored exactly.
"""
import contextlib
import datetime
import glob
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import torch

import distributed
import models

COPIES = ("ema", "old")  # the evaluation EMA; the old (sampling, anchor) policy of the forward-process losses


def checkpoint_dirs(out):
    """Complete checkpoints of a run folder (those with state.json), oldest first."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = sorted(int(d) for d in os.listdir(root)
                   if d.isdigit() and os.path.isfile(os.path.join(root, d, "state.json")))
    return [os.path.join(root, str(s)) for s in steps]


def newest_verified(out):
    """The newest checkpoint of a run folder that verifies (None if none), saying which newer ones were skipped."""
    for path in reversed(checkpoint_dirs(out)):
        problem = verify(path)
        if problem is None:
            return path
        distributed.print0(f"warning: skipping checkpoint {path}: {problem}")
    return None


def resolve_resume(resume, out):
    """'auto' -> the newest checkpoint in out that verifies (or None); a run folder -> its newest that verifies;
    a checkpoint folder -> itself, if it verifies. Anything else stops with one line."""
    if resume is None:
        return None
    if resume == "auto":
        found = newest_verified(out)
        if found is None and checkpoint_dirs(out):
            raise SystemExit(f"error: no checkpoint in {out}/checkpoints verifies (see the warnings above); "
                             "move them away to start over, or --resume a checkpoint from a copy")
        return found
    if os.path.isfile(os.path.join(resume, "state.json")):
        if (problem := verify(resume)) is not None:
            raise SystemExit(f"error: --resume {resume}: {problem}; resume an older checkpoint of that run "
                             "(or its run folder, which picks the newest that verifies)")
        return resume
    if not checkpoint_dirs(resume):
        raise SystemExit(f"error: --resume {resume}: no complete checkpoint there "
                         "(expected <run>/checkpoints/<step>/state.json)")
    found = newest_verified(resume)
    if found is None:
        raise SystemExit(f"error: --resume {resume}: no checkpoint there verifies (see the warnings above)")
    return found


# Flags that change the trained model: a checkpoint cannot be resumed under others.
MODEL_FLAGS = ("model", "lora_rank", "lora_alpha")
# Flags that change nothing a resumed run computes (bookkeeping, speed, robustness): no warning when they differ.
RUN_FLAGS = ("out", "resume", "overwrite", "steps", "fps", "save_every", "keep_checkpoints", "eval_every", "eval_steps",
             "eval_prompts", "log_images_every", "max_bad_steps", "wandb", "compile", "gradient_checkpointing",
             "model_path", "reward_retries", "reward_timeout", "reward_backoff", "ocr_workers", "pickscore_batch_size",
             "hps_batch_size", "remote_batch_size", "remote_max_concurrency")


def compare_flags(path, state, args):
    """Refuse to resume under flags that change the model; warn once, naming them, about flags that change the run."""
    saved = state.get("args", {key: state[key] for key in MODEL_FLAGS if key in state})
    now = vars(args)
    changed = [key for key in MODEL_FLAGS if key in saved and saved[key] != now.get(key)]
    if changed:
        was = " ".join(f"--{k.replace('_', '-')} {saved[k]}" for k in changed)
        new = " ".join(f"--{k.replace('_', '-')} {now.get(k)}" for k in changed)
        raise SystemExit(f"error: --resume {path} holds {was}, this run is {new}: resume with the same flags")
    differ = [key for key in saved if key not in MODEL_FLAGS and key not in RUN_FLAGS and key in now
              and _jsonable(now[key]) != saved[key]]
    if differ:
        distributed.print0("warning: resuming with flags that change the algorithm: " + ", ".join(
            f"--{k.replace('_', '-')} {saved[k]} -> {_jsonable(now[k])}" for k in differ))


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def prepare(args):
    """Before any model loads: check --out, refuse to mix two runs in one folder, find the checkpoint to resume.

    A run folder that already holds a run is only reused with --resume (continue it) or --overwrite (its
    run files are deleted first). --resume auto without a checkpoint yet starts at step 1 and drops the
    metrics rows the interrupted run left. Rank 0 decides and tells the others which checkpoint to load."""
    resume_from = None
    if distributed.is_main:
        out = args.out
        if os.path.exists(out) and not os.path.isdir(out):
            raise SystemExit(f"error: --out {out} is a file, not a folder; pick a folder for the run")
        try:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, ".write-test"), "w") as f:
                f.write("ok")
            os.remove(os.path.join(out, ".write-test"))
        except OSError as e:
            raise SystemExit(f"error: --out {out} is not writable ({e.strerror or e}); pick a writable folder")
        used = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
        if used and args.resume is None:
            if not args.overwrite:
                raise SystemExit(f"error: --out {out} already holds a run ({', '.join(used)}); continue it with "
                                 "--resume auto, start it over with --overwrite, or pick another --out")
            for name in used + ["samples"]:
                target = os.path.join(out, name)
                if os.path.isdir(target):
                    shutil.rmtree(target)
                elif os.path.exists(target):
                    os.remove(target)
            distributed.print0(f"--overwrite: removed the previous run's {', '.join(used)} from {out}")
        resume_from = resolve_resume(args.resume, out)
        if resume_from is not None:
            with open(os.path.join(resume_from, "state.json")) as f:
                compare_flags(resume_from, json.load(f), args)
        elif args.resume == "auto" and used:
            rows = _count_rows(os.path.join(out, "metrics.jsonl"))
            distributed.print0(f"no checkpoint in {out} yet: starting at step 1 (the {rows} metrics rows of the "
                               "interrupted run are dropped)")
            trim_metrics(out, 0)
    return distributed.broadcast(resume_from)


RUN_FILES = ("args.json", "metrics.jsonl", "eval.jsonl", "checkpoints")  # what marks a folder as holding a run


def _count_rows(path):
    if not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


# ----------------------------------------------------------------------------- writing and verifying
def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder):
    """Relative paths of every file under folder, sorted."""
    return sorted(os.path.relpath(os.path.join(d, n), folder) for d, _, names in os.walk(folder) for n in names)


REQUIRED = ("trainable.safetensors", "optimizer.pt", "rng.pt")


def verify(path):
    """None when the checkpoint at path can be trusted, else one phrase saying what is wrong with it.

    state.json must parse and name its step; manifest.json must list the required files, and every file it
    lists must have its recorded size and SHA-256. A checkpoint written before manifests existed is checked by
    loading every file instead."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "model" not in state:
            return "state.json does not hold a step and a model"
    except (OSError, ValueError) as e:
        return f"state.json is unreadable ({type(e).__name__})"
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        return _verify_by_loading(path)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict):
            raise ValueError
    except (OSError, ValueError):
        return "manifest.json is unreadable"
    for name in REQUIRED:
        if name not in manifest:
            return f"manifest.json does not list {name}"
    for name, entry in manifest.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != entry.get("bytes"):
            return f"{name} has {os.path.getsize(file)} bytes, {entry.get('bytes')} were written"
        if _sha256(file) != entry.get("sha256"):
            return f"{name} does not match its checksum (the file changed after it was written)"
    return None


def _verify_by_loading(path):
    from safetensors.torch import load_file
    try:
        for name in REQUIRED:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                return f"{name} is missing"
            load_file(file) if name.endswith(".safetensors") else torch.load(file, weights_only=True)
        for name in COPIES:
            if os.path.isfile(os.path.join(path, f"{name}.safetensors")):
                load_file(os.path.join(path, f"{name}.safetensors"))
    except Exception as e:  # a torn file raises whatever its reader raises: all mean "cannot be trusted"
        return f"a file does not load ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
    return None


def save(args, step, pipe, weights, optim_state, copies, extra):
    """Write <out>/checkpoints/<step>/ under a temporary name, then rename: a crash never leaves a half checkpoint.

    weights: {name: full tensor} of the trained parameters; optim_state: optimizer.state_dict() of an unsharded run.
    Any failure (a full disk, a lost mount) removes the temporary folder and re-raises."""
    from safetensors.torch import save_file
    root = os.path.join(args.out, "checkpoints")
    final, tmp = os.path.join(root, str(step)), os.path.join(root, f".tmp-{step}")
    for torn in glob.glob(os.path.join(root, ".tmp-*")) + glob.glob(os.path.join(root, ".old-*")):  # a killed save
        shutil.rmtree(torn, ignore_errors=True)
    try:
        os.makedirs(tmp)
        save_file({n: p.detach().float().cpu().contiguous() for n, p in weights.items()},
                  os.path.join(tmp, "trainable.safetensors"))
        if args.lora_rank > 0:  # loads with pipe.load_lora_weights(<step>/lora); the EMA when there is one
            with ema_weights(weights, copies.get("ema")):
                models.save_lora(pipe, os.path.join(tmp, "lora"))
        for name, tensors in copies.items():
            if tensors is not None:
                save_file({n: t.cpu().contiguous() for n, t in tensors.items()},
                          os.path.join(tmp, f"{name}.safetensors"))
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(tmp, "rng.pt"))
        for name in _files(tmp):  # flush to disk before the manifest vouches for the files
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        manifest = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)),
                           "sha256": _sha256(os.path.join(tmp, name))} for name in _files(tmp)}
        _write_json(os.path.join(tmp, "manifest.json"), manifest)
        state = dict(step=step, model=args.model, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                     seed=args.seed, args={k: _jsonable(v) for k, v in vars(args).items()}, **extra)
        _write_json(os.path.join(tmp, "state.json"), state)  # written last: its presence marks a complete checkpoint
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a partial folder on a full disk
        raise
    if os.path.isdir(final):  # a rerun of this step: the old copy stays until the new one is in place
        os.replace(final, os.path.join(root, f".old-{step}"))
    os.replace(tmp, final)
    shutil.rmtree(os.path.join(root, f".old-{step}"), ignore_errors=True)
    for old in checkpoint_dirs(args.out)[:-args.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def ema_weights(params, ema):
    """Inside, the trained parameters hold their EMA, what is evaluated and exported (Flow-GRPO swaps its EMA in to
    evaluate and save: ema.py copy_ema_to / copy_temp_to); on exit they hold their live values again, to train on.
    params: {name: parameter (FSDP: its shard)}; ema: {name: tensor} of the same layout, or None (nothing changes)."""
    if ema is None:
        yield
        return
    live = {name: param.detach().clone() for name, param in params.items()}
    try:
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(ema[name])
        yield
    finally:
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(live[name])


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write(args, step, pipe, trainable, optimizer, copies, device, extra):
    """Called on every rank: checks that replicas agree, gathers FSDP shards, and rank 0 writes the checkpoint."""
    sums = distributed.check_replicas(trainable, args.fsdp, device)
    if args.fsdp:  # every rank takes part in the gathers; rank 0 gets the full tensors
        full_state = distributed.fsdp_full_state(pipe.transformer, optimizer, trainable, copies)
    else:
        full_state = (dict(trainable), optimizer.state_dict(), copies) if distributed.is_main else None
    if distributed.is_main:
        try:
            save(args, step, pipe, *full_state, dict(extra, rank_checksums=sums))
        except (OSError, RuntimeError, ValueError) as e:  # full disk, lost mount (torch and safetensors wrap errno)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())[:200]
            raise SystemExit(f"error: could not write checkpoint {step} in {args.out}/checkpoints ({reason}); "
                             "the previous checkpoints are intact: free space and rerun with --resume auto")
    distributed.barrier()


def load(path, args, trainable, optimizer, fsdp_model=None):
    """Restore weights, optimizer, copies and RNG; fsdp_model: the sharded transformer (collective, every rank calls).
    Returns (state, {name: tensors} of the COPIES the checkpoint holds)."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
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
    copies = {}
    for name in COPIES:
        if os.path.isfile(os.path.join(path, f"{name}.safetensors")):
            copies[name] = load_file(os.path.join(path, f"{name}.safetensors"))
            if fsdp_model is not None:  # full tensors -> this rank's shards, cut locally (every rank read the file)
                copies[name] = distributed.shard_like(copies[name], trainable)
    torch.set_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=True)["torch"])
    return state, copies


# ----------------------------------------------------------------------------- the run folder
def read_jsonl(path):
    """(rows, torn) of a run file such as metrics.jsonl or eval.jsonl: its JSON lines, and how many lines were
    skipped for not being JSON (a run killed while writing its last one). A missing file gives ([], 0)."""
    rows, torn = [], 0
    if not os.path.isfile(path):
        return rows, torn
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                torn += 1
    return rows, torn


def metrics_step(line):
    """The step of a metrics.jsonl line; 0 for a torn line (a run killed while writing it)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 0


def trim_metrics(out, step):
    """Keep the rows of steps 1..step in metrics.jsonl and eval.jsonl: a killed run's later rows are redone.
    A torn last line (a run killed while writing it) goes too."""
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = os.path.join(out, name)
        if distributed.is_main and os.path.isfile(path):
            with open(path, "rb") as f:
                kept = [line.rstrip(b"\n") + b"\n" for line in f if 0 < metrics_step(line) <= step]
            with open(path, "wb") as f:
                f.writelines(kept)


def json_line(row):
    """One strict-JSON line: NaN and inf (not JSON) become null."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def append_metrics(out, info):
    """One line per step in metrics.jsonl, rank 0."""
    if distributed.is_main:
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json_line(info))


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
