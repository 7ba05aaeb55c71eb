"""Centered Reward Distillation (arXiv:2603.14128; Flow-Factory src/flow_factory/trainers/crd.py at a0b2bc5) through
the registry: its loss against a float64 transcription of Flow-Factory's training step, by loops; the centring that
cancels a constant shift of the implicit rewards; the optimum it drives the implicit rewards to; its training times
against a transcription of Flow-Factory's TimeSampler.discrete; the decay of its old and sampling copies; and tiny
runs in which the rollouts run the sampling copy, both copies are saved, and a resume is exact. Its toy-learning run
is in tests/test_toy_learning.py.

Line by line, losses.crd against Flow-Factory src/flow_factory/trainers/crd.py (C) and hparams/training_args.py (H) at
a0b2bc5 (the authors' code is not public):
- C L366-368 (sampling_context L200-210): rollouts by the "sampling" snapshot -> train.rollout_weights runs
  policy.frozen("sampling"). C L434-462: deterministic (compute_log_prob False), only the clean latent kept ->
  Loss.process "forward", --sampler euler (its ODE dynamics; examples/crd/lora/sd3_5/default.yaml L103).
- C L172-194: both snapshots start as copies of the trained weights -> policy.py's copies "old", "sampling".
- C L374-376, L380-430: after each epoch, snapshot <- d snapshot + (1 - d) current, d = compute_decay(optimizer
  steps so far) (L67-102; d <= 0 copies, d >= 1 keeps) -> train.after_update with OLD_DECAYS "crd" (H L851-854)
  and "nft-ocr" (H L855-858); policy._lerp is the same blend (d 0 copies exactly, d 1 keeps).
- C L655-658: micro-batches of per_device_batch_size in sample order, no shuffle -> train.py's micro-batches of
  --train-batch-size, shuffled (the same set of samples per optimizer step only on average; departure 2).
- C L674, L214-261: training times per micro-batch, one set shared by its samples -> _crd_times.
- C L683-689, L734: fresh noise per time and sample, x_t = (1 - s) x0 + s eps -> train.renoised, unit "sample".
- C L660-701: the old snapshot's velocities for all micro-batches before the epoch's first optimizer step;
  the snapshot does not move within the epoch -> forward_terms' v_old per micro-batch, from the same unmoved
  copy (the same values).
- C L739: the current velocity at the training forward's guidance (1 in the recipe) -> t["v"].
- C L748-751: the base model (adapter off) at CFG kl_cfg (H L873-883, 4.5) -> t["v_ref"] at --crd-kl-cfg.
- C L753-777: the implicit reward, adaptive weights in float64 -> crd_implicit_reward.
- C L785-791: a = clamp(clip(A) / 5 / 2 + 1/2, 0, 1) -> nft_optimality (the same map; its clamp is a no-op).
- C L780-782, L793-796: r and a gathered from every process for the centring -> centred over this process's
  micro-batch (departure 1).
- C L522-629: the centring and the mse / bce loss, one direction (weight_temp < 0) or two -> crd_loss.
- C L807: x adv_clip_range[1] / max(beta, 1e-8) -> value x adv_clip / max(crd_beta, 1e-8).
- C L811-824: KL = kl_beta mean(mean_dims (v - v_ref)^2), weighted by min_coef + a (1 - min_coef),
  min_coef = 1e-4 / kl_beta with reward_adaptive_kl -> as written.
- C L843-858: backward; clip to max_grad_norm and step when the accumulation is complete -> train.py, policy.step.
"""

import json
import math

import pytest
import torch

import losses
import sde
import train

pytestmark = pytest.mark.usefixtures("one_thread")

HYPER = dict(crd_beta=1.0, crd_temperature=-1.0, crd_loss_type="mse", crd_adaptive=True, crd_old=True,
             crd_adaptive_kl=True, crd_kl_cfg=4.5, adv_clip=5.0, kl_beta=0.1)


