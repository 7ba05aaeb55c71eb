"""Nothing lost, nothing mixed: run folders, corrupt checkpoints, signals during a reward wait, and every refusal
made before a model loads. Faults are injected from outside the training code (patched library calls, damaged
files, signals); each test fails without the handling it names."""
import argparse
import json
import math
import os
import shutil
import signal
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import checkpoints
import eval as evaluation
import run as run_module
import train as train_module
from test_faults import start, wait_for
from test_train import ROOT, SMALL, metrics, run

FAST = SMALL + ["--log-images-every", "0"]


def strict_rows(out, name="metrics.jsonl"):
    """Rows of a jsonl file, refusing anything that is not strict JSON (NaN, torn lines)."""
    def no_constants(token):
        raise AssertionError(f"{name} holds the non-JSON token {token}")
    with open(os.path.join(out, name)) as f:
        return [json.loads(line, parse_constant=no_constants) for line in f]


def main(*flags, out):
    """train.main in this process (fast: no interpreter start); returns what it printed."""
    train_module.main([*FAST, "--out", str(out), *flags])


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
    """A 3-step run with a checkpoint after every step, and a 4-step run as the yardstick for resumed ones."""
    root = tmp_path_factory.mktemp("ckpts")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        main("--steps", "3", "--save-every", "1", out=root / "run")
        main("--steps", "4", out=root / "full")
    finally:
        os.chdir(cwd)
    return root / "run", metrics(root / "full")


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


# ----------------------------------------------------------------------------- run folders
def test_fresh_run_refuses_a_used_folder_and_overwrite_starts_over(tmp_path, capsys):
    out = tmp_path / "run"
    main("--steps", "3", "--save-every", "1", out=out)
    with pytest.raises(SystemExit) as e:
        main("--steps", "2", out=out)
    assert "already holds a run" in str(e.value) and "--resume auto" in str(e.value) and "--overwrite" in str(e.value)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]  # untouched
    main("--steps", "2", "--overwrite", out=out)
    assert [r["step"] for r in metrics(out)] == [1, 2]  # not [1, 2, 3, 1, 2]
    assert sorted(os.listdir(out / "checkpoints")) == ["2"]  # the old run's checkpoint 3 is gone, not resumable


def test_resume_auto_without_a_checkpoint_starts_over_cleanly(tmp_path, capsys):
    out = tmp_path / "run"
    main("--steps", "2", out=out)
    shutil.rmtree(out / "checkpoints")  # as if killed before the first checkpoint (--save-every 0)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_me')  # and killed while writing a line
    main("--steps", "2", "--resume", "auto", out=out)
    assert "no checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in strict_rows(out)] == [1, 2]  # not [1, 2, 1, 2] and no torn line


def test_resume_at_or_past_the_last_step_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    main("--steps", "2", out=out)
    capsys.readouterr()
    main("--steps", "1", "--resume", "auto", out=out)
    assert "already at step 2 of --steps 1: nothing to train" in capsys.readouterr().out
    assert len(metrics(out)) == 2


def test_metrics_lines_are_strict_json():
    line = checkpoints.json_line({"step": 3, "loss": float("nan"), "kl": float("inf"), "reward_mean": 0.5})
    assert json.loads(line, parse_constant=lambda token: pytest.fail(f"bare {token}")) == {
        "step": 3, "loss": None, "kl": None, "reward_mean": 0.5}  # NaN / inf (not JSON) become null


