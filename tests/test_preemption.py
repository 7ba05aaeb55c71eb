"""Preemption inside a step: a SIGTERM stops the run at the next rollout batch or training forward, within seconds, and keeps
the state the step started from; --resume auto then redoes the step exactly. (A signal while waiting for rewards and one
at the end of a step: tests/test_faults.py.)"""
import json
import os
import signal
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

import checkpoints

from test_faults import FAST, start
from test_train import ROOT, metrics, run

# SIGTERM to itself inside step 2's training phase: after its first optimizer step (`after_step`), where the weights
# have already moved and the run must go back to the step's start, or at its backward passes (`before_step`: the
# check before the next forward stops it, before the step's only optimizer step).
SIGNAL_IN_TRAINING = textwrap.dedent('''
    import os, signal, sys, data, models, policy, train
    when, now = sys.argv.pop(1), {}
    real_ids, real_step, real_backward = data.step_prompt_ids, policy.Policy.step, policy.Policy.backward
    def step_prompt_ids(num_prompts, step, **k):  # called once at the start of every step
        now.update(step=step + 1, calls=0)
        return real_ids(num_prompts, step, **k)
    def step(self):
        out = real_step(self)
        if when == "after_step" and now["step"] == 2 and not now["calls"]:
            os.kill(os.getpid(), signal.SIGTERM)
        now["calls"] += 1
        return out
    def backward(self, loss):
        real_backward(self, loss)
        if when == "before_step" and now["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    real_generate = models.generate
    def generate(*a, **k):  # a rollout batch
        out = real_generate(*a, **k)
        if when == "sampling" and now["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    models.generate = generate
    import eval as evaluation
    real_sample = evaluation.sample_images
    def sample_images(*a, stop=None, **k):  # the held-out evaluation: a signal after its first batch
        def signal_then_ask():
            if when == "evaluation" and now.get("step") == 2:
                now["asked"] = now.get("asked", 0) + 1
                if now["asked"] == 2:  # before the second batch
                    os.kill(os.getpid(), signal.SIGTERM)
            return stop()
        return real_sample(*a, stop=signal_then_ask if stop else None, **k)
    evaluation.sample_images = sample_images
    data.step_prompt_ids, policy.Policy.step, policy.Policy.backward = step_prompt_ids, step, backward
    train.main(sys.argv[1:])
''')


def weights(out, step, name):
    return load_file(os.path.join(out, "checkpoints", str(step), f"{name}.safetensors"))


@pytest.mark.parametrize("when, flags", [("after_step", ["--minibatches", "2", "--train-batch-size", "2"]),
                                         ("before_step", []), ("sampling", []),
                                         ("sampling", ["--loss", "nft", "--old-decay", "copy"])])
def test_sigterm_in_training_keeps_the_step_start_and_resumes_exactly(tmp_path, when, flags):
    common = [*FAST, "--steps", "3", "--save-every", "0", "--ema-decay", "0.9", *flags]
    reference = str(tmp_path / "reference")
    run([sys.executable, "train.py", *common, "--out", reference], tmp_path)
    out = str(tmp_path / "run")
    stopped = run([sys.executable, "-c", SIGNAL_IN_TRAINING, when, *common, "--out", out], tmp_path)
    phase = "sampling" if when == "sampling" else "training"
    assert f"in the {phase} phase of step 2; checkpoint 1 saved" in stopped.stdout, stopped.stdout[-2000:]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["1"] and len(metrics(out)) == 1
    state = json.load(open(os.path.join(out, "checkpoints", "1", "state.json")))
    assert state["step"] == 1 and state["optimizer_steps"] == (2 if when == "after_step" else 1)  # step 1's, not more
    run([sys.executable, "train.py", *common, "--out", out, "--resume", "auto"], tmp_path)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    for got, want in zip(metrics(out), metrics(reference)):
        assert {k: got[k] for k in ("reward_mean", "loss", "grad_norm")} == \
            {k: want[k] for k in ("reward_mean", "loss", "grad_norm")}
    for name in ("trainable", "ema"):  # bit for bit
        mine, theirs = weights(out, 3, name), weights(reference, 3, name)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name