def reference_crd(v, v_old, v_ref, x0, eps, adv, *, beta, temperature, kind, adaptive, adaptive_kl, kl_beta,
                  adv_clip=5.0):
    """Flow-Factory crd.py L736-824 (with _compute_crd_loss L550-629), one process, sample by sample in float64: the
    implicit rewards r_i, the advantages mapped to [0, 1], the one or two centrings, the loss times adv_clip / beta,
    and the reward-weighted KL. The centres of r are plain floats: no gradient flows through them."""
    n = len(v)
    target = [(eps[i] - x0[i]).double() for i in range(n)]
    r = []
    for i in range(n):
        e, e_old = v[i].double() - target[i], v_old[i].double() - target[i]
        w = max(e.detach().abs().mean().item(), 1e-5) if adaptive else 1.0
        w_old = max(e_old.abs().mean().item(), 1e-5) if adaptive else 1.0
        r.append(-(e**2 / w - e_old**2 / w_old).mean())
    a = [min(max(float(x), -adv_clip), adv_clip) / adv_clip / 2 + 0.5 for x in adv]
    if temperature < 0:
        weights = [[1 / n] * n]
    else:
        weights = []
        for sign in (1, -1):
            if temperature == 0:
                chosen = [i for i in range(n) if sign * a[i] > 0]  # Flow-Factory's adv_cur > 0 (< 0)
                z = sum(math.exp(a[i]) for i in chosen)
                uniform = [1 / n] * n  # no sample on that side
                weights.append([math.exp(a[i]) / z if i in chosen else 0.0 for i in range(n)] if chosen else uniform)
            else:
                z = sum(math.exp(sign * a[j] / temperature) for j in range(n))
                weights.append([math.exp(sign * a[i] / temperature) / z for i in range(n)])
    total = 0.0
    for p in weights:
        a_centre = sum(p[i] * a[i] for i in range(n))
        r_centre = sum(p[i] * r[i].item() for i in range(n))
        terms = []
        for i in range(n):
            logit, goal = beta * (r[i] - r_centre), a[i] - a_centre
            if kind == "mse":
                terms.append((logit - goal) ** 2)
            else:  # binary_cross_entropy_with_logits with target sigmoid(goal)
                y = 1 / (1 + math.exp(-goal))
                log_sigmoid = torch.nn.functional.logsigmoid
                terms.append(-(y * log_sigmoid(logit) + (1 - y) * log_sigmoid(-logit)))
        total = total + sum(terms) / n / len(weights)
    loss = total * adv_clip / max(beta, 1e-8)
    if kl_beta > 0:
        floor = 1e-4 / kl_beta
        kl = [((v[i].double() - v_ref[i].double()) ** 2).mean() for i in range(n)]
        coef = [floor + a[i] * (1 - floor) if adaptive_kl else 1.0 for i in range(n)]
        loss = loss + kl_beta * sum(coef[i] * kl[i] for i in range(n)) / n
    return loss


def term(seed=0, n=6, shape=(2, 3, 3)):
    g = torch.Generator().manual_seed(seed)
    x0, eps, v_old, v_ref = (torch.randn(n, *shape, generator=g) for _ in range(4))
    v = (v_old + 0.3 * torch.randn(n, *shape, generator=g)).requires_grad_(True)
    adv = torch.tensor([2.5, -1.0, 0.0, 7.0, -6.0, 0.4])[:n]  # two beyond the clip of 5
    return dict(v=v, v_old=v_old, v_ref=v_ref, x0=x0, noise=eps, adv=adv, sigma=torch.full((n,), 0.5))


@pytest.mark.parametrize("flags", [
    {}, dict(crd_loss_type="bce"), dict(crd_temperature=0.0), dict(crd_temperature=0.5),
    dict(crd_temperature=0.5, crd_loss_type="bce"), dict(crd_beta=3.0, crd_adaptive=False),
    dict(crd_adaptive_kl=False), dict(kl_beta=0.0)])
