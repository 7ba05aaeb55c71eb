"""Reward hacking in the shapes world: RL on a learned proxy of the exact judge, with and without brakes.

    python scripts/hacking.py                   # 3 brakes x seeds 0 1 2 -> runs/hacking/ (hacking.md, .png)
    python scripts/hacking.py --brakes none kl --seeds 0 --steps 40  # a quick look
    python scripts/hacking.py --report          # the tables and the plot again from the finished runs
    python scripts/hacking.py --report --brakes none kl gardo gate --ledger docs/runs/hacking.jsonl --out /tmp/h

Every run is `python train.py` on the shapes defaults (DiffusionNFT, 100 steps of 16 prompts x 8 samples) trained on
member 0 of the proxy (shapes/proxy.py, weights/shapes_proxy.safetensors), with the exact GenEval judge and the other
two members scored beside it at weight 0 (COMMON): the held-out evaluations log the proxy (`reward`), the exact accuracy
(`geneval_overall`) and the colour diversity of under-specified prompts (`diversity_color`), so the truth the proxy
stands in for is measured on every checkpoint and never trained on. The brakes (BRAKES) differ in nothing else:

- none: the proxy alone;
- kl: the velocity KL to the starting weights (--kl-reference start: the default is a full fine-tune, which keeps no
  base model) at --kl-beta;
- gardo: GARDO's gated KL (arXiv:2512.24138; the KL only on the samples that the other two members rank well above
  the trained one) and its adaptive reference (regularizers.py), at the same --kl-beta: the anchor renewed after 15
  steps or a KL above 0.15, the squared-velocity KL's threshold that GARDO's DiffusionNFT script starts from
  (scripts/train_sd3_nft_gardo.py L616, L771-781; its nudging of the threshold after each renewal not reproduced);
- gate: the gated KL alone, anchored to the starting weights.

What the table reports per brake, mean +- standard deviation over seeds: the held-out proxy score at step 0 and at
the end; the exact accuracy at step 0, at its peak (and the step) and at the end; the colour diversity at step 0 and
at the end. The plot: the three against the step, a colour per brake, a line style per seed. A finished run is not
run again, a stopped one continues from its checkpoint (--resume auto; SIGTERM stops the running one at a checkpoint).
With --ledger, the finished runs' rows (their flags, then a row per evaluation step: scripts/ledgers.py) go into the
page's ledger as set --set; `--report --ledger` draws the tables and the plot from the ledger instead of run folders.
"""
import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoints  # noqa: E402
import flags  # noqa: E402
import ledgers  # noqa: E402

TRAIN = [sys.executable, os.path.join(ROOT, "train.py")]
COMMON = ["--reward", "shapes_proxy=1,shapes_proxy_1=0,shapes_proxy_2=0,geneval=0", "--reward-key", "shapes_proxy",
          "--log-images-every", "0", "--lr", "2e-4"]  # the rate its runs were measured at (the default's was then)
BRAKES = {
    "none": ("the proxy alone", lambda beta: []),
    "kl": ("KL to the starting weights", lambda beta: ["--kl-beta", beta, "--kl-reference", "start"]),
    "gardo": ("GARDO: gated KL, adaptive reference", lambda beta: [  # renewal as its DiffusionNFT script starts it
        "--kl-beta", beta, "--gardo-gate", "shapes_proxy_1,shapes_proxy_2", "--gardo-reference",
        "--gardo-reset-freq", "15", "--gardo-kl-thres", "0.15"]),
    "gate": ("GARDO's gated KL to the starting weights", lambda beta: [
        "--kl-beta", beta, "--gardo-gate", "shapes_proxy_1,shapes_proxy_2", "--kl-reference", "start"]),
}
MEASURES = [("proxy", "reward", "held-out proxy score (trained on)"),
            ("exact", "geneval_overall", "held-out exact accuracy (never trained on)"),
            ("diversity", "diversity_color", "colour diversity, under-specified prompts")]


