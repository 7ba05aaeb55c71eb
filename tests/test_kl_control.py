"""The two brakes of the long run: the adaptive KL weight (--kl-target, losses.adaptive_kl_beta: Ziegler et al.
2019, Sec. 2.2) and DiffusionNFT's flow-matching pull (--nft-fm; its gradient: tests/test_forward_losses.py), as
train.py wires them: the weight each step trains with, carried from step to step and through a checkpoint."""
import math
import os
import sys
from types import SimpleNamespace

import pytest

import forkserver
import losses
import regularizers
import train
from test_gardo import LORA_KL, same_rows, state, train_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_kl_weight_moves_by_the_clipped_proportional_error():
    """beta (1 + K clip(KL / target - 1, -0.2, 0.2)), restated by hand: a KL at the target leaves beta, one 10 %
    above raises it by K x 10 %, one far above or below by at most K x 20 %; a non-finite KL leaves it."""
    step = lambda kl: losses.adaptive_kl_beta(0.5, kl, target=0.02, rate=0.1)  # noqa: E731
    assert step(0.02) == pytest.approx(0.5)
    assert step(0.022) == pytest.approx(0.5 * (1 + 0.1 * 0.1))
    assert step(0.018) == pytest.approx(0.5 * (1 - 0.1 * 0.1))
    assert step(5.0) == pytest.approx(0.5 * 1.02) and step(0.0) == pytest.approx(0.5 * 0.98)
    assert step(float("nan")) == 0.5 and step(math.inf) == 0.5
    floored = lambda kl: losses.adaptive_kl_beta(0.5, kl, target=0.02, rate=0.1, floor=0.495)  # noqa: E731
    assert floored(0.0) == 0.495 and floored(0.019) == pytest.approx(0.5 * (1 - 0.1 * 0.05))
    beta = 1.0
    for _ in range(10):  # a KL that stays above target: beta grows geometrically, 1 + 0.2 K a step
        beta = losses.adaptive_kl_beta(beta, 1.0, target=0.02, rate=0.5)
    assert beta == pytest.approx(1.1**10)


def test_the_adapted_weight_trains_is_carried_and_resumes_exactly(tmp_path):
    """Step 1's KL is 0 (the policy is the base model): the weight would fall by 20 % x K, but not below --kl-beta;
    every later KL is far above a tiny target: it rises by 20 % x K a step. Each step logs the weight it trained with,
    state.json carries the next, and a run resumed from step 1 logs what the uninterrupted one does."""
    flags = ["--loss", "nft", "--steps", "3", "--save-every", "1", "--keep-checkpoints", "9", *LORA_KL,
             "--kl-target", "1e-9", "--kl-rate", "0.5", "--nft-fm", "0.3"]
    full = train_in_process(tmp_path / "full", *flags)
    assert full[0]["kl"] == 0 and all(r["kl"] > 0 for r in full[1:])
    assert [r["kl_beta"] for r in full] == pytest.approx([0.1, 0.1, 0.11])
    assert [state(tmp_path / "full", s)["carry"]["kl_beta"] for s in (1, 2, 3)] == pytest.approx([0.1, 0.11, 0.121])
    assert all(r["nft_fm"] > 0 for r in full)
    resumed = train_in_process(tmp_path / "resumed", *flags, "--resume", str(tmp_path / "full" / "checkpoints" / "1"))
    assert same_rows(full[1:], resumed)
    fixed = train_in_process(tmp_path / "fixed", *flags[:-6])  # no controller: the weight is --kl-beta, not logged
    assert "kl_beta" not in fixed[0] and "nft_fm" not in fixed[0]


