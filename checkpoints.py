"""Run folders and checkpoints: what train.py leaves on disk, written so that a crash never loses or mixes it.

A run folder (`--out`) holds

    args.json             the flags, git commit and library versions (run_info)
    metrics.jsonl         one JSON object per step (append_metrics); trimmed back to the checkpoint on resume
    samples/              sample grids
    checkpoints/<step>/   trainable.safetensors (weights by parameter name), optimizer.pt, rng.pt, state.json,
                          ema.safetensors (EMA on), old.safetensors (the old policy of --loss nft / awm),
                          reference.safetensors (GARDO's reference snapshot, --gardo-reference),
                          lora/ (LoRA runs: loads with diffusers' load_lora_weights; it holds the EMA weights
                          when the run keeps an EMA, the live ones otherwise)

A checkpoint is written under checkpoints/.tmp-<step>, flushed, and renamed: its folder appears complete or not
at all. manifest.json (the size and SHA-256 of every file, state.json with the step and the run's flags among
them) is written last; a checkpoint is trusted only when every file matches its manifest and state.json names
the folder's step, so a truncated, emptied, garbled or edited file is found before it is loaded, and resuming
falls back to the newest checkpoint that verifies. Everything is safetensors or loadable with
torch.load(weights_only=True).

    prepare(args) -> (checkpoint to resume or None, stale files)   before any model loads: locks --out, refuses what
                                                   would lose or mix runs
    write(args, step, transformer, trainable, optimizer, copies, device, extra, export=None)   every rank calls it
    load(path, args, trainable, optimizer, fsdp_model=None) -> (state, copies on their parameters' devices)
    load_weights(path, params, *, use_ema=False)   a checkpoint's trained weights (or EMA) into parameters by name
    verify(path) -> None, or why the checkpoint cannot be trusted
    swapped(trainable, weights)   context: the trained parameters hold another copy of their weights inside
    ema_weights(params, ema)   context: the trained parameters hold their EMA inside, their live values after

`copies` are further {name: tensor} copies of the trained weights, kept beside them: {"ema": ..., "old": ...,
"sampling": ..., "reference": ...} (COPIES), None where a run keeps none; each is saved as <name>.safetensors and
restored exactly.
"""
import contextlib
import datetime
import fcntl
import glob
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import torch
from safetensors import SafetensorError

import distributed

