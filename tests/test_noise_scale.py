"""scripts/noise_scale.py: the gradient noise scale estimator and its command."""
import importlib.util
import math
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("noise_scale", os.path.join(ROOT, "scripts", "noise_scale.py"))
noise_scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(noise_scale)


@pytest.mark.parametrize("b_true", [10.0, 1000.0])
def test_estimator_recovers_a_known_noise_scale(b_true):
    # batch gradients g = G + mean of B per-sample noises: |G|^2 = 1, tr(Sigma) = b_true, so B_simple = b_true
    gen = torch.Generator().manual_seed(0)
    dims, batch, n = 2000, 50, 400
    G = torch.randn(dims, generator=gen)
    G /= G.norm()
    sigma = math.sqrt(b_true / dims)  # per-dimension std of one sample's gradient
    grads = [G + sigma * torch.randn(dims, generator=gen) / math.sqrt(batch) for _ in range(n)]
    est = noise_scale.noise_scale(grads, batch)
    assert est["G2"] == pytest.approx(1.0, abs=4 * est["G2_se"] + 0.02)
    assert est["trace"] == pytest.approx(b_true, rel=0.05)
    assert est["b_simple"] == pytest.approx(b_true, rel=0.15)
    assert est["signal_share"] == pytest.approx(1 / (1 + b_true / batch), rel=0.15)


def test_pure_noise_has_no_signal():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(5000, generator=gen) for _ in range(40)]
    est = noise_scale.noise_scale(grads, 8)
    assert abs(est["G2"]) < 3 * est["G2_se"]  # zero within its error
    assert abs(est["signal_share"]) < 0.01


def test_estimator_needs_two_batches():
    with pytest.raises(ValueError, match="at least 2"):
        noise_scale.noise_scale([torch.ones(3)], 4)


def test_command_on_the_tiny_model(capsys):
    est = noise_scale.main(["--batches", "3", "--", "--model", "tiny", "--group-size", "4", "--prompts-per-step", "2",
                            "--num-steps", "4", "--sample-batch-size", "8", "--train-batch-size", "8"])
    out = capsys.readouterr().out
    assert "2 prompts x 4" in out and "B_simple" in out
    assert math.isfinite(est["G2"]) and est["trace"] > 0  # a real gradient: noise of positive size


def test_command_refuses_what_it_cannot_measure():
    with pytest.raises(SystemExit):
        noise_scale.main(["--batches", "1"])
    with pytest.raises(SystemExit):
        noise_scale.main(["--batches", "2", "--", "--model", "tiny", "--loss", "nft"])
    with pytest.raises(SystemExit, match="2"):  # train.py's own check, before any model loads (not a ZeroDivision)
        noise_scale.main(["--batches", "2", "--", "--model", "tiny", "--group-size", "1"])
