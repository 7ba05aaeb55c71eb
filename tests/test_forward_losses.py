"""Two forward-process losses of losses.py (DiffusionNFT, AWM) and the velocity-space KL against float64 numpy
references written out here, their stop-gradients, and the gradient the derivations predict."""

import numpy as np
import pytest
import torch

import losses


def batch(seed=0, shape=(5, 3, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    sigma = torch.rand(shape[0], generator=g) * 0.9 + 0.05
    s = sigma.view(-1, *[1] * (len(shape) - 1))
    x_t = (1 - s) * x0 + s * eps
    v_old = eps - x0 + 0.3 * torch.randn(shape, generator=g)  # a model near the flow-matching target
    v = v_old + 0.1 * torch.randn(shape, generator=g)
    return x0, eps, sigma, x_t, v, v_old


def np_nft(v, v_old, x_t, x0, sigma, r, beta, adaptive=True):
    """DiffusionNFT's per-sample loss, one sample at a time in float64 numpy."""
    out = []
    for i in range(len(v)):
        vi, oi, xi, x0i = (np.asarray(a[i], dtype=np.float64) for a in (v, v_old, x_t, x0))
        s = float(sigma[i])
        terms = []
        for pred in (beta * vi + (1 - beta) * oi, (1 + beta) * oi - beta * vi):
            err = (xi - s * pred) - x0i
            w = max(np.abs(err).mean(), 1e-5) if adaptive else 1.0
            terms.append((err**2).mean() / w)
        out.append((float(r[i]) * terms[0] + (1 - float(r[i])) * terms[1]) / beta)
    return np.array(out)


# ----------------------------------------------------------------------------- DiffusionNFT
def test_nft_optimality_is_the_clipped_linear_map():
    adv = torch.tensor([-9.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.5])
    r = losses.nft_optimality(adv, adv_clip=5.0)
    expected = np.clip(adv.numpy() / 5.0, -1, 1) / 2 + 0.5
    np.testing.assert_allclose(r.numpy(), expected, rtol=0, atol=1e-7)
    assert r.tolist()[:2] == [0.0, 0.0] and r.tolist()[-2:] == [1.0, 1.0] and r[3].item() == 0.5  # the clip edges
    assert losses.nft_optimality(torch.tensor([1.0]), adv_clip=2.0).item() == 0.75  # the clip also sets the slope
    with pytest.raises(ValueError, match="--adv-clip"):
        losses.nft_optimality(adv, adv_clip=0.0)


@pytest.mark.parametrize("beta", [1.0, 0.1])
@pytest.mark.parametrize("adaptive", [True, False])
def test_nft_loss_matches_a_numpy_reference(beta, adaptive):
    x0, eps, sigma, x_t, v, v_old = batch()
    r = torch.tensor([0.0, 0.25, 0.5, 0.9, 1.0])
    loss, info = losses.nft_loss(v, v_old, x_t, x0, sigma, r, beta=beta, adaptive=adaptive)
    expected = np_nft(v.numpy(), v_old.numpy(), x_t.numpy(), x0.numpy(), sigma.numpy(), r.numpy(), beta, adaptive)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.mean(), rel=1e-6)
    assert info["r_mean"] == pytest.approx(r.mean().item())
    assert info["old_deviate"] == pytest.approx(((v - v_old) ** 2).mean().item(), rel=1e-5)
    # A float sigma is the same as a [B] tensor of it.
    a, _ = losses.nft_loss(v, v_old, x_t, x0, 0.4, r, beta=beta, adaptive=adaptive)
    b, _ = losses.nft_loss(v, v_old, x_t, x0, torch.full((5,), 0.4), r, beta=beta, adaptive=adaptive)
    assert a.item() == b.item()


def test_nft_adaptive_weights_carry_no_gradient_and_v_old_none():
    """With the weights w+- held constant, d l_i / d v_i = 2 t [(1 - r) (x0- - x0) / w- - r (x0+ - x0) / w+] / D
    (since d x0+ / d v = -t beta, d x0- / d v = +t beta, and the 1/beta cancels); a weight that let the
    gradient through would add a term. v_old is detached: it gets no gradient."""
    x0, eps, sigma, x_t, v, v_old = batch(1)
    r = torch.tensor([0.1, 0.5, 0.7, 1.0, 0.3])
    beta = 0.3
    v = v.clone().requires_grad_(True)
    v_old = v_old.clone().requires_grad_(True)
    loss, _ = losses.nft_loss(v, v_old, x_t, x0, sigma, r, beta=beta)
    loss.backward()
    assert v_old.grad is None
    B, D = v.shape[0], v[0].numel()
    vn, on, xn, x0n = (a.detach().double().numpy() for a in (v, v_old, x_t, x0))
    for i in range(B):
        s = sigma[i].item()
        err_p = xn[i] - s * (beta * vn[i] + (1 - beta) * on[i]) - x0n[i]
        err_m = xn[i] - s * ((1 + beta) * on[i] - beta * vn[i]) - x0n[i]
        grad = 2 * s * ((1 - r[i].item()) * err_m / np.abs(err_m).mean() - r[i].item() * err_p / np.abs(err_p).mean())
        np.testing.assert_allclose(v.grad[i].numpy(), grad / D / B, rtol=1e-4, atol=1e-9)


def test_nft_adaptive_weight_floor():
    """A sample whose x0 estimate is off by less than 1e-5 on average is divided by 1e-5, not by its own error
    (which would blow its gradient up as 1 / error); the other samples keep their own weights."""
    x0, eps, sigma, x_t, v, v_old = batch(2)
    v_old[0] = eps[0] - x0[0] + 1e-7  # x0+- - x0 = -t 1e-7 everywhere (up to float32 rounding)
    v[0] = v_old[0]
    r = torch.full((5,), 0.8)
    loss, _ = losses.nft_loss(v, v_old, x_t, x0, sigma, r, beta=1.0)
    expected = np_nft(v.numpy(), v_old.numpy(), x_t.numpy(), x0.numpy(), sigma.numpy(), r.numpy(), 1.0)
    assert loss.item() == pytest.approx(expected.mean(), rel=1e-6)
    err = x_t[0].double().numpy() - sigma[0].item() * v[0].double().numpy() - x0[0].double().numpy()
    assert 0 < np.abs(err).mean() < 1e-5  # the floor is what divides
    assert expected[0] == pytest.approx((err**2).mean() / 1e-5, rel=1e-9)  # both branches equal at v = v_old
    assert expected[0] < 0.1 * (err**2).mean() / np.abs(err).mean()  # what it would be without the floor


def test_nft_gradient_at_old_is_the_advantage_signed_flow_matching_gradient():
    """At v = v_old (theta = old), write u = eps - x0 and e = v - u. Then v+ = v- = v and x0+- - x0 = -t e, so
    w+ = w- = t mean|e| =: w, and with w held constant

        d L+ / d v = 2 t^2 e / (D w) * beta,   d L- / d v = -2 t^2 e / (D w) * beta,
        d l / d v  = (r - (1 - r)) 2 t^2 e / (D w) = (2 r - 1) 2 t e / (D mean|e|),

    with 2 r - 1 = clip(A / adv_clip, -1, 1): gradient descent on l follows the flow-matching gradient e
    (the normalised one) for A > 0 and goes against it for A < 0, with weight |A| / adv_clip, for any beta.
    Without the adaptive weight: (2 r - 1) 2 t^2 e / D."""
    x0, eps, sigma, _, _, v_old = (a.double() for a in batch(3))  # float64: x_t exactly (1 - t) x0 + t eps
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
    adv = torch.tensor([-7.0, -2.0, 0.0, 1.5, 5.0])
    r = losses.nft_optimality(adv)
    e = v_old - (eps - x0)
    D, B = v_old[0].numel(), v_old.shape[0]
    s = sigma.view(-1, 1, 1, 1)
    signed = (2 * r.double() - 1).view(-1, 1, 1, 1)
    torch.testing.assert_close(signed.flatten(), (adv.double() / 5).clamp(-1, 1))  # 2 r - 1 = clip(A / 5, -1, 1)
    for beta in (1.0, 0.1):
        for adaptive in (True, False):
            v = v_old.clone().requires_grad_(True)
            loss, _ = losses.nft_loss(v, v_old, x_t, x0, sigma, r, beta=beta, adaptive=adaptive)
            loss.backward()
            if adaptive:
                expected = signed * 2 * s * e / (D * e.abs().mean((1, 2, 3), keepdim=True)) / B
            else:
                expected = signed * 2 * s**2 * e / D / B
            torch.testing.assert_close(v.grad, expected, rtol=1e-9, atol=1e-15)
    assert v.grad[2].abs().max() < 1e-15  # A = 0: r = 1/2, positive and negative cancel


def test_nft_fm_adds_its_weight_to_every_advantage_on_policy():
    """--nft-fm c: at v = v_old the gradient of losses.nft on sample i is (clip(A_i, +-5) + c) times the normalised
    flow-matching gradient 2 t e_i / (D mean|e_i|) / B of the test above (adv_clip 5 times its (2 r - 1)): an
    offset of c on every advantage, so that the group-centred advantages (mean 0) pull the mean error down by c.
    The term it adds is logged as nft_fm: the velocity's own normalised error, t mean(e^2) / mean|e|."""
    x0, eps, sigma, _, _, v_old = (a.double() for a in batch(4))
    s = sigma.view(-1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * eps
    adv = torch.tensor([-7.0, -2.0, 0.0, 1.5, 5.0])
    e = v_old - (eps - x0)
    D, B = v_old[0].numel(), v_old.shape[0]
    unit = 2 * s * e / (D * e.abs().mean((1, 2, 3), keepdim=True)) / B
    for c in (0.0, 0.3):
        v = v_old.clone().requires_grad_(True)
        t = dict(v=v, v_old=v_old, x_t=x_t, x0=x0, sigma=sigma, adv=adv)
        value, info = losses.nft(t, nft_beta=1.0, nft_adaptive=True, adv_clip=5.0, nft_fm=c, kl_beta=0.0)
        value.backward()
        torch.testing.assert_close(v.grad, (adv.double().clamp(-5, 5) + c).view(-1, 1, 1, 1) * unit, rtol=1e-6,
                                   atol=1e-15)  # c = 0.3 in float32, as the loss value is
        assert ("nft_fm" in info) == (c > 0)
    own = (s * (e**2).mean((1, 2, 3), keepdim=True) / e.abs().mean((1, 2, 3), keepdim=True)).mean()
    torch.testing.assert_close(info["nft_fm"].double(), own, rtol=1e-6, atol=0)


def test_nft_bad_input():
    x0, eps, sigma, x_t, v, v_old = batch()
    with pytest.raises(ValueError, match="--nft-beta"):
        losses.nft_loss(v, v_old, x_t, x0, sigma, torch.ones(5), beta=0.0)
    with pytest.raises(ValueError, match="one shape"):
        losses.nft_loss(v, v_old[:, :2], x_t, x0, sigma, torch.ones(5), beta=1.0)


# ----------------------------------------------------------------------------- AWM
def np_awm(v, x0, eps, sigma, weighting, p=0.25):
    out = []
    for i in range(len(v)):
        vi, ei, xi = (np.asarray(a[i], np.float64) for a in (v, eps, x0))
        mse = ((vi - (ei - xi)) ** 2).mean()
        t = float(sigma[i])
        nll = {"uniform": mse, "t": t * mse, "t2": t * t * mse, "huber": t * (np.sqrt(mse + 1e-10) - 1e-5),
               "ghuber": t / p * ((mse + 1e-10) ** p - 1e-10**p)}[weighting]
        out.append(-nll)
    return np.array(out)


@pytest.mark.parametrize("weighting", losses.AWM_WEIGHTINGS)
def test_awm_log_prob_matches_a_numpy_reference(weighting):
    x0, eps, sigma, x_t, v, _ = batch(4)
    lp = losses.awm_log_prob(v, x0, eps, sigma, weighting=weighting, p=0.25)
    assert lp.shape == (5,) and lp.dtype == torch.float64
    np.testing.assert_allclose(lp.numpy(), np_awm(v.numpy(), x0.numpy(), eps.numpy(), sigma.numpy(), weighting),
                               rtol=1e-12)
    # At the exact target every weighting is 0 (the offsets cancel), with a finite gradient.
    x0, eps = x0.double(), eps.double()
    exact = (eps - x0).requires_grad_(True)
    lp0 = losses.awm_log_prob(exact, x0, eps, 0.5, weighting=weighting)
    assert lp0.abs().max().item() < 1e-12
    lp0.sum().backward()
    assert torch.isfinite(exact.grad).all()


def test_awm_ghuber_power_and_bad_input():
    x0, eps, sigma, x_t, v, _ = batch(5)
    lp = losses.awm_log_prob(v, x0, eps, sigma, weighting="ghuber", p=0.5)
    np.testing.assert_allclose(lp.numpy(), np_awm(v.numpy(), x0.numpy(), eps.numpy(), sigma.numpy(), "ghuber", 0.5),
                               rtol=1e-12)
    with pytest.raises(ValueError, match="--awm-weighting"):
        losses.awm_log_prob(v, x0, eps, sigma, weighting="Uniform")
    with pytest.raises(ValueError, match="one shape"):
        losses.awm_log_prob(v, x0[:2], eps, sigma)


def test_awm_loss_matches_a_hand_written_loop_with_clip_range_one():
    ratio = torch.tensor([2.5, 2.5, 0.5, 1.3, 0.2, 1.0])
    adv = torch.tensor([1.0, -1.0, 8.0, -2.0, -4.0, 3.0])
    old = torch.randn(6, dtype=torch.float64)
    lp = (old + ratio.double().log()).requires_grad_(True)
    loss, info = losses.awm_loss(lp, old, adv)
    terms, const = [], []
    for r, a in zip(ratio.tolist(), adv.tolist()):
        a = max(-5.0, min(5.0, a)) / 5.0
        rc = min(max(r, 0.0), 2.0)
        terms.append(max(-a * r, -a * rc))
        const.append(-a * rc > -a * r)
    assert loss.item() == pytest.approx(sum(terms) / 6, rel=1e-6)
    assert const == [True, False, False, False, False, False]  # only r = 2.5 with A > 0 leaves [0, 2] the wrong way
    loss.backward()
    for i in range(6):
        a = max(-5.0, min(5.0, adv[i].item())) / 5.0
        assert lp.grad[i].item() == pytest.approx(0.0 if const[i] else -a * ratio[i].item() / 6, rel=1e-6, abs=1e-12)
    assert info["clipfrac"] == pytest.approx(2 / 6)


def test_awm_on_policy_gradient_is_the_advantage_weighted_matching_gradient():
    """On-policy (old = log_prob detached) the ratio is 1 and d loss / d v_i = (A_i / 5) d w(mse_i) / d v_i / B,
    with w = -log_prob; for ghuber d w / d v = t (mse + 1e-10)^(p - 1) 2 (v - u) / D: good samples descend their
    flow-matching error, bad ones ascend it."""
    x0, eps, sigma, x_t, v, _ = batch(6)
    adv = torch.tensor([3.0, -1.0, 0.0, 6.0, -5.0])
    v = v.clone().requires_grad_(True)
    lp = losses.awm_log_prob(v, x0, eps, sigma)
    loss, info = losses.awm_loss(lp, lp.detach(), adv)
    assert info["ratio_mean"] == 1 and info["clipfrac"] == 0
    assert loss.item() == pytest.approx(-(adv.clamp(-5, 5) / 5).mean().item(), rel=1e-6)
    loss.backward()
    e = v.detach().double() - (eps - x0).double()
    D, B = e[0].numel(), e.shape[0]
    mse = (e**2).mean((1, 2, 3), keepdim=True)
    t = sigma.double().view(-1, 1, 1, 1)
    expected = (adv.clamp(-5, 5) / 5).double().view(-1, 1, 1, 1) * t * (mse + 1e-10) ** -0.75 * 2 * e / D / B
    torch.testing.assert_close(v.grad.double(), expected, rtol=1e-5, atol=1e-12)


def test_awm_loss_shares_the_grpo_clip():
    """The same clipped surrogate as grpo_loss, once the advantages are scaled by 1 / adv_clip."""
    g = torch.Generator().manual_seed(7)
    lp, old = torch.randn(8, generator=g) * 0.5, torch.randn(8, generator=g) * 0.5
    adv = torch.randn(8, generator=g) * 4
    awm, _ = losses.awm_loss(lp, old, adv, clip_range=0.3, adv_clip=2.0)
    grpo, _ = losses.grpo_loss(lp, old, adv.clamp(-2, 2) / 2, clip_range=0.3)
    assert awm.item() == pytest.approx(grpo.item(), rel=1e-6)


# ----------------------------------------------------------------------------- velocity-space KL
def test_velocity_kl_is_the_mean_squared_velocity_difference():
    g = torch.Generator().manual_seed(8)
    v, v_ref = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    kl, info = losses.velocity_kl(v, v_ref)
    per = [((v[i].double().numpy() - v_ref[i].double().numpy()) ** 2).mean() for i in range(4)]
    assert kl.item() == pytest.approx(np.mean(per), rel=1e-6)
    assert info["kl_max"] == pytest.approx(max(per), rel=1e-6)
