"""The studies' pages are drawn from what docs/ keeps: each table below is regenerated from its study's ledger by the
study's own script and compared with the page's text, line for line; a damaged ledger is one error line."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import hacking  # noqa: E402
import ledgers  # noqa: E402
import loopholes  # noqa: E402

DOCS = os.path.join(ROOT, "docs")
RUNS = os.path.join(DOCS, "runs")


def page(name):
    with open(os.path.join(DOCS, name)) as f:
        return f.read()


def test_the_judge_page_s_loophole_table_is_the_ledger_s():
    """docs/judge.md's counts of the searched weights (base / gamed / honest / long), from docs/runs/judge.jsonl."""
    table = loopholes.page_table(ledgers.read(os.path.join(RUNS, "judge.jsonl")), ["gamed", "honest", "long"])
    assert len(table.splitlines()) == 8 and "| counting | base / gamed / honest / long | 57 / 99 / 105 / 138 |" in table
    assert table in page("judge.md")


def test_the_hacking_page_s_runs_are_the_ledger_s():
    """docs/hacking.md's table of the twelve runs on the present judge: each figure from the ledger's evaluations
    (hacking.summary, as --report reads them), GenEval's rule in brackets."""
    args = hacking.parse_args(["--report", "--brakes", "none", "kl", "gardo", "gate", "--ledger",
                               os.path.join(RUNS, "hacking.jsonl"), "--out", os.devnull + "_unused"])
    evals = hacking.from_ledger(args)
    assert len(evals) == 12
    lines = []
    for (brake, seed), rows in evals.items():
        m = hacking.summary(rows, args.steps)
        official = [hacking.value(rows[s], "geneval_official") for s in (0, args.steps)]
        lines.append(f"| {brake}, seed {seed} | {m['proxy_0']:.3f} -> {m['proxy_end']:.3f} | {m['exact_0']:.3f} "
                     f"({official[0]:.3f}) | {m['exact_peak']:.3f} ({m['exact_peak_step']}) | ")
        lines.append(f"({official[1]:.3f}) | {m['exact_end'] - m['exact_0']:+.3f} | {m['diversity_0']:.3f} -> "
                     f"{m['diversity_end']:.3f} |")
    text = page("hacking.md")
    missing = [line for line in lines if line not in text]
    assert not missing, "docs/hacking.md differs from docs/runs/hacking.jsonl:\n" + "\n".join(missing)
    assert "| none, seed 1 | 0.364 -> 0.606 | 0.381 (0.353) | 0.381 (0) | **0.178** (0.172) | -0.203 |" in text


def test_hacking_reports_from_the_ledger_as_from_its_run_folders(tmp_path):
    """--report --ledger writes the same hacking.md (its command line aside) as --report on the run folders the
    ledger was written from: the rows hold every figure the tables read."""
    out = tmp_path / "runs"
    args = hacking.parse_args(["--report", "--brakes", "none", "kl", "--seeds", "0", "--ledger",
                               os.path.join(RUNS, "hacking.jsonl"), "--out", str(out / "ledger")])
    hacking.report(args)
    for run, rows in hacking.from_ledger(args).items():  # the run folders the ledger's rows stand for
        folder = out / "folders" / hacking.run_name(*run)
        folder.mkdir(parents=True)
        with open(folder / "eval.jsonl", "w") as f:
            f.writelines(json.dumps(rows[s]) + "\n" for s in sorted(rows))
    folders = hacking.parse_args(["--report", "--brakes", "none", "kl", "--seeds", "0", "--out", str(out / "folders")])
    hacking.report(folders)
    tables = [(out / where / "hacking.md").read_text().split("\n", 1)[1] for where in ("ledger", "folders")]
    assert tables[0] == tables[1] and "| none-s0 | 0.374 -> 0.589 | 0.358 -> 0.408 (20) -> 0.258 |" in tables[0]


