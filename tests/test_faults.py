"""Fault injection on the tiny model: kill -9 mid-step and mid-save, SIGTERM under torchrun, NaN rewards and
gradients, a flaky reward service, hostile recipe files. Each test fails without the handling it names."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import forkserver
from test_train import ROOT, SMALL, metrics, run, train

FAST = SMALL + ["--log-images-every", "0"]

# Faults injected from outside the training code: `python -c` patches a library call, then runs train.main.
SLOW_SAVE = textwrap.dedent('''
    import sys, time, torch, train
    delay = float(sys.argv.pop(1))
    real_save = torch.save
    def save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        if str(f).endswith("rng.pt"):  # the checkpoint's files are written, its state.json not yet
            time.sleep(delay)
    torch.save = save
    train.main(sys.argv[1:])
''')
NAN_LOSS_AT_STEP = textwrap.dedent('''
    import sys, data, losses, train
    nan_step, current = int(sys.argv.pop(1)), {}
    real_ids, real_loss = data.step_prompt_ids, losses.grpo_loss
    def step_prompt_ids(num_prompts, step, **k):  # called once at the start of every step
        current["step"] = step + 1
        return real_ids(num_prompts, step, **k)
    def grpo_loss(*a, **k):
        loss, info = real_loss(*a, **k)
        return (loss * float("nan") if current["step"] == nan_step else loss), info
    data.step_prompt_ids, losses.grpo_loss = step_prompt_ids, grpo_loss
    train.main(sys.argv[1:])
''')


def start(cmd, env=None):
    """Popen(cmd, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True): a forked run where it can be one."""
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env or {}))
    return forkserver.start(cmd, cwd=ROOT, env=full_env)


def wait_for(predicate, proc, timeout=240):
    t0 = time.time()
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"process ended early ({proc.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def n_rows(out):
    path = os.path.join(out, "metrics.jsonl")
    return sum(1 for line in open(path) if line.strip()) if os.path.isfile(path) else 0


def compare(reference, resumed, steps):
    ref = {r["step"]: r for r in reference}
    got = {r["step"]: r for r in resumed}
    assert sorted(got) == list(range(1, max(steps) + 1)), sorted(got)  # no duplicate or missing step
    for s in steps:
        for key in ("reward_mean", "loss", "ratio_mean"):
            assert got[s][key] == pytest.approx(ref[s][key], rel=1e-5, abs=1e-7), (s, key)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 5-step run, the yardstick for every resumed one."""
    tmp = tmp_path_factory.mktemp("ref")
    _, out = train(tmp, "--steps", "5", *FAST[len(SMALL):])
    return metrics(out)


def test_kill_9_mid_step_resumes_from_last_checkpoint(tmp_path, reference_run):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "train.py", *FAST, "--steps", "5", "--save-every", "2", "--out", out]
    proc = start(cmd)
    wait_for(lambda: n_rows(out) >= 3, proc)  # step 3 logged, so step 4 is running: no checkpoint for it yet
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = sorted(int(d) for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit())
    assert done and done[-1] in (2, 4)
    run([*cmd, "--resume", "auto"], tmp_path)
    compare(reference_run, metrics(out), range(done[-1] + 1, 6))


def test_kill_9_mid_checkpoint_write_keeps_previous_checkpoint(tmp_path, reference_run):
    out = str(tmp_path / "run")
    flags = [*FAST, "--steps", "5", "--save-every", "2", "--out", out]
    cmd = [sys.executable, "train.py", *flags]

    def slow_saves(delay, *more):  # every save stalls for `delay` s before it is marked complete
        return start([sys.executable, "-c", SLOW_SAVE, str(delay), *flags, *more])
    proc = slow_saves(30)
    ckpts = os.path.join(out, "checkpoints")
    wait_for(lambda: os.path.isdir(os.path.join(ckpts, ".tmp-2")) and
             os.path.isfile(os.path.join(ckpts, ".tmp-2", "optimizer.pt")), proc)
    os.killpg(proc.pid, signal.SIGKILL)  # dies mid-save of checkpoint 2: nothing complete yet
    proc.wait()
    assert not os.path.isdir(os.path.join(ckpts, "2"))
    # Now a clean save of 2, then a kill while writing 4: 2 must stay intact and be the one resumed.
    proc = slow_saves(0, "--resume", "auto")
    wait_for(lambda: os.path.isfile(os.path.join(ckpts, "2", "state.json")), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc = slow_saves(30, "--resume", "auto")
    wait_for(lambda: os.path.isfile(os.path.join(ckpts, ".tmp-4", "optimizer.pt")), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert sorted(d for d in os.listdir(ckpts) if d.isdigit()) == ["2"]
    proc = run([*cmd, "--resume", "auto"], tmp_path)
    assert "resumed from" in proc.stdout and os.path.join("checkpoints", "2") in proc.stdout
    compare(reference_run, metrics(out), range(3, 6))
    assert not any(d.startswith(".tmp") for d in os.listdir(ckpts))  # the torn write was cleared


def test_keep_checkpoints_prunes_old_ones(tmp_path):
    _, out = train(tmp_path, "--steps", "4", "--save-every", "1", "--keep-checkpoints", "2", *FAST[len(SMALL):])
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["3", "4"]


def test_sigterm_under_torchrun_stops_both_ranks_cleanly(tmp_path):
    out = str(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *FAST,
           "--steps", "50", "--out", out]
    proc = start(cmd)
    wait_for(lambda: n_rows(out) >= 1, proc)
    workers = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "train.py"], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGTERM)  # preempt one rank only
    out_text, err_text = proc.communicate(timeout=240)
    assert proc.returncode == 0, err_text[-3000:]
    assert "stopped by" in out_text + err_text
    saved = sorted(int(d) for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit())
    assert len(saved) == 1 and 1 <= saved[0] < 50
    state = json.load(open(os.path.join(out, "checkpoints", str(saved[0]), "state.json")))
    assert state["step"] == saved[0] and len(state["rank_checksums"]) == 2
    resumed = run([*cmd[:-4], "--steps", str(saved[0] + 1), "--out", out, "--resume", "auto"], tmp_path)
    assert f"at step {saved[0]}" in resumed.stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, saved[0] + 2))


