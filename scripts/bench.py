"""Throughput, memory and overhead of train.py's step: rollout, reward and update, against the model's pure compute.

Launch
------
    python scripts/bench.py                                                   # tiny model, train.py's CPU preset
    python scripts/bench.py --model tiny --json bench.json -- --group-size 4  # train.py flags go after `--`
    python scripts/bench.py --model sd3-random @recipes/sd3_bench.args --json sd3.json       # GPU, random SD3.5-M, no hub
    python scripts/bench.py --windows --model tiny                            # speed-up of fast / mix / mix+flash over all
    python scripts/bench.py --losses --model tiny                             # GRPO next to DiffusionNFT and AWM
    python scripts/bench.py --model shapes --reward geneval --threads 1 --baseline="--mixed-precision no" \
        -- --mixed-precision bf16                                     # a lever's time against the run without it
    python scripts/bench.py --rewards                                         # images/s of each reward scorer on stand-ins,
                                                                      # FLOPs per image of the real models
    scripts/gpu_bench.sh                                              # the GPU figures of the README

What is measured
----------------
The step is the real one: `train.main` runs in this process for --warmup + --steps steps with the
recipe's flags, and its `metrics.jsonl` gives the wall time of each step and of its phases
(`seconds`, `seconds_sampling`, `seconds_reward_wait`, `seconds_training`). Warm-up steps are dropped
and every figure is a median over the measured steps. Samples per step = prompts_per_step x group_size
(one process).

While it runs, a forward pre-hook on the transformer records every call (phase, input shapes, autocast
dtype) and a wrapper counts every VAE decode. After each measured step (once its times are logged, through
train.main's on_step, before the next step starts) each distinct call is replayed bare on the same module
with the same inputs, --repeats times after one warm-up call, median. Timing both sides of the ratio
within seconds of each other keeps a shared machine's changing load out of it (on a shared CPU also pass
--threads 1: torch's threads wait on each other whenever one is descheduled, and step times swing 10x):
  rollout    no-grad forward (the CFG batch is already doubled inside the call), plus the decodes
  train      forward + backward
  reference  no-grad forward while training: the KL reference with the LoRA adapter off (--kl-beta > 0),
             and the old copy of --loss nft / awm (the same compute; replayed with the current weights)
The pure compute of a step is the sum of calls per step x median time, and

    overhead ratio = median over the measured steps of (step seconds / pure compute timed after that step)

so 1.0 means train.py adds nothing to the model's own forwards, backwards and decodes; the optimizer,
the SDE and loss arithmetic, prompt encoding, reward waits and Python all land in the excess.
`rollout_overhead` and `train_overhead` split the ratio by phase.

The reward is timed separately (`reward_images_per_s`: the reward function on one decoded sample batch)
and defaults to jpeg_compressibility, which costs almost nothing, so that the step time is the model's;
pass --reward to time another. FLOPs come from torch.utils.flop_counter.FlopCounterMode on one sample of
each kind of call, times its batch (gradient checkpointing off while counting: recomputation is not useful work);
MFU = FLOPs of the step / (step seconds x --peak-tflops), reported on a GPU (the default peak is the
H200's dense bf16 spec, 989 TFLOP/s) or when --peak-tflops is given. Memory: the peak allocated by tensors
(`peak_mem_mib`) and the peak reserved by the caching allocator (`peak_reserved_mib`, what has to fit on the GPU);
on a CPU both are the peak RSS. `first_ratio_dev` is |ratio - 1| on the first update of each batch (train.py
departure 2), the rounding of --mixed-precision between the rollout's forward and the update's.

--windows runs the recipe four times, each in its own process: --sde-window all, fast and mix (window of
--window-size steps, 2 as in Flow-GRPO-Fast and MixGRPO arXiv:2507.21802), and mix --flash. Its speed-up
is each run's end-to-end samples/s over all's. Two load-free companions: `compute` prices every counted
call at all's bare times (what the window saves in model work), and `at equal load` multiplies that by
all's overhead ratio over the window's (each ratio is timed against the load of its own moment).

--losses runs the recipe three times, each in its own process, with --loss grpo, nft and awm and the other
flags as given (each loss fills in its own defaults: DiffusionNFT and AWM sample CFG-free with a
deterministic solver unless the flags say otherwise): samples/s of each, their speed-up over grpo (measured,
and the load-free `compute` and `at equal load` as above, against grpo's calls), and each run's overhead ratio.

--baseline FLAGS runs the recipe and the recipe with FLAGS appended (the behaviour to compare against, e.g. today's
default written out), each in its own process, --rounds times in the order baseline, recipe, recipe, baseline, ...
so that a machine whose load drifts weighs on both alike: `time_ratio` is the recipe's median step seconds over the
baseline's, the median over the rounds' pairs (below 1: the recipe is faster), `cpu_ratio` the same for the CPU
seconds of a step (the process's, every thread, from one step's end to the next's, the replays left out: with
--threads 1 on a loaded machine the figure that load does not move), `pure_ratio` for the bare model calls.
"""
import argparse
import contextlib
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import families  # noqa: E402
import flags  # noqa: E402
import models  # noqa: E402
import reward_models  # noqa: E402
import reward_services  # noqa: E402
import rewards  # noqa: E402
import train  # noqa: E402
from tests import reward_fixtures  # noqa: E402

REQUIRED_KEYS = ("rollout_samples_per_s", "train_samples_per_s", "end_to_end_samples_per_s", "overhead_ratio",
                 "peak_mem_mib", "reward_images_per_s")
