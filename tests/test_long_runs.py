"""scripts/long_runs.py: every run of docs/long_run.md is a train.py command line train.py accepts, and the queue
stops each run after its stop step's evaluation, writes its rows into the ledger, never reruns a recorded run and
reports a failed one, with a stand-in for train.py that writes a run folder in a moment; bad command lines and a
damaged ledger are refused in one line."""
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


def test_a_run_stops_after_its_stop_step_its_rows_are_recorded_and_never_rerun(tmp_path, fake_train):
    out, ledger = tmp_path / "runs", tmp_path / "docs" / "long_run.jsonl"
    assert long_runs.main(["--out", str(out), "--ledger", str(ledger), "--poll", "0.05"]) == 0
    assert (out / "stopped.stopped").exists() and not (out / "whole.stopped").exists()
    rows = long_runs.ledgers.runs(long_runs.ledgers.read(str(ledger)), "judge")
    for name, last in (("whole", 200), ("stopped", 75)):
        steps = [r["step"] for r in rows[name]]
        assert steps[-1] >= last and steps[0] == 0 and steps == sorted(set(steps))
        assert rows[name][0]["args"] == {"args": {"steps": 200}} and rows[name][1]["train"]["step"] == [25]
        command = rows[name][0]["command"]
        assert f"--out {out / name} --resume auto" in command and "python train.py --steps 200" in command
        assert {r["eval"]["geneval_overall"] for r in rows[name]} == {0.3}
    assert len(fake_train()) == 2
    assert long_runs.main(["--out", str(out), "--ledger", str(ledger), "--poll", "0.05"]) == 0
    assert len(fake_train()) == 2  # both recorded: nothing started again


def test_a_failed_run_exits_non_zero_and_records_nothing(tmp_path, fake_train, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_FAIL", "1")
    out, ledger = tmp_path / "runs", tmp_path / "long_run.jsonl"
    assert long_runs.main(["--only", "stopped", "--out", str(out), "--ledger", str(ledger), "--poll", "0.05"]) == 1
    assert not ledger.exists()
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


def run_script(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "long_runs.py"), *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_a_damaged_ledger_is_named_with_its_line(tmp_path):
    """Before: a damaged record was a JSONDecodeError traceback."""
    ledger = tmp_path / "long_run.jsonl"
    ledger.write_text('{"set": "judge", "run": "s0", "step": 0, "eval": {}}\n{"set": "judge", "run"\n')
    done = run_script("--only", "nftfm03-s0", "--ledger", str(ledger), "--out", str(tmp_path / "runs"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {ledger}:2 is damaged (Expecting ':' delimiter") and line.endswith(
        f"restore it (git checkout {ledger}), or delete that line and run that run again")
    assert not (tmp_path / "runs").exists()  # refused before any run started


@pytest.mark.parametrize("argv,needle", [(["--poll", "-1"], "argument --poll: -1 is not above 0"),
                                         (["--poll", "0"], "argument --poll: 0 is not above 0"),
                                         (["--jobs", "0"], "argument --jobs: 0 is not above 0")])
def test_a_poll_or_jobs_below_one_is_refused_before_a_run_starts(tmp_path, argv, needle):
    """Before: --poll -1 started the first runs, then time.sleep(-1) raised ValueError and left them training with
    no queue to stop them."""
    done = run_script(*argv, "--only", "nftfm03-s0", "--out", str(tmp_path / "runs"))
    assert done.returncode == 2 and "Traceback" not in done.stderr and needle in done.stderr.splitlines()[-1]
    assert not (tmp_path / "runs").exists()


def test_an_out_that_is_a_file_is_refused(tmp_path):
    """Before: FileExistsError from os.makedirs, after the queue had printed its plan."""
    (tmp_path / "runs").write_text("")
    done = run_script("--only", "nftfm03-s0", "--out", str(tmp_path / "runs"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].endswith(f"--out {tmp_path / 'runs'} is a file, not a folder: give a folder "
                                                 "for the runs")


def test_an_error_in_the_queue_stops_its_runs(tmp_path, fake_train, monkeypatch):
    """Whatever ends the queue (here a damaged eval.jsonl of a running run) ends its running runs: none is left
    training alone."""
    monkeypatch.setenv("FAKE_SLEEP", "5")
    out = tmp_path / "runs"
    polls = []

    pause = time.sleep

    def sleep(seconds):  # the first look finds a damaged row in the eval.jsonl of the run it stops early
        polls.append(seconds)
        while not (out / "stopped" / "eval.jsonl").exists():
            pause(0.05)
        with open(out / "stopped" / "eval.jsonl", "a") as f:
            f.write("{damaged\n")

    monkeypatch.setattr(long_runs.time, "sleep", sleep)
    with pytest.raises(SystemExit, match=r"stopped/eval.jsonl:2 is damaged"):
        long_runs.main(["--out", str(out), "--poll", "0.05"])
    assert (out / "whole.stopped").exists() and (out / "stopped.stopped").exists()


def test_the_page_s_runs_unfold_into_folders_eval_py_plots(tmp_path):
    """The ledger's rows of a run give back its evaluations and the training figures eval.py --plot draws."""
    import eval as evaluation
    done = run_script("--unfold", "judge/s0", "recipe/s2", "--ledger", os.path.join(ROOT, "docs", "runs",
                                                                                     "long_run.jsonl"),
                      "--out", str(tmp_path / "plot"))
    assert done.returncode == 0, done.stderr
    run = evaluation.read_run(str(tmp_path / "plot" / "judge" / "s0"), [str(tmp_path / "plot" / "judge" / "s0")])
    assert [r["step"] for r in run["eval"]] == list(range(0, 301, 25))
    assert round(run["eval"][0]["geneval_correct"], 4) == 0.3583 and len(run["metrics"]) == 300
    assert all("kl" in r and "reward_mean" in r for r in run["metrics"])
    bad = run_script("--unfold", "judge/s9", "--ledger", os.path.join(ROOT, "docs", "runs", "long_run.jsonl"),
                     "--out", str(tmp_path / "plot"))
    assert bad.returncode == 1 and bad.stderr.startswith("error: ") and "holds no run judge/s9" in bad.stderr
