"""The league: every algorithm of this repository on the shapes world, at equal samples and at equal wall-clock.

Every entry (algorithm or sampler) runs at its own learning rate, chosen on one seed, then on 3 seeds:

    python scripts/league.py               # 14 entries: 3-lr sweep on seed 0, then seeds 1 2 -> runs/league/
    python scripts/league.py --only grpo nft --lrs 1e-4 --sweep-seed 0 --seeds 0 --samples 64  # a quick look
    python scripts/league.py --report      # the tables and the plot again from the finished runs
    python scripts/league.py --report --readme README.md --doc docs/league.md --copy-to docs/runs/league/judge
                                                  # and the one-table summary into the README, the full tables into
                                                  # docs/league.md (each between its markers), the plot and JSON there

Each entry is `python train.py` on its defaults (`--model shapes`: the pretrained 32 px model, GenEval prompts of the
shapes world, the exact GenEval judge) plus COMMON and the entry's flags below. What is held equal:

- **samples**: every run trains on `--samples` samples (default: the default run's, train.py's steps x prompts per
  step x group size), at train.py's samples per step; entries that train fewer forwards per sample (the windows)
  get no more samples. The held-out set (360 prompts, ODE, fixed noise, the strict GenEval accuracy: the mean of
  the six per-tag accuracies) is evaluated at `--evals` sample counts or more, 0 and the last included.
- **wall-clock**, separately: the accuracy each entry reached at its latest evaluation within the same training
  minutes (`--minutes`; default the fastest entry's median, so that the budget falls within every entry's curves),
  read from the same curves. Training minutes are the sum of metrics.jsonl's per-step `seconds` (sampling, rewards and
  the update; evaluations and checkpoints not counted), with `--jobs` runs sharing the machine.
- **speed-up over Flow-GRPO**, as the papers count theirs: the samples and the training minutes each entry takes to
  first reach a `--reference` entry's final accuracy, mean over seeds, read between evaluations; a table for grpo
  (Flow-GRPO's loss on the repository's default sampler) and one for flow (its loss and its own SDE step, the
  Flow-GRPO the papers ran).
- **learning rate**: each entry's is chosen on one seed (`--sweep-seed`) from `--lrs`, the best final held-out
  accuracy (ties to the smaller), then the entry runs `--seeds` at it. The sweep seed is by default seed 0, one of
  the table's seeds, whose run at the chosen lr is reused (14 runs saved; that seed flatters its entry a little: a
  sweep seed outside the table, `--sweep-seed 3`, costs 3 runs an entry more).

Outputs in --out: a run folder per entry, lr and seed (`grpo-lr1e-4-s0/`, train.py's), its log (`.log`) and its
league record (`.json`: the train.py flags, and `done` once the run reached its last step and evaluation; a killed
or failed run is never marked); league.md (the tables, the command, the machine), league.png (accuracy against
samples and against training minutes, each entry its own colour and line) and league.json. The README's summary
(`--readme`) is one table: each entry's rise over seeds, its speed-up over flow (Flow-GRPO as its authors ran it)
and its samples per second. A finished run is not run again; an interrupted one continues from its last checkpoint
(`--resume auto`, checkpoints every `--save-every` steps; a finished run's are removed unless `--keep-weights`); a
run whose flags changed starts over. Runs go `--jobs` at a time with `--threads` torch threads each; an entry's
seeds start as soon as its sweep has finished. The exit status is non-zero, naming the first failed run, when any
run failed.

Seconds per step measured alone: `--measure-speed` runs each entry (--only) for `--speed-steps` steps with nothing
else of the league running and all CPUs' threads, evaluations off, and writes the median seconds of its steps after
the first into `--speeds FILE`; a report given such a file times every entry's curve by it (step x seconds per
step), the equal wall-clock table included, instead of by the league's own runs, which share the machine.

`--ledger FILE` (a JSON line per finished run: its record with its curve) carries the league across machines: give
it a path inside the repository and commit it as rows land. A league started with the same ledger on a new machine,
or with an empty --out, takes every finished run from it and runs only the rest; `--report` reads it too.

Cost of the default league: 70 runs (14 entries x 3 lrs on seed 0, then seeds 1 2 at the chosen lr) of the
default run's samples (100 steps x 128 = 12,800 with train.py's present defaults: 896,000 in all) and 5 held-out
evaluations each; at the default run's ~5 s per step (the windows less, the full-trajectory reverse losses more),
about 12-18 hours on 2 otherwise idle cores. `--samples 3200` (a quarter) or `--only` and fewer `--lrs` make a
shorter league.
"""
import argparse
import collections
import fcntl
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoints  # noqa: E402
import eval as evaluation  # noqa: E402
import flags  # noqa: E402
import geneval  # noqa: E402
import shapes  # noqa: E402
import train  # noqa: E402