COPIES = ("ema", "old", "sampling", "reference", "critic", "surrogate")  # the evaluation EMA; the old (sampling,
# anchor) policy of the forward-process losses; the rollouts' own copy where a loss keeps one apart from the old (CRD);
# GARDO's KL reference snapshot; the trained roles of the distillation losses (policy.Policy._roles), each with its
# optimizer's state in <name>_optim.pt


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
             "eval_prompts", "log_images_every", "max_bad_steps", "wandb", "log_to", "compile",
             "gradient_checkpointing",
             "model_path", "reward_retries", "reward_timeout", "reward_backoff", "ocr_workers", "pickscore_batch_size",
             "hps_batch_size", "remote_batch_size", "remote_max_concurrency", "print_config",
             "sources")  # where each value came from (config.py)


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
    """Before any model loads: check --out, lock it, refuse to mix two runs in one folder, find the checkpoint to
    resume.

    The folder is locked for this process's life (lock): a second run into it is refused in one line, and the lock
    of a run that died goes with it. A folder that already holds a run is only reused with --resume (continue it) or
    --overwrite (start_run deletes its files, once everything else has been checked); a run that never completed a
    step (its set-up failed) does not count. --resume auto without a checkpoint yet starts at step 1 and drops the
    metrics rows the interrupted run left. A run's history never branches: --resume of one of --out's checkpoints is
    refused while a later one verifies; a checkpoint of another run folder forks that run into a new, empty --out (the
    fork's files start after its step), and is refused into a folder that holds a run. <out>/checkpoints, and the
    metrics a resume rewrites, must be writable now. Rank 0 decides and tells the others which checkpoint to load.
    -> (checkpoint to resume or None, the old run files start_run removes: rank 0's list, [] elsewhere)"""
    resume_from, stale = None, []
    if distributed.is_main:
        out = args.out
        if os.path.realpath(out) == os.path.realpath(os.sep):  # a run folder fills with run files: never the root
            raise SystemExit(f"error: --out {out} is the filesystem root; pick a folder for the run, e.g. runs/NAME")
        if os.path.exists(out) and not os.path.isdir(out):
            raise SystemExit(f"error: --out {out} is a file, not a folder; pick a folder for the run")
        try:
            os.makedirs(out, exist_ok=True)
            _write_test(out)
        except OSError as e:
            raise SystemExit(f"error: --out {out} is not writable ({e.strerror or e}); pick a writable folder with "
                             "free space")
        _check_checkpoint_folder(out)  # now, not at the first save: a run's work would be lost there
        lock(out)
        used = [name for name in RUN_FILES + ("samples", EVAL_BASE) if os.path.exists(os.path.join(out, name))]
        never_stepped = _count_rows(os.path.join(out, "metrics.jsonl")) == 0 and not checkpoint_dirs(out)
        if used and args.resume is None:
            if not (args.overwrite or never_stepped):  # a run that never completed a step leaves nothing to keep
                raise SystemExit(f"error: --out {out} already holds a run ({', '.join(used)}); continue it with "
                                 "--resume auto, start it over with --overwrite, or pick another --out")
            stale = _ours(out, used)
        resume_from = resolve_resume(args.resume, out)
        if resume_from is not None:
            with open(os.path.join(resume_from, "state.json")) as f:
                state = json.load(f)
            compare_flags(resume_from, state, args)
            if fork_source(resume_from, out) is None:  # the run's own checkpoint: no later one may exist
                _refuse_a_branch(args.resume, state["step"], out)
                for name in ("metrics.jsonl", "eval.jsonl"):  # rewritten to the checkpoint's step, then appended to
                    if os.path.exists(path := os.path.join(out, name)):
                        try:
                            open(path, "ab").close()
                        except OSError as e:
                            raise SystemExit(f"error: {path} cannot be written ({e.strerror or e}); the resumed run "
                                             "rewrites and extends it: make it a writable file, then rerun") from None
            elif used and not never_stepped:  # a checkpoint of another run into a folder holding a run of its own
                source = fork_source(resume_from, out)
                raise SystemExit(f"error: --resume {args.resume} is a checkpoint of {source} and --out {out} holds "
                                 f"another run ({', '.join(used)}); continue it in its own folder (--out {source}), or "
                                 "fork it into a new, empty --out")
            elif used:  # a fork into a folder whose run never stepped: that run's files go
                stale = _ours(out, used)
        elif args.resume == "auto" and used:
            rows = _count_rows(os.path.join(out, "metrics.jsonl"))
            distributed.print0(f"no checkpoint in {out} yet: starting at step 1 (the {rows} metrics rows of the "
                               "interrupted run are dropped)")
            stale = _ours(out, used)
        if stale:  # the old run's TensorBoard events go with it: two runs would be drawn as one curve
            stale = stale + [name for name in LOG_FOLDERS if os.path.exists(os.path.join(out, name))]
    return distributed.broadcast(resume_from), stale


def _write_test(folder):
    """Create and remove a small file in `folder` (OSError when it cannot be written)."""
    with open(os.path.join(folder, ".write-test"), "w") as f:
        f.write("ok")
    os.remove(os.path.join(folder, ".write-test"))


def _check_checkpoint_folder(out):
    """<out>/checkpoints, where it exists, must be a folder this run can write: refused in one line at start-up (a
    read-only folder, a file, a link to where nothing can be written), not at the first save after hours of work."""
    folder = os.path.join(out, "checkpoints")
    if not os.path.lexists(folder):
        return  # made at the first save, inside --out, which was just written to
    try:
        if not os.path.isdir(folder):
            raise NotADirectoryError(0, "not a folder")
        _write_test(folder)
    except OSError as e:
        raise SystemExit(f"error: {folder} cannot be written ({e.strerror or e}); checkpoints are saved there: make "
                         "it a writable folder (or move it away), or pick another --out") from None


def fork_source(resume_from, out):
    """None when the checkpoint `resume_from` is one of --out's own (<out>/checkpoints/<step>); else the run folder it
    comes from (a fork: the checkpoint's run continues in another --out)."""
    run = os.path.dirname(os.path.dirname(os.path.abspath(resume_from)))
    return None if os.path.realpath(run) == os.path.realpath(out) else run


