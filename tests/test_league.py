"""scripts/league.py: its bookkeeping (samples, lr choice, curves, the tables) on run folders written here, and
its scheduling and failures with a stand-in for train.py that writes such folders in a moment."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)
import league  # noqa: E402
import forkserver  # noqa: E402
import sde  # noqa: E402
import train  # noqa: E402

LEAGUE_COMMON = list(league.COMMON)  # the league's own, before small_steps replaces it
TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


@pytest.fixture(autouse=True)
def small_steps(monkeypatch):
    """Every league here runs steps of 4 prompts x 8 samples (COMMON), whatever train.py's default step holds."""
    monkeypatch.setattr(league, "COMMON", ["--prompts-per-step", "4"])


def eval_row(step, accuracy, tags=None, official=None):
    """eval.jsonl's row; with `official`, GenEval's own rule beside the judge: that overall, each tag as the judge's
    but counting 0.2 lower."""
    tags = tags or {t: accuracy for t in TAGS}
    row = {"step": step, "geneval_overall": accuracy, **{f"geneval_{t}": v for t, v in tags.items()}}
    if official is not None:
        row.update(geneval_official_overall=official, **{f"geneval_official_{t}": v - 0.2 * (t == "counting")
                                                        for t, v in tags.items()})
    return row


def fake_run(args, run, seconds, accuracy, *, done=True, tags=None, eval0=None, machine=None, official=None):
    """A finished league run as train.py and the league leave it: args.json, a metrics row per step (its `seconds`),
    an eval row every args.eval_every steps from step 0 (`accuracy` per evaluation; `tags` the last one's; `official`
    GenEval's rule per evaluation, eval_row), and the league's record."""
    folder = os.path.join(args.out, league.run_name(*run))
    os.makedirs(folder)
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump({"args": {"prompts_per_step": 4, "group_size": 8}}, f)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, s in enumerate(seconds, start=1):
            f.write(json.dumps({"step": step, "seconds": s}) + "\n")
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i, a in enumerate(accuracy):
            if i or eval0 is None:
                f.write(json.dumps(eval_row(i * args.eval_every, a, tags if i == len(accuracy) - 1 else None,
                                            official[i] if official else None)) + "\n")
        f.write('{"step": 6, "geneval_ov')  # a torn last line (a killed run) is skipped
    record = dict(flags=league.train_flags(*run, args), done=done, eval0=eval0, load=3.0)
    league.write_record(args.out, run, dict(record, machine=machine) if machine else record)


def league_args(tmp_path, *extra):
    """The league's parsed flags: 4 steps of 32 samples, evaluated every 2 steps."""
    return league.parse_args(["--out", str(tmp_path), "--samples", "128", "--evals", "3", *extra])


def test_lr_text_round_trips_and_names_runs():
    assert [league.lr_text(lr) for lr in (5e-5, 1e-4, 2e-4, 1.5e-4, 1e-3)] == ["5e-5", "1e-4", "2e-4", "1.5e-4", "1e-3"]
    assert float(league.lr_text(1.5e-4)) == 1.5e-4
    assert league.run_name("mix-flash", 4e-4, 2) == "mix-flash-lr4e-4-s2"


def test_lr_is_the_best_final_accuracy_of_the_sweep_ties_to_the_smaller(tmp_path):
    assert league.choose_lr({5e-5: 0.35, 1e-4: 0.41, 2e-4: 0.38}) == 1e-4
    assert league.choose_lr({4e-4: 0.41, 1e-4: 0.41 + 1e-12, 2e-4: 0.30}) == 1e-4  # a tie, whatever the float noise
    assert league.choose_lr({}) is None
    args = league_args(tmp_path, "--only", "nft", "--lrs", "1e-4", "2e-4", "4e-4", "--sweep-seed", "7", "--seeds", "0")
    for lr, final in ((1e-4, 0.40), (2e-4, 0.45), (4e-4, 0.45)):  # the sweep: 2e-4 and 4e-4 tie
        fake_run(args, ("nft", lr, 7), [1.0] * 4, [0.3, 0.35, final])
    fake_run(args, ("nft", 4e-4, 0), [1.0] * 4, [0.3, 0.5, 0.6])  # not the chosen lr: not in the table
    fake_run(args, ("nft", 2e-4, 0), [1.0] * 4, [0.3, 0.4, 0.5])
    results = league.report(args)
    assert results["nft"]["lr"] == 2e-4 and list(results["nft"]["curves"]) == [0]
    assert results["nft"]["curves"][0][-1]["accuracy"] == 0.5
    table = open(tmp_path / "league.md").read()
    assert "| nft | 0.400 | 0.450 | 0.450 | 2e-4 |" in table  # the sweep's table, the chosen lr last
    # An entry whose sweep has not finished shows its best lr so far, marked in both tables
    args = league_args(tmp_path / "partial", "--only", "nft", "--lrs", "1e-4", "2e-4", "--sweep-seed", "0",
                       "--seeds", "0", "1")
    fake_run(args, ("nft", 1e-4, 0), [1.0] * 4, [0.3, 0.35, 0.4])
    league.report(args)
    table = open(tmp_path / "partial" / "league.md").read()
    assert "| nft (1 of 2 seeds) (lr sweep unfinished) | 1e-4 |" in table and "| nft | 0.400 | - | 1e-4 so far |" in table


def test_equal_samples_budget_defaults_to_the_default_run_and_sets_the_steps(tmp_path, monkeypatch):
    _, default = train.parse_args(league.COMMON)
    per_step = default.prompts_per_step * default.group_size
    args = league.parse_args(["--out", str(tmp_path)])
    assert (args.samples, args.per_step, args.steps) == (default.steps * per_step, per_step, default.steps)
    args = league.parse_args(["--out", str(tmp_path), "--samples", str(10 * per_step), "--evals", "4"])
    assert args.steps == 10 and args.eval_every == 2  # 6 evaluations: the largest step count giving 4 or more
    assert ["--steps", "10", "--eval-every", "2"] == league.train_flags("awm", 1e-4, 0, args)[4:8]
    assert [league.eval_every(40, 5), league.eval_every(40, 4), league.eval_every(3, 5)] == [10, 10, 1]
    monkeypatch.setattr(league, "COMMON", ["--prompts-per-step", "16"])  # the samples per step follow COMMON
    args = league.parse_args(["--out", str(tmp_path)])
    assert (args.per_step, args.samples) == (16 * default.group_size, default.steps * 16 * default.group_size)


