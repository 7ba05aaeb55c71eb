"""The few-step distillation losses (DMD2, TDM, TDM-R1, DMDR, on-policy distillation) against independent references
(hand transcriptions of the authors' lines in float64, the Gaussian closed forms of the scores and of the KL whose
gradient distribution matching follows, Monte Carlo, the existing dgpo_loss and kl_penalty), and each on a toy where
it must reach a known optimum: Gaussian generators distilled from a Gaussian teacher with exact scores reach the
teacher's mean and std; a critic trained by its loss reaches the generator's; on-policy distillation reaches its
teacher's transition, and the average of two teachers when one student without the prompt field serves both."""

import math

import pytest
import torch

import advantages
import losses

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- Gaussian closed forms
def gaussian_x0(x_t, t, mean, std):
    """E[x0 | x_t] for x0 ~ N(mean, std^2) per dim and x_t = (1 - t) x0 + t eps: Tweedie's estimate
    (x_t + t^2 grad log p_t(x_t)) / (1 - t), p_t = N((1 - t) mean, (1 - t)^2 std^2 + t^2)."""
    t = torch.as_tensor(t, dtype=x_t.dtype).reshape(-1, *([1] * (x_t.ndim - 1)))
    var = (1 - t) ** 2 * std**2 + t**2
    score = -(x_t - (1 - t) * mean) / var
    return (x_t + t**2 * score) / (1 - t)


def gaussian_kl(m_p, s_p, m_q, s_q):
    """KL(N(m_p, s_p^2) || N(m_q, s_q^2)), elementwise."""
    return torch.log(s_q / s_p) + (s_p**2 + (m_p - m_q) ** 2) / (2 * s_q**2) - 0.5


# ----------------------------------------------------------------------------- DMD2
def test_dmd2_generator_loss_is_dmd2s_lines_and_its_gradient_is_the_normalised_score_gap():
    g = torch.Generator().manual_seed(0)
    x0, x0_real, x0_fake = (torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64) for _ in range(3))
    x0.requires_grad_(True)
    loss, info = losses.dmd2_generator_loss(x0, x0_real, x0_fake)
    # tianweiy/DMD2 main/sd_guidance.py L235-241, transcribed
    p_real, p_fake = x0.detach() - x0_real, x0.detach() - x0_fake
    grad = (p_real - p_fake) / p_real.abs().mean(dim=[1, 2, 3], keepdim=True)
    expected = 0.5 * torch.nn.functional.mse_loss(x0.detach(), x0.detach() - grad)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(x0.grad, (grad / x0.numel()).float().double(), rtol=1e-5, atol=1e-9)
    assert info["dmd_weight"].item() == pytest.approx(p_real.abs().mean(dim=[1, 2, 3]).mean().item(), rel=1e-6)
    assert not info["dmd_grad_rms"].requires_grad


def test_dmd2_generator_gradient_follows_the_kl_between_gaussian_marginals():
    """On a Gaussian generator x = m + s z against a Gaussian teacher, with both scores exact, the expected gradient
    of the surrogate on (m, s) at a fixed t is t^2 / ((1 - t)^2 w) times the gradient of KL(p_gen,t || p_real,t),
    both marginals Gaussian in closed form (w concentrates at its mean in many dims)."""
    torch.manual_seed(0)
    dims, n, t = 256, 4096, 0.4
    m_r, s_r = 0.5, 0.8
    m = torch.tensor(-0.3, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(1.4, dtype=torch.float64, requires_grad=True)
    x0 = m + s * torch.randn(n, dims, dtype=torch.float64)
    x_t = (1 - t) * x0.detach() + t * torch.randn(n, dims, dtype=torch.float64)
    real, fake = gaussian_x0(x_t, t, m_r, s_r), gaussian_x0(x_t, t, m.detach(), s.detach())
    loss, info = losses.dmd2_generator_loss(x0, real, fake)
    got = torch.autograd.grad(loss, (m, s))
    mk, sk = m.detach().requires_grad_(True), s.detach().requires_grad_(True)
    var_g, var_r = (1 - t) ** 2 * sk**2 + t**2, (1 - t) ** 2 * s_r**2 + t**2
    kl = gaussian_kl((1 - t) * mk, var_g.sqrt(), (1 - t) * torch.tensor(m_r), torch.tensor(var_r).sqrt())
    expected = torch.autograd.grad(kl, (mk, sk))
    scale = t**2 / ((1 - t) ** 2 * info["dmd_weight"].item())  # the loss is a mean over dims: D KLs over D
    for a, b in zip(got, expected):
        assert a.item() == pytest.approx(scale * b.item(), rel=0.02)


def test_dmd2_critic_loss_is_the_flow_matching_error_and_leaves_the_generator_alone():
    g = torch.Generator().manual_seed(1)
    v, x0, noise = (torch.randn(4, 3, 2, generator=g) for _ in range(3))
    x0.requires_grad_(True)
    v.requires_grad_(True)
    loss, info = losses.dmd2_critic_loss(v, x0, noise)
    assert loss.item() == pytest.approx(((v - (noise - x0)) ** 2).mean().item(), rel=1e-6)
    loss.backward()
    assert x0.grad is None and v.grad.abs().sum() > 0
    assert info["critic_loss"].item() == pytest.approx(loss.item())
    # the clean estimate of the exact velocity eps - x0 at x_t is x0 itself
    t = torch.tensor([0.1, 0.4, 0.7, 0.95])
    x_t = (1 - t.view(-1, 1, 1)) * x0.detach() + t.view(-1, 1, 1) * noise
    torch.testing.assert_close(losses.x0_from_velocity(x_t, noise - x0.detach(), t), x0.detach())


def test_dmd2_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="x0_fake must have x0's shape"):
        losses.dmd2_generator_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4))