def _refuse_a_branch(given, step, out):
    """A resume from one of --out's checkpoints while a later one verifies would branch the run's history: the new
    steps' checkpoints beside the abandoned ones, which --keep-checkpoints (by step) and --resume auto would then
    take for them. Refused in one line; later checkpoints that do not verify (what --resume auto skipped) are written
    over as the run reaches their steps."""
    later = [d for d in checkpoint_dirs(out) if int(os.path.basename(d)) > step]
    if any(verify(d) is None for d in reversed(later)):
        steps = ", ".join(os.path.basename(d) for d in later)
        raise SystemExit(f"error: --resume {given} is step {step} of {out}, which holds later checkpoints ({steps}): "
                         "resuming there would branch the run; continue the newest with --resume auto, fork step "
                         f"{step} into a new, empty --out, or delete checkpoints {steps} first to go back")


RUN_FILES = ("args.json", "metrics.jsonl", "eval.jsonl", "checkpoints")  # what marks a folder as holding a run
LOG_FOLDERS = ("tensorboard",)  # a run's logs beside them, removed with them (--log-to tensorboard's events)
EVAL_BASE = "eval_base.pt"  # the held-out reward outputs at step 0, per image: each later evaluation's "rise" is paired


def wrote_args(out):
    """True when <out>/args.json is one that start_run wrote (the flags beside the run's commit and start time): the
    proof that the folder's run files are a run's, which may be deleted."""
    try:
        with open(os.path.join(out, "args.json")) as f:
            written = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and isinstance(written.get("args"), dict) and {"commit", "started"} <= set(written)


def _ours(out, used):
    """`used` (files that start_run would delete), refused in one line unless a run of this project wrote them:
    a folder of the user's own samples/ or checkpoints/ is never taken for a run that did not step."""
    if not wrote_args(out):
        raise SystemExit(f"error: --out {out} holds {', '.join(used)} but no args.json of a train.py run: they are not "
                         "a run's files and are left alone; pick another --out (a new or empty folder)")
    return used


_LOCKS = {}  # folder -> the open file whose flock marks it as this process's run folder


def lock(out):
    """Take an exclusive lock on <out>/.lock (flock), held until this process exits or locks the folder again (a later
    train.main call in the same process). The kernel drops the lock of a process that dies, so a crashed run never
    blocks the next one. Refuses in one line while another live process holds it."""
    path = os.path.realpath(os.path.join(out, ".lock"))
    if path in _LOCKS:  # this process's own earlier run into the same folder
        _LOCKS.pop(path).close()
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise SystemExit(f"error: --out {out} is in use by another run (pid {holder}); wait for it to finish, or pick "
                         "another --out") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    _LOCKS[path] = handle


def unlock(out):
    """Give back the lock of `lock(out)` (a no-op on ranks that never took it)."""
    handle = _LOCKS.pop(os.path.realpath(os.path.join(out, ".lock")), None)
    if handle is not None:
        handle.close()


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

    state.json must parse and name its step, the folder's own; manifest.json must list the required files and
    state.json itself, and every file it lists must have its recorded size and SHA-256. A checkpoint written before
    manifests existed is checked by loading every file instead (and one written before state.json joined its
    manifest, by its fields alone)."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        if not isinstance(state, dict) or type(state.get("step")) is not int or "model" not in state:
            return "state.json does not hold a step and a model"
    except (OSError, ValueError) as e:
        return f"state.json is unreadable ({type(e).__name__})"
    folder = os.path.basename(os.path.normpath(path))
    if state["step"] < 0 or (folder.isdigit() and state["step"] != int(folder)):
        return f"state.json says step {state['step']} in checkpoint folder {folder} (edited?)"
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
        if not isinstance(entry, dict):
            return "manifest.json is malformed"
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


