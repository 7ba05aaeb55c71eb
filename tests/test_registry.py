"""A loss is one function and one line in losses.LOSSES (README, "Adding a loss"): a loss defined here, registered,
trains the tiny model through train.main with no edit to train.py; and nothing outside losses.py chooses by name."""
import json
import os
import re
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import losses
import models
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4",
         "--train-batch-size", "4", "--num-steps", "4", "--resolution", "32", "--log-images-every", "0",
         "--steps", "2", "--seed", "3"]


def reinforce(t, **_):
    """REINFORCE (Williams 1992) on each trained step: -A log pi(x_{k+1} | x_k), no ratio and no clip."""
    value = -(t["adv"] * t["log_prob"]).mean()
    return value, {"reinforce_logp": t["log_prob"].detach().mean().item()}


def trained(out, step=2):
    return load_file(os.path.join(out, "checkpoints", str(step), "trainable.safetensors"))


def test_a_loss_defined_outside_trains_through_train_main(tmp_path, monkeypatch, one_thread):
    monkeypatch.setitem(losses.LOSSES, "reinforce", losses.Loss(reinforce, "reverse", clip=False))
    train.main(SMALL + ["--loss", "reinforce", "--out", str(tmp_path / "reinforce")])
    rows = [json.loads(line) for line in open(tmp_path / "reinforce" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reinforce_logp" in r and r["grad_norm"] > 0 and not r.get("skipped") for r in rows)
    assert all(abs(r["first_ratio_dev"]) < 1e-6 for r in rows)  # train.py's on-policy check ran on it too
    # At ratio 1 the gradient of -A r is -A grad log pi: the first optimizer step of REINFORCE is GRPO's. One step of
    # each from the same start (same rollout, same advantages) must land on the same weights, to rounding.
    train.main(SMALL + ["--loss", "reinforce", "--steps", "1", "--out", str(tmp_path / "r1")])
    train.main(SMALL + ["--loss", "grpo", "--steps", "1", "--out", str(tmp_path / "g1")])
    a, b = trained(tmp_path / "r1", 1), trained(tmp_path / "g1", 1)
    initial = {n: q.detach() for n, q in models.load_pipeline("tiny").transformer.named_parameters()}
    moved = sum((a[n] - initial[n]).abs().sum().item() for n in a)
    assert moved > 0
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 1e-6 * max(1.0, moved)


def test_an_unknown_loss_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--loss", "reinforce"])
    assert "invalid choice: 'reinforce'" in capsys.readouterr().err


def test_the_forward_process_registry_fields_are_complete():
    for name, loss in losses.LOSSES.items():
        assert loss.process in ("reverse", "forward"), name
        if loss.process == "forward":  # trains at sigmas it draws, needs them to fit the schedule
            assert loss.times is not None, name
            times = loss.times(3, torch.Generator().manual_seed(0), num_steps=10, timestep_fraction=0.9,
                               train_timesteps=2, awm_timesteps="discrete_wo_init")
            assert times.shape[0] == 3 and times.dtype == torch.long and (times >= 0).all() and (times < 10).all()


def test_nothing_outside_losses_chooses_by_loss_name():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    hits = [f"{f}:{i + 1}" for f in files if f != "losses.py" and not f.startswith("tests/")
            for i, line in enumerate(open(os.path.join(ROOT, f))) if re.search(r"args\.loss *(==|!=|in )", line)]
    assert not hits, hits