class GaussianScore(torch.nn.Module):
    """The exact velocity field of N(mean, std^2) per dim under x_t = (1 - t) x0 + t eps, with learnable mean and
    log std: a critic whose family holds the generator's distribution."""

    def __init__(self, mean, std):
        super().__init__()
        self.mean = torch.nn.Parameter(torch.as_tensor(mean, dtype=torch.float32).clone())
        self.log_std = torch.nn.Parameter(torch.as_tensor(std, dtype=torch.float32).log())

    def x0(self, x_t, t):
        return gaussian_x0(x_t, t, self.mean, self.log_std.exp())

    def forward(self, x_t, t):  # velocity = (x_t - x0_hat) / t
        t = torch.as_tensor(t, dtype=x_t.dtype).reshape(-1, 1)
        return (x_t - self.x0(x_t, t)) / t


TEACHER_MEAN, TEACHER_STD = torch.tensor([1.5, -0.5]), torch.tensor([0.5, 2.0])


def test_dmd2_critic_trained_by_its_loss_reaches_the_generators_distribution():
    torch.manual_seed(0)
    gen_mean, gen_std = torch.tensor([0.7, -1.2]), torch.tensor([1.3, 0.6])
    critic = GaussianScore([0.0, 0.0], [1.0, 1.0])
    opt = torch.optim.Adam(critic.parameters(), lr=0.03)
    for _ in range(300):
        x0 = gen_mean + gen_std * torch.randn(256, 2)
        noise, t = torch.randn(256, 2), torch.rand(256, 1) * 0.96 + 0.02
        loss, _ = losses.dmd2_critic_loss(critic((1 - t) * x0 + t * noise, t), x0, noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(critic.mean.detach(), gen_mean, atol=0.05, rtol=0)
    torch.testing.assert_close(critic.log_std.exp().detach(), gen_std, atol=0.05, rtol=0)


@pytest.mark.parametrize("critic_kind", ["exact", "trained"])
def test_dmd2_distils_a_gaussian_generator_to_the_teacher(critic_kind):
    """x = m + s z distilled by dmd2_generator_loss from the teacher's exact clean estimate (CFG-free), against the
    exact fake score of the current generator, or a critic trained by dmd2_critic_loss five times per generator step
    (DMD2's two time-scale rule, dfake_gen_update_ratio 5): it reaches the teacher's mean and std."""
    torch.manual_seed(0)
    m = torch.nn.Parameter(torch.zeros(2))
    log_s = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([m, log_s], lr=0.03)
    critic = GaussianScore(m.detach(), log_s.detach().exp())
    critic_opt = torch.optim.Adam(critic.parameters(), lr=0.03)
    for _ in range(250):
        if critic_kind == "trained":
            for _ in range(5):
                x0 = (m + log_s.exp() * torch.randn(128, 2)).detach()
                noise, t = torch.randn(128, 2), torch.rand(128, 1)
                loss, _ = losses.dmd2_critic_loss(critic((1 - t) * x0 + t * noise, t), x0, noise)
                critic_opt.zero_grad()
                loss.backward()
                critic_opt.step()
        x0 = m + log_s.exp() * torch.randn(256, 2)
        t = torch.rand(256, 1) * 0.96 + 0.02
        x_t = (1 - t) * x0.detach() + t * torch.randn(256, 2)
        with torch.no_grad():
            fake = critic.x0(x_t, t) if critic_kind == "trained" else gaussian_x0(x_t, t, m, log_s.exp())
        loss, _ = losses.dmd2_generator_loss(x0, gaussian_x0(x_t, t, TEACHER_MEAN, TEACHER_STD), fake)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(m.detach(), TEACHER_MEAN, atol=0.1, rtol=0)
    torch.testing.assert_close(log_s.exp().detach(), TEACHER_STD, atol=0.1, rtol=0)


# ----------------------------------------------------------------------------- TDM
def test_tdm_renoise_is_the_forward_transition_from_the_trajectory_point():
    torch.manual_seed(0)
    n, s_mid, t = 50_000, 0.3, 0.7
    x0, noise_mid, fresh = torch.full((n, 1), 0.8), torch.randn(n, 1), torch.randn(n, 1)
    x_t, mixed, w = losses.tdm_renoise(x0, noise_mid, fresh, s_mid, t)
    torch.testing.assert_close(x_t, (1 - t) * x0 + t * mixed)
    # TDM train_tdm_demo.py L1036-1045 in flow form: x_mid scaled by (1 - t) / (1 - s_mid), plus the missing variance
    x_mid = (1 - s_mid) * x0 + s_mid * noise_mid
    r = (1 - t) / (1 - s_mid)
    torch.testing.assert_close(x_t, r * x_mid + math.sqrt(t**2 - (r * s_mid) ** 2) * fresh)
    # ... so that given x0 it is the forward process's marginal at t: mean (1 - t) x0, std t
    assert x_t.mean().item() == pytest.approx((1 - t) * 0.8, abs=0.01)
    assert x_t.std().item() == pytest.approx(t, rel=0.01)
    by_hand = torch.exp(-0.5 * mixed[:, 0].double() ** 2 + 0.5 * fresh[:, 0].double() ** 2)  # L1129 (D = 1)
    torch.testing.assert_close(w.double(), by_hand.clamp(1 / 20, 20), rtol=1e-5, atol=0)
    _, _, w = losses.tdm_renoise(x0, noise_mid, fresh, s_mid, t, importance_clip=2.0)
    torch.testing.assert_close(w.double(), by_hand.clamp(0.5, 2.0), rtol=1e-5, atol=0)
    assert w.max().item() == pytest.approx(2.0) and w.min().item() == pytest.approx(0.5)  # the clip engaged
    # a one-step stage (s_mid = 0): the fresh noise itself, weight 1
    x_t, mixed, w = losses.tdm_renoise(x0[:5], noise_mid[:5], fresh[:5], 0.0, t)
    torch.testing.assert_close(mixed, fresh[:5])
    assert w.eq(1).all()
    with pytest.raises(ValueError, match="0 <= sigma_mid < sigma < 1"):
        losses.tdm_renoise(x0[:2], noise_mid[:2], fresh[:2], 0.7, 0.3)


def test_tdm_critic_loss_is_tdms_min_snr_importance_weighted_x0_error():
    g = torch.Generator().manual_seed(2)
    x0_fake, x0 = torch.randn(4, 3, 2, generator=g), torch.randn(4, 3, 2, generator=g)
    sigma, importance = torch.tensor([0.1, 0.3, 0.6, 0.9]), torch.tensor([0.5, 1.0, 2.0, 1.5])
    loss, _ = losses.tdm_critic_loss(x0_fake, x0, sigma, importance)
    # train_tdm_demo.py L1130-1134: per-sample mean error x min(snr, 5) x is_weight, then the batch mean
    snr = ((1 - sigma) / sigma) ** 2
    expected = sum(min(snr[i].item(), 5.0) * importance[i].item() * ((x0_fake[i] - x0[i]) ** 2).mean().item()
                   for i in range(4)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert min(snr[0].item(), 5.0) == 5.0  # the min-SNR cap engaged at sigma 0.1


@pytest.mark.parametrize("huber", [True, False])
def test_tdm_loss_is_tdms_lines(huber):
    """train_tdm_demo.py L1174-1187 transcribed in float64: the target is the generator's x0 moved by the teacher's
    guided estimate against the fake's, with the teacher's guidance written out (cond + (cfg - 1)(cond - uncond))."""
    g = torch.Generator().manual_seed(3)
    model_latents, sd, sd_uncond, fake = (torch.randn(3, 4, 4, 4, generator=g, dtype=torch.float64) for _ in range(4))
    model_latents.requires_grad_(True)
    cfg, c = 4.5, 1e-3
    coop = model_latents.detach() + (sd - fake) + (cfg - 1) * (sd - sd_uncond)
    sd_cfg = sd + (cfg - 1) * (sd - sd_uncond)
    weighting = (model_latents.detach() - sd_cfg).abs().mean(dim=[1, 2, 3], keepdim=True)
    if huber:
        expected = torch.mean((torch.sqrt((model_latents - coop) ** 2 + c**2) - c) / weighting)
    else:
        expected = (torch.nn.functional.mse_loss(model_latents, coop, reduction="none") / weighting).mean()
    loss, _ = losses.tdm_loss(model_latents, sd_cfg, fake, huber_c=c if huber else None)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    got = torch.autograd.grad(loss, model_latents)[0]
    torch.testing.assert_close(got, torch.autograd.grad(expected, model_latents)[0].float().double(), rtol=1e-5,
                               atol=1e-12)
    if not huber:  # twice DMD2's gradient: the same direction and normaliser, d^2 against d^2 / 2
        x = model_latents.detach().requires_grad_(True)
        dmd, _ = losses.dmd2_generator_loss(x, sd_cfg, fake)
        torch.testing.assert_close(got, 2 * torch.autograd.grad(dmd, x)[0], rtol=1e-5, atol=1e-12)


def tweedie_x0(x_t, t, mean_t, var_t):
    """E[x0 | x_t] when x_t ~ N(mean_t, var_t) per dim at time t: (x_t + t^2 grad log p_t) / (1 - t)."""
    return (x_t - t**2 * (x_t - mean_t) / var_t) / (1 - t)


def test_tdm_distils_a_two_step_generator_to_the_teacher_stage_by_stage():
    """A two-step generator (sigmas 1 -> 0.5 -> 0), each stage's clean prediction affine in its input, trained by
    tdm_loss at every stage on tdm_renoise's points against the teacher's exact clean estimate and the exact fake
    score of those points (their Gaussian marginal, propagated through the stages in closed form): the trajectory
    point after stage 1 reaches the teacher's marginal at sigma 0.5, and the samples the teacher's mean and std."""
    torch.manual_seed(0)
    sigmas = [1.0, 0.5, 0.0]
    a = torch.nn.Parameter(torch.full((2, 2), 0.3))  # [stage, dim]
    c = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.Adam([a, c], lr=0.02)

    def stage_map(k):  # x_{k+1} = A x_k + C and its clean prediction
        s, s_next = sigmas[k], sigmas[k + 1]
        slope = (1 - s_next) - s_next * (1 - s) / s  # of x_{k+1} in x0_k, with x_k fixed
        return slope * a[k] + s_next / s, slope * c[k]

    def moments():  # mean and variance of x_0 .. x_2 per dim, in closed form
        mean, var, out = torch.zeros(2), torch.ones(2), [(torch.zeros(2), torch.ones(2))]
        for k in range(2):
            big_a, big_c = stage_map(k)
            mean, var = big_a * mean + big_c, big_a**2 * var
            out.append((mean, var))
        return out

    for _ in range(500):
        with torch.no_grad():
            m = moments()
            x, traj = torch.randn(512, 2), []
            for k in range(2):  # the rollout, stored as TDM stores it (noisy_imgs_list)
                x0_k = a[k] * x + c[k]
                eps_hat = (x - (1 - sigmas[k]) * x0_k) / sigmas[k]
                traj.append((x, eps_hat))
                x = (1 - sigmas[k + 1]) * x0_k + sigmas[k + 1] * eps_hat
        total = 0.0
        for k in range(2):
            x_k, eps_hat = traj[k]
            x0_k = a[k] * x_k + c[k]  # the live clean prediction of stage k
            s_mid = sigmas[k + 1]
            t = s_mid + 0.02 + torch.rand(512, 1) * (sigmas[k] - s_mid - 0.04)  # TDM's use_separate interval
            x_t, _, _ = losses.tdm_renoise(x0_k.detach(), eps_hat, torch.randn(512, 2), s_mid, t)
            r = (1 - t) / (1 - s_mid)
            mean_mid, var_mid = m[k + 1]
            fake = tweedie_x0(x_t, t, r * mean_mid, r**2 * var_mid + t**2 - (r * s_mid) ** 2)
            real = gaussian_x0(x_t, t, TEACHER_MEAN, TEACHER_STD)
            loss, _ = losses.tdm_loss(x0_k, real, fake)
            total = total + loss
        opt.zero_grad()
        total.backward()
        opt.step()
    with torch.no_grad():
        m = moments()
    torch.testing.assert_close(m[1][0], 0.5 * TEACHER_MEAN, atol=0.05, rtol=0)  # the teacher's marginal at 0.5
    torch.testing.assert_close(m[1][1], 0.25 * TEACHER_STD**2 + 0.25, atol=0.05, rtol=0.05)
    torch.testing.assert_close(m[2][0], TEACHER_MEAN, atol=0.1, rtol=0)
    torch.testing.assert_close(m[2][1].sqrt(), TEACHER_STD, atol=0.1, rtol=0)


# ----------------------------------------------------------------------------- TDM-R1
def flow_factory_revised(x0, correction, reference, huber_c):
    """Flow-Factory distribution_matching.py revised_x0_loss, transcribed in float64 (one latent component)."""
    normaliser = (x0.detach() - reference).abs().mean(dim=[1, 2]).clamp_min(1e-6)
    delta = x0 - (x0.detach() + correction).detach()
    residual = 0.5 * delta**2 if huber_c is None else torch.sqrt(delta**2 + huber_c**2) - huber_c
    return (residual.mean(dim=[1, 2]) / normaliser).mean()


@pytest.mark.parametrize("huber_c", [None, 1e-3])
def test_tdm_r1_loss_is_flow_factorys_three_terms(huber_c):
    """tdm_r1.py _generator_boundary_loss: the TDM term, the guidance reward (cond - uncond) = (guided - cond) /
    (s - 1) scaled by cfg_reward_scale, and the surrogate's direction against the reference, mixed by tdm_weight."""
    g = torch.Generator().manual_seed(4)
    x0, real, fake, cond, sur = (torch.randn(3, 4, 5, generator=g, dtype=torch.float64) for _ in range(5))
    x0.requires_grad_(True)
    s, k, w = 4.5, 3.5, 0.3
    terms = [flow_factory_revised(x0, real - fake, real, huber_c),
             flow_factory_revised(x0, k / (s - 1) * (real - cond), real, huber_c),
             flow_factory_revised(x0, sur - real, sur, huber_c)]
    expected = terms[0] + w * terms[1] + (1 - w) * terms[2]
    loss, info = losses.tdm_r1_loss(x0, real, fake, sur, cond, tdm_weight=w, guidance_scale=s, cfg_reward_scale=k,
                                huber_c=huber_c)
    factor = 2.0 if huber_c is None else 1.0  # d^2 (TDM's code) against Flow-Factory's d^2 / 2: departure 22
    assert loss.item() == pytest.approx(factor * expected.item(), rel=1e-6)
    assert info["cfg_reward_loss"].item() == pytest.approx(factor * terms[1].item(), rel=1e-6)
    got = torch.autograd.grad(loss, x0)[0]
    torch.testing.assert_close(got, factor * torch.autograd.grad(expected, x0)[0], rtol=1e-5, atol=1e-12)
    # without guidance (s = 1) the guidance reward does not exist, and the unguided estimate is not needed
    loss, info = losses.tdm_r1_loss(x0, real, fake, sur, tdm_weight=w, huber_c=huber_c)
    assert loss.item() == pytest.approx(factor * (terms[0] + (1 - w) * terms[2]).item(), rel=1e-6)
    with pytest.raises(ValueError, match="needs x0_cond"):
        losses.tdm_r1_loss(x0, real, fake, sur, guidance_scale=4.5)


def test_tdm_r1_surrogate_loss_is_dgpos_preference_with_its_trust_region():
    """Without the reference penalty and the runaway clip, the surrogate's loss is DGPO's group preference with its
    clip against the old copy (losses.dgpo_loss, transcribed from Flow-Factory's dgpo.py): value and gradient."""
    g = torch.Generator().manual_seed(5)
    b = 8
    x0, noise = torch.randn(b, 3, 4, generator=g), torch.randn(b, 3, 4, generator=g)
    v = (noise - x0 + 0.5 * torch.randn(b, 3, 4, generator=g)).requires_grad_(True)
    v_ref = noise - x0 + 0.5 * torch.randn(b, 3, 4, generator=g)
    v_old = v.detach() + 0.3 * torch.randn(b, 3, 4, generator=g)
    adv = torch.tensor([1.2, -0.4, -0.8, 0.0, 0.9, 0.3, -1.5, 0.3])
    unit = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    expected, info_dgpo = losses.dgpo_loss(v, v_ref, x0, noise, adv, unit, beta=1.0, group_size=4, v_old=v_old,
                                           clip_range=0.05)
    err = losses.flow_matching_error(v, x0, noise)
    loss, info = losses.tdm_r1_surrogate_loss(err, losses.flow_matching_error(v_ref, x0, noise), adv, unit, beta=1.0,
                                          group_size=4, slow_err=losses.flow_matching_error(v_old, x0, noise),
                                          clip_range=0.05, reference_beta=0.0, reference_threshold=math.inf)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert info["clipfrac"].item() == pytest.approx(info_dgpo["clipfrac"].item())
    assert 0 < info["clipfrac"].item() < 1  # the trust region held some samples and not others
    got = torch.autograd.grad(loss, v)[0]
    torch.testing.assert_close(got, torch.autograd.grad(expected, v)[0], rtol=1e-4, atol=1e-9)


def test_tdm_r1_surrogate_loss_runaway_clip_penalty_and_time_weight_by_hand():
    err = torch.tensor([0.20, 0.50, 0.90, 0.40], requires_grad=True)
    ref = torch.tensor([0.60, 0.45, 0.30, 0.40])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    unit = torch.tensor([0, 0, 1, 1])
    loss, info = losses.tdm_r1_surrogate_loss(err, ref, adv, unit, beta=2.0, group_size=2, reference_beta=0.1,
                                          reference_threshold=0.1, time_weight=0.5)
    # sample 0 (A > 0, err below the reference by 0.4: 0.16 > 0.1) and sample 2 (A < 0, above by 0.6) ran away
    assert info["runaway_fraction"].item() == 0.5
    s = [2.0 * (1.0 * -0.4 + 1.0 * 0.05) / 2, 2.0 * (-1.0 * 0.6 + -1.0 * 0.0) / 2]
    sig = [1 / (1 + math.exp(-x)) for x in s]
    penalty = (0.16 + 0.0025 + 0.36 + 0.0) / 4
    expected = 0.5 * ((sig[0] * 0.2 + sig[0] * 0.5 - sig[1] * 0.9 - sig[1] * 0.4) / 4 + 0.1 * penalty)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    # gradient: the preference only through samples 1 and 3, the penalty through all
    pen_grad = [0.5 * 0.1 * 2 * d / 4 for d in (-0.4, 0.05, 0.6, 0.0)]
    pref_grad = [0.0, 0.5 * sig[0] / 4, 0.0, -0.5 * sig[1] / 4]
    torch.testing.assert_close(err.grad, torch.tensor([p + q for p, q in zip(pen_grad, pref_grad)]), rtol=1e-5,
                               atol=1e-7)


def test_tdm_r1_moves_a_one_step_generator_towards_a_non_differentiable_reward():
    """A one-step Gaussian generator distilled from N(0, I) (exact scores), with TDM-R1's surrogate (a Gaussian score
    initialised at the teacher, the frozen reference) trained on the group advantages of the reward 1[x_0 > 0.5]:
    the rewarded fraction rises from the teacher's 0.31, as far as the surrogate may leave the reference (its
    runaway threshold: ten times the threshold, further), while the dimension the reward ignores stays the
    teacher's; with the advantages negated it falls."""
    def run(sign, threshold):
        torch.manual_seed(0)
        m, log_s = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.Adam([m, log_s], lr=0.02)
        surrogate = GaussianScore([0.0, 0.0], [1.0, 1.0])
        sur_opt = torch.optim.Adam(surrogate.parameters(), lr=0.02)
        group_ids = torch.arange(256) // 16
        for _ in range(100):
            x0 = m + log_s.exp() * torch.randn(256, 2)
            adv = sign * advantages.group_advantages((x0[:, 0] > 0.5).float(), group_ids)
            boundary, noise, t = x0.detach(), torch.randn(256, 2), torch.rand(256, 1) * 0.96 + 0.02
            x_t = (1 - t) * boundary + t * noise
            err = losses.flow_matching_error(surrogate(x_t, t).unsqueeze(1), boundary.unsqueeze(1), noise.unsqueeze(1))
            with torch.no_grad():  # the frozen reference: the teacher's velocity
                v_ref = (x_t - gaussian_x0(x_t, t, torch.zeros(2), torch.ones(2))) / t
            ref_err = losses.flow_matching_error(v_ref.unsqueeze(1), boundary.unsqueeze(1), noise.unsqueeze(1))
            loss, _ = losses.tdm_r1_surrogate_loss(err, ref_err, adv, group_ids, group_size=16,
                                               reference_threshold=threshold)
            sur_opt.zero_grad()
            loss.backward()
            sur_opt.step()
            t = torch.rand(256, 1) * 0.96 + 0.02
            x_t = (1 - t) * x0.detach() + t * torch.randn(256, 2)
            with torch.no_grad():
                real = gaussian_x0(x_t, t, torch.zeros(2), torch.ones(2))
                fake = gaussian_x0(x_t, t, m, log_s.exp())
                sur = surrogate.x0(x_t, t)
            loss, _ = losses.tdm_r1_loss(x0, real, fake, sur)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            x = m + log_s.exp() * torch.randn(4096, 2)
        return (x[:, 0] > 0.5).float().mean().item(), m.detach(), log_s.exp().detach()

    rewarded, mean, std = run(1.0, 0.05)  # Flow-Factory's threshold
    assert rewarded > 0.36, rewarded
    assert abs(mean[1].item()) < 0.1 and abs(std[1].item() - 1) < 0.15, (mean, std)
    further, _, _ = run(1.0, 0.5)
    assert further > rewarded + 0.1, (further, rewarded)
    rewarded, _, _ = run(-1.0, 0.05)
    assert rewarded < 0.26, rewarded


# ----------------------------------------------------------------------------- DMDR
def test_dmdr_loss_is_dmd_plus_the_weighted_reward_loss():
    """vvvvvjdy/dmdr train_sitxl_refl_deepspeed.py L553-566: the DMD term (its normaliser + 1e-8) plus
    dino_loss_weight x the reward's loss of the same x0; before the cold start, the DMD term alone."""
    g = torch.Generator().manual_seed(6)
    x0, x0_r, x0_f = (torch.randn(3, 4, 2, 2, generator=g, dtype=torch.float64) for _ in range(3))
    x0.requires_grad_(True)
    reward_loss = ((x0 - 1.0) ** 2).mean(dim=[1, 2, 3])  # a differentiable reward's loss, per sample
    loss, info = losses.dmdr_loss(x0, x0_r, x0_f, reward_loss, reward_weight=0.05)
    p_real, p_fake = x0.detach() - x0_r, x0.detach() - x0_f
    grad = (p_real - p_fake) / (p_real.abs().mean(dim=[1, 2, 3], keepdim=True) + 1e-8)
    dmd = 0.5 * torch.nn.functional.mse_loss(x0, (x0.detach() - grad).detach())
    expected = dmd + 0.05 * reward_loss.mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert info["dmd_loss"].item() == pytest.approx(dmd.item(), rel=1e-6)
    got = torch.autograd.grad(loss, x0, retain_graph=True)[0]
    torch.testing.assert_close(got, torch.autograd.grad(expected, x0, retain_graph=True)[0].float().double(),
                               rtol=1e-5, atol=1e-10)
    cold, info = losses.dmdr_loss(x0, x0_r, x0_f, None)
    assert cold.item() == pytest.approx(dmd.item(), rel=1e-6) and "reward_loss" not in info
    with pytest.raises(ValueError, match="reward_loss must be"):
        losses.dmdr_loss(x0, x0_r, x0_f, reward_loss[:2])


def test_dmdr_trades_distribution_matching_against_the_reward():
    """A Gaussian generator distilled from N(0, I) with exact scores and the reward loss mean (x - (2, 0))^2: at
    weight 0 it is DMD and reaches the teacher; with the reward it moves towards x_0 = 2 in the rewarded dimension
    only, to a mean between the teacher's and the reward's, and a larger weight moves it further."""
    def run(weight):
        torch.manual_seed(0)
        m, log_s = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.Adam([m, log_s], lr=0.03)
        goal = torch.tensor([2.0, 0.0])
        for _ in range(200):
            x0 = m + log_s.exp() * torch.randn(256, 2)
            t = torch.rand(256, 1) * 0.96 + 0.02
            x_t = (1 - t) * x0.detach() + t * torch.randn(256, 2)
            with torch.no_grad():
                real = gaussian_x0(x_t, t, torch.zeros(2), torch.ones(2))
                fake = gaussian_x0(x_t, t, m, log_s.exp())
            reward_loss = ((x0 - goal) ** 2).mean(dim=1) if weight > 0 else None
            loss, _ = losses.dmdr_loss(x0, real, fake, reward_loss, reward_weight=weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return m.detach(), log_s.exp().detach()

    mean, std = run(0.0)
    torch.testing.assert_close(mean, torch.zeros(2), atol=0.1, rtol=0)
    torch.testing.assert_close(std, torch.ones(2), atol=0.1, rtol=0)
    low, _ = run(0.05)
    high, _ = run(0.5)
    assert 0.1 < low[0].item() < high[0].item() < 2.0, (low, high)
    assert abs(low[1].item()) < 0.1 and abs(high[1].item()) < 0.1


# ----------------------------------------------------------------------------- on-policy distillation
def test_opd_loss_is_half_the_mean_squared_gap_over_the_transition_variance():
    g = torch.Generator().manual_seed(7)
    mean = torch.randn(4, 3, 2, generator=g, requires_grad=True)
    teacher = torch.randn(4, 3, 2, generator=g)
    std = torch.tensor([0.1, 0.2, 0.3, 0.4])
    loss, info = losses.opd_loss(mean, teacher, std**2)
    by_hand = [0.5 * ((mean[i] - teacher[i]) ** 2).mean().item() / std[i].item() ** 2 for i in range(4)]
    assert loss.item() == pytest.approx(sum(by_hand) / 4, rel=1e-6)
    assert info["kl_max"].item() == pytest.approx(max(by_hand), rel=1e-6)
    # the exact Gaussian KL of the step, as kl_penalty computes it against the base model
    kl, _ = losses.kl_penalty(mean, teacher, std)
    assert loss.item() == pytest.approx(kl.item(), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(mean.grad, (mean - teacher).detach() / (6 * 4 * std.view(-1, 1, 1) ** 2))
    ode, _ = losses.opd_loss(mean, teacher, 1.0)  # ODE rollouts: mean matching
    assert ode.item() == pytest.approx(0.5 * ((mean - teacher) ** 2).mean().item(), rel=1e-6)
    with pytest.raises(ValueError, match="positive transition variance"):
        losses.opd_loss(mean, teacher, torch.tensor([1.0, 0.0, 1.0, 1.0]))


def test_opd_loss_matches_each_sample_to_its_own_teacher():
    g = torch.Generator().manual_seed(8)
    mean = torch.randn(5, 2, 3, generator=g)
    teachers = torch.randn(3, 5, 2, 3, generator=g)  # [K, B, ...]
    index = torch.tensor([2, 0, 2, 1, 0])
    loss, info = losses.opd_loss(mean, teachers, 0.5, teacher=index)
    per_sample = [0.5 * ((mean[i] - teachers[index[i], i]) ** 2).mean().item() / 0.5 for i in range(5)]
    assert loss.item() == pytest.approx(sum(per_sample) / 5, rel=1e-6)
    assert info["kl_teacher0"].item() == pytest.approx((per_sample[1] + per_sample[4]) / 2, rel=1e-6)
    assert info["kl_teacher1"].item() == pytest.approx(per_sample[3], rel=1e-6)
    assert info["kl_teacher2"].item() == pytest.approx((per_sample[0] + per_sample[2]) / 2, rel=1e-6)
    _, info = losses.opd_loss(mean, teachers, 0.5, teacher=torch.zeros(5, dtype=torch.long), num_teachers=2)
    assert math.isnan(info["kl_teacher1"].item())  # a teacher without a sample in the batch


class LinearVelocity(torch.nn.Module):
    """v_k(x) = a_k x + b_k at step k of a fixed schedule, per dim, with one parameter set per domain."""

    def __init__(self, steps, domains=1, a=0.0, b=0.0):
        super().__init__()
        self.a = torch.nn.Parameter(torch.full((domains, steps, 2), float(a)))
        self.b = torch.nn.Parameter(torch.full((domains, steps, 2), float(b)))

    def forward(self, x, k, domain):
        return self.a[domain, k] * x + self.b[domain, k]


def distil_on_policy(student, teachers, domain_of, *, iters=150, batch=256):
    """Student rollouts (Flow-GRPO's SDE, eta 0.7) on 4 steps, every step's transition mean matched by opd_loss to
    the teacher of each sample's domain at the student's own state, denom the transition variance."""
    import sde

    torch.manual_seed(0)
    sigmas = sde.sd3_sigmas(4)
    opt = torch.optim.Adam(student.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.MultiStepLR(opt, [iters // 2, 3 * iters // 4], gamma=0.2)
    domain = torch.arange(batch) % 2
    for _ in range(iters):
        with torch.no_grad():
            x, states = torch.randn(batch, 2), []
            for k in range(4):
                states.append(x)
                x = sde.sde_step(student(x, k, domain_of(domain)), x, sigmas[k].item(), sigmas[k + 1].item(),
                                 sigma_max=sigmas[1].item()).prev_sample
        opt.zero_grad()
        for k in range(4):
            x, s, s_next = states[k], sigmas[k].item(), sigmas[k + 1].item()
            out = sde.sde_step(student(x, k, domain_of(domain)), x, s, s_next, sigma_max=sigmas[1].item())
            with torch.no_grad():
                means = torch.stack([sde.sde_step(t(x, k, 0), x, s, s_next, sigma_max=sigmas[1].item()).mean
                                     for t in teachers])  # [K, B, 2]
            loss, _ = losses.opd_loss(out.mean, means, out.std**2, teacher=domain)
            (loss / 4).backward()
        opt.step()
        schedule.step()
    return student


def test_opd_distils_the_teacher_and_merges_two_teachers():
    """On-policy distillation of linear velocity fields (teachers: a = -0.5 / 0.5, b = 1 / -1 at every step): a
    student with the prompt's field (one parameter set per domain) reaches each teacher's parameters; one without it
    serves both domains with one set, whose optimum on the same states is the teachers' average (0, 0)."""
    t0, t1 = LinearVelocity(4, a=-0.5, b=1.0), LinearVelocity(4, a=0.5, b=-1.0)
    both = distil_on_policy(LinearVelocity(4, domains=2), [t0, t1], lambda d: d)
    for d, (a, b) in enumerate([(-0.5, 1.0), (0.5, -1.0)]):
        torch.testing.assert_close(both.a[d].detach(), torch.full((4, 2), a), atol=0.05, rtol=0)
        torch.testing.assert_close(both.b[d].detach(), torch.full((4, 2), b), atol=0.05, rtol=0)
    merged = distil_on_policy(LinearVelocity(4, a=0.3, b=0.3), [t0, t1], lambda d: torch.zeros_like(d))
    torch.testing.assert_close(merged.a[0].detach(), torch.zeros(4, 2), atol=0.05, rtol=0)
    torch.testing.assert_close(merged.b[0].detach(), torch.zeros(4, 2), atol=0.05, rtol=0)