def test_crd_matches_flow_factorys_step_and_its_gradient(flags):
    hyper = dict(HYPER, **flags)
    t = term()
    value, info = losses.LOSSES["crd"].fn(t, **losses.LOSSES["crd"].hyper(hyper))
    value.backward()
    got_grad, t["v"].grad = t["v"].grad.clone(), None
    want = reference_crd(t["v"], t["v_old"], t["v_ref"], t["x0"], t["noise"], t["adv"], beta=hyper["crd_beta"],
                         temperature=hyper["crd_temperature"], kind=hyper["crd_loss_type"],
                         adaptive=hyper["crd_adaptive"], adaptive_kl=hyper["crd_adaptive_kl"],
                         kl_beta=hyper["kl_beta"])
    assert value.item() == pytest.approx(want.item(), rel=1e-5)
    want.backward()
    assert torch.allclose(got_grad, t["v"].grad.float(), rtol=1e-4, atol=1e-9)
    assert ("kl" in info) == (hyper["kl_beta"] > 0) and info["old_deviate"] > 0


def test_crd_reads_the_base_model_without_the_old_copy():
    t = term(seed=1)
    crd = losses.LOSSES["crd"]
    with_base, _ = crd.fn(dict(t, v_old=t["v_ref"]), **crd.hyper(HYPER))
    without_old, info = crd.fn(dict(t, v_old=None), **crd.hyper(dict(HYPER, crd_old=False)))
    assert without_old.item() == pytest.approx(with_base.item(), rel=1e-6) and "old_deviate" not in info
    record = losses.LOSSES["crd"]
    assert record.reference(dict(crd_old=False)) and not record.old_copy(dict(crd_old=False))


def test_centring_cancels_a_constant_and_leaves_each_implicit_reward_its_own_gradient():
    """The point of centring (the paper's Sec. 3): log Z(c), the same for every sample of a prompt, shifts every
    implicit reward alike and drops out. With the centre held, d l / d r_i = 2 beta (beta R_theta_i - R_i) / B."""
    g = torch.Generator().manual_seed(2)
    r, a = torch.randn(8, generator=g, dtype=torch.float64), torch.rand(8, generator=g, dtype=torch.float64)
    for temperature in (-1.0, 0.0, 0.3):
        base, _ = losses.crd_loss(r, a, beta=2.0, temperature=temperature)
        shifted, _ = losses.crd_loss(r + 7.5, a, beta=2.0, temperature=temperature)
        assert shifted.item() == pytest.approx(base.item(), rel=1e-6, abs=1e-9)
    r = r.clone().requires_grad_(True)
    loss, _ = losses.crd_loss(r, a, beta=2.0)
    loss.backward()
    want = 2 * 2.0 * (2.0 * (r - r.mean()) - (a - a.mean())) / 8
    assert torch.allclose(r.grad, want.detach(), rtol=1e-5)