# --windows: the same recipe with each way of choosing the stochastic steps (MixGRPO arXiv:2507.21802, Flow-GRPO-Fast).
WINDOWS = {
    "all": ["--sde-window", "all"],
    "fast": ["--sde-window", "fast"],
    "mix": ["--sde-window", "mix"],
    "mix+flash": ["--sde-window", "mix", "--flash"],
}
# --losses: the same model and batch with a reverse-process loss and the two forward-process ones.
LOSSES = {
    "grpo": ["--loss", "grpo"],
    "nft": ["--loss", "nft"],
    "awm": ["--loss", "awm"],
}


def parse_args(argv=None):
    """Bench flags first; train.py flags after `--` and @recipe files anywhere go to train.py unchanged."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, train_args = argv[:split], argv[split + 1:]
    train_args = [a for a in own if a.startswith("@")] + train_args
    own = [a for a in own if not a.startswith("@")]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False,
                                epilog="train.py flags: after `--` (python scripts/bench.py --model tiny -- --group-size 4) or in @recipe files")
    p.add_argument("--model", default="tiny", help="models.MODELS name (sd3-random: SD3.5-M architecture, random weights)")
    p.add_argument("--steps", type=int, default=3, help="measured training steps (medians over these)")
    p.add_argument("--warmup", type=int, default=1, help="training steps run first and discarded")
    p.add_argument("--reward", default="jpeg_compressibility", help="reward spec the step trains on (timed separately as well)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of each bare call (after one warm-up call)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s of the chip for MFU (default on CUDA: 989, H200 dense bf16)")
    p.add_argument("--windows", action="store_true", help="run --sde-window all, fast, mix and mix --flash and print each one's speed-up over all")
    p.add_argument("--window-size", type=int, default=None, help="--windows: steps in the fast / mix window (default 2)")
    p.add_argument("--losses", action="store_true",
                   help="run --loss grpo, nft and awm on the same model and batch and print each one's samples/s")
    p.add_argument("--baseline", default=None, metavar="FLAGS",
                   help="train.py flags appended to the recipe for the run to compare against, in one string "
                        "(--baseline=\"--mixed-precision no\"): prints the recipe's step time over the baseline's")
    p.add_argument("--rounds", type=int, default=2, help="--baseline: pairs of runs (alternating order), median ratio")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the run and the bare timing (default: torch's; 1 is steadiest on a shared CPU)")
    p.add_argument("--rewards", action="store_true", help="only time the offline reward scorers (images/s)")
    p.add_argument("--reward-images", type=int, default=16, help="--rewards: images per timed call")
    p.add_argument("--reward-size", type=int, default=512, help="--rewards: image side in pixels")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.add_argument("--out", default=None, help="train.py run folder (default: a temporary folder, removed afterwards)")
    rewards.add_arguments(p)  # reward options: passed on to train.py, and used by --rewards
    args, unknown = p.parse_known_args(own)
    if unknown:
        p.error(f"unknown bench flag(s) {' '.join(unknown)}: put train.py flags after `--` (python scripts/bench.py --model tiny -- {' '.join(unknown)})")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        p.error("--steps, --repeats and --threads must be >= 1 and --warmup >= 0")
    if args.reward_images < 1 or args.reward_size < 1:
        p.error(f"--reward-images must be >= 1 and --reward-size must be >= 1, got {args.reward_images} and "
                f"{args.reward_size}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        p.error(f"--peak-tflops must be a finite number > 0 (the chip's peak TFLOP/s), got {args.peak_tflops}")
    if args.json:
        json_error = flags.unwritable(args.json, "bench.json")
        if json_error:
            p.error(f"--json {args.json} {json_error}")
    if not args.windows and args.window_size is not None:
        p.error("--window-size before `--` belongs to --windows; for one run give train.py's --window-size after `--`")
    if args.windows and args.out:
        p.error("--out names one run's folder; --windows makes four: drop --out")
    if args.baseline is not None and (args.windows or args.losses or args.out):
        p.error("--baseline makes runs of its own: drop --windows, --losses and --out")
    if args.baseline is not None and not shlex.split(args.baseline):
        p.error("--baseline needs the train.py flags of the run to compare against, e.g. --baseline=\"--mixed-precision no\"")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.losses and (args.windows or args.out):
        p.error("--losses makes three runs of its own: drop --windows and --out")
    if args.losses and any(a == "--loss" or a.startswith("--loss=") for a in train_args):
        p.error("--losses sets --loss for each of its runs: drop --loss after `--`")
    args.window_size = args.window_size or 2
    for flag in ("--model", "--steps", "--out", "--reward", "--resume", "--eval-every"):
        if any(a == flag or a.startswith(flag + "=") for a in train_args):
            p.error({"--resume": "--resume does not apply to a benchmark: drop it",
                     "--eval-every": "--eval-every samples outside the measured step and would be counted in it: drop it"}.get(
                flag, f"{flag} after `--` is set by bench.py: give it as a bench flag before `--`"))
    defaults = rewards.option_defaults()  # reward flags given before `--` go on to train.py (their names are --<dest>)
    args.train_args = train_args + [a for k, v in defaults.items() if getattr(args, k) != v
                                    for a in ("--" + k.replace("_", "-"), str(getattr(args, k)))]
    return args


# ----------------------------------------------------------------------------- instrumentation
def _clone(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _shapes(args, kwargs):
    named = list(enumerate(args)) + sorted(kwargs.items())
    return tuple((str(k), tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in named if torch.is_tensor(v))


def _autocast_dtype(device_type):
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class Recorder:
    """Counts the transformer calls and VAE decodes of a train.main run, keeping one copy of each kind's inputs."""

    def __init__(self, warmup=0, repeats=5, models=None):
        self.pipe, self.reward_fn, self.reward_call = None, None, None
        self.calls = {}  # signature -> {"count", "args", "kwargs", "phase", "autocast"}
        self.handle = None
        self.warmup, self.repeats, self.models = warmup, repeats, models
        self.bare = {}  # step -> {signature: median seconds}, timed right after that step
        self.cpu, self.cpu_since = {}, None  # step -> CPU seconds of the process (every thread) from the last step's end

    def after_step(self, info):
        """Time every kind of call bare between two steps, so both sides of the ratio see the same machine load."""
        if self.cpu_since is not None:
            self.cpu[info["step"]] = time.process_time() - self.cpu_since
        try:
            self._replay(info)
        finally:
            self.cpu_since = time.process_time()  # the replays are not part of the next step's CPU seconds

    def _replay(self, info):
        if info["step"] > self.warmup and "seconds" in info:
            self.handle.remove()  # the replays are not part of the run's counts
            self.handle = None
            try:
                self.bare[info["step"]] = time_bare(self.pipe, self.calls, self.repeats, self.models)
            finally:
                self.handle = self.pipe.transformer.register_forward_pre_hook(self.transformer_hook, with_kwargs=True)

    def transformer_hook(self, module, args, kwargs):
        grad = torch.is_grad_enabled()
        phase = "train" if grad else ("reference" if module.training else "rollout")  # train.py: eval() to sample, train() to update
        self.count(phase, args, kwargs)

    def count(self, phase, args, kwargs=None):
        """Record one call of `phase` with its inputs and the autocast it runs under (the hooks' calls, or one made
        outside them: scripts/anchor_bench.py's VAE decodes)."""
        kwargs = kwargs or {}
        device_type = next(v for v in list(args) + list(kwargs.values()) if torch.is_tensor(v)).device.type
        autocast = _autocast_dtype(device_type)
        self._count((phase, _shapes(args, kwargs), str(autocast)), phase, args, kwargs, autocast)

    def _count(self, sig, phase, args, kwargs, autocast):
        entry = self.calls.get(sig)
        if entry is None:
            entry = self.calls[sig] = dict(count=0, phase=phase, args=_clone(args), kwargs=_clone(kwargs), autocast=autocast)
        entry["count"] += 1

    @contextlib.contextmanager
    def patch(self, models, rewards):
        """Wrap models.load_pipeline / models.decode / rewards.build_reward for the length of the run: the model and
        the reward are found and their calls counted (the per-step timing comes through train.main's on_step)."""
        originals = models.load_pipeline, models.decode, rewards.build_reward

        def load_pipeline(*a, **k):
            pipe = originals[0](*a, **k)
            self.pipe = pipe
            self.handle = pipe.transformer.register_forward_pre_hook(self.transformer_hook, with_kwargs=True)
            return pipe

        def decode(pipe, latents, *a, **k):
            if self.handle is not None:  # not while replaying (the hook is off then)
                autocast = _autocast_dtype(latents.device.type)
                self._count(("decode", _shapes((latents,), {}), str(autocast)), "decode", (latents,), k, autocast)
            return originals[1](pipe, latents, *a, **k)

        def build_reward(*a, **k):
            fn = originals[2](*a, **k)

            def reward_fn(images, prompts, metadata):
                if self.reward_call is None:
                    self.reward_call = (_clone(images), list(prompts), list(metadata))
                return fn(images, prompts, metadata)
            self.reward_fn = fn
            return reward_fn

        models.load_pipeline, models.decode, rewards.build_reward = load_pipeline, decode, build_reward
        try:
            yield self
        finally:
            models.load_pipeline, models.decode, rewards.build_reward = originals
            if self.handle is not None:
                self.handle.remove()
                self.handle = None