def test_a_budget_that_is_not_whole_steps_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        league.parse_args(["--out", str(tmp_path), "--samples", "100"])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].endswith(
        "error: --samples 100 is not a whole number of steps of 32 samples: use --samples 96 or 128")


def test_curve_counts_training_seconds_up_to_each_evaluation(tmp_path):
    args = league_args(tmp_path)
    fake_run(args, ("grpo", 1e-4, 0), [1.0, 2.0, 3.0, 4.0], [0.3, 0.4, 0.5])
    points = league.curve(args.out, ("grpo", 1e-4, 0))
    assert [(p["step"], p["samples"], p["seconds"], p["accuracy"]) for p in points] == \
        [(0, 0, 0.0, 0.3), (2, 64, 3.0, 0.4), (4, 128, 10.0, 0.5)]
    fake_run(args, ("nft", 1e-4, 0), [1.0] * 4, [0.3, 0.3, 0.3], done=False)
    assert league.curve(args.out, ("nft", 1e-4, 0)) is None  # not marked done: run again, not reported
    # train.py's resume drops eval.jsonl's step-0 row; the league's record keeps it
    fake_run(args, ("awm", 1e-4, 0), [1.0] * 4, [0.25, 0.3, 0.35], eval0=eval_row(0, 0.25))
    assert [p["accuracy"] for p in league.curve(args.out, ("awm", 1e-4, 0))] == [0.25, 0.3, 0.35]
    folder = os.path.join(args.out, "awm-lr1e-4-s0")
    assert league.read_curve(folder, None, 4) is None  # incomplete without it
    assert league.read_curve(folder, eval_row(0, 0.25), 5) is None  # and a run short of its last step


