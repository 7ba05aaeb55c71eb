"""Fidelity, round five: what the DGPO and CRD recipes sample and train on, against Flow-Factory
(X-GenGroup/Flow-Factory at a0b2bc5: F) and the DGPO authors' code (Luo-Yihong/DGPO at 01ceb4b: A), transcribed here.
Where a recipe reproduces them the test compares the draws; where this project departs (docs/departures.md 17, the
departures in losses.dgpo's and losses.crd's docstrings) it pins the size of the difference the declaration states.

- F src/flow_factory/scheduler/flow_match_euler_discrete.py set_scheduler_timesteps L49-77 (called by
  models/stable_diffusion/sd3_5.py L258-263): sigmas=linspace(1, 1/N, N) handed to FlowMatchEulerDiscreteScheduler,
  which shifts them (SD3.5's static shift 3) -> flow_factory_schedule.
- A scripts/train_sd3_dgpo.py L557-559: DPMSolverMultistepScheduler, flow_shift 3; L1099-1100: sigma = timestep / 1000.
- F src/flow_factory/utils/noise_schedule.py TimeSampler.discrete L185-239 and _stratified_sample L242-259: the
  indices whose timestep lies in [1000 (1 - range), 1000], strata over [their min, their max] -> flow_factory_discrete.
- A L52-74, L1062-1064: random.sample(range(trunc_steps + 1), 4), trunc_steps 6 (config/dgpo.py L29).
"""
import json
import os

import numpy as np
import pytest
import torch

import losses
import models
import sde
import train
from families import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SD3_10 = [1.0, 0.9601, 0.9133, 0.8577, 0.7904, 0.7073, 0.6022, 0.4649, 0.2780, 0.0089, 0.0]  # sde.sd3_sigmas(10)
FF_10 = [1.0, 0.9643, 0.9231, 0.875, 0.8182, 0.75, 0.6667, 0.5625, 0.4286, 0.25, 0.0]  # shift(linspace(1, 1/N, N))


def flow_factory_schedule(num_steps, shift=3.0):
    """F's SD3.5 schedule: the scheduler's sigmas after set_timesteps(sigmas=linspace(1, 1/N, N)), float32 [N + 1]."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps))
    return scheduler.sigmas.float()


def flow_factory_discrete(sigmas, n, timestep_range, generator):
    """F's TimeSampler.discrete, 'discrete' (include_init, no force_init), on a schedule's timesteps (sigma x 1000,
    without the final 0, as the scheduler keeps them): the indices it draws, [n]."""
    ts = sigmas[:-1] * 1000
    valid = torch.where((ts >= 1000 * (1 - timestep_range) - 1e-3) & (ts <= 1000 + 1e-3))[0]
    bounds = torch.linspace(int(valid.min()), int(valid.max()), n + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return (lower + (torch.rand(n, generator=generator) * (upper - lower)).long()).clamp(0, len(ts) - 1)


def strata_mean(sigmas, lo, hi, n):
    """The mean sigma of n strata of indices at linspace(lo, hi, n + 1), each drawn uniformly in [lower, upper)
    (the lower one where that is empty), and the indices they can draw."""
    bounds = torch.linspace(lo, hi, n + 1)
    total, drawn = 0.0, set()
    for low, up in zip(bounds[:-1].long().tolist(), bounds[1:].long().tolist()):
        ids = list(range(low, up)) or [low]
        drawn |= set(ids)
        total += sum(sigmas[i].item() for i in ids) / len(ids) / n
    return total, sorted(drawn)


def recipe_args(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    return vars(train.parse_args([f"@recipes/{name}"])[1])


def test_the_two_schedules_of_departure_17():
    """SD3's pipeline schedule (what this project samples) and F's, and A's DPM-Solver schedule within 0.001 of F's."""
    from diffusers import DPMSolverMultistepScheduler

    assert sde.sd3_sigmas(10).tolist() == pytest.approx(SD3_10, abs=1e-4)
    ff = flow_factory_schedule(10)
    assert ff.tolist() == pytest.approx(FF_10, abs=1e-4)
    assert torch.allclose(common.flow_match_sigmas({"shift": 3.0}, np.linspace(1.0, 0.1, 10)), ff)
    dpm = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    dpm.set_timesteps(10)
    assert dpm.timesteps.tolist() == [999, 963, 922, 874, 817, 749, 666, 562, 428, 249]  # A trains at these / 1000
    assert (dpm.sigmas.float() - ff).abs().max() < 1e-3


def test_the_dgpo_recipe_draws_flow_factorys_strata_on_the_schedule_it_samples(monkeypatch):
    """F's timestep_range 0.6 keeps the timesteps >= 400: SD3's indices 0 .. 7, which --timestep-fraction 0.7 (a
    fraction of the indices) stratifies alike, draw for draw. The sizes that losses.dgpo's departure 1 states."""
    args = recipe_args("sd3_dgpo_pickscore.args", monkeypatch)
    assert args["timestep_fraction"] == 0.7 and args["train_timesteps"] == 4
    sd3, ff = sde.sd3_sigmas(10), flow_factory_schedule(10)
    for seed in range(30):
        got = losses.LOSSES["dgpo"].times(3, torch.Generator().manual_seed(seed), **args)
        want = flow_factory_discrete(sd3, 4, 0.6, torch.Generator().manual_seed(seed))
        assert (got == got[:1]).all() and torch.equal(got[0], want), seed
    assert strata_mean(sd3, 0, 7, 4) == (pytest.approx(0.854, abs=5e-4), list(range(7)))  # the recipe
    assert strata_mean(sd3, 0, 6, 4) == (pytest.approx(0.886, abs=5e-4), list(range(6)))  # the index reading of 0.6
    assert strata_mean(ff, 0, 8, 4) == (pytest.approx(0.820, abs=5e-4), list(range(8)))  # F on its own schedule
    assert [int(i) for i in torch.where(ff[:-1] * 1000 >= 400)[0]] == list(range(9))  # not its comment's 0 .. 6
    assert (torch.tensor([999, 963, 922, 874, 817, 749, 666]) / 1000).mean().item() == pytest.approx(0.856, abs=5e-4)


