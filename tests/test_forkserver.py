"""tests/forkserver.py, which runs most of the suite's `python train.py` commands: a forked run is the run a new
process makes (the same numbers, weights, output and exit status), a torchrun of N ranks is N ranks, and a run past
its timeout is killed."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

import forkserver
from test_train import ROOT, SMALL

ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
TIMING = ("seconds",)


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)} for line in f]


def test_a_forked_run_is_the_run_a_new_process_makes(tmp_path):
    cmd = [sys.executable, "train.py", *SMALL, "--steps", "2", "--save-every", "2"]
    fresh = subprocess.run(cmd + ["--out", str(tmp_path / "fresh")], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=300)
    forked = forkserver.run(cmd + ["--out", str(tmp_path / "forked")], env=ENV, timeout=300)
    assert fresh.returncode == forked.returncode == 0, forked.stderr[-3000:]
    assert rows(tmp_path / "fresh") == rows(tmp_path / "forked")
    weights = [load_file(tmp_path / run / "checkpoints" / "2" / "trainable.safetensors") for run in ("fresh", "forked")]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])  # bit for bit
    lines = [[line.split(" | ")[:3] for line in p.stdout.splitlines()] for p in (fresh, forked)]  # less the timings
    assert [line for line in lines[0] if "/tmp" not in str(line)] == [line for line in lines[1] if "/tmp" not in str(line)]


def test_a_refusal_reads_and_exits_as_from_a_new_process():
    cmd = [sys.executable, "train.py", "--lr", "nan"]
    fresh = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    forked = forkserver.run(cmd, env=ENV, timeout=300)
    assert fresh.returncode == forked.returncode == 2
    assert fresh.stderr == forked.stderr and "Traceback" not in forked.stderr


def test_torchrun_ranks_see_their_ranks_and_a_failing_rank_fails_the_launch(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys\nimport torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "t = __import__('torch').tensor([float(dist.get_rank() + 1)])\n"
                      "dist.all_reduce(t)\n"
                      "line = f\"{os.environ['RANK']} {os.environ['LOCAL_WORLD_SIZE']} {int(t.item())}\\n\"\n"
                      "os.write(1, line.encode())  # one write: the ranks share stdout\n"
                      "dist.destroy_process_group()\n"
                      "sys.exit(3 if sys.argv[1:] == ['fail'] and os.environ['RANK'] == '1' else 0)\n")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    done = forkserver.run(launch, env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.split("\n")[:2]) == ["0 2 3", "1 2 3"]  # both ranks, the sum over both
    assert forkserver.run(launch + ["fail"], env=ENV, timeout=120).returncode == 1  # torchrun's code for a failure


def test_a_run_past_its_timeout_is_killed(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        forkserver.run([sys.executable, str(script)], env=ENV, timeout=5)
    assert "started" in expired.value.output
    code = "import os, sys; print(sys.argv, os.getcwd() == sys.path[0] or sys.path[0] == '')"
    done = forkserver.run([sys.executable, "-c", code, "a"], cwd=tmp_path, env=ENV, timeout=60)
    assert done.stdout == "['-c', 'a'] True\n"  # as python -c has them


def test_another_environment_runs_as_a_subprocess(monkeypatch):
    assert forkserver._forkable([sys.executable, "train.py"], dict(ENV))
    assert not forkserver._forkable([sys.executable, "-m", "pytest"], dict(ENV))
    monkeypatch.setattr(forkserver, "_server", (None, dict(ENV)))
    assert not forkserver._forkable([sys.executable, "train.py"], dict(ENV, HF_HOME="/elsewhere"))
    assert forkserver._forkable([sys.executable, "train.py"], dict(ENV, PYTHONPATH="/elsewhere"))  # put on sys.path
    assert forkserver._forkable([sys.executable, "train.py"], dict(ENV, OMP_NUM_THREADS="2"))
    assert not forkserver._forkable([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "train.py"], ENV)
    monkeypatch.setenv("FLOW_RL_TEST_FORK", "0")
    assert not forkserver._forkable([sys.executable, "train.py"], dict(ENV))


def test_variables_that_imports_set_in_the_worker_keep_runs_forked():
    """cv2 (with rapidocr), transformers, the shapes scripts and the service tests set variables in the worker after
    its server started; the runs stay forks of the server (a new interpreter costs ~12 CPU-s of imports) and read
    them from their own environment."""
    done = forkserver.run([sys.executable, "-c", "print(1)"], env=ENV, timeout=60)  # the server, started if it was not
    assert forkserver._server[0] is not None and done.stdout == "1\n", "the fork server did not start"
    later = {"QT_QPA_PLATFORM_PLUGIN_PATH": "/qt/plugins", "QT_QPA_FONTDIR": "/qt/fonts", "LD_LIBRARY_PATH": "/lib64x",
             "TOKENIZERS_PARALLELISM": "maybe", "OMP_WAIT_POLICY": "PASSIVE", "NO_PROXY": "10.9.8.7", "no_proxy": "x"}
    env = dict(ENV, **later)
    assert any(forkserver._server[1].get(k) != v for k, v in later.items())
    code = "import os, sys; print(os.getppid(), *(os.environ[k] for k in sys.argv[1:]))"
    done = forkserver.run([sys.executable, "-c", code, *later], env=env, timeout=60)
    assert done.stdout.split() == [str(forkserver._server[0].pid), *later.values()], done.stderr
    assert not forkserver._forkable([sys.executable, "train.py"], dict(env, HF_HUB_OFFLINE="0"))  # read at import


def test_pythonpath_goes_where_the_interpreter_puts_it(tmp_path):
    (tmp_path / "mine.py").write_text("WHERE = 'mine'\n")
    code = "import sys, mine; print(mine.WHERE, sys.path[1] == sys.argv[1], sys.path[0] == '')"
    env = dict(ENV, PYTHONPATH=str(tmp_path))
    forked = forkserver.run([sys.executable, "-c", code, str(tmp_path)], env=env, timeout=60)
    fresh = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert forked.stdout == fresh.stdout == "mine True True\n", (forked.stderr, fresh.stderr)


def test_a_started_run_is_a_popen_that_can_be_signalled(tmp_path):
    """start(): the forked run leads its own process group, answers poll / wait / communicate as Popen does, and a
    signal's death reads as Popen's negative code; another command is a real Popen."""
    script = tmp_path / "waits.py"
    script.write_text("import os, signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n"
                      "print('pid', os.getpid(), os.getpgid(0), flush=True)\n"
                      "print('to stderr', file=sys.stderr, flush=True)\n"
                      "open(sys.argv[1], 'w').close()\n"
                      "time.sleep(600)\n")
    ready = tmp_path / "ready"
    proc = forkserver.start([sys.executable, str(script), str(ready)], env=ENV)
    assert isinstance(proc, forkserver.Started)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    deadline = time.time() + 60
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    proc.terminate()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 5 and out == f"pid {proc.pid} {proc.pid}\n" and err == "to stderr\n"
    killed = forkserver.start([sys.executable, str(script), str(tmp_path / "again")], env=ENV)
    os.killpg(killed.pid, signal.SIGKILL)  # its group: the run alone, not the server
    assert killed.wait(timeout=60) == -signal.SIGKILL
    assert forkserver.run([sys.executable, "-c", "print(1)"], env=ENV, timeout=60).stdout == "1\n"  # server alive
    version = forkserver.start([sys.executable, "-V"], env=ENV)
    assert not isinstance(version, forkserver.Started) and version.communicate(timeout=60)[0].startswith("Python")