def test_equal_wall_clock_reads_each_curve_at_the_budget(tmp_path):
    args = league_args(tmp_path, "--only", "grpo", "fast", "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "0", "1")
    # fast: 2 and 3 minutes in all (median 2.5, the budget); grpo: 4 and 6 minutes
    fake_run(args, ("fast", 1e-4, 0), [30.0] * 4, [0.30, 0.35, 0.40])
    fake_run(args, ("fast", 1e-4, 1), [45.0] * 4, [0.30, 0.33, 0.38])
    fake_run(args, ("grpo", 1e-4, 0), [60.0] * 4, [0.30, 0.50, 0.60])  # at 2.5 min: step 2 (2 min), 0.50
    fake_run(args, ("grpo", 1e-4, 1), [90.0] * 4, [0.30, 0.40, 0.70])  # at 2.5 min: step 0, 0.30
    results = league.report(args)
    assert league.wall_clock_budget(results) == (2.5, "the median of the fastest entry, fast")
    table = open(tmp_path / "league.md").read()
    assert "within 2.5 training minutes" in table
    assert "| grpo | 1e-4 | 32 | 1.0 | 0.400 +- 0.141 | +0.100 |" in table  # samples 64 and 0, minutes 2 and 0
    assert "| fast | 1e-4 | 96 | 1.8 | 0.365 +- 0.049 | +0.065 |" in table  # seed 0 ended at 2 min: its last
    league.main(["--report", "--out", str(tmp_path), "--samples", "128", "--evals", "3", "--only", "grpo", "fast",
                 "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "0", "1", "--minutes", "10"])
    table = open(tmp_path / "league.md").read()
    assert "| grpo* | 1e-4 | 128 | 5.0 | 0.650 +- 0.071 | +0.350 |" in table  # both finished within 10 minutes
    assert "\\* ran out of samples before the budget: grpo, fast" in table
    assert "--minutes 10" in table  # the command that reproduces it


def test_speed_up_over_grpo_is_the_samples_and_minutes_to_reach_its_final_accuracy(tmp_path):
    pytest.importorskip("matplotlib")
    args = league_args(tmp_path, "--only", "grpo", "nft", "fast", "--lrs", "1e-4", "--sweep-seed", "0",
                       "--seeds", "0", "1")
    # evaluations at 0, 64 and 128 samples; grpo's mean curve 0.30, 0.42, 0.50 at 0, 60 and 120 s: its final 0.50
    # is first reached at its end, 128 samples and 2 minutes
    fake_run(args, ("grpo", 1e-4, 0), [30.0] * 4, [0.30, 0.40, 0.50])
    fake_run(args, ("grpo", 1e-4, 1), [30.0] * 4, [0.30, 0.44, 0.50])
    # nft's mean 0.30, 0.55, 0.65 at 0, 30 and 60 s: 0.50 four fifths of the way to its first evaluation
    fake_run(args, ("nft", 1e-4, 0), [15.0] * 4, [0.30, 0.60, 0.70])
    fake_run(args, ("nft", 1e-4, 1), [15.0] * 4, [0.30, 0.50, 0.60])
    fake_run(args, ("fast", 1e-4, 0), [10.0] * 4, [0.30, 0.35, 0.40])
    fake_run(args, ("fast", 1e-4, 1), [10.0] * 4, [0.30, 0.45, 0.48])
    league.report(args)
    table = open(tmp_path / "league.md").read()
    assert "first reach grpo's final accuracy, 0.500" in table and "grpo's 128 samples and 2.0 minutes" in table
    assert "| grpo | 128 | 1.0x | 2.0 | 1.0x |" in table
    assert "| nft | 51 | 2.5x | 0.4 | 5.0x |" in table  # 0.8 x 64 samples, 0.8 x 30 s
    assert "| fast | not reached | - | not reached | - |" in table
    # With flow (Flow-GRPO's own SDE step) in the league, a second table times every entry to its final accuracy
    fake_run(args, ("flow", 1e-4, 0), [30.0] * 4, [0.30, 0.35, 0.40])  # mean 0.30, 0.375, 0.40: final 0.40
    fake_run(args, ("flow", 1e-4, 1), [30.0] * 4, [0.30, 0.40, 0.40])
    league.report(league_args(tmp_path, "--only", "grpo", "nft", "fast", "flow", "--lrs", "1e-4", "--sweep-seed", "0",
                              "--seeds", "0", "1"))
    table = open(tmp_path / "league.md").read()
    assert table.index("**Speed-up over grpo**") < table.index("**Speed-up over flow**")
    after_flow = table[table.index("**Speed-up over flow**"):]
    assert "first reach flow's final accuracy, 0.400" in after_flow
    assert "| flow | 128 | 1.0x | 2.0 | 1.0x |" in after_flow
    assert "| grpo | 53 | 2.4x | 0.8 | 2.4x |" in after_flow  # grpo's mean 0.42 at 64 samples: 0.4 is 10/12 of the way
    assert "| nft | 26 | 5.0x | 0.2 | 10.0x |" in after_flow  # nft's mean 0.55 at 64 samples, 30 s: 0.4 at 0.4 of it
    assert "--reference" not in table  # the default, both
    # Another reference, in the command that reproduces the table; one that did not rise has no speed-up to read
    league.report(league_args(tmp_path, "--only", "grpo", "nft", "fast", "--lrs", "1e-4", "--sweep-seed", "0",
                              "--seeds", "0", "1", "--reference", "nft"))
    table = open(tmp_path / "league.md").read()
    assert "first reach nft's final accuracy, 0.650" in table and "| grpo | not reached |" in table
    assert "--reference nft" in table
    league.report(league_args(tmp_path, "--only", "grpo", "nft", "fast", "--lrs", "1e-4", "--sweep-seed", "0",
                              "--seeds", "0", "1", "--reference", "nft", "nft"))
    assert open(tmp_path / "league.md").read().count("**Speed-up over nft**") == 1  # a repeated name, one table
    assert league.first_reach([(0, 0.0, 0.4), (64, 30.0, 0.3)], 0.35) == (0, 0.0)
    fake_run(args, ("grpo", 1e-4, 2), [30.0] * 4, [0.30, 0.30, 0.25])
    league.report(league_args(tmp_path, "--only", "grpo", "nft", "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "2"))
    assert "**Speed-up over grpo**: none to read, grpo did not rise (0.300 -> 0.250)." \
        in open(tmp_path / "league.md").read()


def test_report_writes_the_summary_into_the_readme_and_the_tables_into_the_doc(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    (_, readme_start, readme_end), (_, doc_start, doc_end) = league.MARKERS["readme"], league.MARKERS["doc"]
    readme, doc, copies = tmp_path / "README.md", tmp_path / "league.md", tmp_path / "docs" / "runs"
    readme.write_text(f"# Title\n\nBefore.\n{readme_start}\nthe old table\n{readme_end}\nAfter.\n")
    doc.write_text(f"# The league\n\n{doc_start}\nthe old tables\n{doc_end}\nMore.\n")
    flags = ["--out", str(tmp_path / "out"), "--samples", "128", "--evals", "3", "--only", "nft", "grpo", "flow",
             "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "0", "1"]
    args = league.parse_args([*flags, "--readme", str(readme), "--doc", str(doc), "--copy-to", str(copies)])
    os.makedirs(args.out)
    fake_run(args, ("nft", 1e-4, 0), [15.0] * 4, [0.30, 0.60, 0.70])  # mean 0.30, 0.55, 0.65 at 0, 30, 60 s
    fake_run(args, ("nft", 1e-4, 1), [15.0] * 4, [0.30, 0.50, 0.60])
    fake_run(args, ("grpo", 1e-4, 0), [30.0] * 4, [0.30, 0.40, 0.50])  # mean 0.30, 0.42, 0.50
    fake_run(args, ("grpo", 1e-4, 1), [30.0] * 4, [0.30, 0.44, 0.50])
    fake_run(args, ("flow", 1e-4, 0), [30.0] * 4, [0.30, 0.35, 0.40])  # mean 0.30, 0.375, 0.40: final 0.40
    fake_run(args, ("flow", 1e-4, 1), [30.0] * 4, [0.30, 0.40, 0.40])
    league.report(args)
    page = readme.read_text()
    assert "the old table" not in page and page.startswith("# Title\n\nBefore.\n") and page.endswith("After.\n")
    summary = page[page.index(readme_start):page.index(readme_end)]
    # one row per entry, by rise: the rise over seeds +- their standard deviation, the speed-up over flow per sample
    # (per minute) as the full table's "Speed-up over flow" reads it, the samples per second
    assert ("| entry | rise +- sd over seeds | rise by GenEval's rule | speed-up over flow, per sample (per minute) | "
            "samples/s |") in summary
    rows = summary.splitlines()[3:6]  # the marker line, the head, its rule, then the rows (no GenEval's rule logged)
    assert rows == ["| nft | +0.350 +- 0.071 | - | 5.0x (10.0x) | 2.1 |",
                    "| grpo | +0.200 +- 0.000 | - | 2.4x (2.4x) | 1.1 |",
                    "| flow | +0.100 +- 0.000 | - | 1.0x (1.0x) | 1.1 |"]
    assert "**Equal samples**" not in summary and "python scripts/league.py --samples 128" in summary
    tables = doc.read_text()
    assert "the old tables" not in tables and tables.endswith("More.\n")
    assert f"{doc_start}\n{open(tmp_path / 'out' / 'league.md').read()}{doc_end}\n" in tables
    assert (copies / "league.png").read_bytes() == (tmp_path / "out" / "league.png").read_bytes()
    assert os.listdir(copies) == ["league.png"]  # league.json is drawn from the ledger: not kept beside the pages
    league.report(args)  # again: the same pages
    assert readme.read_text() == page and doc.read_text() == tables

    def full_disk(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(league.os, "replace", full_disk)  # a full disk: one error line, the README as it was
    with pytest.raises(SystemExit, match="No space left on device.* the tables are in league.md"):
        league.write_into(str(readme), "a new table", *league.MARKERS["readme"])
    monkeypatch.undo()
    assert readme.read_text() == page and not os.path.exists(f"{readme}.tmp")
    readme.write_text(f"# A README with the doc's markers only\n{doc_start}\n{doc_end}\n")
    for flag, path in (("--readme", readme), ("--doc", tmp_path / "missing.md")):
        with pytest.raises(SystemExit) as stop:
            league.parse_args([*flags, flag, str(path)])
        assert stop.value.code == 2 and "put it and" in capsys.readouterr().err


def test_table_has_the_six_tags_the_lr_the_samples_the_minutes_command_and_machine(tmp_path):
    pytest.importorskip("matplotlib")
    args = league_args(tmp_path, "--only", "guard", "--lrs", "2e-4", "--sweep-seed", "0", "--seeds", "0", "1")
    final = dict(zip(TAGS, [0.9, 0.5, 0.25, 0.75, 0.1, 0.05]))
    where = dict(cpu="Some CPU", cpus=64, jobs=4, threads=16)  # where the runs ran, not where the report runs
    fake_run(args, ("guard", 2e-4, 0), [30.0] * 4, [0.3, 0.4, 0.5], tags=final, machine=where)
    fake_run(args, ("guard", 2e-4, 1), [60.0] * 4, [0.32, 0.3, 0.3], tags=dict(final, counting=0.35), machine=where)
    league.report(args)
    table = open(tmp_path / "league.md").read()
    assert "| entry | lr | samples | before | after | rise | GenEval's rule after | single | two_obj | counting " \
           "| colors | position | attr | colour diversity after | samples/s | training minutes |" in table
    row = ("| guard | 2e-4 | 128 | 0.310 +- 0.014 | 0.400 +- 0.141 | +0.090 | - | 0.90 | 0.50 | 0.30 | 0.75 | 0.10 "
           "| 0.05 |")
    # before and after over seeds; the tags after, counting the mean of 0.25 and 0.35; no diversity logged; 128
    # samples in a mean 180 s
    assert row + " - | 0.7 | 3.0 |" in table
    assert "`python scripts/league.py --samples 128 --evals 3 --lrs 2e-4 --sweep-seed 0 --seeds 0 1 --jobs 4 " \
           f"--threads 16 --only guard --out {tmp_path}`" in table
    assert "Machine: Some CPU, 64 CPU threads; 4 run(s) at a time, 16 torch thread(s) each" in table
    assert "median 3.0" in table
    assert os.path.getsize(tmp_path / "league.png") > 10000
    summary = json.load(open(tmp_path / "league.json"))
    assert summary["entries"]["guard"]["curves"]["1"][-1]["tags"]["counting"] == 0.35


def test_tables_give_genevals_own_rule_beside_the_judge(tmp_path):
    """Runs that logged GenEval's own rule on the same images: the equal-samples table gives its accuracy after, and a
    tag's in brackets where it differs from the judge's (counting); the README's summary gives the rise by it."""
    pytest.importorskip("matplotlib")
    flags = ["--only", "nft", "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "0", "1"]
    (_, start, end) = league.MARKERS["readme"]
    (tmp_path / "README.md").write_text(f"{start}\n{end}\n")
    args = league_args(tmp_path, *flags, "--readme", str(tmp_path / "README.md"))
    fake_run(args, ("nft", 1e-4, 0), [30.0] * 4, [0.3, 0.4, 0.5], official=[0.28, 0.36, 0.44])
    fake_run(args, ("nft", 1e-4, 1), [30.0] * 4, [0.3, 0.4, 0.5], official=[0.26, 0.36, 0.40])
    league.report(args)
    row = ("| nft | 1e-4 | 128 | 0.300 +- 0.000 | 0.500 +- 0.000 | +0.200 | 0.420 +- 0.028 | 0.50 | 0.50 | 0.50 (0.30) "
           "| 0.50 |")
    assert row in open(tmp_path / "league.md").read()  # counting: 0.50 on the judge, 0.30 by GenEval's rule
    assert "| nft | +0.200 +- 0.000 | +0.150 | - | 1.1 |" in (tmp_path / "README.md").read_text()  # 0.27 -> 0.42


def test_table_reports_the_colour_diversity_after_over_seeds(tmp_path):
    pytest.importorskip("matplotlib")
    args = league_args(tmp_path, "--only", "nft", "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "0", "1")
    for seed, diversity in ((0, 0.8), (1, 0.6)):
        fake_run(args, ("nft", 1e-4, seed), [30.0] * 4, [0.3, 0.4, 0.5])
        path = tmp_path / league.run_name("nft", 1e-4, seed) / "eval.jsonl"
        with open(path, "a") as f:  # the last evaluation again (the last row of a step counts), with its diversity
            f.write("\n" + json.dumps(dict(eval_row(4, 0.5), diversity_color=diversity)) + "\n")
    league.report(args)
    assert "| 0.700 +- 0.141 | 1.1 | 2.0 |" in open(tmp_path / "league.md").read()
    # A row without it (a run finished before diversity was logged): the mean of those with it, counted
    fake_run(args, ("nft", 1e-4, 2), [30.0] * 4, [0.3, 0.4, 0.5])
    league.report(league_args(tmp_path, "--only", "nft", "--lrs", "1e-4", "--sweep-seed", "0",
                              "--seeds", "0", "1", "2"))
    assert "| 0.700 +- 0.141 (2 seeds) | 1.1 | 2.0 |" in open(tmp_path / "league.md").read()


def test_speeds_measured_alone_time_the_curves_and_the_wall_clock_table(tmp_path, fake_train):
    pytest.importorskip("matplotlib")
    out, speeds = tmp_path / "league", tmp_path / "speeds.json"
    base = ["--out", str(out), "--samples", "128", "--evals", "3", "--poll", "0.02", "--only", "grpo", "nft", "--lrs",
            "2e-4", "--sweep-seed", "0", "--seeds", "0"]
    measured = league.main([*base, "--measure-speed", "--speeds", str(speeds), "--speed-steps", "4"])
    assert {name: v["seconds_per_step"] for name, v in measured.items()} == {"grpo": 6.0, "nft": 3.0}  # not step 1
    runs = [argv for argv in fake_train()]
    assert len(runs) == 2 and all(argv[-4:-2] == ["--steps", "4"] and argv[-1] == "0" for argv in runs)
    assert not (out / "speed-grpo").exists() and json.load(open(speeds))["nft"]["machine"]["jobs"] == 1
    league.main([*base, "--jobs", "2"])  # the league itself: its runs' own seconds are 6 a step for both
    results = league.main([*base, "--speeds", str(speeds), "--report"])
    assert [p["seconds"] for p in results["nft"]["curves"][0]] == [0.0, 6.0, 12.0]  # steps x 3.0
    assert [p["league_seconds"] for p in results["nft"]["curves"][0]] == [0.0, 12.0, 24.0]
    table = open(out / "league.md").read()
    assert "each entry's seconds per step measured alone" in table and f"--speeds {speeds}" in table
    assert "| 0.40 | - | 10.7 | 0.2 |" in table  # nft: 128 samples in 4 steps of 3 s
    # within nft's 0.2 minutes (12 s): grpo at its step 2 evaluation, nft at its end
    assert "| grpo | 2e-4 | 64 | 0.2 | 0.350 (1 seed) | +0.050 |\n| nft | 2e-4 | 128 | 0.2 | 0.400 (1 seed) | +0.100 |" \
        in table
    with pytest.raises(SystemExit) as stop:
        league.parse_args(["--out", str(out), "--measure-speed"])
    assert stop.value.code == 2


def test_report_of_a_missing_folder_is_one_error_line(tmp_path):
    missing = tmp_path / "nothing"
    done = forkserver.run([sys.executable, os.path.join(ROOT, "scripts", "league.py"), "--report", "--out",
                           str(missing)], timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [f"error: {missing} is not a folder: run the league first "
                                                "(python scripts/league.py), or give the --out it wrote"]
    with pytest.raises(SystemExit) as stop:  # an empty folder, or runs of another league
        league.main(["--report", "--out", str(tmp_path)])
    assert str(stop.value.code).startswith(f"error: {tmp_path} holds no finished run of this league")


def test_report_refuses_runs_of_other_flags(tmp_path):
    args = league_args(tmp_path, "--only", "grpo", "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "0")
    fake_run(args, ("grpo", 1e-4, 0), [1.0] * 4, [0.3, 0.4, 0.5])
    with pytest.raises(SystemExit) as stop:  # the same runs read as a league of 2 steps
        league.main(["--report", "--out", str(tmp_path), "--samples", "64", "--only", "grpo", "--lrs", "1e-4",
                     "--sweep-seed", "0", "--seeds", "0"])
    message = str(stop.value.code)
    assert message.startswith(f"error: {tmp_path}/grpo-lr1e-4-s0 was run with `--seed 0 --lr 1e-4 --steps 4 ") and \
        "\n" not in message


FAKE_TRAIN = textwrap.dedent('''
    """Stands in for train.py: the run folder of a run that learns best at lr 2e-4 (4e-4 ties), in a moment."""
    import argparse, json, os, sys
    p = argparse.ArgumentParser()
    for flag in ("--out", "--seed", "--lr", "--steps", "--eval-every", "--resume", "--loss"):
        p.add_argument(flag)
    p.add_argument("--overwrite", action="store_true")
    a, _ = p.parse_known_args()
    with open(os.environ["FAKE_LAUNCHES"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    if os.environ.get("FAKE_SLOW"):  # a long run that saves and exits 0 on SIGTERM, as train.py does
        import signal, time
        signal.signal(signal.SIGTERM, lambda *_: (open(a.out + ".stopped", "w").close(), sys.exit(0)))
        time.sleep(120)
    if a.lr in os.environ.get("FAKE_FAIL", "").split():
        print("step 1 | reward +0.1")
        print(f"error: --lr {a.lr} fails here; fix the fake")
        sys.exit(1)
    steps, every = int(a.steps), int(a.eval_every) or int(a.steps) + 1  # 0: no evaluation (a speed run)
    speed_run = every > steps  # alone: nft twice as fast, the first step slower (it builds what the rest reuse)
    seconds = {"nft": 3.0}.get(a.loss, 6.0) if speed_run else 6.0
    last = steps // 2 if os.environ.get("FAKE_STOP") else steps  # as a SIGTERM'd train.py: saved, exit 0, not done
    gain = {"5e-5": 0.02, "1e-4": 0.05, "2e-4": 0.1, "4e-4": 0.1}[a.lr] + 0.01 * int(a.seed)
    os.makedirs(os.path.join(a.out, "checkpoints", str(last)), exist_ok=True)
    json.dump({"args": {"prompts_per_step": 4, "group_size": 8}}, open(os.path.join(a.out, "args.json"), "w"))
    with open(os.path.join(a.out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "seconds": 20.0 if s == 1 and speed_run else seconds}) + "\\n"
                     for s in range(1, last + 1))
    tags = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
    with open(os.path.join(a.out, "eval.jsonl"), "w") as f:
        for s in range(0, last + 1, every):
            accuracy = 0.3 + gain * s / steps
            f.write(json.dumps({"step": s, "geneval_overall": accuracy, **{f"geneval_{t}": accuracy for t in tags}})
                    + "\\n")
''')


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    """league.TRAIN pointed at FAKE_TRAIN; returns a function giving the argv of every launch so far."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    launches = tmp_path / "launches.jsonl"
    monkeypatch.setattr(league, "TRAIN", [sys.executable, str(script)])
    monkeypatch.setenv("FAKE_LAUNCHES", str(launches))
    return lambda: [json.loads(line) for line in open(launches)] if launches.exists() else []


def run_league(out, *extra):
    return league.main(["--out", str(out), "--samples", "128", "--evals", "3", "--poll", "0.02", "--only", "grpo",
                        "nft", "--lrs", "1e-4", "2e-4", "4e-4", "--sweep-seed", "3", "--seeds", "0", "1", *extra])


def test_league_sweeps_then_runs_the_seeds_at_the_chosen_lr_and_never_reruns_a_finished_run(tmp_path, fake_train):
    out = tmp_path / "league"
    results = run_league(out, "--jobs", "1")
    launched = [(argv[argv.index("--out") + 1].rsplit("/", 1)[1], argv[argv.index("--out") + 2]) for argv in
                fake_train()]
    assert sorted(name for name, _ in launched) == sorted(
        [f"{e}-lr{lr}-s3" for e in ("grpo", "nft") for lr in ("1e-4", "2e-4", "4e-4")]
        + [f"{e}-lr2e-4-s{s}" for e in ("grpo", "nft") for s in (0, 1)])
    assert {how for _, how in launched} == {"--resume"}  # fresh folders: --resume auto starts them
    first = ["grpo-lr1e-4-s3", "grpo-lr2e-4-s3", "grpo-lr4e-4-s3", "grpo-lr2e-4-s0", "grpo-lr2e-4-s1"]
    assert [name for name, _ in launched][:5] == first  # an entry's seeds start as soon as its sweep ends
    assert results["grpo"]["lr"] == results["nft"]["lr"] == 2e-4  # 4e-4 ties: the smaller
    assert [c[-1]["accuracy"] for c in results["nft"]["curves"].values()] == [pytest.approx(0.4), pytest.approx(0.41)]
    assert "| grpo | 2e-4 | 128 | 0.300 +- 0.000 | 0.405 +- 0.007 | +0.105 |" in open(out / "league.md").read()
    assert all(json.load(open(out / f"{name}.json"))["done"] for name, _ in launched)
    assert not (out / "grpo-lr2e-4-s0" / "checkpoints").exists()  # a finished run's weights go (--keep-weights)
    run_league(out)  # everything finished: nothing is launched again
    assert len(fake_train()) == len(launched)


def test_every_failed_run_exits_non_zero_naming_the_first_and_leaves_no_done_mark(tmp_path, fake_train, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1e-4 2e-4 4e-4")
    out = tmp_path / "league"
    with pytest.raises(SystemExit) as stop:
        run_league(out, "--jobs", "1")
    assert str(stop.value.code) == (f"error: 6 run(s) failed; the first, grpo-lr1e-4-s3: rc 1: error: --lr 1e-4 fails "
                                    f"here; fix the fake (log: {out}/grpo-lr1e-4-s3.log); rerun the same command after "
                                    "fixing it: finished runs are kept")
    assert len(fake_train()) == 6  # no seed runs without an lr
    assert not any(json.load(open(out / f"{e}-lr{lr}-s3.json"))["done"] for e in ("grpo", "nft")
                   for lr in ("1e-4", "2e-4", "4e-4"))
    assert not (out / "league.md").exists()


def test_some_failed_runs_report_what_finished_then_exit_non_zero(tmp_path, fake_train, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "2e-4")
    out = tmp_path / "league"
    with pytest.raises(SystemExit) as stop:
        run_league(out)
    assert str(stop.value.code).startswith("error: 2 run(s) failed; the first, grpo-lr2e-4-s3: rc 1: error: --lr 2e-4")
    table = open(out / "league.md").read()  # chosen among the finished: 4e-4
    assert "| grpo (lr sweep unfinished) | 4e-4 | 128 | 0.300 +- 0.000 | 0.405 +- 0.007 | +0.105 |" in table
    assert "| grpo | 0.380 | - | 0.430 | 4e-4 so far |" in table  # the failed sweep run is a dash
    monkeypatch.delenv("FAKE_FAIL")
    before = len(fake_train())
    run_league(out)  # the failed runs run again, the rest not; 2e-4 now ties 4e-4, so the seeds run at 2e-4
    again = fake_train()[before:]
    assert sorted(argv[argv.index("--out") + 1].rsplit("/", 1)[1] for argv in again) == \
        [f"{e}-lr2e-4-s{s}" for e in ("grpo", "nft") for s in (0, 1, 3)]
    assert "| grpo | 2e-4 | 128 | 0.300 +- 0.000 | 0.405 +- 0.007 | +0.105 |" in open(out / "league.md").read()


def test_a_run_stopped_early_is_not_done_and_continues_with_resume(tmp_path, fake_train, monkeypatch):
    monkeypatch.setenv("FAKE_STOP", "1")  # exits 0 half way, as train.py does on SIGTERM
    out = tmp_path / "league"
    with pytest.raises(SystemExit) as stop:
        run_league(out, "--only", "grpo", "--lrs", "1e-4", "--seeds", "3")
    assert "grpo-lr1e-4-s3: stopped before step 4 and its evaluation" in str(stop.value.code)
    record = json.load(open(out / "grpo-lr1e-4-s3.json"))
    assert record["done"] is False and (out / "grpo-lr1e-4-s3" / "checkpoints" / "2").is_dir()  # kept to resume
    monkeypatch.delenv("FAKE_STOP")
    run_league(out, "--only", "grpo", "--lrs", "1e-4", "--seeds", "3")
    second = fake_train()[-1]
    assert second[second.index("--out") + 2:][:2] == ["--resume", "auto"]
    record = json.load(open(out / "grpo-lr1e-4-s3.json"))
    assert record["done"] is True and record["eval0"]["step"] == 0  # kept for the resume
    # a run left by other flags (here 2 evaluations fewer) starts over
    league.write_record(str(out), ("grpo", 1e-4, 0), dict(flags=["--steps", "8"], done=False))
    os.makedirs(out / "grpo-lr1e-4-s0")
    run_league(out, "--only", "grpo", "--lrs", "1e-4", "--seeds", "0", "3")
    third = fake_train()[-1]
    assert third[third.index("--out") + 1].endswith("grpo-lr1e-4-s0") and "--overwrite" in third


def test_a_ledger_carries_finished_runs_to_an_empty_out_and_the_report(tmp_path, fake_train):
    ledger = tmp_path / "ledger.jsonl"
    first = tmp_path / "machine1"
    run_league(first, "--only", "grpo", "--lrs", "1e-4", "2e-4", "--seeds", "0", "--ledger", str(ledger))
    launched = len(fake_train())
    rows = [json.loads(line) for line in open(ledger)]
    assert len(rows) == launched == 3 and all(row["done"] and row["curve"][0]["step"] == 0 for row in rows)
    table = open(first / "league.md").read()
    with open(ledger, "a") as f:
        f.write('{"run": "grpo-lr4e-4-s3", "fla')  # a torn last line (a killed league) is skipped
    second = tmp_path / "machine2"  # a new machine: the run folders are gone, the committed ledger is not
    results = run_league(second, "--only", "grpo", "--lrs", "1e-4", "2e-4", "--seeds", "0", "--ledger", str(ledger))
    assert len(fake_train()) == launched  # nothing runs again
    assert results["grpo"]["lr"] == 2e-4 and open(second / "league.md").read() == table.replace(
        str(first), str(second))
    third = tmp_path / "machine3"  # the report alone, from the ledger
    league.main(["--out", str(third), "--samples", "128", "--evals", "3", "--only", "grpo", "--lrs", "1e-4", "2e-4",
                 "--sweep-seed", "3", "--seeds", "0", "--ledger", str(ledger), "--report"])
    assert (third / "league.md").read_text() == table.replace(str(first), str(third))
    # a wider league on the same ledger runs only what the ledger lacks
    run_league(second, "--only", "grpo", "--lrs", "1e-4", "2e-4", "--seeds", "0", "1", "--ledger", str(ledger))
    assert [argv[argv.index("--out") + 1].rsplit("/", 1)[1] for argv in fake_train()[launched:]] == ["grpo-lr2e-4-s1"]
    for wrong in (tmp_path, tmp_path / "no" / "ledger.jsonl"):  # a folder; a file in a folder that is not there
        with pytest.raises(SystemExit) as stop:
            league.parse_args(["--out", str(tmp_path / "x"), "--ledger", str(wrong)])
        assert stop.value.code == 2


def test_a_terminated_league_stops_its_runs_and_exits_130(tmp_path, fake_train, monkeypatch):
    monkeypatch.setenv("FAKE_SLOW", "1")
    out = tmp_path / "league"
    argv = ["--out", str(out), "--samples", "128", "--poll", "0.05", "--only", "grpo", "--lrs", "1e-4", "2e-4",
            "--sweep-seed", "3"]
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r}); import league; "
            f"league.TRAIN = {league.TRAIN!r}; league.COMMON = {league.COMMON!r}; league.main({argv!r})")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while len(fake_train()) < 2 and time.time() < deadline and process.poll() is None:
        time.sleep(0.2)
    time.sleep(1)  # the stand-ins set their SIGTERM handlers
    process.terminate()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "interrupted: 2 run(s) stopped at a checkpoint; the same command continues" in err
    assert (out / "grpo-lr1e-4-s3.stopped").exists() and (out / "grpo-lr2e-4-s3.stopped").exists()
    assert not json.load(open(out / "grpo-lr1e-4-s3.json"))["done"]


def test_every_entry_is_a_valid_train_py_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(league, "COMMON", LEAGUE_COMMON)  # the steps the league runs (flowdppo splits them in two)
    args = league.parse_args(["--out", str(tmp_path)])
    for name in league.ENTRIES:
        for lr in args.lrs:
            flags = league.train_flags(name, lr, 0, args)
            parser, targs = train.parse_args(["--out", str(tmp_path / "x"), *flags])
            train.check_args(parser, targs, 1)  # refuses what cannot run (e.g. guard on cps steps)
            assert targs.lr == lr and targs.steps == args.steps
            assert targs.prompts_per_step * targs.group_size == args.per_step  # equal samples per step
            assert targs.eval_every == args.eval_every and targs.eval_prompts  # a held-out curve


def covered_share(targs, draws=8):
    """The share of the schedule's steps that a run's SDE windows ever cover, over its steps (fast: `draws` rollout
    batches a step, each its own window)."""
    covered = {i for step in range(targs.steps) for b in range(draws)
               for i in sde.sde_steps(targs.num_steps, **train.window_kwargs(targs, step, (0, b)))}
    assert covered == set(range(max(covered) + 1))  # the noisy end first, without gaps
    return len(covered) / targs.num_steps


@pytest.mark.parametrize("name,recipe", [("fast", "sd3_fast_nocfg_cps"), ("mix", "flux_mixgrpo"),
                                         ("mix-flash", "flux_mixgrpo_flash")])
def test_the_windows_cover_the_share_of_the_schedule_the_authors_recipes_do(tmp_path, name, recipe):
    """Scaled to 10 steps and the league's 100, Flow-GRPO-Fast's window stays in the first half and MixGRPO's slides
    over the same noisy share as over the authors' 300 iterations of 25 steps (0.6; Flash 0.72 against 0.7), never
    parked at the clean end."""
    args = league.parse_args(["--out", str(tmp_path)])
    _, ours = train.parse_args(["--out", str(tmp_path / "x"), *league.train_flags(name, 1e-4, 0, args)])
    _, theirs = train.parse_args([f"@recipes/{recipe}.args"])
    assert (ours.sde_window, ours.flash) == (theirs.sde_window, theirs.flash)
    share = covered_share(ours)
    assert share == pytest.approx(covered_share(theirs), abs=0.03)
    assert share <= 0.7


def test_the_first_settings_windows_are_entries_outside_the_default_league(tmp_path):
    """fast-any and mix-end keep the first setting's placements (docs/league.md, "Where the windows sit") to measure
    what the recipes' placement is worth: Flow-GRPO-Fast's window past the first half, MixGRPO's reaching the clean
    end; the league runs them only when asked."""
    args = league.parse_args(["--out", str(tmp_path)])
    assert args.only == [n for n in league.ENTRIES if n not in league.PLACEMENTS] and "fast" in args.only
    assert "--only" not in league.command_line(args)
    shares = {}
    for name in ("fast", "fast-any", "mix", "mix-end"):
        _, targs = train.parse_args(["--out", str(tmp_path / "x"), *league.train_flags(name, 1e-4, 0, args)])
        shares[name] = covered_share(targs)
    assert shares["fast"] == 0.5 and shares["fast-any"] == 0.9  # steps 0 .. 4 of 10, against 0 .. 8
    assert shares["mix"] == 0.6 and shares["mix-end"] == 0.9  # never the last trainable steps, against parked there
    picked = league.parse_args(["--out", str(tmp_path), "--only", "fast-any", "mix-end", "--lrs", "1e-4"])
    assert "--only fast-any mix-end" in league.command_line(picked)


def test_flowdppo_takes_the_off_policy_step_its_mask_acts_on(tmp_path):
    """FlowDPPO's KL-ADV mask drops a term only when the policy has moved from the one that sampled it: the entry
    takes its recipe's optimizer steps per batch, so that the second is off-policy (with one it is grpo)."""
    args = league.parse_args(["--out", str(tmp_path)])
    _, ours = train.parse_args(["--out", str(tmp_path / "x"), *league.train_flags("flowdppo", 1e-4, 0, args)])
    _, theirs = train.parse_args(["@recipes/sd3_flowdppo_pickscore.args"])
    steps = lambda a: a.minibatches * a.updates_per_batch  # noqa: E731
    assert steps(ours) == steps(theirs) == 2  # on-policy it would mask nothing: test_flowdppo_masks_nothing_on_policy


@pytest.mark.parametrize("name,sde_name,recipe,eta", [
    ("flow", "flow", "recipes/sd3_pickscore_grpo.args", None),  # eta read from the recipe
    ("guard", "flow", "recipes/sd3_guard_pickscore.args", None),
    ("dance", "dance", None, 0.3),  # DanceGRPO scripts/finetune/finetune_flux_grpo.sh (no recipe of ours)
])
def test_each_sde_entry_samples_at_its_authors_noise_level(tmp_path, name, sde_name, recipe, eta):
    """eta means another noise in each step's formula (sde.py): Flow-GRPO's and GRPO-Guard's a = 0.7 scales
    sqrt(s / (1 - s)), DanceGRPO's constant eta = 0.3 alone; the preset's 0.7 would be 2.3 times DanceGRPO's noise."""
    args = league.parse_args(["--out", str(tmp_path)])
    _, ours = train.parse_args(["--out", str(tmp_path / "x"), *league.train_flags(name, 1e-4, 0, args)])
    if recipe:
        _, theirs = train.parse_args(["@" + recipe])
        assert theirs.sde == sde_name
        eta = theirs.eta
    assert ours.sde == sde_name and ours.eta == eta


def test_machine_line_counts_the_runs_that_ran_otherwise():
    """A league carried over machines and job counts says how each share of its runs ran, not the commonest alone."""
    where = {"cpu": "AMD EPYC", "cpus": 2, "jobs": 1, "threads": 1}
    line = league.machine_line(where, [2.0, 2.2], [({**where, "jobs": 2}, 3), ({**where, "cpus": 4}, 1)])
    assert line == ("Machine: AMD EPYC, 2 CPU threads; 1 run(s) at a time, 1 torch thread(s) each (3 run(s) with 2 at "
                    "a time, 1 thread(s) each; 1 run(s) with 1 at a time, 1 thread(s) each, on AMD EPYC, 4 CPU "
                    "threads); load average (1 min) as the runs ended: median 2.1, the league's own runs included.")
    alone = league.machine_line(where, [])
    assert alone == "Machine: AMD EPYC, 2 CPU threads; 1 run(s) at a time, 1 torch thread(s) each."


def test_a_league_never_takes_a_run_of_another_judge(tmp_path, fake_train, capsys):
    """The judge is code, not a flag: a ledger row or a run folder trained on GenEval's 0.9 counting rule (records
    written before they named their judge) has the flags of a run on the present judge. A league that runs takes none
    of them (the ledger's are run again, a folder's is refused in one line); a report states its judge and refuses a
    folder that mixes two."""
    ledger = tmp_path / "ledger.jsonl"
    first = tmp_path / "machine1"
    run_league(first, "--only", "grpo", "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "0", "--ledger", str(ledger))
    launched = len(fake_train())
    rows = [json.loads(line) for line in open(ledger)]
    assert launched == 1 and [row["judge"] for row in rows] == [league.JUDGE]
    assert f"trained and judged by the {league.JUDGE}" in open(first / "league.md").read()
    old = [{k: v for k, v in row.items() if k != "judge"} for row in rows]  # as the 0.9-rule league wrote them
    old_ledger = tmp_path / "old.jsonl"
    old_ledger.write_text("".join(json.dumps(row) + "\n" for row in old))
    third = tmp_path / "machine3"  # the old ledger's report alone still reads, and says which judge
    league.main(["--out", str(third), "--samples", "128", "--evals", "3", "--only", "grpo", "--lrs", "1e-4",
                 "--sweep-seed", "0", "--seeds", "0", "--ledger", str(old_ledger), "--report"])
    assert ("trained and judged by the shapes judge, counting above 0.9; GenEval's own rule"
            in (third / "league.md").read_text())
    second = tmp_path / "machine2"
    run_league(second, "--only", "grpo", "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "0", "--ledger",
               str(old_ledger))
    assert len(fake_train()) == launched + 1  # run again on the present judge
    assert "trained on another judge (shapes judge, counting above 0.9" in capsys.readouterr().out
    # a league on a folder holding a finished run of the old judge: one line, nothing runs
    with pytest.raises(SystemExit) as stop:
        run_league(third, "--only", "grpo", "--lrs", "1e-4", "--sweep-seed", "0", "--seeds", "0")
    assert "trained on another judge (shapes judge, counting above 0.9" in str(stop.value)
    assert len(fake_train()) == launched + 1
    # a report over a folder of both judges: one line
    record = json.loads((second / "grpo-lr1e-4-s0.json").read_text())
    (third / "grpo-lr2e-4-s0.json").write_text(json.dumps(dict(record, flags=league.train_flags(
        "grpo", 2e-4, 0, league.plan(league.parse_args(["--out", str(third), "--samples", "128", "--evals", "3"]),
                                     None)))))
    with pytest.raises(SystemExit) as stop:
        league.main(["--out", str(third), "--samples", "128", "--evals", "3", "--only", "grpo", "--lrs", "1e-4",
                     "2e-4", "--sweep-seed", "0", "--seeds", "0", "--report"])
    assert "mixes runs of two judges" in str(stop.value)