def test_crd_keeps_flow_factorys_indices_and_departs_in_their_sigmas(monkeypatch):
    """On SD3's schedule the recipe's strata are F's rule's (tests/test_crd.py draws them); on F's own schedule that
    rule keeps index 9 (0.25 >= 0.01) and draws down to 0.4286, here down to 0.465 (losses.crd, departure 3)."""
    args = recipe_args("sd3_crd_ocr.args", monkeypatch)
    sd3, ff = sde.sd3_sigmas(10), flow_factory_schedule(10)
    for seed in range(10):
        got = losses.LOSSES["crd"].times(2, torch.Generator().manual_seed(seed), **args)[0]
        assert torch.equal(got, flow_factory_discrete(sd3, 20, 0.99, torch.Generator().manual_seed(seed)))
    here, there = strata_mean(sd3, 0, 8, 20), strata_mean(ff, 0, 9, 20)
    assert here[1] == list(range(8)) and there[1] == list(range(9))
    assert (sd3[7].item(), ff[8].item()) == (pytest.approx(0.4649, abs=1e-4), pytest.approx(0.4286, abs=1e-4))
    assert (here[0], there[0]) == (pytest.approx(0.795, abs=5e-4), pytest.approx(0.790, abs=5e-4))


@pytest.mark.slow
def test_the_shapes_model_samples_and_scores_alike_on_both_schedules(tmp_path, monkeypatch):
    """The measurement departure 17 quotes: the shapes model (SD3's architecture and scheduler) sampled with 10 Euler
    steps on each schedule from the same noise, its 360 held-out prompts under 5 seeds (eval.py, as a run evaluates)."""
    import data
    import eval as evaluation

    monkeypatch.chdir(ROOT)
    sd3_sigmas = models.sigmas

    def flow_factory_sigmas(pipe, num_steps, resolution, *, shift=None):
        return common.flow_match_sigmas(pipe.scheduler.config, np.linspace(1.0, 1 / num_steps, num_steps), shift=shift)

    scores = {}
    for name, schedule in (("sd3", sd3_sigmas), ("flow-factory", flow_factory_sigmas)):
        monkeypatch.setattr(models, "sigmas", schedule)
        for seed in range(5):
            out = tmp_path / f"{name}-{seed}"
            evaluation.main(["--model", "shapes", "--eval-steps", "10", "--seed", str(seed), "--out", str(out),
                             "--grid-rows", "2"])
            with open(out / "summary.json") as f:
                result = json.load(f)["results"]["base"]
            scores.setdefault(name, []).append((result["geneval_overall"], result["reward"]))
    accuracy = {k: np.mean([a for a, _ in v]) for k, v in scores.items()}
    reward = {k: np.mean([r for _, r in v]) for k, v in scores.items()}
    assert accuracy["sd3"] == pytest.approx(0.373, abs=5e-4) and reward["sd3"] == pytest.approx(0.573, abs=5e-4)
    assert abs(accuracy["flow-factory"] - accuracy["sd3"]) < 0.005
    assert abs(reward["flow-factory"] - reward["sd3"]) < 0.005

    pipe = models.load_pipeline("shapes")
    texts = data.load_prompts("prompts/shapes_test.jsonl", input_key="prompt")[0]
    images = {}
    for name, schedule in (("sd3", sd3_sigmas), ("flow-factory", flow_factory_sigmas)):
        monkeypatch.setattr(models, "sigmas", schedule)
        images[name] = evaluation.sample_images(pipe, texts, resolution=32, num_steps=10, guidance_scale=1.0).float()
    assert (images["sd3"] - images["flow-factory"]).abs().mean().item() == pytest.approx(0.95, abs=0.05)
