"""scripts/hacking.py: its runs are valid train.py command lines; with a stand-in for train.py that writes
eval.jsonl in a moment, its table (peaks, ends, means over seeds), its resume and its refusal of changed flags."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)
import hacking  # noqa: E402
import train  # noqa: E402

# Held-out rows as a hacked run leaves them: the proxy rises every evaluation; the exact accuracy peaks at step 2 and
# falls after it unless a KL holds it; the colours narrow unless a KL holds them. FAKE_STOP=N stops after step N's
# evaluation; a continued run (a checkpoint there) drops its step-0 row, as train.py's resume does.
FAKE_TRAIN = textwrap.dedent('''
    import json, os, sys
    argv = sys.argv[1:]
    value = lambda flag: argv[argv.index(flag) + 1]
    out, seed, steps, every = value("--out"), int(value("--seed")), int(value("--steps")), int(value("--eval-every"))
    with open(os.environ["FAKE_LAUNCHES"], "a") as f:
        f.write(json.dumps(argv) + "\\n")
    braked = "--kl-beta" in argv
    if os.environ.get("FAKE_SLOW"):  # a long run that saves and exits 0 on SIGTERM, as train.py does
        import signal, time
        signal.signal(signal.SIGTERM, lambda *_: (open(out + ".stopped", "w").close(), sys.exit(0)))
        open(out + ".started", "w").close()
        time.sleep(120)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "eval.jsonl")
    done = [json.loads(line)["step"] for line in open(path)] if os.path.exists(path) else []
    stop = int(os.environ.get("FAKE_STOP", steps))
    rows = []
    if done:  # continued: the rows up to the checkpoint, without step 0
        rows = [json.loads(line) for line in open(path) if json.loads(line)["step"] > 0]
    for step in range(max(done) + every if done else 0, min(steps, stop) + 1, every):
        exact = 0.3 + 0.02 * min(step, 2) - (0.0 if braked else 0.03 * max(0, step - 2)) + 0.01 * seed
        rows.append({"step": step, "reward": 0.4 + 0.05 * step, "geneval_overall": exact,
                     "diversity_color": 0.9 - (0.0 if braked else 0.05 * step)})
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\\n" for r in rows)
''')


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    launches = tmp_path / "launches.jsonl"
    monkeypatch.setattr(hacking, "TRAIN", [sys.executable, str(script)])
    monkeypatch.setenv("FAKE_LAUNCHES", str(launches))
    return lambda: [json.loads(line) for line in open(launches)] if launches.exists() else []


def test_every_brake_is_a_valid_train_py_command_line(tmp_path):
    args = hacking.parse_args(["--out", str(tmp_path), "--brakes", *hacking.BRAKES])
    for brake in hacking.BRAKES:
        parser, targs = train.parse_args(["--out", str(tmp_path / "x"), *hacking.train_flags(brake, 1, args)])
        train.check_args(parser, targs, 1)
        assert targs.reward_key == "shapes_proxy" and targs.seed == 1 and targs.steps == 100 and targs.eval_every == 20
        assert "geneval=0" in targs.reward  # the exact judge scored, never trained on
        assert targs.kl_beta == (0 if brake == "none" else 0.3)
        assert bool(targs.gardo_gate) == (brake in ("gardo", "gate"))
        if brake == "gardo":  # GARDO's renewal as its DiffusionNFT script starts it; the others never renew
            assert targs.gardo_reference and (targs.gardo_reset_freq, targs.gardo_kl_thres) == (15, 0.15)
        else:
            assert not targs.gardo_reference and targs.kl_reference == ("base" if brake == "none" else "start")


def test_the_table_reads_peaks_and_ends_over_seeds_and_nothing_finished_runs_again(tmp_path, fake_train):
    out = tmp_path / "hacking"
    argv = ["--out", str(out), "--brakes", "none", "kl", "--seeds", "0", "1", "--steps", "6", "--eval-every", "2"]
    rows = hacking.main(argv)
    assert len(fake_train()) == 4
    hacked, braked = rows[("none", 1)], rows[("kl", 1)]
    assert hacked["exact_peak"] == pytest.approx(0.35) and hacked["exact_peak_step"] == 2
    assert hacked["exact_end"] == pytest.approx(0.35 - 0.12) and hacked["proxy_end"] == pytest.approx(0.7)
    assert hacked["diversity_end"] == pytest.approx(0.6) and braked["diversity_end"] == pytest.approx(0.9)
    assert braked["exact_peak_step"] == 2 and braked["exact_end"] == pytest.approx(0.35)  # a tie: the earliest
    table = open(out / "hacking.md").read()
    assert "| none (the proxy alone) | 2 | 0.400 +- 0.000 -> 0.700 +- 0.000 | 0.305 +- 0.007 | 0.345 +- 0.007 (2/2) | " \
           "0.225 +- 0.007 | -0.120 +- 0.000 | 0.900 +- 0.000 -> 0.600 +- 0.000 |" in table
    assert "| kl-s0 | 0.400 -> 0.700 | 0.300 -> 0.340 (2) -> 0.340 | 0.900 -> 0.900 |" in table
    assert (out / "hacking.png").stat().st_size > 0
    hacking.main(argv)
    assert len(fake_train()) == 4


def test_a_stopped_run_continues_and_keeps_its_step_0_row(tmp_path, fake_train, monkeypatch):
    out = tmp_path / "hacking"
    argv = ["--out", str(out), "--brakes", "none", "--seeds", "0", "--steps", "6", "--eval-every", "2"]
    monkeypatch.setenv("FAKE_STOP", "2")
    with pytest.raises(SystemExit, match="none-s0 stopped .*before its step 6 evaluation.*the same command continues"):
        hacking.main(argv)
    monkeypatch.delenv("FAKE_STOP")
    rows = hacking.main(argv)
    assert "--resume" in fake_train()[-1]
    assert [json.loads(line)["step"] for line in open(out / "none-s0" / "eval.jsonl")] == [2, 4, 6]
    assert rows[("none", 0)]["exact_0"] == pytest.approx(0.3)  # from the row kept beside the run


def test_a_terminated_study_stops_its_run_at_a_checkpoint_and_exits(tmp_path, fake_train, monkeypatch):
    monkeypatch.setenv("FAKE_SLOW", "1")
    out = tmp_path / "hacking"
    argv = ["--out", str(out), "--brakes", "none", "--seeds", "0", "--steps", "6", "--eval-every", "2"]
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r}); import hacking; "
            f"hacking.TRAIN = {hacking.TRAIN!r}; hacking.main({argv!r})")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (out / "none-s0.started").exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.terminate()
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # its handler once waited on the wait it interrupted, for ever
        process.kill()
        pytest.fail("the study did not exit after SIGTERM")
    assert process.returncode == 1 and "stopped none-s0 at a checkpoint: the same command continues" in err
    assert (out / "none-s0.stopped").exists()  # the run got the signal and saved


def test_changed_flags_are_refused_before_anything_runs(tmp_path, fake_train):
    out = tmp_path / "hacking"
    hacking.main(["--out", str(out), "--brakes", "kl", "--seeds", "0", "--steps", "2", "--eval-every", "2"])
    with pytest.raises(SystemExit, match=r"kl-s0 was run with .*--kl-beta 0.3.*not .*--kl-beta 1.*give another --out"):
        hacking.main(["--out", str(out), "--brakes", "kl", "--seeds", "0", "--steps", "2", "--eval-every", "2",
                      "--kl-beta", "1"])
    assert len(fake_train()) == 1
    with pytest.raises(SystemExit, match="no finished run"):
        hacking.main(["--out", str(tmp_path / "empty"), "--report"])


def test_the_study_writes_its_ledger_and_reports_from_it(tmp_path, fake_train, monkeypatch):
    """With --ledger the finished runs' rows go into the ledger (a resumed run's step-0 row too, from beside it), and
    --report --ledger reads the same figures from it with no run folder left."""
    out, ledger = tmp_path / "hacking", tmp_path / "docs" / "hacking.jsonl"
    argv = ["--out", str(out), "--brakes", "none", "kl", "--seeds", "0", "--steps", "6", "--eval-every", "2",
            "--ledger", str(ledger)]
    monkeypatch.setenv("FAKE_STOP", "2")
    with pytest.raises(SystemExit):
        hacking.main(argv)
    monkeypatch.delenv("FAKE_STOP")
    rows = hacking.main(argv)
    recorded = [json.loads(line) for line in open(ledger)]
    assert [(r["set"], r["run"], r["step"]) for r in recorded] == [("judge", f"{b}-s0", s) for b in ("none", "kl")
                                                                   for s in (0, 2, 4, 6)]
    assert recorded[0]["flags"] == hacking.train_flags("none", 0, hacking.parse_args(argv))
    assert recorded[0]["eval"]["geneval_overall"] == pytest.approx(0.3)
    table = (out / "hacking.md").read_text().split("\n", 1)[1]  # after the line naming the command
    shutil.rmtree(out)
    again = hacking.main([*argv, "--report", "--out", str(tmp_path / "report")])
    assert again == rows and (tmp_path / "report" / "hacking.md").read_text().split("\n", 1)[1] == table