def run_name(brake, seed):
    return f"{brake}-s{seed}"


def train_flags(brake, seed, args):
    return ["--seed", str(seed), "--steps", str(args.steps), "--eval-every", str(args.eval_every), *COMMON,
            *BRAKES[brake][1](f"{args.kl_beta:g}")]


def write_json(path, obj):
    """Written whole or not at all: a killed study never leaves half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def read_evals(out, run):
    """{step: eval row} of a run; its step-0 row kept beside it (eval0.json), as a resume drops it from eval.jsonl."""
    folder = os.path.join(out, run_name(*run))
    rows, _ = checkpoints.read_jsonl(os.path.join(folder, "eval.jsonl"))
    evals = {r["step"]: r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)}
    side = os.path.join(out, run_name(*run) + ".eval0.json")
    if 0 in evals and not os.path.exists(side):
        write_json(side, evals[0])
    elif 0 not in evals and os.path.exists(side):
        evals[0] = read_json(side, "its step-0 evaluation row")
    return evals


def read_json(path, what):
    """A JSON object the study wrote, or one line naming the file when it is damaged (a torn or edited file)."""
    try:
        with open(path) as f:
            obj = json.load(f)
        if not isinstance(obj, dict):
            raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path} should hold {what} and does not ({' '.join(str(e).split())[:100]}): restore "
                         "it, or delete it and the run's folder to run that run again") from None
    return obj


def finished(out, run, steps):
    evals = read_evals(out, run)
    return 0 in evals and steps in evals


def check_flags(run, args):
    """A run folder belongs to the flags it was started with (<run>.json): continuing it under others would mix
    two runs in one curve."""
    path, now = os.path.join(args.out, run_name(*run) + ".json"), train_flags(*run, args)
    if os.path.exists(path):
        before = read_json(path, "the flags the run was started with").get("flags")
        if not isinstance(before, list):
            raise SystemExit(f"error: {path} holds no list of the flags the run was started with: restore it, or "
                             "delete it and the run's folder to run that run again")
        if before != now:
            raise SystemExit(f"error: {os.path.join(args.out, run_name(*run))} was run with `{shlex.join(before)}`, "
                             f"not `{shlex.join(now)}`: give another --out, or the flags it was run with")
        return
    write_json(path, dict(flags=now))


def run_one(run, args):
    """train.py for one run, continued from its checkpoint when it has one; -> its exit status."""
    folder = os.path.join(args.out, run_name(*run))
    command = [*TRAIN, "--out", folder, "--resume", "auto", "--save-every", str(args.save_every),
               *train_flags(*run, args)]
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    with open(folder + ".log", "ab") as log:
        log.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)

        stopped = []

        def stop(signum, frame):  # train.py saves a checkpoint on SIGTERM; the same command continues it. Only
            stopped.append(signum)  # passed on: a wait here would deadlock on the wait it interrupts (its lock)
            process.send_signal(signal.SIGTERM)

        previous = signal.signal(signal.SIGTERM, stop)
        try:
            rc = process.wait()  # resumed after the handler (PEP 475) until the run has saved and exited
        finally:
            signal.signal(signal.SIGTERM, previous)
        if stopped:
            raise SystemExit(f"stopped {run_name(*run)} at a checkpoint: the same command continues")
        return rc


# ----------------------------------------------------------------------------- the report
def summary(evals, steps):
    """One run's figures: each measure at step 0 and at the end, the exact accuracy's peak and its step."""
    row = {}
    for short, key, _ in MEASURES:
        row[f"{short}_0"], row[f"{short}_end"] = value(evals[0], key), value(evals[steps], key)
    exact = {step: value(r, "geneval_overall") for step, r in evals.items()}
    finite = {step: a for step, a in exact.items() if np.isfinite(a)} or {steps: np.nan}  # NaN is no peak
    row["exact_peak_step"] = max(finite, key=lambda s: (finite[s], -s))
    row["exact_peak"] = finite[row["exact_peak_step"]]
    return row


def value(row, key):
    """A figure of an eval row as a float: NaN where it is missing or not a number (train.py writes NaN as null)."""
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan


def mean_sd(values):
    values = np.asarray(values, float)
    return f"{values.mean():.3f}" + (f" +- {values.std(ddof=1):.3f}" if len(values) > 1 else "")


def from_ledger(args):
    """{run: {step: eval row}} of the finished runs of --set in --ledger; a run recorded under other flags is
    refused, as a run folder is (check_flags)."""
    recorded = ledgers.runs(ledgers.read(args.ledger), args.set)
    evals = {}
    for run in [(b, s) for b in args.brakes for s in args.seeds]:
        rows = recorded.get(run_name(*run), [])
        if not rows:
            continue
        before, now = rows[0].get("flags"), train_flags(*run, args)
        if before != now:
            raise SystemExit(f"error: {args.ledger}'s run {run_name(*run)} ({args.set}) was run with "
                             f"`{shlex.join(before or [])}`, not `{shlex.join(now)}`: give the flags it was run with")
        mine = {r["step"]: {"step": r["step"], **r["eval"]} for r in rows if "eval" in r}
        if 0 in mine and args.steps in mine:
            evals[run] = mine
    return evals


def record(args, runs):
    """The finished runs' rows in place of theirs in --ledger (set --set): their flags, a row per evaluation."""
    for run in runs:
        rows = ledgers.run_rows(os.path.join(args.out, run_name(*run)), args.set, run_name(*run))
        evals = read_evals(args.out, run)
        if rows[0]["step"] != 0:  # a resumed run: its step-0 row was kept beside it
            rows.insert(0, {"set": args.set, "run": run_name(*run), "step": 0,
                            "eval": {k: v for k, v in evals[0].items() if k != "step"}})
        rows[0]["flags"] = train_flags(*run, args)
        ledgers.replace(args.ledger, rows)


