"""The roles of the few-step distillation losses through train.py on the tiny model: each loss trains 2 steps, its
critic trains beside the policy and resumes bit for bit, its teacher stays as it was, --print-config names them, and
a teacher that does not exist is refused in one line (roles.py, policy.Policy._roles / _teachers)."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4",
         "--train-batch-size", "4", "--num-steps", "4", "--resolution", "32", "--critic-updates", "2"]
SMALL_NO_CRITIC = SMALL[:-2]  # a loss without a critic refuses --critic-updates


def train(tmp_path, *flags, out="run", check=True, small=SMALL):
    out_dir = str(tmp_path / out)
    cmd = [sys.executable, "train.py", *small, "--out", out_dir, *flags]
    proc = forkserver.run(cmd, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"), timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc, out_dir


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def weights(out_dir, step, name="trainable"):
    return load_file(os.path.join(out_dir, "checkpoints", str(step), f"{name}.safetensors"))


def changed(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("loss,flags", [("dmd2", []), ("tdm", ["--lora-rank", "4"]), ("tdm_r1", ["--lora-rank", "4"]),
                                        ("dmdr", []), ("opd", ["--lora-rank", "4", "--lr", "0.01"])])
def test_each_distillation_loss_trains_two_steps(tmp_path, loss, flags):
    extra = [] if loss == "opd" else ["--critic-lr", "0.01"]
    _, out = train(tmp_path, "--loss", loss, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "2",
                   *extra, *flags,
                   small=SMALL_NO_CRITIC if loss == "opd" else SMALL)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[-1]["updates"] == 1 and rows[-1]["trained_steps"] == 3  # every stored stage of every sample
    assert changed(weights(out, 1), weights(out, 2)) > 0  # the policy trains
    roles = {"dmd2": ["critic"], "tdm": ["critic"], "tdm_r1": ["critic", "surrogate"], "dmdr": ["critic"], "opd": []}
    for role in roles[loss]:
        assert changed(weights(out, 1, role), weights(out, 2, role)) > 0, role  # the critic trains
        assert changed(weights(out, 2, role), weights(out, 2)) > 0, role  # on its own, not the policy's weights
        assert rows[-1][f"{role}_grad_norm"] > 0
    if not roles[loss]:
        assert not os.path.exists(os.path.join(out, "checkpoints", "2", "critic.safetensors"))


def test_opd_teacher_stays_the_base_while_the_student_moves(tmp_path):
    """The student starts as its teacher (the base): the first step's KL is 0. The teacher is a copy (full fine-tune),
    not the trained weights: once the student moved, the KL is positive, where an alias would keep it 0."""
    _, out = train(tmp_path, "--loss", "opd", "--steps", "3", "--lr", "0.01", small=SMALL_NO_CRITIC)
    rows = metrics(out)
    assert rows[0]["kl_mean"] == 0.0 and rows[0]["grad_norm"] == 0.0
    assert rows[-1]["kl_mean"] > 0


def test_critic_resumes_bit_for_bit(tmp_path):
    flags = ["--loss", "dmd2", "--critic-lr", "0.01", "--lora-rank", "4"]
    _, whole = train(tmp_path, "--steps", "3", *flags, out="whole")
    _, part = train(tmp_path, "--steps", "2", *flags, out="part")
    train(tmp_path, "--steps", "3", "--resume", "auto", *flags, out="part")
    for name in ("critic", "trainable"):
        a, b = weights(whole, 3, name), weights(part, 3, name)
        assert all(torch.equal(a[n], b[n]) for n in a), name
    optim = [torch.load(os.path.join(d, "checkpoints", "3", "critic_optim.pt"), weights_only=True) for d in (whole, part)]
    assert all(torch.equal(optim[0]["state"][k]["exp_avg"], optim[1]["state"][k]["exp_avg"]) for k in optim[0]["state"])
    assert json.load(open(os.path.join(part, "checkpoints", "3", "state.json")))["role_steps"] == {"critic": 6}


def test_print_config_names_the_roles(tmp_path):
    proc, _ = train(tmp_path, "--loss", "tdm", "--print-config")
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("--")}
    assert lines["--teacher"].split("#")[1].strip() == "loss default (tdm)" and "['base']" in lines["--teacher"]
    assert lines["--critic-lr"].split()[1] == "2e-05" and "loss default (tdm)" in lines["--critic-lr"]
    assert lines["--critic-updates"].split()[1] == "2" and "command line" in lines["--critic-updates"]


@pytest.mark.parametrize("flags,needle", [
    (["--loss", "dmd2", "--teacher", "/nonexistent/ckpt"], "--teacher /nonexistent/ckpt: /nonexistent/ckpt is not a "
                                                             "checkpoint folder"),
    (["--loss", "grpo", "--teacher", "base"], "--teacher is read by the distillation losses"),
    (["--loss", "opd", "--critic-lr", "0.1"], "--critic-lr is read by the distillation losses with a critic"),
    (["--loss", "opd", "--teacher", "a=base", "--teacher", "b=base"], "several --teacher need a key each and "
                                                                     "--teacher-field"),
    (["--loss", "dmd2", "--fsdp", "--lora-rank", "0"], "its trained critic is not sharded yet"),
], ids=["missing-teacher", "teacher-for-grpo", "critic-lr-for-opd", "keys-without-field", "fsdp"])
def test_bad_role_flags_are_refused_in_one_line(tmp_path, flags, needle):
    proc, _ = train(tmp_path, "--steps", "1", *flags, check=False, small=SMALL_NO_CRITIC)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert needle in proc.stderr.strip().splitlines()[-1]


def test_two_teachers_keyed_by_a_prompt_field(tmp_path):
    """--teacher a=base --teacher b=CKPT --teacher-field tag: the first step's student is the base, so the samples
    of tag a (the base teaches) have KL 0 and those of tag b (a trained checkpoint teaches) a positive one; a tag no
    teacher names is refused in one line."""
    _, other = train(tmp_path, "--loss", "grpo", "--steps", "1", "--lr", "0.05", out="other", small=SMALL_NO_CRITIC)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"a {word} shape", "metadata": {"tag": tag}}) + "\n"
                               for word, tag in (("red", "a"), ("blue", "b"))))
    teachers = ["--teacher", "a=base", "--teacher", f"b={other}/checkpoints/1", "--teacher-field", "tag"]
    _, out = train(tmp_path, "--loss", "opd", "--steps", "1", "--prompts", str(prompts), *teachers,
                   small=SMALL_NO_CRITIC)
    (row,) = metrics(out)
    assert row["kl_teacher0"] == 0.0 and row["kl_teacher1"] > 0
    prompts.write_text(prompts.read_text().replace('"b"', '"c"'))
    proc, _ = train(tmp_path, "--loss", "opd", "--steps", "1", "--prompts", str(prompts), *teachers, out="bad",
                    check=False, small=SMALL_NO_CRITIC)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "a prompt's tag is 'c', which no --teacher names" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dmd2", "tdm", "tdm_r1", "dmdr", "opd"])
def test_each_distillation_loss_trains_two_steps_on_the_shapes_model(tmp_path, loss):
    """The pretrained shapes model at its preset (16 prompts x 8, 10 steps): about 2.5 minutes each on 2 cores."""
    _, out = train(tmp_path, "--loss", loss, "--steps", "2", "--eval-every", "0", small=["--model", "shapes"])
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    if loss == "opd":  # the student starts as its teacher, the base: OPD's fixed point, nothing to move
        assert [r["kl_mean"] for r in rows] == [0.0, 0.0]
    else:
        assert all(r["grad_norm"] > 0 for r in rows) and rows[-1]["critic_grad_norm"] > 0


def test_sigterm_in_training_keeps_the_critic_of_the_steps_start(tmp_path):
    """A SIGTERM at step 2's generator backward (its critic already updated) saves step 1's critic, not the moved one:
    the resumed run equals the uninterrupted one bit for bit (test_preemption.py's signal, with a critic)."""
    from test_preemption import SIGNAL_IN_TRAINING
    common = [*SMALL, "--loss", "dmd2", "--lora-rank", "4", "--critic-lr", "0.01", "--steps", "3", "--save-every", "0"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    reference, out = str(tmp_path / "reference"), str(tmp_path / "run")
    forkserver.run([sys.executable, "train.py", *common, "--out", reference], cwd=ROOT, env=env, timeout=300)
    stopped = forkserver.run([sys.executable, "-c", SIGNAL_IN_TRAINING, "before_step", *common, "--out", out],
                             cwd=ROOT, env=env, timeout=300)
    assert "in the training phase of step 2; checkpoint 1 saved" in stopped.stdout, stopped.stdout[-2000:]
    forkserver.run([sys.executable, "train.py", *common, "--out", out, "--resume", "auto"], cwd=ROOT, env=env,
                   timeout=300)
    for name in ("critic", "trainable"):
        a, b = weights(reference, 3, name), weights(out, 3, name)
        assert all(torch.equal(a[n], b[n]) for n in a), name


def test_a_tdm_weight_at_an_end_is_refused_in_one_line(tmp_path):
    proc, _ = train(tmp_path, "--steps", "1", "--loss", "tdm_r1", "--tdm-weight", "1", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--tdm-weight 1.0: must lie strictly between 0 and 1" in proc.stderr.strip().splitlines()[-1]
