"""The two brakes of the long run: the adaptive KL weight (--kl-target, losses.adaptive_kl_beta: Ziegler et al.
2019, Sec. 2.2) and DiffusionNFT's flow-matching pull (--nft-fm; its gradient: tests/test_forward_losses.py), as
train.py wires them: the weight each step trains with, carried from step to step and through a checkpoint."""
import math

import pytest

import losses
import train
from test_gardo import LORA_KL, same_rows, state, train_in_process


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
