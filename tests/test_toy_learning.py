"""End to end on a 2-D toy: a velocity MLP trained by flow matching on two Gaussian modes, then
fine-tuned online with sde.rollout + sde.sde_step + each loss, for a reward that prefers the right
mode. This is the trainer's loop in miniature (rollout, group advantages, re-scoring the stored
transitions, several updates per batch), so a sign error, a wrong old log-prob or a broken
gradient path anywhere shows up as a model that does not learn.

Scales differ from image latents: D = 2, so the ratio moves about as in an LLM and clip_range 0.2 is
the right order (hub models: 1e-4), and FlowDPPO's mean-reduced KL threshold is 1e-4 (hub: 1e-5).
GRPO-Guard runs at a third of the learning rate: its RatioNorm factor c and the 1/|dt| reweight make
every step's gradient on v about equally large, where GRPO's shrink at high noise (as
sqrt(|dt|) / std_dev_t), so the same Adam step moves the high-noise steps, which pick the mode, far
more; at 3e-3 it overshoots the mode to x ~ 5.6.

The reward (x > 0) is indifferent to where on the right the samples land and there is no KL term,
so some drift of the mode is expected; the test only asks that the samples stay one compact mode.

Two of the forward-process losses, DiffusionNFT and AWM, run the same toy their own way: deterministic rollouts
(dpm2 / Euler) keep only the clean samples, which are re-noised with fresh noise at the schedule's own
sigmas and trained on with an "old" copy of the model (NFT: the sampler and v_old; AWM: the EMA-KL
anchor) soft-updated after every step with the references' decay schedules.
"""

import copy

import pytest
import torch

import losses
import sde

CENTRES = torch.tensor([[-2.0, 0.0], [2.0, 0.0]])
NUM_STEPS = 10