def report(args):
    if args.ledger and args.report:
        evals = from_ledger(args)
        runs = list(evals)
        os.makedirs(args.out, exist_ok=True)
    else:
        runs = [(b, s) for b in args.brakes for s in args.seeds if finished(args.out, (b, s), args.steps)]
        for run in runs:
            check_flags(run, args)
    if not runs:
        raise SystemExit(f"error: no finished run in {args.ledger if args.ledger and args.report else args.out} "
                         f"(brakes {' '.join(args.brakes)}, seeds {' '.join(map(str, args.seeds))}, {args.steps} "
                         "steps): run the same command without --report")
    if not (args.ledger and args.report):
        evals = {run: read_evals(args.out, run) for run in runs}
    rows = {run: summary(evals[run], args.steps) for run in runs}
    lines = [f"Held-out figures at step 0 and step {args.steps} (360 prompts, ODE, fixed noise), mean +- standard "
             f"deviation over seeds; `python scripts/hacking.py {shlex.join(args.argv)}`:", "",
             "| brake | seeds | proxy, step 0 -> end | exact accuracy, step 0 | peak (step) | end | end - peak | "
             "colour diversity, step 0 -> end |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for brake in args.brakes:
        mine = [rows[r] for r in runs if r[0] == brake]
        if not mine:
            continue
        col = lambda k: mean_sd([m[k] for m in mine])  # noqa: E731
        steps = "/".join(str(m["exact_peak_step"]) for m in mine)
        lines.append(f"| {brake} ({BRAKES[brake][0]}) | {len(mine)} | {col('proxy_0')} -> {col('proxy_end')} | "
                     f"{col('exact_0')} | {col('exact_peak')} ({steps}) | {col('exact_end')} | "
                     f"{mean_sd([m['exact_end'] - m['exact_peak'] for m in mine])} | "
                     f"{col('diversity_0')} -> {col('diversity_end')} |")
    lines += ["", "Per run:", "", "| run | proxy 0 -> end | exact 0 -> peak (step) -> end | diversity 0 -> end |",
              "| --- | --- | --- | --- |"]
    for run, m in rows.items():
        lines.append(f"| {run_name(*run)} | {m['proxy_0']:.3f} -> {m['proxy_end']:.3f} | {m['exact_0']:.3f} -> "
                     f"{m['exact_peak']:.3f} ({m['exact_peak_step']}) -> {m['exact_end']:.3f} | "
                     f"{m['diversity_0']:.3f} -> {m['diversity_end']:.3f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "hacking.md"), "w") as f:
        f.write(text)
    plot(args, evals, os.path.join(args.out, "hacking.png"))
    print(text, end="")
    return rows


def plot(args, evals, path):
    """hacking.png: each measure against the step, a colour per brake, a line style per seed; evals {run: rows}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(MEASURES), figsize=(4.6 * len(MEASURES), 3.6))
    styles = ["-", "--", ":", "-."]
    for ax, (_, key, title) in zip(axes, MEASURES):
        for run, rows in evals.items():
            steps = sorted(s for s in rows if key in rows[s])
            colour = f"C{args.brakes.index(run[0])}"
            ax.plot(steps, [value(rows[s], key) for s in steps], color=colour, marker="o", ms=3,
                    ls=styles[args.seeds.index(run[1]) % len(styles)], label=run_name(*run))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--brakes", nargs="+", default=["none", "kl", "gardo"], choices=list(BRAKES))
    p.add_argument("--seeds", nargs="+", type=flags.SEED, default=[0, 1, 2])
    p.add_argument("--steps", type=flags.POSITIVE_INT, default=100, help="training steps of every run")
    p.add_argument("--eval-every", type=flags.POSITIVE_INT, default=20, help="held-out evaluations every this many "
                   "steps (and at the last)")
    p.add_argument("--kl-beta", type=flags.POSITIVE, default=0.3, help="the KL weight of every brake but none")
    p.add_argument("--threads", type=flags.POSITIVE_INT, default=1, help="torch threads of each run")
    p.add_argument("--save-every", type=flags.POSITIVE_INT, default=10, help="checkpoints every this many steps")
    p.add_argument("--out", default="runs/hacking", help="folder of the runs, hacking.md and hacking.png")
    p.add_argument("--report", action="store_true", help="only the tables and the plot, from the finished runs")
    p.add_argument("--ledger", default=None, help="the page's ledger (docs/runs/hacking.jsonl): the finished runs' "
                   "rows go there; with --report, the tables and the plot are drawn from it")
    p.add_argument("--set", default="judge", help="the runs' set in --ledger (the page's: judge, on the present "
                   "judge; first, on GenEval's 0.9 rule)")
    args = p.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} is a file, not a folder: give a folder for the runs, hacking.md and hacking.png")
    if args.ledger and os.path.isdir(args.ledger):
        p.error(f"--ledger {args.ledger} is a folder: give the ledger's file, such as docs/runs/hacking.jsonl")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.steps % args.eval_every:
        p.error(f"--steps {args.steps} is not a multiple of --eval-every {args.eval_every}: the end must be evaluated")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not args.report:
        os.makedirs(args.out, exist_ok=True)
        runs = [(b, s) for s in args.seeds for b in args.brakes]  # seed by seed: each seed's row set lands whole
        for run in runs:
            check_flags(run, args)  # every run's, before any of them starts
        for run in runs:
            if finished(args.out, run, args.steps):
                continue
            print(f"{time.strftime('%H:%M:%S')} {run_name(*run)}", flush=True)
            rc = run_one(run, args)
            if rc or not finished(args.out, run, args.steps):
                raise SystemExit(f"error: {run_name(*run)} stopped (rc {rc}) before its step {args.steps} evaluation: "
                                 f"see {os.path.join(args.out, run_name(*run))}.log; the same command continues it")
        if args.ledger:
            record(args, runs)
    return report(args)


if __name__ == "__main__":
    main()