# ----------------------------------------------------------------------------- bare timing
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _output(out):
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.sample if hasattr(out, "sample") else out


def bare_call(pipe, entry, models):
    """One call of a recorded kind on the same module and inputs: the model's compute and nothing else."""
    transformer = pipe.transformer
    device = transformer.device
    autocast = torch.autocast(device.type, dtype=entry["autocast"]) if entry["autocast"] else contextlib.nullcontext()
    if entry["phase"] == "decode":
        with torch.no_grad(), autocast:
            return models.decode(pipe, *entry["args"], **entry["kwargs"])  # not counted: the recorder's hook is off
    if entry["phase"] == "train":
        with autocast:
            out = _output(transformer(*entry["args"], **entry["kwargs"]))
        out.float().mean().backward()
        return out
    with torch.no_grad(), autocast:  # rollout; reference runs inside phase_context's models.reference
        return transformer(*entry["args"], **entry["kwargs"])


def phase_context(pipe, entry, models):
    """The module state train.py ran the call in: eval() to sample, train() to update, adapter off for the reference
    (a no-grad training forward without an adapter is the old copy of --loss nft / awm: same compute, as it is)."""
    pipe.transformer.train(entry["phase"] in ("train", "reference"))
    reference = entry["phase"] == "reference" and models.has_adapter(pipe)
    return models.reference(pipe) if reference else contextlib.nullcontext()


def time_bare(pipe, calls, repeats, models):
    """Median seconds of each recorded kind of call, after one warm-up call."""
    transformer = pipe.transformer
    device = transformer.device
    was_training = transformer.training
    seconds = {}
    for sig, entry in calls.items():
        times = []
        with phase_context(pipe, entry, models):  # entered once: toggling the adapter is plumbing, not compute
            for r in range(repeats + 1):
                _sync(device)
                t = time.perf_counter()
                bare_call(pipe, entry, models)
                _sync(device)
                if r:
                    times.append(time.perf_counter() - t)
        seconds[sig] = statistics.median(times)
    transformer.zero_grad(set_to_none=True)
    transformer.train(was_training)
    return seconds


