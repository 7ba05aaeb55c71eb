"""The runs of docs/long_run.md, queued: each is `python train.py` with its flags, stopped after its evaluation at the
step where the page stops it, and its rows (one per evaluation step: eval.jsonl's row, metrics.jsonl's figures since
the last evaluation, the command; scripts/ledgers.py) written into the page's ledger when it ends, which the page's
tables are read from.

    python scripts/long_runs.py --list                 # the runs, their flags and where each stops
    python scripts/long_runs.py --jobs 2 --out runs/long_runs --ledger docs/runs/long_run.jsonl
    python scripts/long_runs.py --only div300-s0 floored04-s0 --jobs 2 --out runs/long_runs
    python scripts/long_runs.py --unfold judge/s0 judge/s1 judge/s2 --out runs/long_run_judge  # then eval.py --plot

A run whose rows in --ledger reach its stop (or its last step) is not run again; one interrupted in --out continues
from its last checkpoint (`--resume auto`, checkpoints every 5 steps, the last one kept), as a league run does. Runs
go `--jobs` at a time, `--threads` torch threads each, in the order of RUNS (or of --only). A run is stopped with
SIGTERM, which train.py answers by saving its step and exiting 0 (run.py), once eval.jsonl has its stop step. Each
run of the page took 50-100 minutes on one thread beside a second run on this project's 2-core machine. The ledger's
runs are named <set>/<run>: the queue's are set `judge` (the present judge); the page's earlier sets (`recipe`,
`plateau`, `levers`, `first`) were measured on GenEval's 0.9 counting rule. `--unfold` writes runs of the ledger back
as run folders (eval.jsonl, metrics.jsonl) that `python eval.py --plot` draws.
"""
import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config  # noqa: E402
import ledgers  # noqa: E402

TRAIN = [sys.executable, os.path.join(ROOT, "train.py")]  # the command each run starts with
RECIPE = ["@recipes/shapes_long.args"]
LEVER = ["--seed", "0", "--steps", "200", "--eval-every", "25", "--log-images-every", "0"]
# The long recipe before its KL controller and its diversity advantage (recipes/shapes_long.args at 7015213): the
# cosine rate to a tenth over --steps and the KL to the starting weights at beta 0.1.
COSINE = ["--model", "shapes", "--loss", "nft", "--reward", "geneval", "--sampler", "dpm2", "--num-steps", "6",
          "--timestep-fraction", "0.5", "--no-global-std", "--lora-rank", "0", "--lr", "2e-4", "--lr-schedule",
          "cosine", "--lr-final", "0.1", "--kl-beta", "0.1", "--kl-reference", "start", "--eval-every", "25",
          "--log-images-every", "0", "--seed", "0"]
COS400 = COSINE + ["--steps", "400"]
DIVERSITY = ["--gardo-diversity", "--diversity", "pixels"]
HARD = ["--prompts", "prompts/shapes_train_hard.jsonl"]
P24 = ["--prompts-per-step", "24", "--steps", "200"]
# The long recipe without GARDO's advantage, with the batch-wide std (the cosine schedule, the floored controller).
NOGARDO_GSTD = COSINE + ["--steps", "300", "--kl-target", "0.1", "--kl-rate", "1", "--global-std"]

# Ziegler et al.'s controller as first run: free to fall below --kl-beta, towards a lower target at half the gain.
UNFLOORED = ["--kl-target", "0.03", "--kl-rate", "0.5", "--kl-floor", "0"]


def seeded(flags, seed):
    """`flags` with the value of its --seed replaced by `seed`."""
    i = flags.index("--seed")
    return flags[:i + 1] + [str(seed)] + flags[i + 2:]


