"""The sixth hostile campaign (issue 78), the run and its command line: a gradient that stays non-finite, attention
backends that exist but cannot run here (or change nothing), a signal in the first moments of a run, recipes that use
--fsdp read with --print-config, a recipe with a byte-order mark, a reader that closes the report's pipe, and a flag
that does nothing without --fsdp. Each ends in one line naming the fix (or a warning, or works); each test fails
without the handling it names."""
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import run as run_module
from test_faults import start
from test_train import ROOT, SMALL, metrics, run

FAST = [*SMALL, "--log-images-every", "0"]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def one_error_line(proc):
    """The run ended non-zero in one `error:` line, no traceback -> the line."""
    assert proc.returncode not in (0, None), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") or ": error: " in line, proc.stderr[-2000:]
    return line


# ----------------------------------------------------------------------------- a gradient that stays non-finite
NAN_LOSS_FROM_STEP = """
import functools, sys, data, losses, train
first, current = int(sys.argv.pop(1)), {}
real_ids, real_fn = data.step_prompt_ids, losses.LOSSES["grpo"].fn
def step_prompt_ids(num_prompts, step, **k):  # called once at the start of every step
    current["step"] = step + 1
    return real_ids(num_prompts, step, **k)
@functools.wraps(real_fn)  # its signature: the flags the loss reads
def poisoned(*a, **k):
    loss, info = real_fn(*a, **k)
    return (loss * float("nan") if current["step"] >= first else loss), info
data.step_prompt_ids = step_prompt_ids
losses.LOSSES["grpo"] = losses.LOSSES["grpo"]._replace(fn=poisoned)
train.main(sys.argv[1:])
"""


def test_three_steps_of_non_finite_gradients_stop_the_run_and_keep_the_last_good_weights(tmp_path):
    """Before: each such step was skipped and the run went on (an exit 0 when it ended within --max-bad-steps 5),
    with a line that named only the reward and --lr."""
    from safetensors.torch import load_file
    out = str(tmp_path / "run")
    proc = run([sys.executable, "-c", NAN_LOSS_FROM_STEP, "2", *FAST, "--loss", "grpo", "--steps", "8",
                "--save-every", "1", "--keep-checkpoints", "10", "--out", out], tmp_path, check=False)
    line = one_error_line(proc)
    assert line.startswith("error: the gradient was not finite in 3 consecutive steps (steps 2-4)"), line
    assert "--lr" in line and f"--resume auto --out {out}" in line
    assert "--kl-rate" not in line and "fp16" not in line  # neither is on in this run
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]  # stopped at once, not at --max-bad-steps
    assert [r.get("skipped_updates", 0) for r in metrics(out)] == [0, 1, 1, 1]
    first, last = (load_file(os.path.join(out, "checkpoints", s, "trainable.safetensors")) for s in ("1", "4"))
    assert all(torch.equal(first[k], last[k]) and last[k].isfinite().all() for k in first)  # the last good ones


def test_the_non_finite_stop_names_the_kl_controller_and_fp16_where_the_run_has_them():
    args = types.SimpleNamespace(lr=3e-4, kl_target=0.03, kl_beta=0.04, kl_rate=10.0, mixed_precision="fp16",
                                 out="runs/x")
    line = run_module.nonfinite_stop(args, 3, 7, {"kl_beta": 4e57})
    assert line.startswith("error: the gradient was not finite in 3 consecutive steps (steps 5-7)") and "\n" not in line
    assert "--lr 0.0003" in line and "now 4e+57 (lower --kl-rate 10)" in line and "--mixed-precision bf16" in line
    assert "Checkpoint 7" in line


# ----------------------------------------------------------------------------- attention backends
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals are of kernels a CPU lacks")
@pytest.mark.parametrize("backend, needle", [("flex", "FlexAttention does not support backward on CPU"),
                                             ("_native_efficient", "No viable backend")])
def test_an_attention_backend_that_cannot_run_here_is_refused_before_the_first_step(tmp_path, backend, needle):
    """Before: a NotImplementedError / RuntimeError traceback at the first forward."""
    proc = run([sys.executable, "train.py", "--model", "tiny-wan", "--attention-backend", backend, "--steps", "1",
                "--num-steps", "2", "--out", str(tmp_path / "run")], tmp_path, check=False)
    line = one_error_line(proc)
    assert line.startswith(f"error: --attention-backend {backend} cannot run a forward and backward on cpu in "
                           "float32") and needle in line and "leave it native" in line, line
    assert "step     1" not in proc.stdout


def test_an_attention_backend_on_sd3s_joint_attention_is_said_to_change_nothing(tmp_path):
    """Before: accepted in silence, and recorded in args.json as if it ran."""
    proc = run([sys.executable, "train.py", *FAST, "--attention-backend", "_native_math", "--steps", "1",
                "--out", str(tmp_path / "run")], tmp_path)
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: --attention-backend")]
    assert warnings == ["warning: --attention-backend _native_math changes nothing on tiny: its attention "
                        "(JointAttnProcessor2_0) calls torch's SDPA itself, not diffusers' backends (leave it native)"]


# ----------------------------------------------------------------------------- signals in the first moments
STOPPED = "error: interrupted (Ctrl-C) during start-up, before the first step"