NAN_REWARD = textwrap.dedent('''
    import torch
    def score(images, prompts, metadata, args):
        size = images.reshape(len(images), -1).float().mean(1) / 255
        if args == "always" or (args == "once" and not hasattr(score, "done")):
            score.done = True
            size[1] = float("nan")
        return size
''')


@pytest.mark.parametrize("mode", ["once", "always"])
def test_nan_reward_skips_step_then_stops(tmp_path, mode):
    (tmp_path / "nanreward.py").write_text(NAN_REWARD)
    env = {"PYTHONPATH": str(tmp_path)}
    out = str(tmp_path / "run")
    proc = run([sys.executable, "train.py", *FAST, "--steps", "3", "--out", out, "--reward", "custom",
                "--custom-rm-path", "nanreward.score", "--custom-rm-args", mode, "--max-bad-steps", "2"],
               tmp_path, check=False, env=env)
    rows = metrics(out)
    if mode == "once":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert rows[0]["skipped"] == 1 and "sample 1" in rows[0]["skip_reason"]
        assert all(not r.get("skipped") for r in rows[1:]) and len(rows) == 3
    else:
        assert proc.returncode != 0
        assert "consecutive" in proc.stderr.strip().splitlines()[-1] and "Traceback" not in proc.stderr
        assert len(rows) == 2 and all(r["skipped"] for r in rows)


def test_nan_gradient_skips_update_without_touching_weights(tmp_path):
    from safetensors.torch import load_file
    out = str(tmp_path / "run")
    run([sys.executable, "-c", NAN_LOSS_AT_STEP, "2", *FAST, "--steps", "3", "--save-every", "1", "--out", out], tmp_path)
    rows = metrics(out)
    assert rows[1]["skipped"] == 1 and rows[1]["skipped_updates"] == 1 and not rows[2].get("skipped")
    w1, w2, w3 = (load_file(os.path.join(out, "checkpoints", str(s), "trainable.safetensors")) for s in (1, 2, 3))
    assert all((w1[k] == w2[k]).all() for k in w1)  # no optimizer step on the poisoned gradient
    assert any((w2[k] != w3[k]).any() for k in w2) and all(w3[k].isfinite().all() for k in w3)


def test_divergence_warnings_name_the_knob(capsys):
    import run
    run.warn_divergence({"clipfrac": 0.95, "masked_fraction": 0.9, "ratio_mean": 2.0})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    assert "--lr" in lines[0] and "--clip-range" in lines[0]
    assert "--kl-mask-threshold" in lines[1]
    run.warn_divergence({"clipfrac": 0.1, "masked_fraction": 0.1, "ratio_mean": 1.0})
    assert capsys.readouterr().out == ""
    run.warn_divergence({"grad_norm": 1.2}, early_grad_norm=0.1)  # any loss: the gradient norm grew 12x
    line = capsys.readouterr().out.strip()
    assert "12x" in line and "--lr" in line and "--kl-beta" in line
    for info, early in (({"grad_norm": 0.9}, 0.1), ({"grad_norm": 5.0}, None), ({}, 0.1)):
        run.warn_divergence(info, early_grad_norm=early)  # under 10x, no baseline yet, no gradient norm
    assert capsys.readouterr().out == ""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=300).map(lambda b: b.decode("utf-8", "replace")),
                      st.lists(st.sampled_from(["--lr", "1e-3", "--steps", "x", '"', "'", "#", "--model", "sd9", "@",
                                                "--reward", "ocr=", "=", "\n", " ", "--group-size", "-1", "\x00"]),
                               max_size=12).map(" ".join)))
def test_recipe_parser_fuzz(tmp_path, body):
    """Random recipe files: parsed, or refused with an argparse message (exit 2); never a traceback."""
    import train as train_module
    recipe = tmp_path / "fuzz.args"
    recipe.write_text(body, encoding="utf-8", errors="replace")
    try:
        p, args = train_module.parse_args([f"@{recipe}"])
        train_module.check_args(p, args, 1)
    except SystemExit as e:
        assert e.code == 2


def test_resume_refuses_another_lora_rank(tmp_path):
    _, out = train(tmp_path, "--steps", "1", *FAST[len(SMALL):])
    proc, _ = train(tmp_path, "--steps", "2", "--lora-rank", "4", "--resume", "auto", *FAST[len(SMALL):], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --resume") and "--lora-rank 0" in last and "--lora-rank 4" in last


def test_ocr_prompts_without_target_are_counted(tmp_path, capsys, monkeypatch):
    import train as train_module
    monkeypatch.chdir(ROOT)
    prompts = tmp_path / "p.txt"
    prompts.write_text('a sign that says "OPEN"\na red apple\na blue car\n')
    train_module.main([*FAST, "--steps", "1", "--prompts", str(prompts), "--reward", "ocr", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert f"warning: 2 of 3 prompts in {prompts} have no quoted target" in out