# ----------------------------------------------------------------------------- corrupt checkpoints
def damage(path, how):
    if how == "truncated weights":
        data = (path / "trainable.safetensors").read_bytes()
        (path / "trainable.safetensors").write_bytes(data[:len(data) // 2])
    elif how == "empty weights":
        (path / "trainable.safetensors").write_bytes(b"")
    elif how == "garbage optimizer":
        size = (path / "optimizer.pt").stat().st_size
        (path / "optimizer.pt").write_bytes(os.urandom(size))  # same size: only the checksum can tell
    elif how == "missing rng":
        (path / "rng.pt").unlink()
    elif how == "bad state.json":
        (path / "state.json").write_text('{"step": ')


DAMAGE = ["truncated weights", "empty weights", "garbage optimizer", "missing rng", "bad state.json"]


@pytest.mark.parametrize("how", DAMAGE)
def test_verify_names_what_is_wrong(three_checkpoints, tmp_path, how):
    run_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints[0], run_dir)
    ckpt = run_dir / "checkpoints" / "3"
    assert checkpoints.verify(str(ckpt)) is None
    damage(ckpt, how)
    problem = checkpoints.verify(str(ckpt))
    assert problem is not None and len(problem.splitlines()) == 1
    assert checkpoints.newest_verified(str(run_dir)) == str(run_dir / "checkpoints" / "2")


def test_resume_falls_back_past_a_corrupt_checkpoint_and_matches(three_checkpoints, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints[0], run_dir)
    damage(run_dir / "checkpoints" / "3", "garbage optimizer")
    main("--steps", "4", "--resume", "auto", out=run_dir)
    printed = capsys.readouterr().out
    assert "skipping checkpoint" in printed and os.path.join("checkpoints", "3") in printed
    assert f"resumed from {run_dir / 'checkpoints' / '2'} at step 2" in printed
    resumed, reference = metrics(run_dir), three_checkpoints[1]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed[2:], reference[2:]):  # steps 3 and 4 redone from checkpoint 2 equal the straight run
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], rel=1e-5)


def test_explicit_corrupt_checkpoint_is_refused_in_one_line(three_checkpoints, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints[0], run_dir)
    damage(run_dir / "checkpoints" / "3", "truncated weights")
    with pytest.raises(SystemExit) as e:
        main("--steps", "4", "--resume", str(run_dir / "checkpoints" / "3"), out=tmp_path / "new")
    assert "trainable.safetensors" in str(e.value) and len(str(e.value).splitlines()) == 1


def test_resume_refuses_another_lora_alpha_and_warns_on_algorithm_flags(tmp_path, capsys):
    out = tmp_path / "run"
    main("--steps", "1", "--lora-rank", "2", "--lora-alpha", "2", out=out)
    with pytest.raises(SystemExit) as e:
        main("--steps", "2", "--lora-rank", "2", "--lora-alpha", "4", "--resume", "auto", out=out)
    assert "--lora-alpha 2" in str(e.value) and "--lora-alpha 4" in str(e.value)
    capsys.readouterr()
    main("--steps", "2", "--lora-rank", "2", "--lora-alpha", "2", "--seed", "5", "--loss", "guard", "--resume", "auto",
         out=out)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "change the algorithm" in line]
    assert len(warnings) == 1 and "--seed 0 -> 5" in warnings[0] and "--loss grpo -> guard" in warnings[0]


def test_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if str(f).endswith(os.path.join(".tmp-2", "optimizer.pt")):
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 4160 vs 4054")
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(SystemExit) as e:
        main("--steps", "2", "--save-every", "1", out=out)
    message = str(e.value)
    assert message.startswith("error: could not write checkpoint 2") and "unexpected pos" in message
    assert len(message.splitlines()) == 1
    assert sorted(os.listdir(out / "checkpoints")) == ["1"]  # no .tmp-2 left on the full disk
    assert checkpoints.verify(str(out / "checkpoints" / "1")) is None


# ----------------------------------------------------------------------------- signals during the reward wait
SLOW_REWARD = textwrap.dedent('''
    import os, time
    def score(images, prompts, metadata, marker):
        calls = int(open(marker).read()) if os.path.exists(marker) else 0
        with open(marker, "w") as f:
            f.write(str(calls + 1))
        if calls >= 2:  # from step 2 on (two rollout batches a step), the reward service hangs
            time.sleep(120)
        return images.reshape(len(images), -1).float().mean(1) / 255
''')


def test_sigterm_while_waiting_for_a_hung_reward_saves_and_exits_0(tmp_path):
    (tmp_path / "slowreward.py").write_text(SLOW_REWARD)
    out, marker = str(tmp_path / "run"), str(tmp_path / "calls")
    cmd = [sys.executable, "train.py", *FAST, "--sample-batch-size", "4", "--steps", "5", "--out", out, "--reward",
           "custom", "--custom-rm-path", "slowreward.score", "--custom-rm-args", marker]
    proc = start(cmd, env={"PYTHONPATH": str(tmp_path)})
    wait_for(lambda: os.path.exists(marker) and open(marker).read() >= "3", proc)  # step 2's rewards are hanging
    time.sleep(0.5)
    t0 = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert time.time() - t0 < 20  # not after the 120 s the reward would take
    assert "while waiting for rewards" in stdout
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["1"]  # the last complete step
    assert [r["step"] for r in metrics(out)] == [1]


