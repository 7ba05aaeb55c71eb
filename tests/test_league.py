"""scripts/league.py: the table and the curves it reads from run folders (the runs themselves are train.py's)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import league  # noqa: E402


def fake_run(folder, seconds, accuracy, *, done=True):
    """A run folder as train.py leaves it: a step line per step, an eval line every 2 steps (step 0 first)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, s in enumerate(seconds, start=1):
            f.write(json.dumps({"step": step, "seconds": s}) + "\n")
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i, a in enumerate(accuracy):
            f.write(json.dumps({"step": 2 * i, "geneval_overall": a}) + "\n")
        f.write('{"step": 6, "geneval_ov')  # a torn last line (a killed run) is skipped
    if done:
        open(os.path.join(folder, "league_done"), "w").close()


def test_curve_counts_training_seconds_up_to_each_evaluation(tmp_path):
    fake_run(str(tmp_path / "grpo-s0"), [1.0, 2.0, 3.0, 4.0], [0.3, 0.4, 0.5])
    assert league.curve(str(tmp_path / "grpo-s0")) == [(0.0, 0, 0.3), (3.0, 2, 0.4), (10.0, 4, 0.5)]
    fake_run(str(tmp_path / "nft-s0"), [1.0], [0.3], done=False)
    assert league.curve(str(tmp_path / "nft-s0")) is None  # unfinished: run again, not reported


def test_report_averages_seeds(tmp_path):
    pytest.importorskip("matplotlib")
    fake_run(str(tmp_path / "grpo-s0"), [30.0] * 4, [0.3, 0.4, 0.5])
    fake_run(str(tmp_path / "grpo-s1"), [60.0] * 4, [0.3, 0.3, 0.3])
    results = league.main(["--report", "--only", "grpo", "nft", "--seeds", "0", "1", "--steps", "4",
                        "--out", str(tmp_path)])
    assert set(results) == {"grpo"}  # nft has no finished run
    assert results["grpo"] == {"before": [0.3, 0.3], "after": [0.5, 0.3], "minutes": [2.0, 4.0]}
    table = open(tmp_path / "league.md").read()
    assert "| 0.300 | 0.400 +- 0.100 | +0.100 | 3.0 |" in table
    assert os.path.getsize(tmp_path / "league.png") > 0


def test_every_entry_is_a_valid_train_py_command_line():
    sys.path.insert(0, ROOT)
    import train
    for name, (_, flags) in league.ENTRIES.items():
        parser, args = train.parse_args(["--model", "shapes", *flags])
        train.check_args(parser, args, 1)  # refuses what cannot run (e.g. guard on cps steps)
