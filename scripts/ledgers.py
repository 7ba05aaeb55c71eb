"""A study's ledger (docs/runs/<study>.jsonl): the numbers its page's tables and figures are drawn from, one JSON
object a line, one line per run and evaluation step, in place of the runs' folders. A row of a train.py run:

    {"set": "judge", "run": "s0", "step": 25,                  # which study's runs, which run, which evaluation
     "eval": {...},                                           # eval.jsonl's row of that step, whole
     "train": {"step": [1, ..., 25], "kl": [...], ...},       # metrics.jsonl's steps since the last evaluation
     "command": "python train.py ...", "args": {...}}         # on the run's first row only: how to run it again

`train` keeps every figure of metrics.jsonl, per step, to 6 significant digits (a page quotes 3; eval.jsonl's rows
are kept whole); the last row of a run also holds the steps after its last evaluation. `unfold` writes a run's rows
back as eval.jsonl and metrics.jsonl, so `python eval.py --plot` draws its curves again. A line that is not such an
object is refused in one line naming the file and the line.
"""
import json
import os

import checkpoints

DIGITS = 6  # significant digits of a training figure in a ledger


def short(value):
    """A training figure to DIGITS significant digits (ints, None and text as they are)."""
    return float(f"{value:.{DIGITS}g}") if isinstance(value, float) else value


def read(path, what="a study's ledger"):
    """The rows of a ledger; a missing file, a line that is not UTF-8 JSON, not an object with its set and run, or
    with a step that is not a whole number or an eval / train that is not an object, is one error line naming the
    file and the line."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} is not a file: give --ledger the ledger of the study ({what}), such as "
                         "docs/runs/long_run.jsonl")
    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))  # UnicodeDecodeError is a ValueError
                if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("set", "run")):
                    raise ValueError("not an object with its set and run named")
                if "step" in row and (not isinstance(row["step"], int) or isinstance(row["step"], bool)):
                    raise ValueError(f"step {row['step']!r} is not a whole number")
                if not all(isinstance(row.get(k, {}), dict) for k in ("eval", "train")):
                    raise ValueError("its eval or train is not an object")
            except ValueError as e:
                raise SystemExit(f"error: {path}:{number} is damaged ({' '.join(str(e).split())[:80]}): restore it "
                                 f"(git checkout {path}), or delete that line and run that run again") from None
            rows.append(row)
    return rows


def write(path, rows):
    """The rows, written whole or not at all: a killed study never leaves half a ledger."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)


def replace(path, rows, key=("set", "run")):
    """The ledger at path with `rows` in place of its rows of the same set and run (added when new)."""
    kept = read(path) if os.path.exists(path) else []
    new = {tuple(r.get(k) for k in key) for r in rows}
    write(path, [r for r in kept if tuple(r.get(k) for k in key) not in new] + list(rows))


def run_rows(folder, set_name, run, command=None):
    """A train.py run folder (eval.jsonl, metrics.jsonl, args.json) as ledger rows, one per evaluation step."""
    evals = {r["step"]: r for r in checkpoints.read_jsonl(os.path.join(folder, "eval.jsonl"))[0]
             if isinstance(r, dict) and isinstance(r.get("step"), int)}  # a resumed step: its last row
    metrics = {r["step"]: r for r in checkpoints.read_jsonl(os.path.join(folder, "metrics.jsonl"))[0]
               if isinstance(r, dict) and isinstance(r.get("step"), int)}
    steps = sorted(evals)
    rows = []
    for i, step in enumerate(steps):
        since = [s for s in sorted(metrics) if (i == 0 or s > steps[i - 1]) and (s <= step or i == len(steps) - 1)]
        row = {"set": set_name, "run": run, "step": step, "eval": {k: v for k, v in evals[step].items() if k != "step"}}
        if since:
            keys = dict.fromkeys(k for s in since for k in metrics[s] if k != "step")
            row["train"] = {"step": since, **{k: [short(metrics[s].get(k)) for s in since] for k in keys}}
        rows.append(row)
    if rows:
        args = os.path.join(folder, "args.json")
        if command:
            rows[0]["command"] = command
        if os.path.isfile(args):
            with open(args) as f:
                rows[0]["args"] = json.load(f)
    return rows


def runs(rows, set_name=None):
    """{run: its rows in step order} of the ledger's rows (of one set, when given)."""
    out = {}
    for row in rows:
        if set_name is None or row.get("set") == set_name:
            out.setdefault(row["run"], []).append(row)
    return {run: sorted(rs, key=lambda r: r.get("step", 0)) for run, rs in out.items()}


def unfold(rows, folder):
    """One run's rows back as a run folder eval.py --plot reads: eval.jsonl, metrics.jsonl and, where
    the ledger kept it, args.json (the curves' labels) -> folder."""
    os.makedirs(folder, exist_ok=True)
    if "args" in rows[0]:
        with open(os.path.join(folder, "args.json"), "w") as f:
            json.dump(rows[0]["args"], f, indent=1)
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps({"step": row["step"], **row["eval"]}) + "\n")
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for row in rows:
            train = row.get("train", {})
            for i, step in enumerate(train.get("step", [])):
                f.write(json.dumps({"step": step, **{k: v[i] for k, v in train.items() if k != "step"}}) + "\n")
    return folder