# name -> (the page's section, flags, the step it stops after; None: its last step). Where the page's first
# measurement (GenEval's 0.9 counting rule) stopped a run that was falling or trailing, this one stops near there too.
RUNS = {
    "levers-nft-ocr": ("The levers, one at a time", LEVER + ["--old-decay", "nft-ocr"], None),
    "div300-s0": ("The diversity run over 300 steps", COSINE + ["--steps", "300"] + DIVERSITY, None),
    "floored04-s0": ("The floored controller", RECIPE + ["--seed", "0", "--kl-target", "0.04"], None),
    "floored04-s1": ("The floored controller", RECIPE + ["--seed", "1", "--kl-target", "0.04"], None),
    "cos400-s0": ("Over 400 steps", COS400, 250),
    "cos400-gardo-s0": ("Over 400 steps", COS400 + DIVERSITY, 275),
    "cos400-gstd-s0": ("Over 400 steps", COS400 + ["--global-std"], 300),
    "nogardo-gstd-s0": ("Where that leaves the bar", NOGARDO_GSTD, None),
    "nftfm03-s0": ("Two brakes", RECIPE + ["--seed", "0", "--nft-fm", "0.3"], 50),
    "prompts24-s0": ("The plateau", RECIPE + ["--seed", "0"] + P24, None),
    "prompts24-s1": ("The plateau", RECIPE + ["--seed", "1"] + P24, None),
    "prompts24-s2": ("The plateau", RECIPE + ["--seed", "2"] + P24, None),
    "lr3e-4-hard-s0": ("The plateau", RECIPE + ["--seed", "0", "--lr", "3e-4"] + HARD, None),
    "prompts24-kl03-s1": ("The plateau", RECIPE + ["--seed", "1", "--kl-beta", "0.03"] + P24, None),
    "lr3e-4-s0": ("The plateau", RECIPE + ["--seed", "0", "--lr", "3e-4"], 175),
    "group16-hard-s0": ("The plateau", RECIPE + ["--seed", "0", "--group-size", "16", "--prompts-per-step", "8"]
                        + HARD, 200),
    "lr3e-4-hard-s1": ("The plateau", RECIPE + ["--seed", "1", "--lr", "3e-4"] + HARD, 150),
    "prompts24-hard-s1": ("The plateau", RECIPE + ["--seed", "1"] + P24 + HARD, 175),
    "prompts24-cfg3-s1": ("The plateau", RECIPE + ["--seed", "1"] + P24 + ["--guidance-scale", "3", "--no-train-cfg",
                                                                        "--eval-guidance-scale", "1"], 150),
    "unfloored-s0": ("Two brakes", RECIPE + ["--seed", "0"] + UNFLOORED, None),
    "unfloored-s1": ("Two brakes", RECIPE + ["--seed", "1"] + UNFLOORED, None),
    "nogardo-gstd-s1": ("Where that leaves the bar", seeded(NOGARDO_GSTD, 1), None),
    "nogardo-gstd-s2": ("Where that leaves the bar", seeded(NOGARDO_GSTD, 2), None),
}
SET = "judge"  # the ledger's set of the queue's runs: measured on the present judge


def last_step(flags):
    """The run's --steps, read and checked as train.py reads them (the recipe file included)."""
    cwd = os.getcwd()
    os.chdir(ROOT)  # the recipes' and prompt files' paths are the repository's
    try:
        parser, args = config.parse_args(flags + ["--out", os.devnull])
        config.check_args(parser, args, world_size=1)
        return args.steps
    finally:
        os.chdir(cwd)


def evaluated(folder):
    """The steps evaluated in folder/eval.jsonl (none when it is missing); a line still being written is not read, a
    damaged one is one error line."""
    path = os.path.join(folder, "eval.jsonl")
    if not os.path.exists(path):
        return []
    steps = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n") or not line.strip():
                continue
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                raise SystemExit(f"error: {path}:{number} is damaged (no JSON row with a step): delete the run's "
                                 f"folder {folder} to run it again") from None
    return steps


def finished(folder, stop):
    return any(step >= stop for step in evaluated(folder))


def recorded(ledger, name, stop):
    """Whether the ledger's rows of the run reach its stop step."""
    return any(r.get("step", -1) >= stop for r in ledger.get(name, []))


def run_flags(name, flags, out):
    return [*flags, "--out", os.path.join(out, name), "--resume", "auto", "--save-every", "5", "--keep-checkpoints", "1"]


def record(name, flags, stop, out, ledger, threads):
    """The finished run's rows in place of its rows in the ledger."""
    command = (f"OMP_NUM_THREADS={threads} {shlex.join(['python', 'train.py', *run_flags(name, flags, out)])}"
               f"   # scripts/long_runs.py's run {name}, stopped after the evaluation of step {stop}; {threads} "
               "thread(s) each, beside the queue's other runs")
    ledgers.replace(ledger, ledgers.run_rows(os.path.join(out, name), SET, name, command))


def unfold(args):
    """The named runs of the ledger (<set>/<run>) as run folders under --out, for eval.py --plot."""
    rows = ledgers.read(args.ledger)
    by_name = {f"{r.get('set')}/{r['run']}" for r in rows if "eval" in r}
    missing = [name for name in args.unfold if name not in by_name]
    if missing:
        held = f"its runs are {', '.join(sorted(by_name))}" if by_name else "it holds no run's evaluations"
        raise SystemExit(f"error: {args.ledger} holds no run {', '.join(missing)}: {held}")
    folders = []
    for name in args.unfold:
        set_name, run = name.split("/", 1)
        mine = [r for r in ledgers.runs(rows, set_name)[run] if "eval" in r]
        folders.append(ledgers.unfold(mine, os.path.join(args.out, set_name, run)))
    print(f"wrote {', '.join(folders)}; their curves: python eval.py --plot {' '.join(folders)} --out {args.out}")
    return 0