def save(args, step, weights, optim_state, copies, extra, export=None, role_optimizers=None):
    """Write <out>/checkpoints/<step>/ under a temporary name, then rename: a crash never leaves a half checkpoint.

    weights: {name: full tensor} of the trained parameters; optim_state: optimizer.state_dict() of an unsharded run;
    export(folder): writes the weights in a format others load (LoRA runs: diffusers' lora/), given the EMA weights
    where the run keeps an EMA. Any failure (a full disk, a lost mount) removes the temporary folder and re-raises."""
    from safetensors.torch import save_file
    root = os.path.join(args.out, "checkpoints")
    final, tmp = os.path.join(root, str(step)), os.path.join(root, f".tmp-{step}")
    for torn in glob.glob(os.path.join(root, ".tmp-*")) + glob.glob(os.path.join(root, ".old-*")):  # a killed save
        shutil.rmtree(torn, ignore_errors=True)
    try:
        os.makedirs(tmp)
        save_file({n: p.detach().float().cpu().contiguous() for n, p in weights.items()},
                  os.path.join(tmp, "trainable.safetensors"))
        if export is not None:  # LoRA: loads with pipe.load_lora_weights(<step>/lora); the EMA when there is one
            with ema_weights(weights, copies.get("ema")):
                export(os.path.join(tmp, "lora"))
        for name, tensors in copies.items():
            if tensors is not None:
                save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()},
                          os.path.join(tmp, f"{name}.safetensors"))
        torch.save(_on_cpu(optim_state), os.path.join(tmp, "optimizer.pt"))
        for name, state in (role_optimizers or {}).items():  # a trained role's AdamW, beside its weights
            torch.save(_on_cpu(state), os.path.join(tmp, f"{name}_optim.pt"))
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(tmp, "rng.pt"))
        for name in _files(tmp):  # flush to disk before the manifest vouches for the files
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        state = dict(step=step, model=args.model, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                     seed=args.seed, args={k: _jsonable(v) for k, v in vars(args).items()}, **extra)
        _write_json(os.path.join(tmp, "state.json"), state)  # its presence marks a complete checkpoint (after rename)
        manifest = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)),
                           "sha256": _sha256(os.path.join(tmp, name))} for name in _files(tmp)}
        _write_json(os.path.join(tmp, "manifest.json"), manifest)  # vouches for every file, state.json included
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a partial folder on a full disk
        raise
    if os.path.isdir(final):  # a rerun of this step: the old copy stays until the new one is in place
        os.replace(final, os.path.join(root, f".old-{step}"))
    os.replace(tmp, final)
    shutil.rmtree(os.path.join(root, f".old-{step}"), ignore_errors=True)
    # The newest --keep-checkpoints up to this step stay. A later one is never taken for newer: it is one that
    # --resume auto skipped as corrupt (prepare refuses to branch past one that verifies), written over when the run
    # reaches its step; pruning by step number alone would keep it and delete the checkpoints just written.
    done = [d for d in checkpoint_dirs(args.out) if int(os.path.basename(d)) <= step]
    for old in done[:-args.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _on_cpu(state):
    """optimizer.state_dict() with every tensor copied to the CPU (torch.save would copy CUDA tensors itself, one by
    one as well, but tag them with their device, so that a file saved from a GPU run holds cuda:0 tensors). One copy
    and wait per tensor, as for the weights above: at a checkpoint's cadence the syncs cost nothing worth a pinned
    staging buffer the size of Adam's state."""
    if torch.is_tensor(state):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_cpu(v) for v in state)
    return state


@contextlib.contextmanager
def swapped(trainable, weights):
    """Inside, the trained parameters hold `weights` (a {name: tensor} copy: the EMA, or the old policy of the
    forward-process losses) and `weights` holds theirs; both are exchanged back on exit. The exchange is in place,
    through a scratch buffer of at most SWAP_CHUNK elements (or the largest tensor): no second model in memory, and a
    few multi-tensor copies (torch._foreach_copy_) per chunk where one copy per tensor would launch tens of thousands
    of small kernels on a GPU. It is exact when both are float32, as the trained weights are (a LoRA adapter is
    float32, a full fine-tune loads in float32). It works alike for a LoRA adapter, a full fine-tune and FSDP shards
    (each rank exchanges its own). trainable: [(name, parameter or tensor)]."""
    global _exchanged
    pairs = [(distributed.local(param.detach()), distributed.local(weights[name])) for name, param in trainable]
    _exchange(pairs)
    _exchanged += 1
    try:
        yield
    finally:
        _exchanged -= 1
        _exchange(pairs)


_exchanged = 0  # swapped contexts open; write refuses to save inside one


SWAP_CHUNK = 1 << 26  # elements of swapped's scratch buffer (256 MB in float32)


def _exchange(pairs):
    """Swap the values of each (a, b) pair of same-shape tensors in place, chunk by chunk (see swapped)."""
    with torch.no_grad():
        for chunk in _chunks(pairs, SWAP_CHUNK):
            a, b = [p for p, _ in chunk], [q for _, q in chunk]
            flat = torch.empty(sum(t.numel() for t in a), dtype=a[0].dtype, device=a[0].device)
            held = [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in a]), a)]
            torch._foreach_copy_(held, a)
            torch._foreach_copy_(a, b)
            torch._foreach_copy_(b, held)