def test_kl_floor_0_lets_the_weight_fall_as_ziegler_et_al(tmp_path):
    """--kl-floor 0: every KL is under a huge target, so the weight falls by 20 % x K a step from --kl-beta, past it
    (the default floor holds it at --kl-beta: the test above); a floor between stops it there."""
    flags = ["--loss", "nft", "--steps", "3", *LORA_KL, "--kl-target", "1e9", "--kl-rate", "0.5"]
    free = train_in_process(tmp_path / "free", *flags, "--kl-floor", "0")
    assert [r["kl_beta"] for r in free] == pytest.approx([0.1, 0.09, 0.081])
    held = train_in_process(tmp_path / "held", *flags, "--kl-floor", "0.085")
    assert [r["kl_beta"] for r in held] == pytest.approx([0.1, 0.09, 0.085])


@pytest.mark.parametrize("flags, says", [
    (["--kl-target", "0.02"], "--kl-target adapts the weight of a KL term"),
    (["--kl-beta", "0.1", "--lora-rank", "4", "--kl-target", "0.02", "--kl-floor", "0.2"],
     "give --kl-floor <= --kl-beta"),
    (["--loss", "grpo", "--nft-fm", "0.3"], "--nft-fm is read by --loss nft, not by --loss grpo: drop it"),
])
def test_a_brake_without_what_it_acts_on_is_refused(flags, says, capsys):
    p, args = train.parse_args(["--model", "tiny", "--kl-beta", "0", *flags])
    with pytest.raises(SystemExit):
        train.check_args(p, args, 1)
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("rate", ["10", "1e30", "5"])
def test_a_controller_rate_that_zeroes_or_explodes_the_weight_is_refused_in_one_line(rate):
    """--kl-rate 10 took the weight to 0 after one step below target (a multiplicative controller never raises 0
    again), 1e30 to 2e29 x --kl-beta after one above, then 4e57 and NaN gradients, and the run exited 0. The factor
    1 +- 0.2 rate must stay within (0, 2]: rates of 5 and above are refused before any model loads."""
    cmd = [sys.executable, "train.py", "--model", "tiny", *LORA_KL, "--kl-target", "1", "--kl-rate", rate,
           "--kl-floor", "0", "--steps", "1", "--out", os.devnull]
    proc = forkserver.run(cmd, cwd=ROOT, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert f"--kl-rate {float(rate):g}" in line and "within (0, 2]: use a rate below 5" in line, line


def test_the_adapted_weight_is_held_within_its_bounds_and_warned_once(capsys):
    """A rate just below 5 moves the weight by x0.02 or x1.98 a step. Twenty steps under target (floor 0, Ziegler's free
    fall) would take 0.1 to 1e-35, from which no step could bring it back: it is held at --kl-beta / 1e4 instead;
    twenty above would take it to 1e5: held at --kl-beta x 1e4. Each bound is warned once, as it is reached; the
    floor the user set is reached without a warning."""
    args = SimpleNamespace(gardo_reference=False, kl_target=1.0, kl_rate=4.9, kl_floor=0.0, kl_beta=0.1)

    def run(kl, steps, floor=0.0):
        carry, weights = {"kl_beta": args.kl_beta}, []
        for _ in range(steps):
            info = regularizers.after_training({"kl": kl}, {"kl_beta": carry["kl_beta"]}, {},
                                               SimpleNamespace(**dict(vars(args), kl_floor=floor)), carry, "cpu")
            weights.append(info["kl_beta"])
        return weights + [carry["kl_beta"]]

    low = run(0.0, 20)
    assert low[1] == pytest.approx(0.1 * 0.02) and low[-1] == pytest.approx(1e-5) and min(low) == pytest.approx(1e-5)
    out = capsys.readouterr().out
    assert out.count("warning: the adaptive KL weight reached 1e-05, --kl-beta 0.1 / 10000") == 1
    assert "stays below --kl-target 1" in out
    high = run(100.0, 20)
    assert high[1] == pytest.approx(0.1 * 1.98) and high[-1] == pytest.approx(1e3) and max(high) == pytest.approx(1e3)
    assert capsys.readouterr().out.count("reached 1e+03, --kl-beta 0.1 x 10000") == 1
    floored = run(0.0, 5, floor=0.05)
    assert floored[-1] == 0.05 and capsys.readouterr().out == ""