def test_a_checkpoint_inside_an_exchange_of_weights_is_refused():
    """Inside checkpoints.swapped the trained parameters hold another copy (the EMA, the old policy): a save there
    would keep that copy as the trained weights, so write refuses it; on exit the weights are back."""
    param, other = torch.nn.Parameter(torch.zeros(3)), {"w": torch.ones(3)}
    with checkpoints.swapped([("w", param)], other):
        with pytest.raises(RuntimeError, match="inside checkpoints.swapped"):
            checkpoints.write(None, 1, None, [("w", param)], None, {}, "cpu", {})
    assert torch.equal(param.detach(), torch.zeros(3)) and torch.equal(other["w"], torch.ones(3))
    assert checkpoints._exchanged == 0


def test_sigterm_in_the_held_out_evaluation_keeps_the_step_and_evaluates_it_on_resume(tmp_path):
    """A signal while step 2's held-out evaluation samples (a real model's takes minutes) stops before its next batch:
    step 2 is complete and saved, its evaluation left out; --resume auto evaluates step 2 before training on, and every
    evaluation and weight equals an uninterrupted run's."""
    common = [*FAST, "--steps", "3", "--save-every", "0", "--eval-every", "2", "--eval-prompts", "prompts/tiny.txt",
              "--eval-steps", "2"]
    reference = str(tmp_path / "reference")
    run([sys.executable, "train.py", *common, "--out", reference], tmp_path)
    out = str(tmp_path / "run")
    stopped = run([sys.executable, "-c", SIGNAL_IN_TRAINING, "evaluation", *common, "--out", out], tmp_path)
    assert "in the held-out evaluation of step 2; checkpoint 2 saved" in stopped.stdout, stopped.stdout[-2000:]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2"] and len(metrics(out)) == 2
    assert [r["step"] for r in map(json.loads, open(os.path.join(out, "eval.jsonl")))] == [0]
    run([sys.executable, "train.py", *common, "--out", out, "--resume", "auto"], tmp_path)
    rows = [list(map(json.loads, open(os.path.join(folder, "eval.jsonl")))) for folder in (out, reference)]
    assert [r["step"] for r in rows[0]] == [0, 2] and rows[0] == rows[1]
    mine, theirs = weights(out, 3, "trainable"), weights(reference, 3, "trainable")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


LONG_STEP = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4",
             "--train-batch-size", "1", "--num-steps", "150", "--resolution", "256", "--log-images-every", "0",
             "--steps", "2", "--save-every", "0", "--eval-every", "0"]


def test_sigterm_to_torchrun_in_a_long_training_phase_saves_inside_its_window(tmp_path):
    """As a cluster preempts: SIGTERM to the torchrun launcher while its two workers are in the training phase of a
    step whose training alone lasts well past the launcher's 30 s before SIGKILL (this step, uninterrupted, on 2 CPU
    cores, other runs beside it: sampling 28 s, training 71 s). The workers stop before their next forward, save the last
    complete step and exit 0 well inside the window (the test takes 40-75 s)."""
    out = str(tmp_path / "ddp")
    marker = tmp_path / "scored"
    reward = tmp_path / "marking.py"  # scores, and marks when the step's last rollout batch has been scored
    reward.write_text(textwrap.dedent(f'''
        import pathlib
        def score(images, prompts, metadata, args):
            pathlib.Path({str(marker)!r}).write_text("scored")
            return images.reshape(len(images), -1).float().mean(1) / 255
    '''))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *LONG_STEP,
           "--reward", "custom", "--custom-rm-path", "marking.score", "--out", out]
    proc = start(cmd, env={"PYTHONPATH": str(tmp_path)})
    t0 = time.time()
    while not marker.exists():  # the rollouts of step 1 (minutes); then its training phase
        assert proc.poll() is None and time.time() - t0 < 600, proc.communicate()
        time.sleep(0.2)
    time.sleep(5)  # inside the training phase: 4 micro-batches of 149 trained steps each per rank
    proc.send_signal(signal.SIGTERM)  # to the launcher, which forwards it and kills the workers 30 s later
    t_signal = time.time()
    out_text, err_text = proc.communicate(timeout=120)
    elapsed = time.time() - t_signal
    text = out_text + err_text
    assert "forcefully exiting via 9" not in text and elapsed < 25, (elapsed, text[-3000:])
    assert "in the training phase of step 1; checkpoint 0 saved" in text, text[-3000:]
    assert os.listdir(os.path.join(out, "checkpoints")) == ["0"]
    assert json.load(open(os.path.join(out, "checkpoints", "0", "state.json")))["optimizer_steps"] == 0