def test_the_league_s_tables_regenerate_from_its_ledger(tmp_path):
    """The command docs/league.md gives writes its tables and the README's summary from the ledger and the speeds,
    running nothing: on copies of the two pages it changes nothing."""
    pytest.importorskip("matplotlib")
    for name in ("judge/ledger.jsonl", "speeds.json"):
        os.makedirs(tmp_path / "docs" / "runs" / "league" / os.path.dirname(name), exist_ok=True)
        shutil.copyfile(os.path.join(RUNS, "league", name), tmp_path / "docs" / "runs" / "league" / name)
    shutil.copyfile(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    shutil.copyfile(os.path.join(DOCS, "league.md"), tmp_path / "league.md")
    entries = "nft dpo grpo fast flow sft dgpo crd awm mix mix-flash guard flowdppo dance".split()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "league.py"), "--report", "--lrs", "1e-4",
                           "2e-4", "--ledger", "docs/runs/league/judge/ledger.jsonl", "--speeds",
                           "docs/runs/league/speeds.json", "--only", *entries, "--readme", "README.md", "--doc",
                           "league.md", "--out", "runs/league_judge"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "league.md").read_text() == page("league.md")
    with open(os.path.join(ROOT, "README.md")) as f:
        assert (tmp_path / "README.md").read_text() == f.read()


def long_run_rows(rows):
    """docs/long_run.md's two rows of a run of the recipe: held-out accuracy (colour diversity) at the page's steps,
    the peak rise (its step), the rise at the end, the most the accuracy falls below its running peak from step 100
    on, the colours at the end over the base's; then GenEval's rule on the same images."""
    acc = {s: r["geneval_correct"] for s, r in rows.items()}
    steps, shown = sorted(acc), (0, 50, 100, 150, 200, 225, 250, 275, 300)
    peak = max(steps, key=lambda s: (acc[s], -s))
    fall = max(max(acc[t] for t in steps if t <= s) - acc[s] for s in steps if s >= 100)
    cells = [f"{acc[s]:.3f} ({rows[s]['diversity_color']:.2f})" for s in shown]
    official = [f"{rows[s]['geneval_official']:.3f}" for s in shown]
    return (" | ".join(cells) + f" | {acc[peak] - acc[0]:+.3f} ({peak}) | {acc[300] - acc[0]:+.3f} | {fall:.3f} | "
            f"{rows[300]['diversity_color'] / rows[0]['diversity_color']:.2f} |",
            " | ".join(official) + f" | | {rows[300]['geneval_official'] - rows[0]['geneval_official']:+.3f} | | |")


def test_the_long_run_page_s_first_table_is_the_ledger_s():
    """docs/long_run.md's table of the recipe on the judge, every cell, from the ledger's evaluations of judge/s0,
    s1 and s2."""
    runs = ledgers.runs(ledgers.read(os.path.join(RUNS, "long_run.jsonl")), "judge")
    text = page("long_run.md")
    for seed in (0, 1, 2):
        judge, geneval = long_run_rows({r["step"]: r["eval"] for r in runs[f"s{seed}"]})
        assert f"| {seed} | {judge}\n| {seed}, GenEval's rule | {geneval}\n" in text, f"seed {seed}: {judge}"


def test_every_ledger_reads_and_names_its_runs():
    """Each ledger in docs/runs is a JSON object a line with its set and run; the runs the pages name are there."""
    names = {}
    for name in ("long_run.jsonl", "hacking.jsonl", "choice.jsonl", "judge.jsonl"):
        rows = ledgers.read(os.path.join(RUNS, name))
        names[name] = {f"{r['set']}/{r['run']}" for r in rows}
    assert {"judge/s0", "judge/div300-s0", "recipe/s2", "plateau/prompts24-s0", "levers/A-s0", "first/s0",
            "judge/noise_draws", "judge/base"} <= names["long_run.jsonl"]
    assert {f"{s}/{b}-s{k}" for s in ("first", "judge") for b in hacking.BRAKES for k in range(3)} == \
        names["hacking.jsonl"]
    assert len(names["choice.jsonl"]) == 19 and "loopholes/worst-sft" in names["judge.jsonl"]


def test_a_damaged_ledger_is_one_line_naming_its_line(tmp_path):
    ledger = tmp_path / "judge.jsonl"
    ledger.write_text('{"set": "loopholes", "run": "a"}\n\n[1, 2]\n')
    with pytest.raises(SystemExit) as e:
        ledgers.read(str(ledger))
    assert str(e.value).startswith(f"error: {ledger}:3 is damaged (not an object with its set and run named)")
    # what the studies' scripts would index without a check: bytes that are not UTF-8, a step that is text, an eval
    # that is not an object (each was a traceback in hacking.py / long_runs.py)
    for line, why in ((b'{"set": "s", "run": "a", "step": 1}\n\xff\xfe\n', "utf-8"),
                      (b'{"set": "s", "run": "a", "step": "25"}\n', "step '25' is not a whole number"),
                      (b'{"set": "s", "run": "a", "step": 25, "eval": [0.5]}\n', "its eval or train is not an object")):
        ledger.write_bytes(line)
        with pytest.raises(SystemExit) as e:
            ledgers.read(str(ledger))
        assert str(e.value).startswith(f"error: {ledger}:") and why in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="is not a file: give --ledger the ledger"):
        ledgers.read(str(tmp_path))