BATCHED = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance")  # per-sample inputs


def one_sample(entry):
    """The call cut to its first sample, and its batch size (a transformer's or VAE's FLOPs are linear in the batch)."""
    args, kwargs = entry["args"], entry["kwargs"]
    lead = args[0] if args and torch.is_tensor(args[0]) else kwargs["hidden_states"]
    batch = lead.shape[0]
    cut = lambda v: v[:1] if torch.is_tensor(v) and v.dim() and v.shape[0] == batch else v
    args = tuple(cut(v) for v in args)
    kwargs = {k: cut(v) if k in BATCHED else v for k, v in kwargs.items()}
    return dict(entry, args=args, kwargs=kwargs), batch


def count_flops(pipe, calls, models):
    """FLOPs of one call of each kind (forward, or forward + backward for train), counted on one sample and
    scaled by the batch (so counting never needs more memory than the run did), gradient checkpointing off."""
    from torch.utils.flop_counter import FlopCounterMode
    transformer = pipe.transformer
    checkpointing = bool(getattr(transformer, "is_gradient_checkpointing", False))
    if checkpointing:
        transformer.disable_gradient_checkpointing()  # recomputed activations are not useful work
    flops, was_training = {}, transformer.training
    try:
        for sig, entry in calls.items():
            single, batch = one_sample(entry)
            mode = FlopCounterMode(display=False)
            with phase_context(pipe, entry, models), mode:
                bare_call(pipe, single, models)
            flops[sig] = batch * mode.get_total_flops()
    finally:
        transformer.zero_grad(set_to_none=True)
        transformer.train(was_training)
        if checkpointing:
            transformer.enable_gradient_checkpointing()
    return flops


# ----------------------------------------------------------------------------- one benchmark
def median_of(rows, key):
    return statistics.median(r[key] for r in rows)


