"""The roles beside the policy in the few-step distillation losses (docs/design.md, "A role"): the terms the generator
trains on, built from the frozen teachers' and the critic's forwards, and the roles' own updates.

    x0_terms(...), mean_terms(...)     in train.reverse_terms' place (Loss.terms "x0" / "mean", TERMS): for each
                                       stored stage k of the micro-batch, (x_k, sigma_k on the host, complete(v)) with
                                       complete(v) the loss's term dict from the policy's velocity v at x_k
    train_roles(policy, loss, batch, adv, sigmas, args, step, guidance) -> stats   before the policy's update: for each
                                       trained role (Loss.roles: the critic, TDM-R1's surrogate), --critic-updates
                                       passes over this rank's samples, each one optimizer step of the role

Every frozen forward (teacher, critic) runs before the training forward that holds a graph: the roles' weights are
exchanged in place with the trained ones (checkpoints.swapped), which a graph must not see. The generator's clean
prediction is therefore computed twice, once without gradient to place x_t, once with it (complete); the two agree as
the training forward reproduces the rollout's (departure 2's check).

The generator trains on every stored stage of its rollout (TDM's every stage; DMD2's backward simulation keeps the
stages its generator visits), and on every sample: the distillation terms need no advantage. A step is --critic-updates
role passes then the policy's update (Flow-Factory's order, dmd2.py / tdm.py `optimize`); DMD2 updates its generator
every dfake_gen_update_ratio-th critic step on fresh samples (train_sd.py L330), here the critic passes reuse the
step's rollouts (docs/algorithms.md, "Few-step distillation", departure 1).
"""
import torch

import data
import losses
import sde
from distributed import RANK

DMD_RANGE = (0.02, 0.98)  # DMD2's generator t, uniform over 2 % .. 98 % of the schedule (train_sd.py L634-635)


def _rows(embeds, ids, rows):
    """The micro-batch's rows of the prompt embeddings (train.embed_rows: the masks stay on the CPU)."""
    return {k: v[rows if v.device.type == "cpu" else ids] for k, v in embeds.items()}


def teacher_index(policy, batch, rows, args):
    """[b] each sample's teacher, an index into policy.teachers: 0 with one teacher, else the teacher named by the
    prompt row's --teacher-field; a value no --teacher names is refused in one line."""
    keys = list(policy.teachers)
    if len(keys) == 1:
        return torch.zeros(len(rows), dtype=torch.long)
    index = []
    for r in rows.tolist():
        value = str((batch["metadata"][r] or {}).get(args.teacher_field))
        if value not in keys:
            raise SystemExit(f"error: a prompt's {args.teacher_field} is {value!r}, which no --teacher names (they "
                             f"are {', '.join(keys)}): add --teacher {value}=PATH")
        index.append(keys.index(value))
    return torch.tensor(index)


def teacher_velocity(policy, x, sigma, embeds, guidance, teacher):
    """Each sample's teacher's velocity at (x, sigma), without gradient: one forward per teacher present."""
    v = None
    for k, key in enumerate(policy.teachers):
        mine = (teacher == k).to(x.device).view((-1,) + (1,) * (x.ndim - 1))  # [b, 1, ...]
        if not mine.any():
            continue
        with policy.frozen("teacher", key):
            v_k = policy.velocity(x, sigma, embeds, guidance)
        v = v_k if v is None else torch.where(mine, v_k, v)
    return v


def _stage(batch, ids, rows, sigmas, j):
    """Stored stage j of samples ids: x_k, x_{k+1} [b, ...], sigma_k, sigma_{k+1} [b] on the device, sigma_k on the
    host (where the forwards take it)."""
    k = batch["steps"][ids, j]
    on_device = sigmas.to(batch["latents"].device)
    return (batch["latents"][ids, k], batch["latents"][ids, k + 1], on_device[k], on_device[k + 1],
            sigmas[batch["host_steps"][rows, j]])


def _point(loss, x0, x_end, sigma_next, generator):
    """Where the critic and the teacher look at the generator's x0: (x_t, its noise, t [b], weight [b]). DMD2: t
    uniform over DMD_RANGE, x_t = (1 - t) x0 + t fresh, weight 1; TDM (Loss.point, tdm_renoise): t uniform between
    the stage's end sigma_{k+1} and 1, the stage's own noise carried there, TDM's importance weight."""
    fresh = torch.randn(x0.shape, generator=generator).to(x0.device)
    u = torch.rand(x0.shape[0], generator=generator).to(x0.device)
    low, high = DMD_RANGE
    if loss.point is None:
        t = low + (high - low) * u
        return sde.renoise(x0, fresh, t), fresh, t, torch.ones_like(t)
    s_mid = sigma_next.float()
    t = s_mid + (1 - s_mid) * (low + (high - low) * u)  # in (s_mid, 1)
    shape = (-1,) + (1,) * (x0.ndim - 1)
    noise_mid = torch.where(s_mid.view(shape) > 0, (x_end - (1 - s_mid.view(shape)) * x0) /
                            s_mid.clamp_min(1e-6).view(shape), torch.zeros_like(x0))  # the noise x_{k+1} implies
    x_t, noise, weight = loss.point(x0, noise_mid, fresh, s_mid, t)
    return x_t, noise, t, weight


