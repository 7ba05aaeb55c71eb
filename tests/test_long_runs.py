"""scripts/long_runs.py: every run of docs/long_run.md is a train.py command line train.py accepts, and the queue
stops each run after its stop step's evaluation, copies its record, never reruns a recorded run and reports a failed
one, with a stand-in for train.py that writes a run folder in a moment."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import long_runs  # noqa: E402

FAKE_TRAIN = textwrap.dedent('''
    """Stands in for train.py: one evaluation a tenth of a second up to --steps, a SIGTERM saves and exits 0."""
    import argparse, json, os, signal, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--steps", type=int)
    a, _ = p.parse_known_args()
    with open(os.environ["FAKE_LAUNCHES"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    if os.environ.get("FAKE_FAIL"):
        sys.exit(2)
    signal.signal(signal.SIGTERM, lambda *_: (open(a.out + ".stopped", "w").close(), sys.exit(0)))
    os.makedirs(a.out, exist_ok=True)
    json.dump({"args": {"steps": a.steps}}, open(os.path.join(a.out, "args.json"), "w"))
    for step in range(0, a.steps + 1, 25):
        with open(os.path.join(a.out, "eval.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "geneval_overall": 0.3}) + "\\n")
        with open(os.path.join(a.out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step}) + "\\n")
        time.sleep(float(os.environ.get("FAKE_SLEEP", "0.1")))
''')


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    """long_runs.TRAIN pointed at FAKE_TRAIN, two runs of 200 steps (one stopped after 75); -> the launches so far."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    launches = tmp_path / "launches.jsonl"
    monkeypatch.setattr(long_runs, "TRAIN", [sys.executable, str(script)])
    monkeypatch.setattr(long_runs, "RUNS", {"whole": ("a section", ["--steps", "200"], None),
                                            "stopped": ("a section", ["--steps", "200"], 75)})
    monkeypatch.setattr(long_runs, "last_step", lambda flags: int(flags[flags.index("--steps") + 1]))
    monkeypatch.setenv("FAKE_LAUNCHES", str(launches))
    return lambda: [json.loads(line) for line in open(launches)] if launches.exists() else []


def test_every_run_of_the_page_is_a_command_line_train_py_accepts():
    stops = {name: stop or long_runs.last_step(flags) for name, (_, flags, stop) in long_runs.RUNS.items()}
    assert stops["levers-nft-ocr"] == 200 and stops["div300-s0"] == 300 and stops["cos400-s0"] == 250
    assert all(0 < stop <= 400 for stop in stops.values())


def test_a_run_stops_after_its_stop_step_its_record_is_copied_and_never_rerun(tmp_path, fake_train):
    out, copy_to = tmp_path / "runs", tmp_path / "docs"
    assert long_runs.main(["--out", str(out), "--copy-to", str(copy_to), "--poll", "0.05"]) == 0
    assert (out / "stopped.stopped").exists() and not (out / "whole.stopped").exists()
    for name, last in (("whole", 200), ("stopped", 75)):
        steps = [json.loads(line)["step"] for line in open(copy_to / name / "eval.jsonl")]
        assert steps[-1] >= last and steps[0] == 0
        assert (copy_to / name / "args.json").exists() and (copy_to / name / "metrics.jsonl").exists()
        command = (copy_to / name / "command.txt").read_text()
        assert f"--out {out / name} --resume auto" in command and "python train.py --steps 200" in command
    assert len(fake_train()) == 2
    assert long_runs.main(["--out", str(out), "--copy-to", str(copy_to), "--poll", "0.05"]) == 0
    assert len(fake_train()) == 2  # both recorded: nothing started again


def test_a_failed_run_exits_non_zero_and_copies_nothing(tmp_path, fake_train, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_FAIL", "1")
    out, copy_to = tmp_path / "runs", tmp_path / "docs"
    assert long_runs.main(["--only", "stopped", "--out", str(out), "--copy-to", str(copy_to), "--poll", "0.05"]) == 1
    assert not (copy_to / "stopped").exists()
    assert "failed: stopped" in capsys.readouterr().err


def test_a_stopped_queue_stops_its_runs_which_save_and_exits_130(tmp_path, fake_train, monkeypatch):
    monkeypatch.setenv("FAKE_SLEEP", "5")
    out = tmp_path / "runs"
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r}); import long_runs; "
            f"long_runs.TRAIN = {long_runs.TRAIN!r}; long_runs.RUNS = {long_runs.RUNS!r}; "
            f"long_runs.last_step = lambda flags: 200; "
            f"sys.exit(long_runs.main(['--out', {str(out)!r}, '--poll', '0.05']))")
    queue = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while len(fake_train()) < 2 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    queue.terminate()
    assert queue.wait(timeout=60) == 130
    assert (out / "whole.stopped").exists() and (out / "stopped.stopped").exists()
    assert "continues whole stopped from their checkpoints" in queue.stderr.read()


def test_a_line_still_being_written_is_not_read(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"step": 0}\n{"step": 25}\n{"step": 5')
    assert long_runs.evaluated(tmp_path) == [0, 25] and long_runs.evaluated(tmp_path / "missing") == []
    assert long_runs.finished(tmp_path, 25) and not long_runs.finished(tmp_path, 50)