TRAIN = [sys.executable, os.path.join(ROOT, "train.py")]  # the command each run starts with
# Flags for every entry, over train.py's defaults (e.g. ["--prompts-per-step", "16"]): the samples per step and the
# default --samples budget follow them.
COMMON = []
# name -> (what it is, flags over train.py's shapes defaults). Settings the papers tie to the algorithm
# (window sizes, flash ratio, the forward-process losses' solvers and schedules) are train.py's or the recipes'.
ENTRIES = {
    "grpo": ("Flow-GRPO loss, coefficient-preserving steps", ["--loss", "grpo", "--sde", "cps"]),
    "flow": ("Flow-GRPO loss and SDE step", ["--loss", "grpo", "--sde", "flow"]),
    # DanceGRPO's step at its authors' noise level, eta 0.3 (DanceGRPO scripts/finetune/finetune_flux_grpo.sh), not
    # the shapes preset's 0.7 (Flow-GRPO's a, of another formula): its std eta sqrt(-dt) is the same at every step,
    # and at 0.7 the base model's rollouts score +0.16 (accuracy 0.03) against +0.42 at 0.3 (seed 0, first step).
    "dance": ("DanceGRPO's SDE step at its noise level", ["--loss", "grpo", "--sde", "dance", "--eta", "0.3"]),
    "guard": ("GRPO-Guard: RatioNorm and gradient reweighting (Flow-GRPO's SDE)", ["--loss", "guard", "--sde", "flow"]),
    # FlowDPPO's mask acts only off-policy: with one optimizer step per batch its KL to the old policy is 0, nothing
    # is masked and the entry is grpo to the last digit. It takes its recipe's two optimizer steps per batch, the
    # second off-policy (UniRL's num_updates_per_batch 2: recipes/sd3_flowdppo_pickscore.args --minibatches 2).
    "flowdppo": ("FlowDPPO: KL-masked trust region, two optimizer steps per batch",
                 ["--loss", "flowdppo", "--sde", "cps", "--minibatches", "2"]),
    # The windows as the authors place them over a run, scaled to 10 steps and 100 training steps. Flow-GRPO-Fast
    # draws its window inside the first half of the schedule (sde_window_range (0, num_steps // 2), as
    # recipes/sd3_fast_nocfg_cps.args). MixGRPO slides its 4-step window by one step every 25 iterations (Flash:
    # 20) for 300 iterations over 25 steps: it starts at steps 0 .. 11 (0 .. 14), covers steps 0 .. 14 (0 .. 17),
    # and never reaches the end, where its roll-back would act (recipes/flux_mixgrpo*.args). Here a 3-step window
    # every 25 (20) of 100 steps starts at 0 .. 3 (0 .. 4) and covers steps 0 .. 5 (0 .. 6) of 10: the same share.
    "fast": ("Flow-GRPO-Fast: a window of 3 SDE steps in the first half",
             ["--loss", "grpo", "--sde", "cps", "--sde-window", "fast", "--window-size", "3",
              "--window-range", "0", "5"]),
    "mix": ("MixGRPO: a window of 3 SDE steps sliding every 25 steps",
            ["--loss", "grpo", "--sde", "cps", "--sde-window", "mix", "--window-size", "3",
             "--iters-per-window", "25"]),
    "mix-flash": ("MixGRPO-Flash: the window sliding every 20 steps, DPM-Solver++ after it",
                  ["--loss", "grpo", "--sde", "cps", "--sde-window", "mix", "--window-size", "3",
                   "--iters-per-window", "20", "--flash"]),
    "nft": ("DiffusionNFT: forward process, ODE rollouts, as the default run", ["--loss", "nft"]),
    "awm": ("Advantage Weighted Matching: forward process, ODE rollouts", ["--loss", "awm"]),
    "sft": ("online SFT (flow_grpo): each group's best samples as flow-matching targets", ["--loss", "sft"]),
    "dpo": ("online DPO (flow_grpo): Diffusion-DPO on each group's best-worst pair", ["--loss", "dpo"]),
    "dgpo": ("DGPO: group preferences on ODE rollouts", ["--loss", "dgpo"]),
    "crd": ("CRD: centred rewards matched by implicit rewards, Euler rollouts", ["--loss", "crd"]),
}
# The windows where the league's first setting placed them (docs/league.md, "Where the windows sit"): Flow-GRPO-Fast's
# anywhere in steps 0 .. 8, MixGRPO's sliding every 5 steps, so that it reaches the last three trainable steps by step
# 30 and stays there. Entries of their own, to measure what the recipes' placement is worth; not in the default --only.
PLACEMENTS = {
    "fast-any": ("Flow-GRPO-Fast's window of 3 anywhere in the schedule (the first setting)",
                 ["--loss", "grpo", "--sde", "cps", "--sde-window", "fast", "--window-size", "3"]),
    "mix-end": ("MixGRPO's window of 3 sliding every 5 steps, parked at the clean end (the first setting)",
                ["--loss", "grpo", "--sde", "cps", "--sde-window", "mix", "--window-size", "3",
                 "--iters-per-window", "5"]),
}
DEFAULT_ONLY = list(ENTRIES)
ENTRIES.update(PLACEMENTS)
LRS = [1e-4, 2e-4, 4e-4]
# The judge a run trained on and was measured with, kept in its record and ledger row: the code, not a flag, sets it,
# so two runs of the same flags on two judges differ only here. A record without it was measured before the field,
# on GenEval's 0.9 counting rule (docs/judge.md).
JUDGE = f"shapes judge, counting above {shapes.COUNTING_THRESHOLD}"
OLD_JUDGE = "shapes judge, counting above 0.9"
REFERENCES = ["grpo", "flow"]  # Flow-GRPO's loss on CPS steps, and on its own SDE step as the papers ran it


# ----------------------------------------------------------------------------- the plan
def lr_text(lr):
    """1e-4, 5e-5, 1.5e-4: the learning rate as folder names and tables show it (and as train.py gets it)."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def run_name(name, lr, seed):
    return f"{name}-lr{lr_text(lr)}-s{seed}"


def samples_per_step(argv):
    """Samples of one training step of train.py under argv (global: prompts per step x group size)."""
    _, args = train.parse_args(argv)
    return args.prompts_per_step * args.group_size


def default_samples():
    """The default run's samples: train.py's steps x samples per step, under COMMON."""
    _, args = train.parse_args(COMMON)
    return args.steps * args.prompts_per_step * args.group_size


def eval_every(steps, evals):
    """The largest divisor of steps that gives at least `evals` evaluations (step 0 and the last included)."""
    return max(d for d in range(1, steps + 1) if steps % d == 0 and steps // d >= min(evals - 1, steps))


def plan(args, p):
    """The league's bookkeeping from its flags: args.per_step (samples per step, equal for every entry), args.steps
    (from the --samples budget) and args.eval_every; refuses in one line what does not divide."""
    per_step = {name: samples_per_step([*COMMON, *ENTRIES[name][1]]) for name in args.only}
    if len(set(per_step.values())) > 1:
        p.error(f"entries train different samples per step ({per_step}): give every entry the same "
                "--prompts-per-step and --group-size (COMMON)")
    args.per_step = per_step[args.only[0]]
    args.samples = args.samples or default_samples()
    if args.samples % args.per_step:
        low = max(args.per_step, args.samples - args.samples % args.per_step)
        p.error(f"--samples {args.samples} is not a whole number of steps of {args.per_step} samples: use --samples "
                f"{low} or {low + args.per_step}")
    args.steps = args.samples // args.per_step
    args.eval_every = eval_every(args.steps, args.evals)
    return args


def train_flags(name, lr, seed, args):
    """train.py's flags of one run that identify it (without --out, how it starts and its checkpoints)."""
    return ["--seed", str(seed), "--lr", lr_text(lr), "--steps", str(args.steps), "--eval-every", str(args.eval_every),
            "--log-images-every", "0", *COMMON, *ENTRIES[name][1]]


def sweep_runs(name, args):
    return [(name, lr, args.sweep_seed) for lr in args.lrs]


def all_runs(args):
    """Every run the league could hold: each entry at each lr, on the sweep seed and the table's seeds."""
    seeds = sorted({args.sweep_seed, *args.seeds})
    return [(name, lr, seed) for name in args.only for lr in args.lrs for seed in seeds]


# ----------------------------------------------------------------------------- run records and curves
def record_path(out, run):
    return os.path.join(out, run_name(*run) + ".json")


def read_record(out, run):
    """The league's record of a run ({flags, done, eval0, ...}), or None (none yet, or unreadable)."""
    try:
        with open(record_path(out, run)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("flags"), list) else None


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)  # a killed league never leaves a half-written file


def write_record(out, run, record):
    write_json(record_path(out, run), record)


def last_rows(path):
    """{step: row} of a run's JSONL file, the last row of each step (torn lines skipped)."""
    rows, _ = checkpoints.read_jsonl(path)
    return {row["step"]: row for row in rows if isinstance(row, dict) and isinstance(row.get("step"), int)}