def x0_terms(policy, loss, batch, ids, rows, sub, adv, sigmas, args, key, guidance):
    """The generator's terms of the distribution-matching losses (dmd2, tdm, tdm_r1, dmdr): per stored stage, x0 =
    x_k - sigma_k v (losses.x0_from_velocity), the teacher's (at the model's --guidance-scale, DMD2's
    real_guidance_scale) and the critic's (unguided, sd_guidance.py L283) clean estimates at x_t, and for TDM-R1 the
    surrogate's (at the teacher's guidance) and the teacher's unguided one."""
    gen = data.seeded(args.seed, *key, RANK, 3)
    teacher, real_guidance = teacher_index(policy, batch, rows, args), args.guidance_scale
    for j in range(batch["steps"].shape[1]):
        x, x_end, sigma, sigma_next, at = _stage(batch, ids, rows, sigmas, j)
        with torch.no_grad():
            x0 = losses.x0_from_velocity(x, policy.velocity(x, at, sub, guidance), sigma)
        x_t, _, t, _ = _point(loss, x0, x_end, sigma_next, gen)
        t_host = t.cpu()
        frozen = dict(x0_real=losses.x0_from_velocity(
            x_t, teacher_velocity(policy, x_t, t_host, sub, real_guidance, teacher), t))
        with policy.frozen("critic"):
            frozen["x0_fake"] = losses.x0_from_velocity(x_t, policy.velocity(x_t, t_host, sub, 1.0), t)
        if "surrogate" in policy.role_optimizers:
            with policy.frozen("surrogate"):
                frozen["x0_surrogate"] = losses.x0_from_velocity(
                    x_t, policy.velocity(x_t, t_host, sub, real_guidance), t)
            if real_guidance > 1:
                frozen["x0_cond"] = losses.x0_from_velocity(
                    x_t, teacher_velocity(policy, x_t, t_host, sub, 1.0, teacher), t)

        def complete(v):  # called before the generator moves on: x, sigma, ... are this stage's
            return dict(x0=losses.x0_from_velocity(x, v, sigma), adv=adv, guidance=real_guidance, **frozen)
        yield x, at, complete


def mean_terms(policy, loss, batch, ids, rows, sub, adv, sigmas, args, key, guidance):
    """On-policy distillation's terms: per stored stage, the student's transition mean at its own x_k (sde.sde_step
    scoring the stored x_{k+1}) and its teacher's there (at the training forward's guidance, as the student's)."""
    teacher = teacher_index(policy, batch, rows, args)
    step = dict(kind=args.sde, eta=args.eta, sigma_max=sigmas[1].item())  # as train.reverse_terms
    for j in range(batch["steps"].shape[1]):
        x, x_next, sigma, sigma_next, at = _stage(batch, ids, rows, sigmas, j)
        v_teacher = teacher_velocity(policy, x, at, sub, guidance, teacher)
        teacher_mean = sde.sde_step(v_teacher, x, sigma, sigma_next, prev_sample=x_next, **step).mean

        def complete(v):
            out = sde.sde_step(v, x, sigma, sigma_next, prev_sample=x_next, **step)
            return dict(mean=out.mean, teacher_mean=teacher_mean, std=out.std, adv=adv,
                        teacher=teacher.to(x.device), num_teachers=len(policy.teachers))
        yield x, at, complete


TERMS = {"x0": x0_terms, "mean": mean_terms}


def train_roles(policy, loss, batch, adv, sigmas, args, step, guidance):
    """The trained roles' updates before the policy's (Loss.roles {name: loss fn}): for each, --critic-updates passes
    over this rank's samples in micro-batches of --train-batch-size, each pass one optimizer step of the role
    (policy.step_role), at a stored stage drawn per micro-batch. A role's term t: its velocity v at x_t (with its graph,
    inside policy.role), x_t, the generator's x0 (no graph) and noise, sigma = t, importance, the teacher's velocity
    v_real there, adv, unit (each sample's group in the micro-batch). -> {statistic: [values]} (train_on_batch's)."""
    stats = {}
    n = len(batch["prompts"])
    for name, fn in loss.roles.items():
        hyper = losses.keywords(fn, vars(args))
        for update in range(args.critic_updates):
            gen = data.seeded(args.seed, step, RANK, update, len(name), 4)
            for start in range(0, n, args.train_batch_size):
                rows = torch.arange(start, min(start + args.train_batch_size, n))
                ids = rows.to(batch["latents"].device)
                sub = _rows(batch["embeds"], ids, rows)
                j = int(torch.randint(batch["steps"].shape[1], (1,), generator=gen))
                x, x_end, sigma, sigma_next, at = _stage(batch, ids, rows, sigmas, j)
                with torch.no_grad():
                    x0 = losses.x0_from_velocity(x, policy.velocity(x, at, sub, guidance), sigma)
                    x_t, noise, t, weight = _point(loss, x0, x_end, sigma_next, gen)
                    v_real = teacher_velocity(policy, x_t, t.cpu(), sub, 1.0, teacher_index(policy, batch, rows, args))
                unit = torch.unique(batch["groups"][rows], return_inverse=True)[1].to(x.device)  # [b]
                with policy.role(name):
                    v = policy.velocity(x_t, t.cpu(), sub, 1.0)
                    value, info = fn(dict(v=v, x_t=x_t, x0=x0, noise=noise, sigma=t, importance=weight, v_real=v_real,
                                          adv=adv["adv"][ids], unit=unit), **hyper)
                    (value * len(rows) / n).backward()  # the pass's mean over the samples
                for k, val in dict(info, objective=value.detach()).items():
                    stats.setdefault(k if k.startswith(name) else f"{name}_{k}", []).append(val)
            status, grad_norm = policy.step_role(name)
            stats.setdefault(f"{name}_grad_norm", []).append(grad_norm)
            stats.setdefault(f"{name}_skipped", []).append(float(status != "ok"))
    return stats