def peak_memory_mib(device):
    """(allocated, reserved) peak MiB. On a GPU the allocated peak is what tensors held; the reserved one what the
    caching allocator took from the device, fragmentation included: the figure that must fit (an out-of-memory error
    comes when it cannot grow). On a CPU both are the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.max_memory_reserved(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB (the process's peak RSS)
    return rss, rss


def run(args):
    """Run train.main on the recipe, timing its calls bare between steps; returns the figures as a dict."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise SystemExit("error: bench.py measures one process (figures are per GPU): run it with python, not torchrun")
    out = args.out or tempfile.mkdtemp(prefix="bench-")
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        raise SystemExit(f"error: {out} already holds a run (metrics.jsonl): pick an empty --out")
    if args.threads:
        torch.set_num_threads(args.threads)
    total_steps = args.warmup + args.steps
    train_argv = args.train_args + ["--model", args.model, "--reward", args.reward, "--steps", str(total_steps), "--out", out]
    recorder = Recorder(warmup=args.warmup, repeats=args.repeats, models=models)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        with recorder.patch(models, rewards):
            t = time.time()
            train.main(train_argv, on_step=recorder.after_step)  # bare calls timed between steps
            wall = time.time() - t
        pipe = recorder.pipe
        device = pipe.transformer.device
        peak_mib, peak_reserved_mib = peak_memory_mib(device)
        with open(os.path.join(out, "args.json")) as f:
            targs = json.load(f)["args"]
        with open(os.path.join(out, "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    measured = [r for r in lines if r["step"] > args.warmup and "seconds" in r]
    if not measured:
        raise SystemExit(f"error: none of the {args.steps} measured steps completed (skipped: "
                         f"{[r.get('skip_reason') for r in lines if r.get('skipped')]}); fix the reward or raise --steps")
    samples = targs["prompts_per_step"] * targs["group_size"]  # one process: / world_size = / 1

    # Pure compute of a step: for every recorded kind of call, calls per step x bare median seconds.
    per_step = {sig: entry["count"] / total_steps for sig, entry in recorder.calls.items()}
    phase_of = {sig: entry["phase"] for sig, entry in recorder.calls.items()}
    interleaved = bool(recorder.bare)
    if not interleaved:  # no measured step completed its update: time once, after the run
        print("note: bare calls timed after the run, not between steps; the ratio is exposed to load drift", flush=True)
        bare = time_bare(pipe, recorder.calls, args.repeats, models)
        recorder.bare = {r["step"]: bare for r in measured}

    def pure(step, kinds):  # NaN when the step has no such calls, never a division by zero
        return sum(per_step[s] * sec for s, sec in recorder.bare[step].items() if phase_of[s] in kinds) or math.nan

    rollout_kinds, train_kinds = ("rollout", "decode"), ("train", "reference")
    ratios = [dict(step=r["seconds"] / pure(r["step"], rollout_kinds + train_kinds),
                   rollout=r["seconds_sampling"] / pure(r["step"], rollout_kinds),
                   train=r["seconds_training"] / pure(r["step"], train_kinds),
                   pure_rollout=pure(r["step"], rollout_kinds), pure_train=pure(r["step"], train_kinds))
              for r in measured]  # each step against the bare calls timed right after it
    seconds = {s: statistics.median(recorder.bare[r["step"]][s] for r in measured) for s in recorder.calls}
    flops = count_flops(pipe, recorder.calls, models)
    flops_step = sum(per_step[s] * flops[s] for s in flops)
    pure_rollout, pure_train = median_of(ratios, "pure_rollout"), median_of(ratios, "pure_train")
    pure_step = statistics.median(r["pure_rollout"] + r["pure_train"] for r in ratios)

    # Reward on one decoded sample batch, alone.
    images, prompts, metadata = recorder.reward_call
    recorder.reward_fn(images, prompts, metadata)  # warm-up (lazy model loads)
    reward_times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        recorder.reward_fn(images, prompts, metadata)
        reward_times.append(time.perf_counter() - t)

    step_s = median_of(measured, "seconds")
    cpu = [recorder.cpu[r["step"]] for r in measured if r["step"] in recorder.cpu]
    result = dict(
        model=args.model, device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        rollout_samples_per_s=samples / median_of(measured, "seconds_sampling"),
        train_samples_per_s=samples / median_of(measured, "seconds_training"),
        end_to_end_samples_per_s=samples / step_s,
        overhead_ratio=median_of(ratios, "step"),
        rollout_overhead=median_of(ratios, "rollout"),
        train_overhead=median_of(ratios, "train"),
        overhead_ratio_per_step=[r["step"] for r in ratios], bare_timed_between_steps=interleaved,
        peak_mem_mib=peak_mib, peak_reserved_mib=peak_reserved_mib,
        # |ratio - 1| on the first update of each batch, warm-up included (train.py departure 2): 0 up to the
        # rounding of --mixed-precision, which the update's forward repeats at another batch shape
        first_ratio_dev=max((abs(r["first_ratio_dev"]) for r in lines if "first_ratio_dev" in r), default=math.nan),
        reward_images_per_s=len(images) / statistics.median(reward_times),
        samples_per_step=samples, measured_steps=len(measured), warmup_steps=args.warmup,
        seconds=step_s, seconds_sampling=median_of(measured, "seconds_sampling"),
        seconds_reward_wait=median_of(measured, "seconds_reward_wait"),
        seconds_training=median_of(measured, "seconds_training"),
        seconds_per_step=[r["seconds"] for r in measured],
        cpu_seconds=statistics.median(cpu) if cpu else math.nan, cpu_seconds_per_step=cpu,
        pure_seconds=pure_step, pure_rollout_seconds=pure_rollout, pure_train_seconds=pure_train,
        tflop_per_step=flops_step / 1e12, achieved_tflops=flops_step / step_s / 1e12,
        calls=[dict(phase=phase_of[s], per_step=per_step[s], seconds=seconds[s], tflop=flops[s] / 1e12,
                    autocast=str(recorder.calls[s]["autocast"]), shapes={name: list(shape) for name, shape, _ in s[1]})
               for s in recorder.calls],
        train_wall_seconds=wall, train_argv=train_argv, torch=torch.__version__,
        reward=args.reward, sde_window=targs.get("sde_window"), flash=targs.get("flash"),
        gradient_checkpointing=targs.get("gradient_checkpointing"),
    )
    peak = args.peak_tflops if args.peak_tflops is not None else (989.0 if device.type == "cuda" else None)
    if peak:
        result.update(peak_tflops=peak, mfu=flops_step / step_s / (peak * 1e12), pure_mfu=flops_step / pure_step / (peak * 1e12))
    return result


# ----------------------------------------------------------------------------- reporting
def report(r):
    lines = [
        f"bench {r['model']} on {r['device']} | {r['samples_per_step']:g} samples/step | median of {r['measured_steps']} steps after {r['warmup_steps']} warm-up",
        f"  end-to-end {r['end_to_end_samples_per_s']:.3f} samples/s ({r['seconds']:.2f} s/step, {r['cpu_seconds']:.2f} CPU s/step)",
        f"  rollout    {r['rollout_samples_per_s']:.3f} samples/s ({r['seconds_sampling']:.2f} s; pure {r['pure_rollout_seconds']:.2f} s; x{r['rollout_overhead']:.3f})",
        f"  update     {r['train_samples_per_s']:.3f} samples/s ({r['seconds_training']:.2f} s; pure {r['pure_train_seconds']:.2f} s; x{r['train_overhead']:.3f})",
        f"  reward     {r['reward_images_per_s']:.1f} images/s alone ({r['reward']}); waited {r['seconds_reward_wait']:.2f} s/step",
        f"  overhead ratio {r['overhead_ratio']:.3f} (median over steps of step / pure compute; medians {r['seconds']:.2f} s / {r['pure_seconds']:.2f} s)",
        f"  peak memory {r['peak_mem_mib']:.0f} MiB allocated, {r['peak_reserved_mib']:.0f} MiB reserved | "
        f"first-update |ratio - 1| {r['first_ratio_dev']:.2e} | {r['tflop_per_step']:.3f} TFLOP/step, {r['achieved_tflops']:.3f} TFLOP/s"
        + (f" | MFU {100 * r['mfu']:.1f} % of {r['peak_tflops']:g} (pure compute {100 * r['pure_mfu']:.1f} %)" if "mfu" in r else ""),
    ]
    for c in r["calls"]:
        shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in c["shapes"].items())
        amp = "" if c["autocast"] == "None" else f" {c['autocast'].replace('torch.', '')}"
        lines.append(f"    {c['phase']:9s} {c['per_step']:6.1f}/step x {1e3 * c['seconds']:8.2f} ms  {c['tflop']:.4f} TFLOP{amp}  [{shapes}]")
    print("\n".join(lines), flush=True)


def run_each(args, mode, variants):
    """Bench the recipe once per variant (extra train.py flags), each in its own process (clean peak memory)."""
    results = {}
    with tempfile.TemporaryDirectory(prefix=f"bench-{mode}-") as tmp:
        for name, flags in variants.items():
            path = os.path.join(tmp, f"{name.replace('+', '_')}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--reward", args.reward, "--repeats", str(args.repeats), "--json", path]
            cmd += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops is not None else []
            cmd += ["--threads", str(args.threads)] if args.threads else []
            cmd += ["--"] + args.train_args + flags
            print(f"--{mode} {name}: {' '.join(cmd[1:])}", flush=True)
            proc = subprocess.run(cmd)
            if proc.returncode:
                raise SystemExit(f"error: --{mode} {name} failed (exit {proc.returncode}); "
                                 "rerun the command above to see why")
            with open(path) as f:
                results[name] = json.load(f)
    return results


def run_windows(args):
    """Each window mode in its own process; speed-up = end-to-end samples/s over `all`."""
    window = ["--window-size", str(args.window_size)]
    results = run_each(args, "windows",
                       {name: flags + ([] if name == "all" else window) for name, flags in WINDOWS.items()})
    base = results["all"]["end_to_end_samples_per_s"]
    speedup = {name: r["end_to_end_samples_per_s"] / base for name, r in results.items()}
    # The same speed-up from the call counts alone, every call priced at `all`'s bare time: what the window
    # saves in model compute, free of the load differences between the four runs.
    price = {(c["phase"], json.dumps(c["shapes"])): c["seconds"] for c in results["all"]["calls"]}
    cost = {name: sum(c["per_step"] * price.get((c["phase"], json.dumps(c["shapes"])), c["seconds"]) for c in r["calls"])
            for name, r in results.items()}
    compute_speedup = {name: cost["all"] / cost[name] for name in results}
    # Each run's step = its overhead ratio x its pure compute, and the ratio is timed against the load of its own
    # moment, so compute speed-up x (overhead of all / overhead of the window) is the speed-up at equal load.
    equal_load = {name: compute_speedup[name] * results["all"]["overhead_ratio"] / r["overhead_ratio"] for name, r in results.items()}
    print(f"\n{'window':10s} {'end-to-end':>11s} {'speed-up':>9s} {'at equal load':>14s} {'compute':>9s} {'rollout':>9s} {'update':>9s} {'overhead':>9s}")
    for name, r in results.items():
        print(f"{name:10s} {r['end_to_end_samples_per_s']:11.3f} {speedup[name]:8.2f}x {equal_load[name]:13.2f}x {compute_speedup[name]:8.2f}x "
              f"{r['rollout_samples_per_s']:9.3f} {r['train_samples_per_s']:9.3f} {r['overhead_ratio']:9.3f}")
    print("(samples/s; speed-up: end-to-end samples/s over all's; compute: from the counted calls priced at all's bare times; "
          "at equal load: compute x all's overhead ratio / the window's)")
    return dict(windows=results, speedup_vs_all=speedup, compute_speedup_vs_all=compute_speedup, equal_load_speedup_vs_all=equal_load)


def run_losses(args):
    """GRPO, DiffusionNFT and AWM on the same model and batch, each in its own process; speed-up over grpo's
    end-to-end samples/s, and each run's overhead ratio (step time / the model compute inside it)."""
    results = run_each(args, "losses", LOSSES)
    base = results["grpo"]["end_to_end_samples_per_s"]
    speedup = {name: r["end_to_end_samples_per_s"] / base for name, r in results.items()}
    # Load-free companions, as --windows: every counted call priced at grpo's bare time of the same kind and shapes
    # (a no-grad training forward that grpo does not make, at the run's own time).
    price = {(c["phase"], json.dumps(c["shapes"])): c["seconds"] for c in results["grpo"]["calls"]}
    cost = {name: sum(c["per_step"] * price.get((c["phase"], json.dumps(c["shapes"])), c["seconds"])
                      for c in r["calls"]) for name, r in results.items()}
    compute_speedup = {name: cost["grpo"] / cost[name] for name in results}
    equal_load = {name: compute_speedup[name] * results["grpo"]["overhead_ratio"] / r["overhead_ratio"]
                  for name, r in results.items()}
    print(f"\n{'loss':6s} {'end-to-end':>11s} {'vs grpo':>8s} {'at equal load':>14s} {'compute':>8s} {'rollout':>9s} "
          f"{'update':>9s} {'overhead':>9s} {'rollout fwd':>12s} {'train fwd+bwd':>14s} {'frozen fwd':>11s}")
    for name, r in results.items():
        calls = {phase: sum(c["per_step"] for c in r["calls"] if c["phase"] == phase)
                 for phase in ("rollout", "train", "reference")}
        print(f"{name:6s} {r['end_to_end_samples_per_s']:11.3f} {speedup[name]:7.2f}x {equal_load[name]:13.2f}x "
              f"{compute_speedup[name]:7.2f}x {r['rollout_samples_per_s']:9.3f} {r['train_samples_per_s']:9.3f} "
              f"{r['overhead_ratio']:9.3f} {calls['rollout']:12.1f} {calls['train']:14.1f} {calls['reference']:11.1f}")
    print("(samples/s; vs grpo: end-to-end samples/s over grpo's; compute: the counted calls priced at grpo's bare "
          "times; at equal load: compute x grpo's overhead ratio / the loss's; overhead: step seconds / the bare model "
          "calls inside it; calls per step: transformer forwards of the rollout, forwards + backwards of the update, "
          "no-grad forwards while training)")
    return dict(losses=results, speedup_vs_grpo=speedup, compute_speedup_vs_grpo=compute_speedup,
                equal_load_speedup_vs_grpo=equal_load)


def run_baseline(args):
    """The recipe against the recipe + --baseline's flags, --rounds pairs of runs in alternating order (ABBA...), each
    in its own process: the recipe's median step seconds over the baseline's, per pair, and their median."""
    variants = {"baseline": shlex.split(args.baseline), "recipe": []}
    rounds = []
    for r in range(args.rounds):
        order = dict(reversed(variants.items())) if r % 2 else variants  # baseline first, then recipe first, ...
        rounds.append(run_each(args, "baseline", order))
    time_ratios = [rr["recipe"]["seconds"] / rr["baseline"]["seconds"] for rr in rounds]
    cpu_ratios = [rr["recipe"]["cpu_seconds"] / rr["baseline"]["cpu_seconds"] for rr in rounds]
    pure_ratios = [rr["recipe"]["pure_seconds"] / rr["baseline"]["pure_seconds"] for rr in rounds]
    print(f"\n{'round':6s} {'baseline s/step':>16s} {'recipe s/step':>14s} {'time ratio':>11s} {'CPU ratio':>10s} "
          f"{'pure ratio':>11s}")
    for r, (rr, tr, cr, pr) in enumerate(zip(rounds, time_ratios, cpu_ratios, pure_ratios)):
        print(f"{r:<6d} {rr['baseline']['seconds']:16.2f} {rr['recipe']['seconds']:14.2f} {tr:11.3f} {cr:10.3f} {pr:11.3f}")
    result = dict(baseline_flags=variants["baseline"], rounds=rounds, time_ratios=time_ratios, pure_ratios=pure_ratios,
                  cpu_ratios=cpu_ratios, time_ratio=statistics.median(time_ratios),
                  cpu_ratio=statistics.median(cpu_ratios), pure_ratio=statistics.median(pure_ratios))
    print(f"recipe / baseline: step time x{result['time_ratio']:.3f}, CPU seconds x{result['cpu_ratio']:.3f}, "
          f"bare model calls x{result['pure_ratio']:.3f} "
          f"(median of {args.rounds} pairs; baseline: the recipe + {args.baseline})")
    return result


def _unifiedreward_stub():
    """A local OpenAI-compatible server that answers every request at once with a UnifiedReward-style reply: timing
    the `unifiedreward` client alone (PNG encoding, HTTP, parsing), not a model."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    reply = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
                                                             "content": "object (type): 1\nFinal Score: 3"}}]}).encode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def reward_flops():
    """FLOPs per image of the real models behind the new scorers, from their published configs: each architecture
    is built on the meta device (no weights, no download) and run under torch.utils.flop_counter.FlopCounterMode.
    Qwen2-VL's vision tower needs real grid values, so it runs on the CPU at full width with 1 and 2 blocks and is
    extrapolated linearly to its 32. Matmuls and attention only (norms and activations are not counted)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import (BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel, CLIPConfig,
                              CLIPModel, Qwen2VLConfig, Qwen2VLModel)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    def count(fn):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    meta = dict(device="meta")
    # openai/clip-vit-large-patch14 config.json; 77 text tokens, the most CLIP reads
    clip_config = CLIPConfig(projection_dim=768, text_config=dict(hidden_size=768, intermediate_size=3072,
                                                                  num_hidden_layers=12, num_attention_heads=12),
                             vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                                num_attention_heads=16, patch_size=14, image_size=224))
    with torch.device("meta"):
        clip = CLIPModel(clip_config).eval()
    clip_image = count(lambda: clip.get_image_features(pixel_values=torch.zeros(1, 3, 224, 224, **meta)))
    clip_text = count(lambda: clip.get_text_features(input_ids=torch.zeros(1, 77, dtype=torch.long, **meta)))
    # ImageReward: BLIP's ViT-L/16 at 224 (BLIP/blip.py, create_vit "large") and BERT-base with cross-attention
    # (its med_config.json), the prompt padded to 35 tokens; no attention masks (the meta device has no values)
    with torch.device("meta"):
        vit = BlipVisionModel(BlipVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                               num_attention_heads=16, image_size=224, patch_size=16)).eval()
        bert = BlipTextModel(BlipTextConfig(vocab_size=30524, hidden_size=768, intermediate_size=3072,
                                            num_hidden_layers=12, num_attention_heads=12, encoder_hidden_size=1024,
                                            is_decoder=True), add_pooling_layer=False).eval()
    imagereward = count(lambda: bert(input_ids=torch.zeros(1, 35, dtype=torch.long, **meta), encoder_hidden_states=vit(
        pixel_values=torch.zeros(1, 3, 224, 224, **meta)).last_hidden_state))
    # HPSv3: Qwen/Qwen2-VL-7B-Instruct config.json; a square image gives 1024 patches of 14 px, 256 tokens after the
    # 2 x 2 merge. Text tokens: the chat template's 8 special tokens and its words, with CLIP's BPE standing in for
    # Qwen2's (not available offline; on English prose Qwen2's larger vocabulary makes no more tokens).
    vision = dict(embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    per_depth = []
    for depth in (1, 2):
        tower = Qwen2VisionTransformerPretrainedModel._from_config(
            Qwen2VLConfig(vision_config=dict(vision, depth=depth)).vision_config).eval()
        per_depth.append(count(lambda: tower(torch.zeros(1024, 3 * 2 * 14 * 14), grid_thw=torch.tensor([[1, 32, 32]]))))
    hpsv3_vision = per_depth[0] + 31 * (per_depth[1] - per_depth[0])
    words = ("system\nYou are a helpful assistant.\nuser\n" + reward_models.hpsv3_text(
        "a photo of an astronaut riding a horse on the moon, highly detailed") + "\nassistant\n")
    tokenizer = families.common.clip_tokenizer()
    tokenizer.model_max_length = 10**6  # counting, not encoding for CLIP: no length warning
    tokens = 256 + 8 + len(tokenizer(words, add_special_tokens=False)["input_ids"])
    config = Qwen2VLConfig(text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                            num_attention_heads=28, num_key_value_heads=4, vocab_size=151658,
                                            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
                           vision_config=dict(vision, depth=1))
    with torch.device("meta"):
        language = Qwen2VLModel(config).language_model.eval()
    hpsv3_text = count(lambda: language(inputs_embeds=torch.zeros(1, tokens, 3584, **meta),
                                        position_ids=torch.arange(tokens, **meta)[None]))
    head = 2 * (3584 * 1024 + 1024 * 16 + 16 * 2)  # rm_head, float32
    return {"imagereward": imagereward, "hpsv3": hpsv3_vision + hpsv3_text + head, "clipscore": clip_image + clip_text,
            "aesthetic": clip_image + 2 * (768 * 1024 + 1024 * 128 + 128 * 64 + 64 * 16 + 16)}, tokens


def reward_throughput(args):
    """images/s of each offline scorer on this machine (the model scorers as tiny random stand-ins, the unifiedreward
    client against a local server that answers at once), and the FLOPs per image of the real models."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(0)
    n, size = args.reward_images, args.reward_size
    images, prompts = [], []
    for i in range(n):  # smooth colour fields with a line of text: JPEG and OCR behave as on real samples
        img = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
        ImageDraw.Draw(img).text((size // 10, size // 2), f"Sample {i}", fill="black", font=ImageFont.load_default(size=size // 10))
        images.append(np.asarray(img))
        prompts.append(f'a sign that says "Sample {i}"')
    images, metadata = np.stack(images), [{}] * n
    print(f"{os.cpu_count()} CPU threads, torch {torch.__version__}, {n} images of {size}x{size} per call")
    result, per_cpu = {}, {}

    def bench(label, score, repeats=2):
        score(images[:2], prompts[:2], metadata[:2])  # warm-up (loads the model)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(repeats):
            score(images, prompts, metadata)
        result[label] = repeats * n / (time.perf_counter() - start)
        # CPU seconds of this process, all its threads: on a shared machine this rate holds where wall time does not
        per_cpu[label] = repeats * n / max(time.process_time() - cpu, 1e-9)
        print(f"{label:44s} {result[label]:8.1f} images/s {per_cpu[label]:8.1f} images per CPU-second")

    options = dict({k: getattr(args, k) for k in rewards.option_defaults()}, device="cpu")
    bench("jpeg_compressibility", rewards.jpeg_compressibility(**options))
    bench("jpeg_incompressibility", rewards.jpeg_incompressibility(**options))
    bench(f"ocr ({args.ocr_backend}, {args.ocr_workers} worker(s))", rewards.ocr(**options), repeats=1)
    with tempfile.TemporaryDirectory() as tmp:
        # 224 px in patches of 14: the 256 image tokens of ViT-H-14, in a 2-layer, 32-wide model
        folder = reward_fixtures.tiny_pickscore(os.path.join(tmp, "pickscore"), image_size=224, patch_size=14)
        bench("pickscore (tiny random CLIP stand-in)",
              reward_models.pickscore(**dict(options, pickscore_processor_path=folder, pickscore_model_path=folder)))
        name, path = reward_fixtures.tiny_hps(os.path.join(tmp, "hps"), image_size=224, patch_size=14)
        bench("hps (tiny random open_clip stand-in)",
              reward_models.hps(**dict(options, hps_checkpoint_path=path, hps_model_name=name)))
        bench("clipscore (tiny random CLIP stand-in)", reward_models.clipscore(**dict(options, clipscore_model_path=folder)))
        # the real models' image tokens: 224 px in patches of 16 (ImageReward); HPSv3 resizes to 448 px itself
        ir = reward_fixtures.tiny_imagereward(os.path.join(tmp, "imagereward"), image_size=224, patch_size=16)
        bench("imagereward (tiny random BLIP stand-in)", reward_models.imagereward(
            **dict(options, imagereward_model_path=ir, imagereward_tokenizer_path=ir)))
        base, checkpoint = reward_fixtures.tiny_hpsv3(os.path.join(tmp, "hpsv3"))
        bench("hpsv3 (tiny random Qwen2-VL stand-in)",
              reward_models.hpsv3(**dict(options, hpsv3_base_path=base, hpsv3_checkpoint_path=checkpoint)), repeats=1)
        clip, mlp = reward_fixtures.tiny_aesthetic(os.path.join(tmp, "aesthetic"), image_size=224, patch_size=14)
        bench("aesthetic (tiny random CLIP stand-in)",
              reward_models.aesthetic(**dict(options, aesthetic_clip_path=clip, aesthetic_mlp_path=mlp)))
    server = _unifiedreward_stub()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        bench("unifiedreward (client, instant local server)",
              reward_services.unifiedreward(**dict(options, unifiedreward_url=url)))
    finally:
        server.shutdown()
        server.server_close()
    flops, tokens = reward_flops()
    print(f"FLOPs per image of the real models (HPSv3: {tokens} tokens into Qwen2-VL-7B's language model):")
    for name, value in flops.items():
        print(f"{name:44s} {value / 1e9:8.1f} GFLOP")
    print("unifiedreward                                served model: 2 x parameters per token read and written")
    return {"reward_images_per_s": result, "reward_images_per_cpu_s": per_cpu, "reward_flops_per_image": flops,
            "hpsv3_tokens": tokens}


def main(argv=None):
    args = parse_args(argv)
    if args.rewards:
        result = reward_throughput(args)
    elif args.windows:
        result = run_windows(args)
    elif args.losses:
        result = run_losses(args)
    elif args.baseline is not None:
        result = run_baseline(args)
    else:
        result = run(args)
        report(result)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not (args.windows or args.rewards or args.losses or args.baseline is not None):
        bad = [k for k in REQUIRED_KEYS + (("mfu",) if "mfu" in result else ()) if not (math.isfinite(result[k]) and result[k] > 0)]
        if bad:
            raise SystemExit(f"error: non-finite or non-positive figures {bad}; see the table above")
    return result


if __name__ == "__main__":
    main()