def read_curve(folder, eval0=None, steps=None):
    """The held-out curve of a run folder: [{step, samples, seconds, accuracy, tags, official, official_tags,
    diversity}] at every evaluation (official, official_tags: GenEval's own rule on the same images, eval.jsonl's
    `geneval_official_*`, None where not logged; diversity: the free-colour entropy of under-specified prompts,
    eval.py's `diversity_color`), seconds the training wall-clock up to that step (the sum of the per-step `seconds`
    of metrics.jsonl). With `steps`: None unless the run is complete (an evaluation at step 0 and at `steps`, a
    metrics row for every step in between). eval0 stands in for a step-0 evaluation that eval.jsonl lost (train.py's
    resume keeps rows of steps 1..N)."""
    try:
        with open(os.path.join(folder, "args.json")) as f:
            saved = json.load(f)["args"]
        per_step = saved["prompts_per_step"] * saved["group_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    metrics = last_rows(os.path.join(folder, "metrics.jsonl"))
    evals = last_rows(os.path.join(folder, "eval.jsonl"))
    if 0 not in evals and eval0:
        evals[0] = eval0
    if steps is not None and (0 not in evals or steps not in evals or not set(range(1, steps + 1)) <= set(metrics)):
        return None
    points = []
    for step in sorted(evals):
        row = evals[step]
        if not isinstance(row.get("geneval_overall"), (int, float)):  # not a GenEval evaluation, or NaN (null)
            return None
        seconds = sum(metrics[s].get("seconds", 0.0) for s in metrics if s <= step)
        points.append(dict(step=step, samples=step * per_step, seconds=seconds, accuracy=row["geneval_overall"],
                           tags={tag: row.get(f"geneval_{tag}") for tag in geneval.TAGS},
                           official=row.get("geneval_official_overall"),
                           official_tags={tag: row.get(f"geneval_official_{tag}") for tag in geneval.TAGS},
                           diversity=row.get("diversity_color")))  # of under-specified prompts; None if not logged
    return points


def curve(out, run):
    """The curve of a finished run of the league (marked done), or None. A record's curve that is not a list of
    evaluations with numbers (an edited or damaged record: a null point or accuracy) stops the report in one line."""
    record = read_record(out, run)
    if not (record and record.get("done")):
        return None
    if isinstance(record.get("curve"), list):  # kept in the record since the ledger: the folder may be gone
        for i, point in enumerate(record["curve"]):
            if not (isinstance(point, dict) and all(number(point.get(k)) for k in ("step", "samples", "seconds",
                                                                                   "accuracy"))):
                raise SystemExit(f"error: {record_path(out, run)}: evaluation {i} of its curve is "
                                 f"{json.dumps(point)[:80]}, not numbers (an edited or damaged record); restore it, "
                                 "or delete it to run that run again")
        return record["curve"]
    return read_curve(os.path.join(out, run_name(*run)), record.get("eval0"))


def number(value):
    """Whether value is a number (NaN included: a run's accuracy may be NaN; None, text and True are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def judge_of(record):
    """The judge a run's record names (OLD_JUDGE for records written before records named one)."""
    return record.get("judge", OLD_JUDGE)


def read_ledger(path):
    """{run name: record} of the finished runs a ledger holds (the last line of a name wins; torn lines skipped)."""
    rows, _ = checkpoints.read_jsonl(path)
    return {row["run"]: {k: v for k, v in row.items() if k != "run"} for row in rows
            if isinstance(row, dict) and isinstance(row.get("run"), str) and isinstance(row.get("flags"), list)
            and row.get("done") and isinstance(row.get("curve"), list)}


def append_ledger(path, run, record):
    """One line for a finished run, flushed to disk before the league goes on."""
    with open(path, "a") as f:
        f.write(json.dumps(dict(run=run_name(*run), **record)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def restore_ledger(args):
    """The ledger's finished runs as --out's records, where --out has no finished record of them. -> how many. A
    league that runs takes only the rows of the present judge (JUDGE): a run trained on another judge's reward is run
    again, with one line saying how many; a report takes every row (check_records then refuses a mix)."""
    if not args.ledger:
        return 0
    ledger, restored, other = read_ledger(args.ledger), 0, collections.Counter()
    for run in all_runs(args):
        row = ledger.get(run_name(*run))
        here = read_record(args.out, run)
        if row and not args.report and judge_of(row) != JUDGE:
            other[judge_of(row)] += 1
        elif row and not (here and here.get("done")):
            write_record(args.out, run, row)
            restored += 1
    for judge, count in other.items():
        print(f"{count} finished run(s) of the ledger {args.ledger} trained on another judge ({judge}; this league's: "
              f"{JUDGE}) are run again", flush=True)
    return restored


def check_records(args):
    """One line, before anything runs or is reported, when a finished run of --out was run with other flags, or on
    another judge than this league's (JUDGE; a report: than the other finished runs')."""
    judges = {}
    for run in all_runs(args):
        record = read_record(args.out, run)
        if record and record.get("done") and record["flags"] != train_flags(*run, args):
            was = shlex.join(record["flags"])
            raise SystemExit(f"error: {os.path.join(args.out, run_name(*run))} was run with `{was}`, not with this "
                             "league's flags (--samples, --evals, COMMON or the entry's): give the flags it "
                             "ran with, or another --out")
        if record and record.get("done"):
            judges.setdefault(judge_of(record), run_name(*run))
    if not args.report and set(judges) - {JUDGE}:
        judge = min(set(judges) - {JUDGE})
        raise SystemExit(f"error: {os.path.join(args.out, judges[judge])} trained on another judge ({judge}; this "
                         f"league's: {JUDGE}): give another --out")
    if len(judges) > 1:
        (a, first), (b, second) = sorted(judges.items())[:2]
        raise SystemExit(f"error: {args.out} mixes runs of two judges ({first}: {a}; {second}: {b}): report each "
                         "judge's runs from their own --out and ledger")
    args.judge = next(iter(judges), JUDGE)


# ----------------------------------------------------------------------------- the learning rate
def choose_lr(finals):
    """{lr: final held-out accuracy} -> the best lr; ties (to 6 decimals) go to the smaller one; a NaN (a diverged run)
    is never the best. None when none is a finite number."""
    finals = {lr: a for lr, a in finals.items() if number(a) and math.isfinite(a)}
    if not finals:
        return None
    return max(sorted(finals), key=lambda lr: round(finals[lr], 6))


def sweep_finals(name, args):
    """{lr: final held-out accuracy} of the entry's finished sweep runs."""
    curves = {run[1]: curve(args.out, run) for run in sweep_runs(name, args)}
    return {lr: c[-1]["accuracy"] for lr, c in curves.items() if c}


# ----------------------------------------------------------------------------- running
def last_error(path, offset=0):
    """The last line of a log (from byte offset) that reads as an error, else its last line."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    errors = [line for line in lines if line.lower().startswith("error") or "Error" in line]
    return (errors or lines or ["(empty log)"])[-1]


def run_env(threads):
    """The environment of a train.py run: its torch threads, and a live log."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")


def launch(run, args):
    """Start one run: continued (--resume auto) when its record holds the same flags, started over otherwise."""
    folder, flags_now = os.path.join(args.out, run_name(*run)), train_flags(*run, args)
    record = read_record(args.out, run)
    same = record is not None and record["flags"] == flags_now and judge_of(record) == JUDGE
    eval0 = record.get("eval0") if same else None
    if same and 0 in (evals := last_rows(os.path.join(folder, "eval.jsonl"))):
        eval0 = evals[0]  # a resume drops eval.jsonl's step-0 row: the league keeps it
    write_record(args.out, run, dict(flags=flags_now, done=False, eval0=eval0, machine=machine(args), judge=JUDGE))
    how = ["--resume", "auto"] if same or not os.path.exists(folder) else ["--overwrite"]
    command = [*TRAIN, "--out", folder, *how, "--save-every", str(args.save_every), "--keep-checkpoints", "1",
               *flags_now]
    log_path = folder + ".log"
    log = open(log_path, "ab")
    offset = log.tell()
    log.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n".encode())
    log.flush()
    process = subprocess.Popen(command, cwd=ROOT, env=run_env(args.threads), stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    return dict(run=run, process=process, log=log, log_path=log_path, offset=offset, started=time.time())


def finish(job, args):
    """Mark a run that ended done when it is complete, -> None; else the failure (run, log, last error line)."""
    job["log"].close()
    run, rc = job["run"], job["process"].returncode
    folder = os.path.join(args.out, run_name(*run))
    record = read_record(args.out, run) or {}
    points = read_curve(folder, record.get("eval0"), args.steps) if rc == 0 else None
    if points is None:
        why = f"rc {rc}" if rc else f"stopped before step {args.steps} and its evaluation"
        return run, job["log_path"], f"{why}: {last_error(job['log_path'], job['offset'])}"
    record.update(done=True, minutes=points[-1]["seconds"] / 60, wall_minutes=(time.time() - job["started"]) / 60,
                  load=os.getloadavg()[0], curve=points)
    write_record(args.out, run, record)
    if args.ledger:
        append_ledger(args.ledger, run, record)
    if not args.keep_weights:  # the league reads the curves only; 54 MB a run otherwise
        shutil.rmtree(os.path.join(folder, "checkpoints"), ignore_errors=True)
    return None


def next_run(args, state):
    """The next run to start: the table's seeds of an entry whose sweep has ended (at its chosen lr), then sweeps."""
    for name in args.only:
        sweep = sweep_runs(name, args)
        if all(state.get(run) in ("done", "failed") for run in sweep):
            lr = choose_lr(sweep_finals(name, args))
            for seed in args.seeds:
                if lr is not None and (name, lr, seed) not in state:
                    return name, lr, seed
    for name in args.only:
        for run in sweep_runs(name, args):
            if run not in state:
                return run
    return None


def run_league(args):
    """Run what is not finished, --jobs at a time. -> the failures [(run, log, last error line)], first first."""
    state = {run: "done" for run in all_runs(args) if curve(args.out, run) is not None}
    failures, running, start = [], [], time.time()

    def stamp():
        return f"[{(time.time() - start) / 60:6.1f} min]"

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        while True:
            while len(running) < args.jobs and (run := next_run(args, state)):
                state[run] = "running"
                running.append(launch(run, args))
                print(f"{stamp()} started {run_name(*run)}", flush=True)
            if not running:
                break
            time.sleep(args.poll)
            for job in [job for job in running if job["process"].poll() is not None]:
                running.remove(job)
                failure = finish(job, args)
                name = run_name(*job["run"])
                if failure:
                    state[job["run"]] = "failed"
                    failures.append(failure)
                    print(f"{stamp()} {name} failed ({failure[2]}); see {failure[1]}", flush=True)
                else:
                    state[job["run"]] = "done"
                    points = curve(args.out, job["run"])
                    print(f"{stamp()} {name}: accuracy {points[0]['accuracy']:.3f} -> {points[-1]['accuracy']:.3f} "
                          f"in {points[-1]['seconds'] / 60:.1f} training minutes", flush=True)
    except KeyboardInterrupt:  # stop the runs at a checkpoint (train.py saves on SIGTERM): a rerun continues them
        for job in running:
            job["process"].send_signal(signal.SIGTERM)
        print(f"{stamp()} stopping {len(running)} run(s): each saves at the end of its step or evaluation",
              file=sys.stderr, flush=True)
        for job in running:
            job["process"].wait()
            job["log"].close()
        print(f"{stamp()} interrupted: {len(running)} run(s) stopped at a checkpoint; the same command continues",
              file=sys.stderr, flush=True)
        raise SystemExit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return failures


# ----------------------------------------------------------------------------- seconds per step, measured alone
def read_speeds(path):
    """{entry: {seconds_per_step, steps, machine, ...}} of a --speeds file; {} when there is none."""
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            speeds = json.load(f)
    except ValueError:
        raise SystemExit(f"error: --speeds {path} is not JSON: measure again (--measure-speed) or give another file") \
            from None
    return {name: v for name, v in speeds.items() if isinstance(v, dict)
            and isinstance(v.get("seconds_per_step"), (int, float)) and v["seconds_per_step"] > 0}


def measure_speeds(args):
    """Each --only entry alone for --speed-steps steps (evaluations off, every CPU's thread), one after the other;
    its median seconds per step after the first (which builds what later steps reuse) into --speeds. -> the file's
    entries. A run that fails stops the measurement with its last error line."""
    speeds, threads = read_speeds(args.speeds), len(os.sched_getaffinity(0))
    for name in args.only:
        folder = os.path.join(args.out, f"speed-{name}")
        command = [*TRAIN, "--out", folder, "--overwrite", *train_flags(name, args.lrs[0], args.sweep_seed, args),
                   "--steps", str(args.speed_steps), "--eval-every", "0"]
        load = os.getloadavg()[0]
        with open(folder + ".log", "wb") as log:
            rc = subprocess.run(command, cwd=ROOT, env=run_env(threads), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL).returncode
        metrics = last_rows(os.path.join(folder, "metrics.jsonl"))
        seconds = [metrics[s]["seconds"] for s in range(2, args.speed_steps + 1) if s in metrics]
        if rc or len(seconds) < args.speed_steps - 1:
            raise SystemExit(f"error: the speed run of {name} stopped (rc {rc}): {last_error(folder + '.log')} "
                             f"(log: {folder}.log)")
        speeds[name] = dict(seconds_per_step=float(np.median(seconds)), steps=args.speed_steps, load_before=load,
                            machine=dict(machine(args), jobs=1, threads=threads),
                            measured=time.strftime("%Y-%m-%d %H:%M"))
        write_json(args.speeds, speeds)
        print(f"{name}: {speeds[name]['seconds_per_step']:.2f} s per step of {args.per_step} samples "
              f"(median of steps 2-{args.speed_steps}; load before {load:.1f})", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    return speeds


def timed_by_speed(curve_points, seconds_per_step):
    """A curve with its training seconds the steps times the seconds per step measured alone (the league's own in
    `league_seconds`)."""
    return [dict(p, seconds=p["step"] * seconds_per_step, league_seconds=p["seconds"]) for p in curve_points]


# ----------------------------------------------------------------------------- the report
def at_minutes(points, minutes):
    """The latest evaluation of a curve within `minutes` of training."""
    return [p for p in points if p["seconds"] <= minutes * 60 + 1e-9][-1]


def mean_std(values):
    """'mean +- std' over seeds (sample standard deviation), or 'mean (1 seed)'."""
    values = np.asarray(values, dtype=float)
    if len(values) == 1:
        return f"{values[0]:.3f} (1 seed)"
    return f"{values.mean():.3f} +- {values.std(ddof=1):.3f}"


def official(curves, at=-1):
    """GenEval's own rule at evaluation `at` of every curve ([value per seed]), or None where a curve lacks it (a run
    of the judge before it was logged, or a judge that is GenEval's rule)."""
    values = [c[at].get("official") for c in curves]
    return values if all(number(v) for v in values) else None


def official_tag(curves, tag):
    """A tag's accuracy after, mean over seeds, with GenEval's rule beside it in brackets where it differs."""
    value = np.mean([c[-1]["tags"][tag] for c in curves])
    theirs = [(c[-1].get("official_tags") or {}).get(tag) for c in curves]
    if not all(number(v) for v in theirs) or f"{np.mean(theirs):.2f}" == f"{value:.2f}":
        return f"{value:.2f}"
    return f"{value:.2f} ({np.mean(theirs):.2f})"


def collect(args):
    """{entry: {lr, finals, curves, speed}} of every entry with a finished run at its chosen lr on a table seed. When
    --speeds holds every such entry, the curves are timed by it (speed: its seconds per step); else by the league's
    own runs (speed None)."""
    results = {}
    for name in args.only:
        finals = sweep_finals(name, args)
        lr = choose_lr(finals)
        curves = {seed: c for seed in args.seeds if lr is not None and (c := curve(args.out, (name, lr, seed)))}
        if curves:
            results[name] = dict(lr=lr, finals=finals, curves=curves, speed=None)
    speeds = read_speeds(args.speeds)
    for name, r in results.items() if all(name in speeds for name in results) else ():
        r["speed"] = speeds[name]["seconds_per_step"]
        r["curves"] = {seed: timed_by_speed(c, r["speed"]) for seed, c in r["curves"].items()}
    return results


def timed_alone(results):
    """Whether the curves are timed by the seconds per step measured alone (collect)."""
    return any(r["speed"] is not None for r in results.values())


def wall_clock_budget(results, minutes=None):
    """(minutes, how chosen): --minutes, else the fastest entry's median training minutes."""
    if minutes:
        return minutes, "--minutes"
    medians = {name: float(np.median([c[-1]["seconds"] / 60 for c in r["curves"].values()]))
               for name, r in results.items()}
    fastest = min(medians, key=medians.get)
    return medians[fastest], f"the median of the fastest entry, {fastest}"


def mean_curve(curves):
    """An entry's curves averaged over seeds, evaluation by evaluation: [(samples, seconds, accuracy)]."""
    n = min(len(c) for c in curves)  # the same evaluation steps on every seed
    return [(curves[0][i]["samples"], float(np.mean([c[i]["seconds"] for c in curves])),
             float(np.mean([c[i]["accuracy"] for c in curves]))) for i in range(n)]


def first_reach(points, target):
    """(samples, seconds) at which a mean curve first reaches `target`, linear between its evaluations; None when it
    never does."""
    if points[0][2] >= target:
        return points[0][:2]
    for (s0, t0, a0), (s1, t1, a1) in zip(points, points[1:]):
        if a1 >= target:
            f = (target - a0) / (a1 - a0)
            return s0 + f * (s1 - s0), t0 + f * (t1 - t0)
    return None


def times(whole, part):
    """'4.2x': how many times `part` goes into `whole`; '-' for a part of zero (reached before training)."""
    return "-" if part <= 0 else f"{whole / part:.1f}x"


def speedup_lines(results, args):
    """The papers' speed-up (DiffusionNFT's, AWM's, DGPO's over Flow-GRPO): for each --reference entry that has a row,
    the samples and training minutes each entry takes to first reach its final accuracy (mean over seeds), against
    the reference's whole budget."""
    lines = []
    for reference in dict.fromkeys(args.reference):  # each once, in the order given
        if reference in results:
            lines += speedup_table(results, reference)
    return lines


def speedup_table(results, reference):
    """One reference's speed-up table, or a line saying it has none to read when the reference did not rise."""
    ref = mean_curve(list(results[reference]["curves"].values()))
    (samples, seconds, target), before = ref[-1], ref[0][2]
    if target <= before:
        return ["", f"**Speed-up over {reference}**: none to read, {reference} did not rise "
                    f"({before:.3f} -> {target:.3f})."]
    lines = ["", f"**Speed-up over {reference}** (how the papers count theirs): the samples and training minutes "
                 f"each entry takes to first reach {reference}'s final accuracy, {target:.3f} (means over seeds; "
                 f"linear between evaluations: for a curve that rises fastest early, the crossing late and the "
                 f"speed-up low), and {reference}'s {samples:,} samples and {seconds / 60:.1f} minutes over "
                 f"them.", "",
             "| entry | samples to reach it | speed-up per sample | minutes to reach it | speed-up per minute |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        reached = first_reach(mean_curve(list(r["curves"].values())), target)
        if reached is None:
            lines.append(f"| {name} | not reached | - | not reached | - |")
            continue
        s, t = reached
        lines.append(f"| {name} | {s:,.0f} | {times(samples, s)} | {t / 60:.1f} | {times(seconds, t)} |")
    return lines


def tables(results, args):
    """The markdown of the league: equal samples, equal wall-clock, the lr sweep, the entries, command and machine."""
    tags = [evaluation.TAG_NAMES[t] for t in geneval.TAGS]
    n = len(args.seeds)
    lines = [f"**Equal samples**: {args.samples:,} samples per run ({args.steps} steps of {args.per_step}), held-out "
             f"GenEval accuracy (360 prompts, ODE) before and after, mean +- standard deviation over seeds "
             f"({' '.join(map(str, args.seeds))}); per tag after, mean over seeds; trained and judged by the "
             f"{getattr(args, 'judge', JUDGE)}; GenEval's own rule on the same images beside it (after, and in "
             f"brackets where a tag differs).", "",
             "| entry | lr | samples | before | after | rise | GenEval's rule after | " + " | ".join(tags)
             + " | colour diversity after | samples/s | training minutes |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in tags)
             + " | ---: | ---: | ---: |"]
    for name, r in results.items():
        curves = list(r["curves"].values())
        before = [c[0]["accuracy"] for c in curves]
        after = [c[-1]["accuracy"] for c in curves]
        theirs = official(curves)
        seeds = "" if len(curves) == n else f" ({len(curves)} of {n} seeds)"
        seeds += "" if len(r["finals"]) == len(args.lrs) else " (lr sweep unfinished)"
        diversity = [d for c in curves if isinstance(d := c[-1].get("diversity"), (int, float))]  # where logged
        diversity = ("-" if not diversity else mean_std(diversity)
                     + ("" if len(diversity) in (1, len(curves)) else f" ({len(diversity)} seeds)"))
        seconds = np.mean([c[-1]["seconds"] for c in curves])
        lines.append(f"| {name}{seeds} | {lr_text(r['lr'])} | {curves[0][-1]['samples']:,} | {mean_std(before)} | "
                     f"{mean_std(after)} | {np.mean(after) - np.mean(before):+.3f} | "
                     f"{'-' if theirs is None else mean_std(theirs)} | "
                     + " | ".join(official_tag(curves, t) for t in geneval.TAGS)
                     + f" | {diversity} | {curves[0][-1]['samples'] / seconds:.1f} | {seconds / 60:.1f} |")
    budget, how = wall_clock_budget(results, args.minutes)
    timing = (f"training seconds: each entry's seconds per step measured alone ({args.speeds}: "
              + ", ".join(f"{name} {r['speed']:.2f}" for name, r in results.items()) + ")"
              if timed_alone(results) else
              "training seconds: the league's own runs (sampling, rewards, update; they shared the machine, see "
              "below; `--measure-speed` times each entry alone)")
    lines += ["", f"**Equal wall-clock**: the accuracy at each run's latest evaluation within {budget:.1f} training "
              f"minutes ({how}), from the same runs; samples and minutes of that evaluation, mean over seeds; "
              f"{timing}.", "",
              "| entry | lr | samples by then | minutes | accuracy | rise |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    ended = []
    for name, r in results.items():
        curves = list(r["curves"].values())
        reached = [at_minutes(c, budget) for c in curves]
        if all(c[-1]["seconds"] < budget * 60 for c in curves):
            ended.append(name)
        accuracy = [p["accuracy"] for p in reached]
        lines.append(f"| {name}{'*' if name in ended else ''} | {lr_text(r['lr'])} | "
                     f"{np.mean([p['samples'] for p in reached]):,.0f} | "
                     f"{np.mean([p['seconds'] for p in reached]) / 60:.1f} | {mean_std(accuracy)} | "
                     f"{np.mean(accuracy) - np.mean([c[0]['accuracy'] for c in curves]):+.3f} |")
    if ended:
        lines.append(f"\n\\* ran out of samples before the budget: {', '.join(ended)} (its last evaluation).")
    lines += speedup_lines(results, args)
    lrs = sorted({lr for r in results.values() for lr in r["finals"]} | set(args.lrs))
    lines += ["", f"**Learning rate**: each entry's final held-out accuracy on seed {args.sweep_seed} at each lr "
              f"of the sweep (the same samples); the best is chosen, ties to the smaller.", "",
              "| entry | " + " | ".join(lr_text(lr) for lr in lrs) + " | chosen |",
              "| --- | " + " | ".join("---:" for _ in lrs) + " | --- |"]
    for name, r in results.items():
        so_far = "" if len(r["finals"]) == len(args.lrs) else " so far"  # the sweep's other runs not finished
        lines.append(f"| {name} | " + " | ".join(f"{r['finals'][lr]:.3f}" if lr in r["finals"] else "-" for lr in lrs)
                     + f" | {lr_text(r['lr'])}{so_far} |")
    lines += ["", "Entries (train.py's shapes defaults plus): " + "; ".join(
        f"`{name}` {ENTRIES[name][0]}" + (f" (`{shlex.join(ENTRIES[name][1])}`)" if ENTRIES[name][1] else "")
        for name in results) + ("." if not COMMON else f"; every entry `{shlex.join(COMMON)}`."), "",
        f"Command: `{command_line(args, timed_alone(results))}`", "", machine_line(*ran_on(args, results))]
    return "\n".join(lines)


def summary_table(results, args):
    """The README's one table: each entry's rise (mean +- standard deviation of its seeds' rises), its speed-up over
    flow (Flow-GRPO as its authors ran it; else the first --reference with a row) per sample and per minute, and its
    samples per second; the entries by rise, the largest first."""
    reference = "flow" if "flow" in results else next((r for r in args.reference if r in results), None)
    target = None
    if reference is not None:
        ref = mean_curve(list(results[reference]["curves"].values()))
        (ref_samples, ref_seconds, target), before = ref[-1], ref[0][2]
        target = target if target > before else None  # a reference that did not rise has no speed-up to read
    rows = []
    for name, r in results.items():
        curves = list(r["curves"].values())
        rises = [c[-1]["accuracy"] - c[0]["accuracy"] for c in curves]
        rise = f"{np.mean(rises):+.3f}" + (f" +- {np.std(rises, ddof=1):.3f}" if len(rises) > 1 else " (1 seed)")
        after, before = official(curves), official(curves, 0)
        theirs = "-" if after is None or before is None else f"{np.mean(after) - np.mean(before):+.3f}"
        speedup = "-"
        if target is not None and (reached := first_reach(mean_curve(curves), target)) is not None:
            speedup = f"{times(ref_samples, reached[0])} ({times(ref_seconds, reached[1])})"
        elif target is not None:
            speedup = "not reached"
        seconds = np.mean([c[-1]["seconds"] for c in curves])
        rows.append((np.mean(rises), f"| {name} | {rise} | {theirs} | {speedup} | "
                                     f"{curves[0][-1]['samples'] / seconds:.1f} |"))
    over = f"over {reference}" if reference else "(no reference)"
    lines = [f"| entry | rise +- sd over seeds | rise by GenEval's rule | speed-up {over}, per sample (per minute) | "
             "samples/s |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [row for _, row in sorted(rows, key=lambda row: -row[0])]
    read = (f"; speed-up: the samples (minutes) to first reach {reference}'s final accuracy against "
            f"{reference}'s" if reference else "")
    lines += ["", f"{args.samples:,} samples per run, held-out GenEval accuracy (360 prompts, ODE) from before "
                  f"training to the end, seeds {' '.join(map(str, args.seeds))}, each entry at its best of "
                  f"{len(args.lrs)} learning rates{read}; GenEval's rule: the rise on the same images under GenEval's "
                  f"own counting rule; `{command_line(args, timed_alone(results))}`."]
    return "\n".join(lines)


def command_line(args, speeds=False):
    """The command that reproduces the league, every setting explicit."""
    parts = ["python scripts/league.py", f"--samples {args.samples}", f"--evals {args.evals}",
             "--lrs " + " ".join(lr_text(lr) for lr in args.lrs), f"--sweep-seed {args.sweep_seed}",
             "--seeds " + " ".join(map(str, args.seeds)), f"--jobs {args.jobs}", f"--threads {args.threads}"]
    if args.only != DEFAULT_ONLY:
        parts.append("--only " + " ".join(args.only))
    if args.minutes:
        parts.append(f"--minutes {args.minutes:g}")
    if args.reference != REFERENCES:
        parts.append("--reference " + " ".join(args.reference))
    if args.out_given != "runs/league":
        parts.append(f"--out {args.out_given}")
    if args.ledger:
        parts.append(f"--ledger {args.ledger}")
    if speeds:
        parts.append(f"--speeds {args.speeds}")
    return " ".join(parts)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else "unknown CPU"


def machine(args):
    """Where and how a run runs: the CPU, its threads, the runs at a time and the torch threads of each."""
    return dict(cpu=cpu_model(), cpus=os.cpu_count(), jobs=args.jobs, threads=args.threads)


def ran_on(args, results):
    """The machine of the reported runs (the most common in their records; this one for older records), the load
    averages as they ended, and [(machine, runs)] of the runs that ran otherwise (another job count or machine)."""
    records = [read_record(args.out, (name, r["lr"], seed)) for name, r in results.items() for seed in r["curves"]]
    records = [record for record in records if record]  # a record may be gone (the ledger's curves stand for it)
    mine = machine(args)  # a record's machine without the keys of one (null, edited) is not counted
    machines = collections.Counter(json.dumps(record["machine"], sort_keys=True) for record in records
                                   if isinstance(record.get("machine"), dict)
                                   and mine.keys() <= record["machine"].keys()).most_common()
    found = json.loads(machines[0][0]) if machines else mine
    others = [(json.loads(m), n) for m, n in machines[1:]]  # runs that ran otherwise: [(machine, runs)]
    loads = [record["load"] for record in records if number(record.get("load")) and math.isfinite(record["load"])]
    return found, loads, others


def machine_line(where, loads, others=()):
    load = f"; load average (1 min) as the runs ended: median {np.median(loads):.1f}, the league's own runs " \
           f"included" if loads else ""
    mixed = "" if not others else " (" + "; ".join(
        f"{n} run(s) with {w['jobs']} at a time, {w['threads']} thread(s) each"
        + ("" if (w["cpu"], w["cpus"]) == (where["cpu"], where["cpus"])
           else f", on {w['cpu']}, {w['cpus']} CPU threads")
        for w, n in others) + ")"
    return (f"Machine: {where['cpu']}, {where['cpus']} CPU threads; {where['jobs']} run(s) at a time, "
            f"{where['threads']} torch thread(s) each{mixed}{load}.")


def entry_style(i):
    """The i-th entry's colour, line and marker: ten hues, then the ten again lighter, dashed and square-marked, then
    dotted, ...: no two of up to 40 entries are drawn alike."""
    import matplotlib
    hue, lap = i % 10, i // 10
    return dict(color=matplotlib.colormaps["tab20"](2 * hue + lap % 2), linestyle=("-", "--", ":", "-.")[lap % 4],
                marker=("o", "s", "^", "D")[lap % 4])


def plot(results, args, budget, path):
    import matplotlib  # optional, heavy: only for the report
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_minutes) = plt.subplots(1, 2, figsize=(14, 4.8), sharey=True)
    for i, (name, r) in enumerate(results.items()):
        curves = list(r["curves"].values())
        samples, seconds, accuracy = zip(*mean_curve(curves))
        minutes = np.asarray(seconds) / 60
        style = dict(**entry_style(i), markersize=3,
                     label=f"{name} (lr {lr_text(r['lr'])}, {len(curves)} seed{'s' if len(curves) > 1 else ''})")
        by_samples.plot(samples, accuracy, **style)
        by_minutes.plot(minutes, accuracy, **style)
    by_minutes.axvline(budget, color="grey", linestyle=":", linewidth=1, label=f"budget {budget:.1f} min")
    by_samples.set_xlabel("training samples")
    by_minutes.set_xlabel("training wall-clock (minutes; evaluations not counted)")
    by_samples.set_ylabel("held-out GenEval accuracy (ODE), mean over seeds")
    by_samples.set_title("equal samples")
    by_minutes.set_title("equal wall-clock (seconds per step measured alone)" if timed_alone(results)
                         else f"equal wall-clock ({args.jobs} runs at a time, {args.threads} thread(s) each)")
    for ax in (by_samples, by_minutes):
        ax.grid(alpha=0.3)
    by_minutes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the plot, over no curve
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args):
    """league.md (printed too), league.png and league.json from the finished runs; one error line when there are
    none."""
    if not os.path.isdir(args.out):
        raise SystemExit(f"error: {args.out} is not a folder: run the league first (python scripts/league.py), "
                         "or give the --out it wrote")
    results = collect(args)
    if not results:
        raise SystemExit(f"error: {args.out} holds no finished run of this league ({', '.join(args.only)}; lrs "
                         f"{' '.join(lr_text(lr) for lr in args.lrs)} on sweep seed {args.sweep_seed}, seeds "
                         f"{' '.join(map(str, args.seeds))}): run the league first, or give the flags it ran with")
    budget, _ = wall_clock_budget(results, args.minutes)
    where = ran_on(args, results)[0]
    args.jobs, args.threads = where["jobs"], where["threads"]  # as the runs ran: the command and the plot say so
    table = tables(results, args)
    with open(os.path.join(args.out, "league.md"), "w") as f:
        f.write(table + "\n")
    plot(results, args, budget, os.path.join(args.out, "league.png"))
    summary = {name: dict(lr=r["lr"], sweep={lr_text(lr): a for lr, a in r["finals"].items()},
                          seconds_per_step=r["speed"], curves={str(seed): c for seed, c in r["curves"].items()})
               for name, r in results.items()}
    with open(os.path.join(args.out, "league.json"), "w") as f:
        json.dump(dict(samples=args.samples, steps=args.steps, minutes_budget=budget, entries=summary), f, indent=1)
    if args.readme:
        write_into(args.readme, summary_table(results, args), *MARKERS["readme"])
    if args.doc:
        write_into(args.doc, table, *MARKERS["doc"])
    if args.copy_to:
        os.makedirs(args.copy_to, exist_ok=True)
        shutil.copyfile(os.path.join(args.out, "league.png"), os.path.join(args.copy_to, "league.png"))  # the figure
        # the pages show; league.json is drawn again from the ledger by --report
    print(table)
    print(f"wrote {os.path.join(args.out, 'league.md')}, league.png, league.json"
          + (f"; the summary into {args.readme}" if args.readme else "")
          + (f"; the tables into {args.doc}" if args.doc else "")
          + (f"; league.png into {args.copy_to}" if args.copy_to else ""))
    return results


# Where --readme and --doc write, in their files: (flag, first line, last line); what was between them goes.
MARKERS = {
    "readme": ("--readme", "<!-- league: written by scripts/league.py --report --readme -->",
               "<!-- league end -->"),
    "doc": ("--doc", "<!-- league.md: written by scripts/league.py --report --doc -->",
            "<!-- league.md end -->"),
}


def write_into(path, text, flag, first, last):
    """Put `text` between the lines `first` and `last` of the markdown file `path` (what was there goes); one error
    line when the file lacks them."""
    try:
        with open(path) as f:
            page = f.read()
    except OSError as e:
        raise SystemExit(f"error: {flag} {path} cannot be read ({e.strerror or e}): give the file's path") from None
    start, end = page.find(first), page.find(last)
    if start < 0 or end < start:
        raise SystemExit(f"error: {flag} {path} has no place for the table: put the lines {first} and {last} where "
                         "it goes")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(page[:start + len(first)] + "\n" + text + "\n" + page[end:])
        os.replace(path + ".tmp", path)  # a full disk or a kill leaves the file as it was
    except OSError as e:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise SystemExit(f"error: {flag} {path} cannot be written ({e.strerror or e}): make it writable; "
                         "the tables are in league.md") from None


# ----------------------------------------------------------------------------- main
def lock(out):
    """One league per --out at a time (the lock goes with the process)."""
    handle = open(os.path.join(out, ".league.lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise SystemExit(f"error: another league is running in {out}: wait for it, or give another --out") from None
    return handle


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", default=DEFAULT_ONLY, choices=list(ENTRIES), metavar="NAME",
                   help="entries to run (default: all but the first setting's windows, " + ", ".join(PLACEMENTS)
                        + "): " + ", ".join(ENTRIES))
    p.add_argument("--samples", type=flags.POSITIVE_INT, default=None,
                   help="training samples per run, a whole number of train.py steps (default: the default run's, "
                        f"{default_samples()})")
    p.add_argument("--evals", type=flags.bounded(int, 2), default=5,
                   help="held-out evaluations per run, at least, step 0 and the last included (default: 5)")
    p.add_argument("--lrs", nargs="+", type=flags.POSITIVE, default=LRS,
                   help="learning rates of the sweep (default: " + " ".join(map(lr_text, LRS)) + ")")
    p.add_argument("--sweep-seed", type=flags.SEED, default=0, help="the seed the lr is chosen on (default: 0)")
    p.add_argument("--seeds", nargs="+", type=flags.SEED, default=[0, 1, 2],
                   help="seeds of the table, at the chosen lr (default: 0 1 2)")
    p.add_argument("--minutes", type=flags.POSITIVE, default=None,
                   help="training minutes of the equal wall-clock table (default: the fastest entry's median)")
    p.add_argument("--reference", nargs="+", default=REFERENCES, choices=list(ENTRIES), metavar="NAME",
                   help="the entries whose final accuracy a speed-up table each times the others to (default: "
                        f"{' '.join(REFERENCES)}: Flow-GRPO's loss on CPS steps and on its own SDE step)")
    p.add_argument("--jobs", type=flags.POSITIVE_INT, default=2, help="runs at once (default: 2)")
    p.add_argument("--threads", type=flags.POSITIVE_INT, default=None,
                   help="torch threads per run (default: the CPUs // --jobs, at least 1)")
    p.add_argument("--save-every", type=flags.POSITIVE_INT, default=5,
                   help="steps between a run's checkpoints, what a killed league loses at most (default: 5)")
    p.add_argument("--keep-weights", action="store_true",
                   help="keep the last checkpoint of finished runs (54 MB each; default: removed)")
    p.add_argument("--out", default="runs/league", help="folder of the runs, the tables and the plot "
                                                        "(default: runs/league)")
    p.add_argument("--ledger", default=None, metavar="FILE",
                   help="JSON lines of the finished runs, appended as each ends and read at the start: commit it to "
                        "carry the league to another machine (default: none)")
    p.add_argument("--speeds", default=None, metavar="FILE",
                   help="JSON of each entry's seconds per step measured alone (--measure-speed writes it); the "
                        "report times the curves by it when it holds every entry (default: none)")
    p.add_argument("--measure-speed", action="store_true",
                   help="only measure each entry's seconds per step alone into --speeds, nothing else running")
    p.add_argument("--speed-steps", type=flags.bounded(int, 2), default=5,
                   help="steps of each speed run; the first is not counted (default: 5)")
    p.add_argument("--report", action="store_true", help="only the tables and the plot, from the finished runs")
    p.add_argument("--readme", default=None, metavar="FILE",
                   help="also write the summary table into FILE (the README) between its league marker lines")
    p.add_argument("--doc", default=None, metavar="FILE",
                   help="also write the full tables into FILE (docs/league.md) between its league.md marker lines")
    p.add_argument("--copy-to", default=None, metavar="DIR",
                   help="also copy league.png, the figure the pages show, into DIR (docs/runs/league/judge)")
    p.add_argument("--poll", type=flags.POSITIVE, default=2.0, help=argparse.SUPPRESS)  # seconds between looks
    args = p.parse_args(argv)
    args.only = list(dict.fromkeys(args.only))
    args.seeds = list(dict.fromkeys(args.seeds))
    args.lrs = sorted(set(args.lrs))
    args.threads = args.threads or max(1, len(os.sched_getaffinity(0)) // args.jobs)
    args.out_given, args.out = args.out, os.path.abspath(args.out)
    if args.ledger and os.path.exists(args.ledger) and not os.path.isfile(args.ledger):
        p.error(f"--ledger {args.ledger} is not a file: give the path of a JSON lines file (made if missing)")
    if args.ledger and not os.path.isdir(os.path.dirname(os.path.abspath(args.ledger))):
        p.error(f"--ledger {args.ledger}: its folder does not exist: make it, or give a path in an existing folder")
    for key in MARKERS:
        path, (flag, first, last) = getattr(args, key), MARKERS[key]
        if path and not (os.path.isfile(path) and first in open(path).read()):
            p.error(f"{flag} {path}: no such file with the line {first}: put it and {last} where the table goes")
    if args.measure_speed and not args.speeds:
        p.error("--measure-speed needs --speeds FILE: where the seconds per step go")
    return plan(args, p)


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        if args.ledger:
            os.makedirs(args.out, exist_ok=True)
            restore_ledger(args)
        if os.path.isdir(args.out):
            check_records(args)
        return report(args)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise SystemExit(f"error: --out {args.out} is a file: give a folder")
    try:
        os.makedirs(args.out, exist_ok=True)
        handle = lock(args.out)
    except OSError as e:
        raise SystemExit(f"error: --out {args.out} cannot be written ({e.strerror or e}): give a writable folder") \
            from None
    if restored := restore_ledger(args):
        print(f"{restored} finished run(s) taken from the ledger {args.ledger}", flush=True)
    check_records(args)
    for name in args.only:  # every command line is train.py's to refuse, once, before anything runs
        argv = ["--out", os.path.join(args.out, "x"), *train_flags(name, args.lrs[0], 0, args)]
        parser, targs = train.parse_args(argv)
        train.check_args(parser, targs, 1)
    if args.measure_speed:
        speeds = measure_speeds(args)
        handle.close()
        return speeds
    failures = run_league(args)
    handle.close()
    results = report(args) if collect(args) else {}
    if failures:
        run, log, line = failures[0]
        total = len(failures)
        raise SystemExit(f"error: {total} run(s) failed; the first, {run_name(*run)}: {line} (log: {log}); rerun the "
                         "same command after fixing it: finished runs are kept")
    if not results:
        raise SystemExit(f"error: no run of the league finished in {args.out}: see its .log files")
    return results


if __name__ == "__main__":
    main()
