"""The runs of docs/long_run.md, queued: each is `python train.py` with its flags, stopped after its evaluation at the
step where the page stops it, and its record (the command, args.json, eval.jsonl, metrics.jsonl) copied to
`--copy-to FOLDER/<name>` when it ends, which the page's tables are read from.

    python scripts/long_runs.py --list                 # the runs, their flags and where each stops
    python scripts/long_runs.py --jobs 2 --out runs/long_runs --copy-to docs/runs/long_run/judge
    python scripts/long_runs.py --only div300-s0 floored04-s0 --jobs 2 --out runs/long_runs

A run whose record in --copy-to reached its stop (or its last step) is not run again; one interrupted in --out
continues from its last checkpoint (`--resume auto`, checkpoints every 5 steps, the last one kept), as a league run
does. Runs go `--jobs` at a time, `--threads` torch threads each, in the order of RUNS (or of --only). A run is stopped
with SIGTERM, which train.py answers by saving its step and exiting 0 (run.py), once eval.jsonl has its stop step.
Each run of the page took 50-100 minutes on one thread beside a second run on this project's 2-core machine.
"""
import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config  # noqa: E402

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
RECORD = ["args.json", "eval.jsonl", "metrics.jsonl"]


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
    """The steps evaluated in folder/eval.jsonl (none when it is missing); a line still being written is not read."""
    path = os.path.join(folder, "eval.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n") and line.strip()]


def finished(folder, stop):
    return any(step >= stop for step in evaluated(folder))


def run_flags(name, flags, out):
    return [*flags, "--out", os.path.join(out, name), "--resume", "auto", "--save-every", "5", "--keep-checkpoints", "1"]


def copy_record(name, flags, stop, out, copy_to, threads):
    source, target = os.path.join(out, name), os.path.join(copy_to, name)
    os.makedirs(target, exist_ok=True)
    for file in RECORD:
        shutil.copyfile(os.path.join(source, file), os.path.join(target, file))
    with open(os.path.join(target, "command.txt"), "w") as f:
        f.write(f"# scripts/long_runs.py's run {name}, stopped after the evaluation of step {stop}; "
                f"{threads} thread(s) each, beside the queue's other runs\n")
        f.write(f"OMP_NUM_THREADS={threads} {shlex.join(['python', 'train.py', *run_flags(name, flags, out)])}\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(RUNS), help="these runs, in this order (default: all)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="torch threads a run")
    p.add_argument("--out", default="runs/long_runs", help="the runs' folders")
    p.add_argument("--copy-to", default=None, help="where each finished run's record goes (and is looked for)")
    p.add_argument("--poll", type=float, default=30.0, help="seconds between looks at the runs' evaluations")
    p.add_argument("--list", action="store_true", help="print the runs and exit")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.threads < 1:
        p.error("--jobs and --threads take 1 or more")
    names = args.only or list(RUNS)
    plan = [(name, RUNS[name][1], RUNS[name][2] or last_step(RUNS[name][1])) for name in names]
    if args.list:
        for name, flags, stop in plan:
            print(f"{name:20s} stops after step {stop:3d}  ({RUNS[name][0]})  {shlex.join(flags)}")
        return 0
    out = os.path.abspath(args.out)
    copy_to = os.path.abspath(args.copy_to) if args.copy_to else None
    todo = [run for run in plan if not (copy_to and finished(os.path.join(copy_to, run[0]), run[2]))]
    print(f"{len(plan) - len(todo)} of {len(plan)} run(s) already recorded in {copy_to}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    running, failed, start = {}, [], time.time()
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped queue stops its runs (each saves
    try:  # its step)
        return queue(todo, running, failed, start, out, copy_to, env, args)
    except KeyboardInterrupt:
        for proc, *_ in running.values():
            proc.send_signal(signal.SIGTERM)
        for proc, *_ in running.values():
            proc.wait()
        print(f"stopped; the same command continues {' '.join(running)} from their checkpoints", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, before)


def queue(todo, running, failed, start, out, copy_to, env, args):
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
            if done and copy_to:
                copy_record(name, flags, stop, out, copy_to, args.threads)
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
