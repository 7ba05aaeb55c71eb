"""The sixth hostile campaign, its reward and evaluation findings: a checkpoint file whose pickle runs code, user code
imported from another folder than the message says, a password written into the run's settings, tracebacks above a
missing hub model's line, eval.py outputs that fail after the sampling, and messages or files that point at the wrong
place. Each attack ends in one `error:` line naming the fix (or works); each test fails without the handling it
names."""
import json
import os
import pickle
import sys

import pytest
import torch

import flags
import forkserver
import reward_models
import rewards
import services
from test_train import ROOT, SMALL

FAST = SMALL + ["--log-images-every", "0"]


def cli(script, *args, cwd=ROOT, env=None, timeout=300):
    """`python <repo>/<script> args` from the folder `cwd`, offline, one thread."""
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env or {}))
    return forkserver.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=str(cwd), env=full_env,
                          timeout=timeout)


def one_line(proc, needle=""):
    """The command failed with one `error:` line holding needle, and no traceback -> the line."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and needle in last, proc.stderr[-2000:]
    return last


# ----------------------------------------------------------------------------- a pickle that runs code

class Creates:
    """Unpickled, it creates the file `path` (as a hostile checkpoint's code would)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("wrap", [lambda evil: evil, lambda evil: {"state_dict": {"weight": evil}}],
                         ids=["bare", "inside-a-state-dict"])
def test_a_checkpoint_whose_pickle_runs_code_is_refused_unrun(tmp_path, wrap):
    """Before: a failed weights_only load was retried with weights_only=False, which ran the pickle's code."""
    marker, evil = tmp_path / "pwned", tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump(wrap(Creates(marker)), f)
    with pytest.raises(RuntimeError) as e:
        rewards.REWARDS["hps"](device="cpu", **{**rewards.option_defaults(), "hps_checkpoint_path": str(evil)})
    assert not marker.exists()
    message = str(e.value)
    assert "\n" not in message and str(evil) in message and "--hps-checkpoint-path" in message
    assert "weights_only=True) refused it" in message and ".safetensors" in message


def test_every_user_file_loader_refuses_a_pickle_of_code(tmp_path):
    """The aesthetic MLP and ImageReward's weights go through the same safe loader."""
    marker, evil = tmp_path / "pwned", tmp_path / "ImageReward.pt"
    with open(evil, "wb") as f:
        pickle.dump(Creates(marker), f)
    (tmp_path / "med_config.json").write_text("{}")
    for flag, name, options in [("--aesthetic-mlp-path", "aesthetic", {"aesthetic_mlp_path": str(evil)}),
                                ("--imagereward-model-path", "imagereward", {"imagereward_model_path": str(evil)})]:
        with pytest.raises(RuntimeError, match=f"{name}: .*refused.*{flag}"):
            reward_models.load_tensors(str(evil), name, flag)
    assert not marker.exists()


def test_safe_loader_reads_tensors_and_safetensors(tmp_path):
    from safetensors.torch import save_file

    state = {"w": torch.arange(6.0).view(2, 3)}
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "a.pt")
    save_file(state, tmp_path / "a.safetensors")
    assert torch.equal(reward_models.load_tensors(str(tmp_path / "a.pt"), "hps", "--f")["state_dict"]["w"], state["w"])
    assert torch.equal(reward_models.load_tensors(str(tmp_path / "a.safetensors"), "hps", "--f")["w"], state["w"])
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="hps: .*junk.pt.*--f"):
        reward_models.load_tensors(str(tmp_path / "junk.pt"), "hps", "--f")


def test_train_refuses_a_hostile_hps_checkpoint_in_one_line(tmp_path):
    marker, evil = tmp_path / "pwned", tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump(Creates(marker), f)
    proc = cli("train.py", *FAST, "--steps", "1", "--reward", "hps", "--hps-checkpoint-path", evil,
               "--out", tmp_path / "run")
    one_line(proc, "--hps-checkpoint-path")
    assert not marker.exists()