def _chunks(pairs, limit):
    """Runs of consecutive pairs of one device and dtype, each of at most `limit` elements (or one larger tensor)."""
    chunk, size = [], 0
    for a, b in pairs:
        if chunk and (size + a.numel() > limit or (a.device, a.dtype) != (chunk[0][0].device, chunk[0][0].dtype)):
            yield chunk
            chunk, size = [], 0
        chunk.append((a, b))
        size += a.numel()
    if chunk:
        yield chunk


def ema_weights(params, ema):
    """Context: the trained parameters hold their EMA, what is evaluated and exported (Flow-GRPO swaps its EMA in to
    evaluate and save: ema.py copy_ema_to / copy_temp_to); on exit they hold their live values again, to train on.
    params: {name: parameter (FSDP: its shard)}; ema: {name: tensor} of the same layout, or None (nothing changes)."""
    return contextlib.nullcontext() if ema is None else swapped(list(params.items()), ema)


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write(args, step, transformer, trainable, optimizer, copies, device, extra, export=None, role_optimizers=None):
    """Called on every rank: checks that replicas agree, gathers FSDP shards, and rank 0 writes the checkpoint
    (export: see save)."""
    if _exchanged:  # the trained parameters hold another copy now: it would be saved as the trained weights
        raise RuntimeError("a checkpoint written inside checkpoints.swapped would save the exchanged copy as the "
                           "trained weights: write it after the context")
    sums = distributed.check_replicas(trainable, args.fsdp, device)
    if args.fsdp:  # every rank takes part in the gathers; rank 0 gets the full tensors
        full_state = distributed.fsdp_full_state(transformer, optimizer, trainable, copies)
    else:
        full_state = (dict(trainable), optimizer.state_dict(), copies) if distributed.is_main else None
    if distributed.is_main:
        try:
            save(args, step, *full_state, dict(extra, rank_checksums=sums), export, role_optimizers)
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:  # full disk, lost mount, a file-size limit
            # (torch wraps errno in RuntimeError; safetensors raises its own SafetensorError, an Exception)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())[:200]
            raise SystemExit(f"error: could not write checkpoint {step} in {args.out}/checkpoints ({reason}); "
                             "the previous checkpoints are intact: free space (or raise the file-size limit, "
                             "ulimit -f) and rerun with --resume auto")
    distributed.barrier()