def positive(kind):
    def parse(text):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        return value
    return parse


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(RUNS), help="these runs, in this order (default: all)")
    p.add_argument("--jobs", type=positive(int), default=2, help="runs at a time")
    p.add_argument("--threads", type=positive(int), default=1, help="torch threads a run")
    p.add_argument("--out", default="runs/long_runs", help="the runs' folders (with --unfold: the unfolded runs')")
    p.add_argument("--ledger", default=None, help="the page's ledger, where each finished run's rows go (and are "
                   "looked for): docs/runs/long_run.jsonl")
    p.add_argument("--poll", type=positive(float), default=30.0, help="seconds between looks at the runs' evaluations")
    p.add_argument("--list", action="store_true", help="print the runs and exit")
    p.add_argument("--unfold", nargs="+", metavar="SET/RUN", help="write these runs of --ledger as run folders into "
                   "--out (eval.jsonl, metrics.jsonl) for eval.py --plot, and exit")
    args = p.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} is a file, not a folder: give a folder for the runs")
    if args.ledger and os.path.isdir(args.ledger):
        p.error(f"--ledger {args.ledger} is a folder: give the ledger's file, such as docs/runs/long_run.jsonl")
    if args.unfold:
        if not args.ledger:
            p.error("--unfold reads --ledger: give it, such as --ledger docs/runs/long_run.jsonl")
        return unfold(args)
    names = args.only or list(RUNS)
    plan = [(name, RUNS[name][1], RUNS[name][2] or last_step(RUNS[name][1])) for name in names]
    if args.list:
        for name, flags, stop in plan:
            print(f"{name:20s} stops after step {stop:3d}  ({RUNS[name][0]})  {shlex.join(flags)}")
        return 0
    out = os.path.abspath(args.out)
    ledger = os.path.abspath(args.ledger) if args.ledger else None
    done = ledgers.runs(ledgers.read(ledger), SET) if ledger and os.path.exists(ledger) else {}
    todo = [run for run in plan if not recorded(done, run[0], run[2])]
    print(f"{len(plan) - len(todo)} of {len(plan)} run(s) already recorded in {ledger}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    running, failed, start = {}, [], time.time()
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped queue stops its runs (each saves
    try:  # its step)
        return queue(todo, running, failed, start, out, ledger, env, args)
    except KeyboardInterrupt:
        stop_all(running)
        print(f"stopped; the same command continues {' '.join(running)} from their checkpoints", file=sys.stderr)
        return 130
    except BaseException:
        stop_all(running)  # whatever ends the queue ends its runs: none is left training alone
        raise
    finally:
        signal.signal(signal.SIGTERM, before)


def stop_all(running):
    for proc, *_ in running.values():
        proc.send_signal(signal.SIGTERM)
    for proc, *_ in running.values():
        proc.wait()


def queue(todo, running, failed, start, out, ledger, env, args):
    while todo or running:
        while todo and len(running) < args.jobs:
            name, flags, stop = todo.pop(0)
            os.makedirs(out, exist_ok=True)
            log = open(os.path.join(out, f"{name}.log"), "a")
            running[name] = (subprocess.Popen(TRAIN + run_flags(name, flags, out), cwd=ROOT, env=env, stdout=log,
                                              stderr=subprocess.STDOUT), flags, stop, log)
            print(f"[{(time.time() - start) / 60:6.1f} min] started {name} (stops after step {stop})", flush=True)
        time.sleep(args.poll)
        for name in list(running):
            proc, flags, stop, log = running[name]
            early = RUNS[name][2] is not None  # stopped before its last step (which ends it by itself)
            if early and proc.poll() is None and finished(os.path.join(out, name), stop):
                proc.send_signal(signal.SIGTERM)  # saves its step and exits 0
                proc.wait()
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            done = finished(os.path.join(out, name), stop)
            if done and ledger:
                record(name, flags, stop, out, ledger, args.threads)
            if not done:
                failed.append(name)
            print(f"[{(time.time() - start) / 60:6.1f} min] {name}: "
                  f"{'done' if done else f'failed (exit {proc.returncode}): {out}/{name}.log'}", flush=True)
    if failed:
        print(f"failed: {' '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