def test_crd_drives_the_centred_implicit_rewards_to_the_centred_rewards_over_beta():
    """Descending the loss on free implicit rewards: beta (r_i - mean r) -> a_i - mean a, for mse and bce alike
    (the cross-entropy of sigmoid(beta R_theta) against sigmoid(R) is smallest where the two are equal)."""
    a = torch.tensor([0.9, 0.1, 0.5, 0.7, 0.2], dtype=torch.float64)
    for kind in losses.CRD_KINDS:
        r = torch.zeros(5, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([r], lr=0.1 if kind == "mse" else 1.0)  # below 2 / the curvature
        for _ in range(300):
            opt.zero_grad()
            losses.crd_loss(r, a, beta=4.0, kind=kind)[0].backward()
            opt.step()
        assert torch.allclose(4.0 * (r - r.mean()), a - a.mean(), atol=1e-4), kind


def test_the_implicit_reward_is_zero_at_the_old_copy_and_positive_where_v_fits_better():
    t = term(seed=3)
    v_old, target = t["v_old"], t["noise"] - t["x0"]
    assert losses.crd_implicit_reward(v_old, v_old, t["x0"], t["noise"]).abs().max() == 0
    better = v_old + 0.5 * (target - v_old)  # halfway to the flow-matching target
    assert (losses.crd_implicit_reward(better, v_old, t["x0"], t["noise"], adaptive=False) > 0).all()
    plain = losses.crd_implicit_reward(better, v_old, t["x0"], t["noise"], adaptive=False)
    want = -(((better - target) ** 2).flatten(1).mean(1) - ((v_old - target) ** 2).flatten(1).mean(1))
    assert torch.allclose(plain.float(), want, rtol=1e-5)


def reference_discrete(num_steps, n, fraction, generator):
    """Flow-Factory TimeSampler.discrete (noise_schedule.py L185-259), 'discrete' (include_init), on the SD3 schedule's
    timesteps (sigma x 1000, the last 0 left out as the scheduler does): the indices, not the timesteps."""
    ts = sde.sd3_sigmas(num_steps)[:-1] * 1000
    t_min, t_max = 1000 * (1 - fraction), 1000.0
    valid = torch.where((ts >= t_min - 1e-3) & (ts <= t_max + 1e-3))[0]
    bounds = torch.linspace(int(valid.min()), int(valid.max()), n + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return (lower + (torch.rand(n, generator=generator) * (upper - lower)).long()).clamp(0, num_steps - 1)


def test_crd_times_are_flow_factorys_discrete_strata():
    for n in (20, 9, 4):  # the SD3.5 example's 20 strata of a 10-step schedule repeat indices; 9 is the default
        for seed in range(5):
            got = losses.LOSSES["crd"].times(3, torch.Generator().manual_seed(seed), num_steps=10, train_timesteps=n,
                                             timestep_fraction=0.99)
            want = reference_discrete(10, n, 0.99, torch.Generator().manual_seed(seed))
            assert got.shape == (3, n) and (got == got[:1]).all() and torch.equal(got[0], want), (n, seed)
    auto = losses.LOSSES["crd"].times(1, torch.Generator().manual_seed(0), num_steps=10, train_timesteps=None,
                                      timestep_fraction=0.99)
    assert auto.shape == (1, 9)  # int(10 x 0.99), CRDTrainingArguments L913-919
    draws = torch.cat([losses.LOSSES["crd"].times(1, torch.Generator().manual_seed(s), num_steps=10,
                                                  train_timesteps=20, timestep_fraction=0.99)[0] for s in range(50)])
    assert set(draws.tolist()) == set(range(8))  # index 8 (sigma 0.278) is a stratum's exclusive upper end only


def compute_decay(step, start_step, start_value, slope, end_value):
    """Flow-Factory crd.py compute_decay L100-102 for a 'start_step-start_value-slope-end_value' schedule."""
    return start_value if step < start_step else min(start_value + (step - start_step) * slope, end_value)


def test_the_old_and_sampling_copies_decay_as_flow_factorys_schedules():
    for k in range(0, 400, 7):
        assert losses.OLD_DECAYS["crd"](k) == pytest.approx(compute_decay(k, 0, 0.25, 0.005, 0.999))
        assert losses.OLD_DECAYS["nft-ocr"](k) == pytest.approx(compute_decay(k, 75, 0.0, 0.0075, 0.999))
    _, args = train.parse_args(["--model", "tiny", "--loss", "crd"])
    assert (args.old_decay, args.sampling_decay, args.sampler) == ("crd", "nft-ocr", "euler")


def test_rollouts_run_the_sampling_copy_both_copies_decay_and_a_resume_is_exact(tmp_path):
    """Three steps on the tiny model with a LoRA adapter and the KL to the CFG-guided base: the rollouts run the
    sampling copy (train.rollout_weights), which copies the weights after each step (decay 0 before 75 optimizer
    steps), the old copy blends on its own schedule, both are saved, and a run resumed from step 1 repeats steps 2
    and 3 exactly (both copies restored)."""
    from safetensors.torch import load_file
    from test_train import SMALL, metrics

    flags = [*SMALL, "--loss", "crd", "--lora-rank", "4", "--lora-alpha", "8", "--kl-beta", "0.1", "--crd-kl-cfg",
             "3", "--train-timesteps", "2", "--steps", "3", "--save-every", "1", "--log-images-every", "0"]
    train.main([*flags, "--out", str(tmp_path / "full")])
    full = metrics(str(tmp_path / "full"))
    assert [r["old_decay"] for r in full] == pytest.approx([0.255, 0.26, 0.265])
    assert [r["sampling_decay"] for r in full] == [0, 0, 0] and all(r["kl"] > 0 for r in full)
    ckpt = tmp_path / "full" / "checkpoints"
    old_prev = load_file(ckpt / "1" / "old.safetensors")
    for step in (2, 3):
        weights, old, sampling = (load_file(ckpt / str(step) / f"{name}.safetensors")
                                  for name in ("trainable", "old", "sampling"))
        d = 0.25 + 0.005 * step
        for name, w in weights.items():
            assert torch.equal(sampling[name], w.float())
            torch.testing.assert_close(old[name], d * old_prev[name] + (1 - d) * w, rtol=1e-6, atol=1e-7)
        old_prev = old
    train.main([*flags, "--out", str(tmp_path / "resumed"), "--resume", str(ckpt / "1")])
    resumed = metrics(str(tmp_path / "resumed"))
    timing = ("seconds", "seconds_sampling", "seconds_reward_wait", "seconds_training")
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(full[1:], resumed):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}

    class Stub:
        copies = {"sampling": {}, "old": {}}

        def frozen(self, name):
            return name
    _, args = train.parse_args(["--model", "tiny", "--loss", "crd"])
    assert train.rollout_weights(Stub(), losses.LOSSES["crd"], 0, args) == "sampling"
    _, args = train.parse_args(["--model", "tiny", "--loss", "nft"])
    Stub.copies = {"sampling": None, "old": {}}
    assert train.rollout_weights(Stub(), losses.LOSSES["nft"], 0, args) == "old"


def test_a_sampling_decay_without_a_sampling_copy_is_refused(capsys):
    p, args = train.parse_args(["--model", "tiny", "--loss", "nft", "--sampling-decay", "crd"])
    with pytest.raises(SystemExit):
        train.check_args(p, args, 1)
    assert "--sampling-decay" in capsys.readouterr().err
    p, args = train.parse_args(["--model", "tiny", "--loss", "crd", "--sampling-decay", "crd"])
    train.check_args(p, args, 1)


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan", "tiny-qwen-image", "tiny-flux2-klein", "tiny-z-image"])
def test_crd_trains_every_family_with_its_kl_to_the_guided_base(name, tmp_path):
    """One step of --loss crd on each text-to-image family's tiny twin, with a LoRA adapter and the KL to the base at
    CFG 3 (the prompts encoded with their negative although the rollouts run without CFG; FLUX.1's guidance is its
    embedding): finite, and the KL positive from the first step (the guided base is not the unguided policy)."""
    out = tmp_path / "run"
    train.main(["--model", name, "--loss", "crd", "--steps", "1", "--num-steps", "4", "--prompts-per-step", "2",
                "--group-size", "4", "--sample-batch-size", "4", "--train-batch-size", "4", "--train-timesteps", "1",
                "--lora-rank", "4", "--lora-alpha", "4", "--kl-beta", "0.1", "--crd-kl-cfg", "3",
                "--log-images-every", "0", "--out", str(out)])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"]) and rows[0]["kl"] > 0