# ----------------------------------------------------------------------------- refused before any model loads
BAD_FLAGS = [
    (["--sample-batch-size", "0"], "--sample-batch-size"),
    (["--train-batch-size", "0"], "--train-batch-size"),
    (["--minibatches", "0"], "--minibatches"),
    (["--group-size", "0"], "--group-size"),
    (["--group-size", "-3"], "--group-size"),
    (["--group-size", "1", "--prompts-per-step", "2"], "--group-size 1"),
    (["--prompts-per-step", "0"], "--prompts-per-step"),
    (["--resolution", "0"], "--resolution"),
    (["--resolution", "36"], "multiple of 8"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--max-bad-steps", "0"], "--max-bad-steps"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints"),
    (["--seed", "-1"], "--seed"),
    (["--ema-decay", "1"], "--ema-decay"),
    (["--overwrite", "--resume", "auto"], "--overwrite"),
]


@pytest.mark.parametrize("flags,needle", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_values_are_refused_in_one_line(tmp_path, capsys, flags, needle):
    with pytest.raises(SystemExit) as e:
        main("--steps", "1", *flags, out=tmp_path / "run")
    assert e.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in message and needle in message
    assert not (tmp_path / "run").exists()  # refused before anything was created


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_unusable_out_is_refused_in_one_line(tmp_path, kind):
    out = tmp_path / "a-file" if kind == "file" else "/proc/flowrl-run"  # /proc refuses new folders, even to root
    if kind == "file":
        out.write_text("x")
    with pytest.raises(SystemExit) as e:
        main("--steps", "1", out=out)
    assert str(e.value).startswith("error: --out") and len(str(e.value).splitlines()) == 1


def test_binary_and_self_including_recipes_are_refused(tmp_path, capsys):
    binary = tmp_path / "binary.args"
    binary.write_bytes(b"--lr \xff\xfe\x00\x81 1e-3\n")
    loop = tmp_path / "loop.args"
    loop.write_text(f"--lr 1e-3\n@{loop}\n")
    for recipe, needle in ((binary, "not UTF-8"), (loop, "includes itself")):
        with pytest.raises(SystemExit) as e:
            train_module.parse_args([f"@{recipe}"])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_unknown_rm_type_fails_when_the_prompts_load(tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [{"input": "a cat"}, {"input": "a dog", "metadata": {"rm_type": "jpeg_compressibility"}},
            {"input": "a sign", "metadata": {"rm_type": "ocrr"}}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as e:
        main("--steps", "1", "--prompts", str(prompts), out=tmp_path / "run")
    assert "prompt 3" in str(e.value) and "'ocrr'" in str(e.value)


def test_a_run_whose_every_step_was_skipped_says_so(tmp_path):
    (tmp_path / "nanreward.py").write_text("def score(images, prompts, metadata, args):\n    return [float('nan')] * len(images)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(SystemExit) as e:
            main("--steps", "2", "--reward", "custom", "--custom-rm-path", "nanreward.score", out=tmp_path / "run")
    finally:
        sys.path.remove(str(tmp_path))
    assert "none of the 2 steps of this run updated the weights" in str(e.value)


NUMERIC_FLAGS = ["--resolution", "--lora-rank", "--lora-alpha", "--num-steps", "--shift", "--guidance-scale", "--eta",
                 "--window-size", "--window-stride", "--iters-per-window", "--timestep-fraction", "--group-size",
                 "--prompts-per-step", "--sample-batch-size", "--clip-range", "--adv-clip", "--kl-beta",
                 "--kl-mask-threshold", "--lr", "--weight-decay", "--max-grad-norm", "--train-batch-size",
                 "--minibatches", "--updates-per-batch", "--ema-decay", "--ema-every", "--steps", "--seed",
                 "--save-every", "--keep-checkpoints", "--eval-every", "--eval-steps", "--log-images-every",
                 "--max-bad-steps"]
VALUES = st.one_of(st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e308", "1e999", "9" * 30, "0.5", "1", "2",
                                    "x", "", "-0", "1e-320"]),
                   st.integers(-10**20, 10**20).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(st.sampled_from(NUMERIC_FLAGS), VALUES), min_size=1, max_size=4))
def test_flag_values_fuzz_never_give_a_traceback(pairs):
    """Any value of any numeric flag: parsed and accepted, or refused by argparse (exit 2); never an exception."""
    argv = [token for flag, value in pairs for token in (flag, value)]
    try:
        p, args = train_module.parse_args(argv)
        train_module.check_args(p, args, 1)
    except SystemExit as e:
        assert e.code == 2
        return
    for flag, _ in pairs:  # what is accepted is finite and in range
        value = getattr(args, flag[2:].replace("-", "_"))
        assert isinstance(value, int) or math.isfinite(value)


# ----------------------------------------------------------------------------- eval.py
def test_eval_refuses_damaged_inputs_in_one_line(three_checkpoints, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints[0], run_dir)
    damage(run_dir / "checkpoints" / "3", "truncated weights")
    damage(run_dir / "checkpoints" / "2", "bad state.json")
    common = ["--resolution", "32", "--eval-steps", "2", "--max-prompts", "1", "--out", str(tmp_path / "eval")]
    for argv, needle in (
            (["--checkpoints", str(run_dir / "checkpoints" / "3")], "trainable.safetensors"),
            (["--checkpoints", str(run_dir / "checkpoints" / "2")], "state.json"),
            (["--prompts", str(tmp_path / "missing.txt")], "not found")):
        with pytest.raises(SystemExit) as e:
            evaluation.main([*common, *argv])
        assert str(e.value).startswith("error:") and needle in str(e.value) and len(str(e.value).splitlines()) == 1
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')  # a torn last line
    evaluation.main(["--plot", str(run_dir)])
    assert "skipped 1 line" in capsys.readouterr().out and (run_dir / "curves.png").is_file()


def test_a_custom_reward_of_the_wrong_length_stops_in_one_line(tmp_path):
    (tmp_path / "shortreward.py").write_text("def score(images, prompts, metadata, args):\n    return [0.5]\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(SystemExit) as e:
            main("--steps", "2", "--reward", "custom", "--custom-rm-path", "shortreward.score", out=tmp_path / "run")
    finally:
        sys.path.remove(str(tmp_path))
    message = str(e.value)
    assert message.startswith("error:") and "--custom-rm-path" in message and len(message.splitlines()) == 1


# ----------------------------------------------------------------------------- concurrency and honest resumes
def test_a_second_run_into_a_folder_in_use_is_refused_and_a_dead_runs_lock_is_not(tmp_path):
    out = str(tmp_path / "run")
    first = start([sys.executable, "train.py", *FAST, "--steps", "500", "--out", out])
    wait_for(lambda: os.path.isfile(os.path.join(out, "metrics.jsonl")), first)
    os.killpg(first.pid, signal.SIGSTOP)  # alive and holding its lock, without taking a core from the second run
    try:
        second = run([sys.executable, "train.py", *FAST, "--steps", "2", "--out", out, "--seed", "9"], tmp_path,
                     check=False)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a dead run's lock goes with it
        first.wait()
    assert second.returncode != 0 and "Traceback" not in second.stderr
    assert "in use by another run" in second.stderr.strip().splitlines()[-1]
    assert str(first.pid) in second.stderr
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["args"]["seed"] == 0  # the folder still holds the first run only
    run([sys.executable, "train.py", *FAST, "--steps", "2", "--out", out, "--overwrite"], tmp_path)
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_overwrite_keeps_the_old_run_until_the_new_one_is_valid(tmp_path):
    out = tmp_path / "run"
    main("--steps", "2", "--save-every", "1", out=out)
    for bad in (["--prompts", str(tmp_path / "missing.txt")], ["--num-frames", "5"]):  # refused before / at load
        with pytest.raises(SystemExit):
            main("--steps", "2", "--overwrite", *bad, out=out)
        assert [r["step"] for r in metrics(out)] == [1, 2]
        assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"]


def test_a_run_that_failed_in_its_set_up_does_not_block_the_rerun(tmp_path, capsys):
    out = tmp_path / "run"
    (tmp_path / "broken.py").write_text("def score(images, prompts, metadata, args):\n    return [1.0]\n")
    with pytest.raises(SystemExit, match="1 score"):  # found after args.json was written: the reward's first answer
        main("--steps", "2", "--reward", "custom", "--custom-rm-path", f"{tmp_path / 'broken.py'}:score", out=out)
    assert os.path.isfile(out / "args.json") and not os.path.isfile(out / "metrics.jsonl")
    main("--steps", "2", out=out)  # no "already holds a run": it never completed a step
    assert [r["step"] for r in metrics(out)] == [1, 2]


@pytest.mark.parametrize("step", [1, -2, "2"])
def test_an_edited_state_json_is_not_trusted(three_checkpoints, tmp_path, step, capsys):
    run_dir, _ = three_checkpoints
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    rows_before = metrics(copy)
    path = copy / "checkpoints" / "3" / "state.json"
    state = json.loads(path.read_text())
    state["step"] = step
    path.write_text(json.dumps(state))
    assert "state.json" in checkpoints.verify(str(copy / "checkpoints" / "3"))
    with pytest.raises(SystemExit, match="state.json"):  # named explicitly: refused, nothing truncated
        main("--steps", "4", "--resume", str(copy / "checkpoints" / "3"), out=copy)
    assert metrics(copy) == rows_before
    main("--steps", "4", "--resume", "auto", out=copy)  # auto: the newest that verifies, 2
    assert "skipping checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in metrics(copy)] == [1, 2, 3, 4]


def test_metrics_that_cannot_be_written_mid_run_stop_in_one_line(tmp_path):
    out = tmp_path / "run"

    def break_metrics(info):  # after step 1: metrics.jsonl becomes a folder, which nobody can append to
        if info["step"] == 1:
            os.remove(out / "metrics.jsonl")
            os.mkdir(out / "metrics.jsonl")
    with pytest.raises(SystemExit) as e:
        train_module.main([*FAST, "--steps", "3", "--save-every", "1", "--out", str(out)], on_step=break_metrics)
    assert str(e.value).startswith("error: cannot write") and "--resume auto" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags, needle", [
    (["--loss", "nft", "--sde", "flow"], "drop --sde"),
    (["--loss", "awm", "--sde", "cps"], "drop --sde"),
    (["--window-range", "0", "3"], "--sde-window fast"),
])
def test_flags_that_would_be_ignored_are_refused(flags, needle, capsys):
    with pytest.raises(SystemExit):
        train_module.parse_args([*FAST, *flags])
    assert needle in capsys.readouterr().err