def test_a_run_folder_folds_into_rows_and_unfolds_back(tmp_path):
    """run_rows keeps every evaluation and, per step, every training figure (6 significant digits); unfold gives
    them back."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "eval.jsonl").write_text("".join(json.dumps({"step": s, "geneval_overall": s / 100}) + "\n"
                                               for s in (0, 2, 4)))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "kl": s * 0.1, "r_mean": 1 / 3}) + "\n"
                                                  for s in range(1, 6)))
    rows = ledgers.run_rows(str(folder), "a", "r", command="python train.py")
    assert [r["step"] for r in rows] == [0, 2, 4] and rows[0]["command"] == "python train.py"
    assert [r["train"]["step"] for r in rows[1:]] == [[1, 2], [3, 4, 5]]  # the last row: the steps after it too
    assert rows[2]["train"]["kl"] == pytest.approx([0.3, 0.4, 0.5]) and rows[2]["train"]["r_mean"] == [0.333333] * 3
    back = ledgers.unfold(rows, str(tmp_path / "back"))
    metrics = [json.loads(line) for line in open(os.path.join(back, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5] and np.allclose([m["kl"] for m in metrics],
                                                                           [0.1, 0.2, 0.3, 0.4, 0.5])
    assert [json.loads(line) for line in open(os.path.join(back, "eval.jsonl"))][2] == {"step": 4,
                                                                                       "geneval_overall": 0.04}


def script(name, *argv, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.parametrize("argv,last", [
    (["--samples", "0"], "loopholes.py: error: argument --samples: must be an integer in [1, inf), got 0"),
    (["--out", "{file}"], "loopholes.py: error: --out {file} is a file, not a folder: give a folder for "
                          "loopholes.json and the grids"),
    (["base", "--ledger", "{damaged}", "--name", "x"], "error: {damaged}:2 is damaged (Expecting property name "
                                                       "enclosed in double quotes: line 1 column 2 (char 1)): restore "
                                                       "it (git checkout {damaged}), or delete that line and run "
                                                       "that run again"),
    (["--report", "gamed", "--ledger", "{damaged}"], "error: {damaged}:2 is damaged (Expecting property name enclosed "
                                                     "in double quotes: line 1 column 2 (char 1)): restore it (git "
                                                     "checkout {damaged}), or delete that line and run that run "
                                                     "again")])
def test_loopholes_refuses_bad_input_in_one_line_before_sampling(tmp_path, argv, last):
    """Before: --samples 0 sampled nothing and ended in torch.cat's ValueError, an --out that is a file in
    FileExistsError, each a traceback after the model was loaded."""
    where = {"file": str(tmp_path / "a_file"), "damaged": str(tmp_path / "judge.jsonl")}
    (tmp_path / "a_file").write_text("")
    (tmp_path / "judge.jsonl").write_text('{"set": "loopholes", "run": "a"}\n{oops\n')
    done = script("loopholes.py", *[a.format(**where) for a in argv])
    assert done.returncode in (1, 2) and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == last.format(**where)
    assert "samples" not in done.stdout  # nothing sampled


def test_hacking_refuses_an_out_that_is_a_file_and_a_damaged_ledger(tmp_path):
    (tmp_path / "a_file").write_text("")
    done = script("hacking.py", "--report", "--out", str(tmp_path / "a_file"))
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        f"--out {tmp_path / 'a_file'} is a file, not a folder: give a folder for the runs, hacking.md and hacking.png")
    (tmp_path / "hacking.jsonl").write_text('{"set": "judge", "run": "none-s0"}\n[]\n')
    done = script("hacking.py", "--report", "--ledger", str(tmp_path / "hacking.jsonl"), "--out", str(tmp_path / "r"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path / 'hacking.jsonl'}:2 is damaged (not an object "
                                                f"with its set and run named): restore it (git checkout "
                                                f"{tmp_path / 'hacking.jsonl'}), or delete that line and run that run "
                                                "again"]