def load(path, args, trainable, optimizer, fsdp_model=None):
    """Restore weights, optimizer, copies and RNG; fsdp_model: the sharded transformer (collective, every rank calls).
    Returns (state, {name: tensors} of the COPIES the checkpoint holds)."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    weights, optim_state = {}, {}
    if fsdp_model is not None:  # rank 0 reads and scatters
        if distributed.is_main:
            weights = _read_weights(path, [n for n, _ in trainable], "--resume")
            optim_state = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
        distributed.fsdp_load(fsdp_model, optimizer, trainable, weights, optim_state)
    else:
        load_weights(path, dict(trainable), what="--resume")
        # Read onto the CPU: saved from cuda:0, the state would otherwise land on cuda:0 on every rank (an extra CUDA
        # context and a copy of Adam's state there); load_state_dict moves it to each parameter's device.
        optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu",
                                             weights_only=True))
    copies = {}
    for name in COPIES:
        if os.path.isfile(os.path.join(path, f"{name}.safetensors")):
            copies[name] = load_file(os.path.join(path, f"{name}.safetensors"))  # float32 on the CPU
            if fsdp_model is not None:  # full tensors -> this rank's shards, cut locally (every rank read the file)
                copies[name] = distributed.shard_like(copies[name], trainable)
            else:  # where the copies live: beside their parameters (a GPU), in float32
                copies[name] = {n: copies[name][n].to(q.device, torch.float32) for n, q in trainable}
    rng = torch.load(os.path.join(path, "rng.pt"), map_location="cpu", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():  # this process's current GPU (distributed.init sets it)
        torch.cuda.set_rng_state(rng["cuda"])
    return state, copies


def load_role(path, name, weights, optimizer, saved):
    """A trained role's weights and AdamW state from checkpoint `path` into its own tensors (which its optimizer
    holds), exactly; a checkpoint without the role (another loss's) leaves it as it starts, with a warning."""
    if name not in saved:
        distributed.print0(f"warning: checkpoint {path} holds no {name}: it starts afresh from the policy's weights")
        return
    with torch.no_grad():
        for n, t in weights.items():
            t.copy_(saved[name][n])
    optimizer.load_state_dict(torch.load(os.path.join(path, f"{name}_optim.pt"), map_location="cpu",
                                         weights_only=True))


def _read_weights(path, names, what, file="trainable.safetensors"):
    """{name: tensor} of a checkpoint file, refused in one line when it lacks a trained tensor of `names`."""
    from safetensors.torch import load_file
    weights = load_file(os.path.join(path, file))
    if missing := [n for n in names if n not in weights]:
        raise SystemExit(f"error: {what} {path} lacks {len(missing)} trained tensors (e.g. {missing[0]}): "
                         "use the flags it was saved with (--model, --lora-rank)")
    return weights


def load_weights(path, params, *, use_ema=False, what="checkpoint", complete=True):
    """Copy a checkpoint's trained weights (use_ema: its EMA, where it has one) into `params` {name: parameter}. With
    complete, params are the trained weights themselves (resume: the same model and LoRA rank, every one in the
    file); without, any superset of them (a pipeline's every parameter). Returns the file read."""
    file = "ema.safetensors" if use_ema and os.path.isfile(os.path.join(path, "ema.safetensors")) else \
        "trainable.safetensors"
    weights = _read_weights(path, list(params) if complete else [], what, file)
    if unknown := [n for n in weights if n not in params]:
        raise SystemExit(f"error: {what} {path} does not match this model ({len(unknown)} unknown tensors, e.g. "
                         f"{unknown[0]}): use the --model and --lora-rank it was trained with")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    return file


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
    """The step of a metrics.jsonl or eval.jsonl line; None for a torn line (a run killed while writing it)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, AttributeError, TypeError):
        return None


def trim_metrics(out, step):
    """Keep the rows of steps 1..step in metrics.jsonl and 0..step in eval.jsonl (the model before training is step
    0): a killed run's later rows are redone. A torn last line (a run killed while writing it) goes too. Resumed at
    step 0 (a run stopped during its first step), the step-0 evaluation is redone by the resumed run: its row goes."""
    for name, first in (("metrics.jsonl", 1), ("eval.jsonl", 0 if step else 1)):
        path = os.path.join(out, name)
        if distributed.is_main and os.path.isfile(path):
            try:
                with open(path, "rb") as f:
                    kept = [line.rstrip(b"\n") + b"\n" for line in f
                            if (n := metrics_step(line)) is not None and first <= n <= step]
                with open(path, "wb") as f:
                    f.writelines(kept)
            except OSError as e:
                raise SystemExit(f"error: cannot rewrite {path} to step {step} ({e.strerror or e}); make it a "
                                 "writable file, then continue with --resume") from None


def json_line(row):
    """One strict-JSON line: NaN and inf (not JSON) become null."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def append_metrics(out, info):
    """One line per step in metrics.jsonl, rank 0; a file that cannot be written (a full disk, a folder made read-only
    or deleted) stops the run in one line: its last checkpoint is intact."""
    if distributed.is_main:
        path = os.path.join(out, "metrics.jsonl")
        try:
            with open(path, "a") as f:
                f.write(json_line(info))
        except OSError as e:
            raise SystemExit(f"error: cannot write {path} ({e.strerror or e}); free space or restore the folder's "
                             "write permission, then continue with --resume auto") from None


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


def start_run(args, stale=()):
    """Create the run folder and write args.json (rank 0), removing first the `stale` files of the run that was there
    (prepare's list: --overwrite, a run that never completed a step, --resume auto before a checkpoint): only now,
    every check having passed, so that a refused run never loses the one before it. API keys live in environment
    variables, never in args."""
    if not distributed.is_main:
        return
    path = os.path.join(args.out, "args.json")
    try:  # the new args.json first, under a temporary name: a full disk or a file-size limit stops the run here,
        _write_json(path + ".tmp", dict(args=vars(args), **run_info()))  # before the old run loses anything
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise SystemExit(f"error: cannot write {path} ({e.strerror or e}); nothing in {args.out} was removed: free "
                         "space (or raise the file-size limit, ulimit -f) and rerun") from None
    for name in stale:
        target = os.path.join(args.out, name)
        shutil.rmtree(target) if os.path.isdir(target) and not os.path.islink(target) else os.remove(target)
    if stale and args.overwrite:
        distributed.print0(f"--overwrite: removed the previous run's {', '.join(stale)} from {args.out}")
    os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
    os.replace(path + ".tmp", path)