class VelocityMLP(torch.nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, hidden),
                                       torch.nn.SiLU(), torch.nn.Linear(hidden, 2))

    def forward(self, x, sigma):  # sigma: float or [B]
        s = torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, 1).expand(x.shape[0], 1)
        return self.net(torch.cat([x, s], dim=1))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def base_model(one_thread):
    """Flow matching: regress v on eps - x0 at x_s = (1 - s) x0 + s eps, s ~ U(0, 1)."""
    torch.manual_seed(0)
    model = VelocityMLP()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(600):
        x0 = CENTRES[torch.randint(0, 2, (256,), generator=g)] + 0.3 * torch.randn(256, 2, generator=g)
        eps, s = torch.randn(256, 2, generator=g), torch.rand(256, 1, generator=g)
        loss = ((model((1 - s) * x0 + s * eps, s) - (eps - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def ode_samples(model, n=2000):
    x = torch.randn(n, 2, generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        return sde.rollout(model, x, sde.sd3_sigmas(NUM_STEPS), sde_steps=[], kind="ode")["latents"][:, -1]


# The flags the losses read, as train.py passes them (vars(args)); the toy has no reference model (kl_beta 0).
HYPER = dict(clip_range=0.2, kl_beta=0.0, kl_form="flow-grpo", sde="flow", kl_mask_threshold=1e-4, adv_clip=5.0,
             step_loss_weight="none",
             nft_beta=1.0, nft_adaptive=True, ema_kl_beta=1.0, awm_weighting="ghuber", ghuber_power=0.25,
             num_steps=NUM_STEPS, train_timesteps=6, awm_timesteps="discrete_wo_init",
             crd_beta=1.0, crd_temperature=-1.0, crd_loss_type="mse", crd_adaptive=True, crd_old=True,
             crd_adaptive_kl=True, crd_kl_cfg=1.0)


def fine_tune(model, loss_name, *, lr, iters=30, batch=128, group=16, updates=2, eta=0.7):
    sigmas = sde.sd3_sigmas(NUM_STEPS)
    steps = sde.sde_steps(NUM_STEPS)  # all but the last
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    group_ids = torch.arange(batch) // group  # the toy has no prompt: groups are just slices
    log = []
    for _ in range(iters):
        traj = sde.rollout(model, torch.randn(batch, 2, generator=g), sigmas, sde_steps=steps, kind="flow", eta=eta,
                           generator=g)
        reward = (traj["latents"][:, -1, 0] > 0).float()  # [B]: the right mode
        adv = losses.group_advantages(reward, group_ids)
        for update in range(updates):
            opt.zero_grad()
            for j, k in enumerate(steps):
                s, s_next = sigmas[k].item(), sigmas[k + 1].item()
                x, x_next = traj["latents"][:, k], traj["latents"][:, k + 1]
                out = sde.sde_step(model(x, s), x, s, s_next, kind="flow", eta=eta, prev_sample=x_next,
                                   sigma_max=sigmas[1].item())
                t = dict(log_prob=out.log_prob, old_log_prob=traj["log_probs"][:, j], mean=out.mean,
                         old_mean=traj["means"][:, j], std=out.std, dt=s_next - s, adv=adv)
                loss, info = losses.LOSSES[loss_name].fn(t, **losses.LOSSES[loss_name].hyper(HYPER))  # as train.py
                (loss / len(steps)).backward()
                log.append(dict(info, update=update))
            opt.step()
    return log


def test_base_model_samples_both_modes(base_model):
    y = ode_samples(base_model)
    right = (y[:, 0] > 0).float().mean().item()
    assert 0.35 < right < 0.65, right
    near = ((y[:, None] - CENTRES).norm(dim=-1).min(dim=1).values < 1.0).float().mean().item()
    assert near > 0.9, near  # the samples sit on the modes


@pytest.mark.parametrize("loss_name, lr", [("grpo", 3e-3), ("guard", 1e-3), ("flowdppo", 3e-3)])
def test_online_rl_moves_the_samples_to_the_rewarded_mode(base_model, loss_name, lr):
    model = copy.deepcopy(base_model)
    log = fine_tune(model, loss_name, lr=lr)
    # On-policy: the first update of every batch re-scores the rollout's own transitions exactly.
    first = [info for info in log if info["update"] == 0]
    assert max(abs(info["ratio_mean"] - 1) for info in first) < 1e-5
    assert max(info["ratio_max"] - info["ratio_min"] for info in first) < 1e-5
    assert any(abs(info["ratio_mean"] - 1) > 1e-5 for info in log if info["update"] == 1)  # off-policy after a step
    if loss_name == "flowdppo":
        assert max(info["masked_fraction"] for info in log) > 0  # the KL-ADV mask engaged
    y = ode_samples(model)
    right = (y[:, 0] > 0).float().mean().item()
    assert right >= 0.9, right
    right_std = y[y[:, 0] > 0].std(dim=0)
    assert (right_std < 0.75).all(), right_std  # still one compact mode (base: about 0.3)


def fine_tune_forward(model, loss_name, *, lr, iters=30, batch=128, group=16):
    """DiffusionNFT (train_nft_sd3.py), AWM (train_sd3_awm.py) or CRD (Flow-Factory trainers/crd.py) on the toy
    through the registry (its training sigmas, its loss, its old copy's decay; CRD's sampling copy and its decay), one
    optimizer step per batch."""
    loss_fn = losses.LOSSES[loss_name]
    hyper = dict(HYPER, timestep_fraction=loss_fn.defaults["timestep_fraction"], clip_range=loss_fn.defaults.get(
        "clip_range", HYPER["clip_range"]), kl_beta=loss_fn.hub_defaults["kl_beta"])  # AWM's EMA-KL needs beta > 0
    sigmas = sde.sd3_sigmas(NUM_STEPS)
    old = copy.deepcopy(model).requires_grad_(False)
    base = copy.deepcopy(model).requires_grad_(False)  # the reference of the KL to the base
    sampling = copy.deepcopy(model).requires_grad_(False) if loss_fn.sampling_copy else None  # CRD's own sampler
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    group_ids = torch.arange(batch) // group
    log = []
    for k in range(iters):
        sampler = old if loss_fn.samples_with_old else model  # NFT samples with the old policy, AWM on-policy
        sampler = sampling if sampling is not None else sampler
        solver = "dpm2" if loss_fn.samples_with_old else "euler"
        x0 = sde.ode_sample(sampler, torch.randn(batch, 2, generator=g), sigmas, solver=solver)  # [B, 2]
        adv = losses.group_advantages((x0[:, 0] > 0).float(), group_ids)
        opt.zero_grad()
        order = loss_fn.times(batch, g, **hyper)  # NFT: 9 of 10 sigmas, each sample its own; AWM: 6 strata, shared
        n = order.shape[1]
        for j in range(n):
            s = sigmas[order[:, j]]  # [B]
            eps = torch.randn(batch, 2, generator=g)  # fresh noise per (sample, sigma)
            x_t = sde.renoise(x0, eps, s)  # (1 - s) x0 + s eps
            v = model(x_t, s)
            with torch.no_grad():
                v_old, v_ref = old(x_t, s), base(x_t, s)
            loss, info = loss_fn.fn(dict(v=v, x_t=x_t, x0=x0, noise=eps, sigma=s, adv=adv, v_old=v_old, v_ref=v_ref),
                                    **loss_fn.hyper(hyper))
            (loss / n).backward()
            log.append(dict(info, iteration=k))
        opt.step()
        copies = [(old, loss_fn.defaults["old_decay"])] + ([(sampling, loss_fn.defaults["sampling_decay"])]
                                                           if sampling is not None else [])
        for frozen, schedule in copies:
            decay = losses.OLD_DECAYS[schedule](k + 1)
            with torch.no_grad():  # old <- d old + (1 - d) current
                for p_old, p in zip(frozen.parameters(), model.parameters()):
                    p_old.lerp_(p, 1 - decay)
    return log


@pytest.mark.parametrize("loss_name, lr", [("nft", 3e-3), ("awm", 3e-3), ("crd", 3e-3)])
def test_forward_process_losses_move_the_samples_to_the_rewarded_mode(base_model, loss_name, lr):
    """30 iterations (base model: about half the samples on the right); each is under 0.4 s on one core."""
    model = copy.deepcopy(base_model)
    log = fine_tune_forward(model, loss_name, lr=lr)
    # The old copy starts as the model: the first batch is exactly on-policy, later ones are not.
    deviate = "ema_kl" if loss_name == "awm" else "old_deviate"  # how far the current weights are from the old copy
    assert all(info[deviate] == 0 for info in log if info["iteration"] == 0)
    assert any(info[deviate] > 0 for info in log if info["iteration"] == 1)
    y = ode_samples(model)
    right = (y[:, 0] > 0).float().mean().item()
    assert right >= 0.9, right
    right_std = y[y[:, 0] > 0].std(dim=0)
    assert (right_std < 0.75).all(), right_std