def test_the_fp16_loss_scale_is_checkpointed_and_restored(tmp_path):
    from policy import Policy
    _, args = train_module.parse_args([*FAST, "--mixed-precision", "fp16", "--out", str(tmp_path / "run")])
    args.resume = None
    first = Policy(args, torch.device("cpu"), old_copy=False)
    first.scaler.load_state_dict(dict(first.scaler.state_dict(), scale=1024.0))  # as after overflows lowered it
    os.makedirs(tmp_path / "run" / "checkpoints")
    first.checkpoint(args, 3, {})
    second = Policy(args, torch.device("cpu"), old_copy=False)
    assert second.scaler.get_scale() == 65536.0
    second.resume(str(tmp_path / "run" / "checkpoints" / "3"), args)
    assert second.scaler.get_scale() == 1024.0


def test_geneval_rows_the_detector_cannot_judge_stop_before_any_model_loads(tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "a photo of a circle", "metadata": {"tag": "single_object",
                                                          "include": [{"class": "circle", "count": 1}]}},
            {"prompt": "a photo of a dragon", "metadata": {"tag": "single_object",
                                                          "include": [{"class": "dragon", "count": 1}]}}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run([sys.executable, "train.py", "--prompts", str(prompts), "--out", str(tmp_path / "run"), "--steps", "1"],
               tmp_path, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "line 2" in last and "'dragon'" in last
    assert "model shapes" not in proc.stdout  # refused before the model loaded


def test_a_checkpoint_in_the_earlier_layout_still_resumes(three_checkpoints, tmp_path):
    """Checkpoints written before state.json joined the manifest (and before the fp16 loss scale and optimizer
    steps were saved in it) resume as they did, and continue exactly as an uninterrupted run."""
    run_dir, full = three_checkpoints
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    ckpt = copy / "checkpoints" / "2"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["state.json"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    state = json.loads((ckpt / "state.json").read_text())
    for key in ("grad_scaler", "optimizer_steps"):
        del state[key]
    (ckpt / "state.json").write_text(json.dumps(state))
    shutil.rmtree(copy / "checkpoints" / "3")
    assert checkpoints.verify(str(ckpt)) is None
    main("--steps", "4", "--resume", "auto", out=copy)
    for a, b in zip(metrics(copy), full):
        assert a["reward_mean"] == b["reward_mean"] and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


def test_a_resume_keeps_the_evaluation_of_the_model_before_training(tmp_path, capsys):
    """eval.jsonl's step-0 row (the base model) survives a resume; rows past the checkpoint are redone."""
    flags = ["--eval-every", "1", "--eval-prompts", "prompts/tiny.txt", "--eval-steps", "2", "--save-every", "1"]
    main("--steps", "2", *flags, out=tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "2")  # as if killed before checkpoint 2
    main("--steps", "3", "--resume", "auto", *flags, out=tmp_path / "run")
    rows = strict_rows(tmp_path / "run", "eval.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # every later row's rise is paired with the step-0 images, also after the resume (eval_base.pt)
    assert "rise" not in rows[0] and (tmp_path / "run" / "eval_base.pt").exists()
    for r in rows[1:]:
        assert r["rise"] == pytest.approx(r["reward"] - rows[0]["reward"], abs=1e-6) and r["rise_se"] >= 0
    # a damaged eval_base.pt (a disk error) costs the rise, with a warning, never the run
    (tmp_path / "run" / "eval_base.pt").write_bytes(b"\x80\x02garbage")
    capsys.readouterr()
    assert run_module.Run.eval_base(str(tmp_path / "run" / "eval_base.pt")) is None
    assert "eval_base.pt is unreadable" in capsys.readouterr().out


def test_eval_guidance_scale_samples_the_held_out_images_at_its_own_scale(tmp_path, monkeypatch):
    """--eval-guidance-scale: rollouts guided at 3, the held-out images sampled unguided, and the step-0 scores filed
    under the scale they were sampled at (a run without the flag at CFG 1 pairs with them)."""
    monkeypatch.chdir(ROOT)
    seen = []
    real = run_module.evaluation.sample_images

    def spy(*a, **kw):
        seen.append(kw["guidance_scale"])
        return real(*a, **kw)
    monkeypatch.setattr(run_module.evaluation, "sample_images", spy)
    train_module.main(["--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "8",
                       "--train-batch-size", "8", "--num-steps", "2", "--eval-steps", "2", "--eval-every", "1",
                       "--log-images-every", "0", "--steps", "1", "--guidance-scale", "3", "--no-train-cfg",
                       "--eval-guidance-scale", "1", "--out", str(tmp_path / "run")])
    assert seen == [1.0, 1.0]  # step 0 and step 1
    args = argparse.Namespace(**{k: 1 for k in run_module.EVAL_FLAGS})
    plain = run_module.eval_fingerprint(args, ["a"], [{}])
    args.guidance_scale, args.eval_guidance_scale = 3.0, 1
    assert run_module.eval_fingerprint(args, ["a"], [{}]) == plain
    args.eval_guidance_scale = None
    assert run_module.eval_fingerprint(args, ["a"], [{}]) != plain
    for own in ("audio_guidance_scale", "guidance_scale_2"):  # LTX-2's soundtrack, Wan 2.2's second expert
        other = argparse.Namespace(**{k: 1 for k in run_module.EVAL_FLAGS})
        setattr(other, own, 7.0)
        assert run_module.eval_fingerprint(other, ["a"], [{}]) != plain, own