def stopped_in_one_line(proc, stdout, stderr):
    """A SIGINT stopped the run: the set-up line (exit 1, nothing trained) or, once it trains, the run's own stop
    line (exit 0, checkpoint saved). Never a traceback, never a run that went on."""
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    if proc.returncode == 1:
        assert stderr.strip().splitlines()[-1].startswith(STOPPED), stderr[-2000:]
    else:
        assert proc.returncode == 0 and "stopped by SIGINT" in stdout, (proc.returncode, stdout[-2000:],
                                                                         stderr[-2000:])


@pytest.mark.parametrize("delay", [0.2, 1.0])
def test_ctrl_c_while_the_libraries_import_is_one_line(tmp_path, delay):
    """A new interpreter (not a fork of one that imported them): before, a KeyboardInterrupt traceback from inside
    torch's or diffusers' import."""
    proc = subprocess.Popen([sys.executable, "train.py", *FAST, "--steps", "50", "--out", str(tmp_path / "run")],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    stopped_in_one_line(proc, stdout, stderr)


@pytest.mark.parametrize("delay", [0.2, 0.5, 1.0, 2.0])
def test_ctrl_c_at_any_moment_of_the_start_stops_the_run_in_one_line(tmp_path, delay):
    """The run's start after the imports (a fork of a process that made them): its folder prepared
    (checkpoints.prepare, where a KeyboardInterrupt traceback came from), the models loading, the first steps."""
    proc = start([sys.executable, "train.py", *FAST, "--steps", "200", "--out", str(tmp_path / "run")])
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    stopped_in_one_line(proc, stdout, stderr)


def test_a_set_up_signal_whose_exit_a_library_swallowed_still_stops_the_run(tmp_path):
    """Before: the SystemExit of the set-up handler, raised inside code that caught it (a bare except, a __del__),
    was lost, and the run trained every step and exited 0."""
    import config
    p, args = config.parse_args([*FAST, "--steps", "2", "--out", str(tmp_path / "run")])
    config.check_args(p, args, 1)
    the_run = run_module.Run(args, torch.device("cpu"))
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the handler runs here
        except SystemExit:  # what a library's bare except does
            pass
        with pytest.raises(SystemExit) as e:
            the_run.start(None, ([], []), None)
        assert str(e.value.code).startswith(STOPPED)
    finally:
        for signum, handler in the_run.handlers.items():
            signal.signal(signum, handler)
        the_run.pool.shutdown()
        run_module.checkpoints.unlock(args.out)


# ----------------------------------------------------------------------------- --print-config and recipes
@pytest.mark.parametrize("recipe", ["flux_mixgrpo", "flux_mixgrpo_flash", "wan22_5b_hpsv3_dancegrpo"])
def test_a_recipe_that_uses_fsdp_prints_its_settings_outside_torchrun(tmp_path, recipe):
    """Before: refused ('--fsdp shards a full fine-tune over processes'), though the report reads a recipe before its
    launch."""
    proc = run([sys.executable, "train.py", f"@recipes/{recipe}.args", "--print-config"], tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("--fsdp True ") and f"recipes/{recipe}.args:" in line for line in lines)
    assert any(line.startswith("--lora-rank 0 ") for line in lines)
    assert lines[-1] == "# --fsdp: launch it under torchrun --nproc_per_node N > 1 (it shards over the processes)"


def test_fsdp_outside_torchrun_is_still_refused_for_a_run(tmp_path):
    proc = run([sys.executable, "train.py", "@recipes/flux_mixgrpo.args", "--steps", "1"], tmp_path, check=False)
    assert "--nproc_per_node N > 1" in one_error_line(proc)


def test_a_recipe_with_a_byte_order_mark_is_read(tmp_path):
    """Before: 'unrecognized arguments: \\ufeff--model' (Windows editors start a UTF-8 file with one)."""
    recipe = tmp_path / "bom.args"
    recipe.write_bytes("\ufeff--model tiny\n--lr 0.0007\n".encode("utf-8"))
    proc = run([sys.executable, "train.py", f"@{recipe}", "--print-config"], tmp_path)
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("--")}
    assert rows["--model"].split()[1] == "tiny" and rows["--model"].endswith(f"# {recipe}:1")
    assert rows["--lr"].split()[1] == "0.0007" and rows["--lr"].endswith(f"# {recipe}:2")


def test_a_reader_that_closes_the_reports_pipe_ends_it_quietly(tmp_path):
    """`train.py --print-config | head`: before, a BrokenPipeError traceback. A new interpreter, its stdout a pipe
    whose reader is gone before the report is written."""
    proc = subprocess.Popen([sys.executable, "train.py", "--model", "tiny", "--print-config"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


def test_fsdp_reduce_without_fsdp_is_refused_in_one_line(tmp_path):
    """Before: accepted, and nothing reduce-scatters without --fsdp."""
    proc = run([sys.executable, "train.py", *FAST, "--fsdp-reduce", "optimizer-step", "--steps", "1",
                "--out", str(tmp_path / "run")], tmp_path, check=False)
    line = one_error_line(proc)
    assert "--fsdp-reduce optimizer-step" in line and "add --fsdp" in line and "drop --fsdp-reduce" in line
    assert not os.path.exists(tmp_path / "run")  # before anything was made
