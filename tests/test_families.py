"""The families of families/ against their diffusers pipelines, on the tiny twins (no download).

For each family: an Euler ODE through models.velocity reproduces the pipeline's own __call__ (Wan:
its first UniPC step, which is an Euler step; the others: the whole trajectory, and the decoded
pixels). And for every tiny twin of the registry that generates from text: models.sigmas equals
the schedule its pipeline's __call__ sets up (__call__ run until it sets the timesteps, so its own
token count and shift); a rollout scored again by sde.sde_step gives the same log-probs
bit for bit (the first-update ratio is exactly 1); a LoRA written by models.save_lora loads with the
pipeline's load_lora_weights and gives the adapted velocity; train.py runs it two steps. Every hub
model, offline, fails in one sentence naming --model-path.
"""

import functools
import inspect
import json
import math
import os

import huggingface_hub.constants
import numpy as np
import pytest
import torch

import families
import models
import rewards
import sde
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = ['a sign that says "hello"', "a red cube on a blue sphere"]
# The tiny twins of the registry that generate from text (the edit twins, which need source images:
# tests/test_edit_models.py); the hub models it names.
TWINS = [name for name, f in models.MODELS.items() if name.startswith("tiny") and f.source_images != "required"]
HUB = [name for name, f in models.MODELS.items() if f.hub_id]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def pipes():
    return {name: models.load_pipeline(name) for name in TWINS}


def noise(pipe, name, seed=0, batch=2):
    generator = torch.Generator().manual_seed(seed)
    frames = models.MODELS[name].preset.get("num_frames")  # tiny-wan: 5 frames -> 2 latent frames
    return models.initial_noise(pipe, batch, 64, num_frames=frames, generator=generator)


def euler(pipe, x, sigmas, embeds, guidance_scale):
    for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        x = x + (s_next - s) * models.velocity(pipe, x, s, embeds, guidance_scale=guidance_scale).float()
    return x


# ----------------------------------------------------------------------------- against the pipelines

def test_wan_first_step_and_decode_match_the_pipeline(pipes):
    pipe = pipes["tiny-wan"]
    x = noise(pipe, "tiny-wan")
    assert x.shape == (2, 16, 2, 8, 8)  # 8x spatial, 4x temporal compression
    # One step: UniPC's single step (order 1, into sigma 0) is exactly an Euler step, then the VAE.
    call = dict(prompt=list(PROMPTS), negative_prompt="", num_inference_steps=1, guidance_scale=4.5, height=64,
                width=64, num_frames=5, latents=x.clone(), max_sequence_length=models.default_tokens(pipe))
    expected = pipe(**call, output_type="latent").frames
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.5)
    with torch.no_grad():
        ours = euler(pipe, x, models.sigmas(pipe, 1, 64), embeds, 4.5)
        cond = models.velocity(pipe, x, 0.9, embeds)
        assert (cond - models.velocity(pipe, x, 0.9, embeds, guidance_scale=4.5)).abs().max() > 1e-3  # CFG is used
    assert (ours - x).abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    video = models.decode(pipe, ours)
    assert video.shape == (2, 5, 64, 64, 3) and video.dtype == torch.uint8  # [B, F, H, W, 3]
    frames = torch.from_numpy(pipe(**call, output_type="np").frames * 255)
    assert (video.float() - frames).abs().max() <= 1
    # A first step inside a 4-step schedule (integer timestep floor(1000 s) of a sigma below 1).
    stop = lambda p, i, t, kw: (setattr(p, "_interrupt", True), kw)[1]
    first = pipe(**dict(call, num_inference_steps=4), output_type="latent", callback_on_step_end=stop).frames
    with torch.no_grad():
        ours_first = euler(pipe, x, models.sigmas(pipe, 4, 64)[:2], embeds, 4.5)
    torch.testing.assert_close(ours_first, first, atol=1e-4, rtol=1e-4)


def test_wan22_routes_each_sample_to_the_pipelines_expert(pipes):
    """WanPipeline.__call__ runs `transformer` where t = floor(1000 s) >= boundary_ratio x 1000, `transformer_2` below.
    Its first step (t = 999, an Euler step) against ours with the boundary at 999 and at 1000: one timestep apart, the
    two experts; and a batch of samples on both sides of the boundary, each given its expert's velocity."""
    pipe = pipes["tiny-wan2.2"]
    x = noise(pipe, "tiny-wan2.2")
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.5)
    call = dict(prompt=list(PROMPTS), negative_prompt="", num_inference_steps=1, guidance_scale=4.5, height=64,
                width=64, num_frames=5, latents=x.clone(), max_sequence_length=models.default_tokens(pipe))
    first = {}
    try:
        for ratio in (0.999, 1.0):
            pipe.register_to_config(boundary_ratio=ratio)
            expected = pipe(**call, output_type="latent").frames
            with torch.no_grad():
                first[ratio] = euler(pipe, x, models.sigmas(pipe, 1, 64), embeds, 4.5)
            torch.testing.assert_close(first[ratio], expected, atol=1e-4, rtol=1e-4)
    finally:
        pipe.register_to_config(boundary_ratio=0.875)
    assert (first[0.999] - first[1.0]).abs().mean() > 0.05  # the two experts differ
    one = {name: {"transformer": getattr(pipe, name)} for name in ("transformer", "transformer_2")}  # no routing
    # t = 876 and 875 (the boundary itself) take the high-noise expert, 874 the low-noise one
    for s, expert in [(0.876, "transformer"), (0.875, "transformer"), (0.8749, "transformer_2")]:
        with torch.no_grad():
            v = models.velocity(pipe, x, s, embeds, guidance_scale=4.5)
            torch.testing.assert_close(v, models.velocity(pipe, x, s, embeds, guidance_scale=4.5, modules=one[expert]))
    sigma = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        mixed = models.velocity(pipe, x, sigma, embeds, guidance_scale=4.5)
        high = models.velocity(pipe, x, sigma, embeds, guidance_scale=4.5, modules=one["transformer"])
        low = models.velocity(pipe, x, sigma, embeds, guidance_scale=4.5, modules=one["transformer_2"])
    torch.testing.assert_close(mixed, torch.stack([high[0], low[1]]), atol=1e-5, rtol=1e-5)


def test_wan22_guides_the_low_noise_expert_by_its_own_scale(pipes):
    """--guidance-scale-2 (pipe.guidance_scale_2) is WanPipeline's guidance_scale_2: the low-noise expert's CFG scale
    (the model card's 4.0 and 3.0), against __call__ with the boundary above the first step; the high-noise expert
    keeps --guidance-scale, and a forward without CFG stays without it."""
    pipe = pipes["tiny-wan2.2"]
    x = noise(pipe, "tiny-wan2.2", seed=5)
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.0)
    call = dict(prompt=list(PROMPTS), negative_prompt="", num_inference_steps=1, guidance_scale=4.0,
                guidance_scale_2=3.0, height=64, width=64, num_frames=5, latents=x.clone(),
                max_sequence_length=models.default_tokens(pipe))
    one = {name: {"transformer": getattr(pipe, name)} for name in ("transformer", "transformer_2")}
    try:
        pipe.guidance_scale_2 = 3.0
        pipe.register_to_config(boundary_ratio=1.0)  # t = 999 < 1000: the first step is the low-noise expert's
        expected = pipe(**call, output_type="latent").frames
        with torch.no_grad():
            ours = euler(pipe, x, models.sigmas(pipe, 1, 64), embeds, 4.0)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        pipe.register_to_config(boundary_ratio=0.875)
        with torch.no_grad():
            for s, name, g in [(0.9, "transformer", 4.0), (0.5, "transformer_2", 3.0)]:
                torch.testing.assert_close(models.velocity(pipe, x, s, embeds, guidance_scale=4.0),
                                           models.velocity(pipe, x, s, embeds, guidance_scale=g, modules=one[name]))
            torch.testing.assert_close(models.velocity(pipe, x, 0.5, embeds),  # no CFG: none for either expert
                                       models.velocity(pipe, x, 0.5, embeds, modules=one["transformer_2"]))
    finally:
        pipe.guidance_scale_2 = None
        pipe.register_to_config(boundary_ratio=0.875)


@pytest.mark.parametrize("name", ["tiny-qwen-image", "tiny-z-image"])
def test_euler_matches_pipeline(name, pipes):
    pipe = pipes[name]
    x = noise(pipe, name)
    g = 4.0
    call = dict(prompt=list(PROMPTS), num_inference_steps=4, height=64, width=64, latents=x.clone(),
                max_sequence_length=models.default_tokens(pipe))
    if name == "tiny-qwen-image":
        call.update(negative_prompt="", true_cfg_scale=g)
    else:
        call.update(guidance_scale=g - 1)  # Z-Image counts guidance from 0: its w is our g - 1
    expected = pipe(**call, output_type="latent").images
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=g)
    with torch.no_grad():
        ours = euler(pipe, x, models.sigmas(pipe, 4, 64), embeds, g)
        guided = models.velocity(pipe, x, 0.6, embeds, guidance_scale=g)
        assert (models.velocity(pipe, x, 0.6, embeds) - guided).abs().max() > 1e-3  # CFG is used
    assert (ours - x).abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    call["prompt"] = list(PROMPTS)  # ZImagePipeline writes its chat template into the list it is given
    images = torch.from_numpy(pipe(**call, output_type="np").images * 255)
    assert (models.decode(pipe, ours).float() - images).abs().max() <= 1


@pytest.mark.parametrize("distilled", [False, True])
def test_flux2_klein_matches_pipeline(distilled, pipes):
    pipe = pipes["tiny-flux2-klein"]
    pipe.register_to_config(is_distilled=distilled)  # the step-distilled models: no guidance at all
    try:
        x = noise(pipe, "tiny-flux2-klein")
        side = 16  # 64 px / 4 (VAE)
        assert x.shape == (2, side * side // 4, 16)
        unpacked = x.permute(0, 2, 1).reshape(2, 16, side // 2, side // 2)  # what prepare_latents takes
        call = dict(prompt=list(PROMPTS), num_inference_steps=4, guidance_scale=4.0, height=64, width=64,
                    latents=unpacked.clone(), max_sequence_length=models.default_tokens(pipe))
        expected = pipe(**call, output_type="latent").images  # unpacked, batch-norm undone, unpatchified
        embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.0)
        assert ("neg_prompt_embeds" in embeds) != distilled
        with torch.no_grad():
            ours = euler(pipe, x, models.sigmas(pipe, 4, 64), embeds, 4.0)
        assert (ours - x).abs().mean() > 0.1
        vae = pipe.vae
        z = ours.permute(0, 2, 1).reshape(2, 16, side // 2, side // 2)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        z = z * std + vae.bn.running_mean.view(1, -1, 1, 1)
        torch.testing.assert_close(pipe._unpatchify_latents(z), expected, atol=1e-4, rtol=1e-4)
        images = torch.from_numpy(pipe(**call, output_type="np").images * 255)
        assert (models.decode(pipe, ours).float() - images).abs().max() <= 1
    finally:
        pipe.register_to_config(is_distilled=False)


@pytest.mark.parametrize("name", ["tiny-qwen-image", "tiny-flux2-klein", "tiny-flux"])
def test_bf16_transformer_inputs_and_outputs_are_the_pipelines(name):
    """Loaded in bf16 (as train.py loads the frozen base of a LoRA run), each adapter hands the transformer what the
    pipeline's __call__ hands it, bit for bit: the timestep t.to(latents.dtype) / 1000 with t = 1000 s the
    scheduler's (rounded to bf16 before the division, not s.to(bf16)), hence the same velocity. 10 steps, no CFG
    (the pipeline runs the two CFG halves as separate forwards, ours as one batch)."""
    pipe = models.load_pipeline(name, dtype=torch.bfloat16)
    sigmas = models.sigmas(pipe, 10, 64)
    rounded_late = (sigmas[:-1] * 1000).to(torch.bfloat16) / 1000
    assert (sigmas[:-1].to(torch.bfloat16) != rounded_late).any()  # the two orders differ somewhere: it can fail
    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((kwargs["hidden_states"], kwargs["timestep"], out[0])),
        with_kwargs=True)
    try:
        x = noise(pipe, name, seed=1)
        tokens = models.default_tokens(pipe)
        call = dict(prompt=list(PROMPTS), num_inference_steps=10, height=64, width=64, output_type="latent",
                    max_sequence_length=tokens)
        if name == "tiny-qwen-image":
            pipe(**call, latents=x.clone(), true_cfg_scale=1.0)
        elif name == "tiny-flux2-klein":
            pipe(**call, latents=x.permute(0, 2, 1).reshape(2, 16, 8, 8).clone(), guidance_scale=1.0)
        else:
            pipe(**call, latents=x.clone(), guidance_scale=3.5)
        theirs, calls[:] = list(calls), []
        assert len(theirs) == 10 and theirs[0][0].dtype == torch.bfloat16
        g = 3.5 if name == "tiny-flux" else 1.0  # FLUX.1's guidance is an embedding, not CFG
        embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=1.0, max_sequence_length=tokens)
        with torch.no_grad():
            for k, (hidden, _, _) in enumerate(theirs):  # ours at the pipeline's own latents of each step
                models.velocity(pipe, hidden, sigmas[k].item(), embeds, guidance_scale=g)
    finally:
        hook.remove()
    for k, ((_, t_theirs, v_theirs), (hidden, t_ours, v_ours)) in enumerate(zip(theirs, calls)):
        assert torch.equal(hidden, theirs[k][0]), k
        assert t_ours.dtype == t_theirs.dtype and torch.equal(t_ours, t_theirs), (k, t_ours, t_theirs)
        assert torch.equal(v_ours, v_theirs), k


def test_qwen_image_vae_stays_float32_in_a_bf16_load(pipes):
    """Flow-GRPO keeps Qwen-Image's VAE in float32 whatever the mixed precision (train_qwenimage.py L404) and
    decodes under its rollout's bf16 autocast (L655): a bf16 load decodes as the float32 load does, there."""
    pipe = models.load_pipeline("tiny-qwen-image", dtype=torch.bfloat16)
    assert pipe.vae.dtype == torch.float32 and pipe.transformer.dtype == torch.bfloat16
    z = noise(pipe, "tiny-qwen-image", seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as train.py decodes its rollouts
        ours, reference = models.decode(pipe, z), models.decode(pipes["tiny-qwen-image"], z)
    assert torch.equal(ours, reference) and ours.float().std() > 1


def test_noise_is_the_pipelines_noise(pipes):
    for name in ("tiny-wan", "tiny-qwen-image", "tiny-flux2-klein", "tiny-z-image"):
        pipe = pipes[name]
        ours = noise(pipe, name, seed=3)
        g = torch.Generator().manual_seed(3)
        if name == "tiny-wan":
            theirs = pipe.prepare_latents(2, 16, 64, 64, 5, torch.float32, "cpu", g)
        elif name == "tiny-z-image":
            theirs = pipe.prepare_latents(2, pipe.transformer.in_channels, 64, 64, torch.float32, "cpu", g)
        else:
            theirs = pipe.prepare_latents(2, pipe.transformer.config.in_channels // 4, 64, 64, torch.float32, "cpu", g)
            theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        assert torch.equal(ours, theirs), name


# ----------------------------------------------------------------------------- native schedules

class _ScheduleSet(Exception):
    """Raised by reference_sigmas' scheduler once __call__ has set its schedule: nothing after it need run."""


def reference_sigmas(pipe, name, num_steps, resolution):
    """The sigmas that the pipeline's own __call__ sets up: __call__ runs on a copy of its scheduler until it sets the
    timesteps, with the size and frames our run samples at. Whatever the family's latent layout, its pipeline's code
    counts the tokens of the resolution-dependent shift (packed [B, tokens, C], channels first [B, C, H, W], frames),
    so a new family's schedule is checked without a branch here."""
    original = pipe.scheduler
    scheduler = pipe.scheduler = type(original).from_config(original.config)
    set_timesteps = scheduler.set_timesteps

    @functools.wraps(set_timesteps)  # retrieve_timesteps reads its signature (sigmas=, mu=)
    def set_and_stop(*args, **kwargs):
        set_timesteps(*args, **kwargs)
        raise _ScheduleSet

    scheduler.set_timesteps = set_and_stop
    takes = inspect.signature(type(pipe).__call__).parameters
    call = dict(prompt="a red cube", num_inference_steps=num_steps, height=resolution, width=resolution,
                output_type="latent")
    if models.MODELS[name].preset.get("num_frames") and "num_frames" in takes:
        call["num_frames"] = models.MODELS[name].preset["num_frames"]  # the frames our run samples
    if "max_area" in takes:  # FluxKontextPipeline would resize to 1024^2 pixels
        call["max_area"] = resolution * resolution
    try:
        pipe(**call)
    except _ScheduleSet:
        return scheduler.sigmas
    finally:
        pipe.scheduler = original
    raise AssertionError(f"{type(pipe).__name__}.__call__ never set its scheduler's timesteps")


@pytest.mark.parametrize("name", TWINS)
def test_schedule_is_the_pipelines(name, pipes):
    pipe = pipes[name]
    for num_steps, resolution in [(4, 64), (10, 64), (28, 128), (16, 512)]:
        if models.MODELS[name].video and resolution > 128:
            continue
        expected = reference_sigmas(pipe, name, num_steps, resolution)
        frames = models.MODELS[name].preset.get("num_frames")  # as train.py asks: ltx2's shift counts the frames
        ours = models.sigmas(pipe, num_steps, resolution, num_frames=frames)
        assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
        assert ours[-1] == 0 and (ours[1:] < ours[:-1]).all()
        torch.testing.assert_close(ours, expected.float(), atol=0, rtol=0,
                                   msg=f"{name} {num_steps} steps {resolution} px")


def test_schedules_depend_on_what_they_should(pipes):
    flux = models.load_pipeline("tiny-flux")
    klein, qwen, z = pipes["tiny-flux2-klein"], pipes["tiny-qwen-image"], pipes["tiny-z-image"]
    for pipe in (flux, klein, qwen):  # resolution-dependent shifts: more tokens, more noise
        assert (models.sigmas(pipe, 10, 256)[1:-2] > models.sigmas(pipe, 10, 64)[1:-2]).all()
    assert models.sigmas(qwen, 10, 64)[-2] == models.sigmas(qwen, 10, 256)[-2] == pytest.approx(0.02)  # shift_terminal
    torch.testing.assert_close(models.sigmas(z, 10, 256), models.sigmas(z, 10, 64))  # a static shift
    assert not torch.equal(models.sigmas(klein, 10, 64)[1:5], models.sigmas(klein, 20, 64)[1:5:2])  # mu(N)
    # klein's empirical mu, transcribed, against the pipeline's function on both branches
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    for tokens, steps in [(256, 4), (1024, 50), (4096, 28), (4301, 28), (16384, 4)]:
        assert families.flux2_klein.empirical_mu(tokens, steps) == pytest.approx(compute_empirical_mu(tokens, steps),
                                                                               rel=1e-12)


def test_shift_overrides_every_schedule(pipes):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    sd3 = models.load_pipeline("tiny")
    reference = FlowMatchEulerDiscreteScheduler(shift=5.0)
    reference.set_timesteps(10)
    torch.testing.assert_close(models.sigmas(sd3, 10, 64, shift=5.0), reference.sigmas, atol=0, rtol=0)
    wan = UniPCMultistepScheduler.from_config(pipes["tiny-wan"].scheduler.config, flow_shift=5.0)
    wan.set_timesteps(10)
    torch.testing.assert_close(models.sigmas(pipes["tiny-wan"], 10, 64, shift=5.0), wan.sigmas, atol=0, rtol=0)
    z = FlowMatchEulerDiscreteScheduler.from_config(pipes["tiny-z-image"].scheduler.config, shift=5.0)
    z.set_timesteps(sigmas=np.linspace(1.0, 0.1, 10).astype(np.float32), mu=0.0)
    torch.testing.assert_close(models.sigmas(pipes["tiny-z-image"], 10, 64, shift=5.0), z.sigmas, atol=1e-7, rtol=0)
    # On a resolution-dependent schedule --shift is a static shift of the same grid (MixGRPO's FLUX.1 schedule:
    # sd3_time_shift(3, linspace(1, 0, N + 1)) in its train_grpo_flux.py).
    for name in ("tiny-flux", "tiny-qwen-image", "tiny-flux2-klein"):
        t = torch.linspace(1, 0, 11, dtype=torch.float64)
        static = (3 * t / (1 + 2 * t)).float()
        got = models.sigmas(pipes[name] if name in pipes else models.load_pipeline(name), 10, 64, shift=3.0)
        if name == "tiny-qwen-image":  # its config stretches the end to shift_terminal 0.02
            static = 1 - (1 - static) / ((1 - static[-2]) / (1 - 0.02))
            static[-1] = 0
        torch.testing.assert_close(got, static, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- RL plumbing

@pytest.mark.parametrize("name", TWINS)
def test_first_update_ratio_is_exactly_one(name, pipes):
    """A rollout's stored transitions, scored again with the same velocity, give the same log-probs:
    the on-policy ratio of the first update is exactly 1 in float32 (train.py asserts it)."""
    pipe = pipes[name]
    g = 3.0
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=g)
    sigmas = models.sigmas(pipe, 4, 64)
    x = noise(pipe, name, seed=5)

    def v(x_, s_):
        return models.velocity(pipe, x_, s_, embeds, guidance_scale=g)

    traj = sde.rollout(v, x, sigmas, sde_steps=[0, 1, 2], generator=torch.Generator().manual_seed(6))
    assert traj["latents"].shape == (2, 5, *x.shape[1:])
    sigma_max = sigmas[1].item()
    with torch.no_grad():
        for j, k in enumerate(traj["steps"].tolist()):
            xk = traj["latents"][:, k].contiguous()  # as train.py indexes it (a copy)
            out = sde.sde_step(v(xk, sigmas[k].item()), xk, sigmas[k].item(), sigmas[k + 1].item(),
                               prev_sample=traj["latents"][:, k + 1], sigma_max=sigma_max)
            assert torch.equal(out.log_prob, traj["log_probs"][:, j]), (name, k)
            assert torch.equal(out.mean, traj["means"][:, j])
    assert torch.isfinite(traj["log_probs"]).all()


@pytest.mark.parametrize("name", TWINS)
def test_lora_roundtrips_through_the_pipelines_loader(name, tmp_path):
    pipe = models.load_pipeline(name)
    embeds = models.encode_prompts(pipe, PROMPTS)
    x = noise(pipe, name, seed=2)

    sigma = torch.tensor([0.95, 0.5])  # Wan 2.2: one sample for each expert

    def v(p):
        with torch.no_grad():
            return models.velocity(p, x, sigma, embeds)

    base = v(pipe)
    params = models.add_lora(pipe, rank=4, alpha=8)  # alpha != rank: the saved scale must survive loading
    for module in models.trained_modules(pipe).values():
        trainable = {n.rsplit(".lora_", 1)[0] for n, p in module.named_parameters() if p.requires_grad}
        targets = models.family(pipe).lora_targets
        assert all(any(t.endswith("." + target) for t in trainable) for target in targets)  # every target exists
    torch.testing.assert_close(v(pipe), base)  # LoRA B starts at zero
    with torch.no_grad():
        for i, p in enumerate(params):
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(i))
    tuned = v(pipe)
    assert (tuned - base).abs().max() > 1e-2
    models.velocity(pipe, x, sigma, embeds).square().mean().backward()
    assert all(p.grad is not None for p in params)  # what DDP needs: no trained layer without a gradient
    with models.reference(pipe):
        torch.testing.assert_close(v(pipe), base, atol=0, rtol=0)
    models.save_lora(pipe, tmp_path)
    fresh = models.load_pipeline(name)
    if hasattr(fresh, "load_lora_weights"):
        fresh.load_lora_weights(tmp_path)
    else:  # HunyuanVideo15Pipeline has no LoRA loader in diffusers 0.42: its transformer's (families/hunyuan_video.py)
        fresh.transformer.load_lora_adapter(tmp_path, weight_name="pytorch_lora_weights.safetensors")
    for extra in list(models.trained_modules(pipe))[1:]:  # Wan 2.2's second expert, as diffusers loads it
        fresh.load_lora_weights(tmp_path / extra, **{f"load_into_{extra}": True})
    torch.testing.assert_close(v(fresh), tuned, atol=1e-5, rtol=1e-5)


def test_full_finetune_leaves_out_layers_without_gradient():
    pipe = models.load_pipeline("tiny-qwen-image")
    params = models.add_lora(pipe, rank=0, alpha=0)
    frozen = {n for n, p in pipe.transformer.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith("transformer_blocks.1.") for n in frozen)  # the last block's text output
    embeds = models.encode_prompts(pipe, PROMPTS)
    models.velocity(pipe, noise(pipe, "tiny-qwen-image"), 0.5, embeds).square().mean().backward()
    assert all(p.grad is not None for p in params)


def test_video_shapes_frames_and_rewards(pipes):
    wan = pipes["tiny-wan"]
    assert models.is_video(wan) and not models.is_video(pipes["tiny-z-image"])
    assert models.latent_shape(wan, 64, num_frames=33) == (16, 9, 8, 8)
    assert models.latent_shape(wan, (48, 80), num_frames=1) == (16, 1, 6, 10)  # (height, width)
    with pytest.raises(ValueError, match="--num-frames 6 must be 4 k \\+ 1"):
        models.initial_noise(wan, 1, 64, num_frames=6)
    with pytest.raises(ValueError, match="--num-frames is for video"):
        models.initial_noise(pipes["tiny-qwen-image"], 1, 64, num_frames=5)
    with pytest.raises(ValueError, match="square --resolution"):
        models.latent_shape(pipes["tiny-flux2-klein"], (64, 128))
    video = models.decode(wan, noise(wan, "tiny-wan"))
    assert video.shape == (2, 5, 64, 64, 3) and video.float().std() > 1
    scores = rewards.build_reward("jpeg_compressibility")(video.numpy(), PROMPTS, [{}, {}])["reward"]
    frame_scores = [rewards.build_reward("jpeg_compressibility")(v.numpy(), PROMPTS[:1] * 5, [{}] * 5)["reward"].mean()
                    for v in video]
    torch.testing.assert_close(scores.float(), torch.stack(frame_scores).float())  # a video scores its frames' mean


def test_prompt_length_defaults_and_override(pipes):
    assert models.default_tokens(models.load_pipeline("sd3-random", device="meta")) == 128  # Flow-GRPO's SD3 T5 length
    wan = pipes["tiny-wan"]
    assert models.default_tokens(wan) == 32  # 512, capped by the tiny tokenizer's context
    assert models.encode_prompts(wan, PROMPTS, max_sequence_length=16)["prompt_embeds"].shape == (2, 16, 32)
    z = pipes["tiny-z-image"]
    short = models.encode_prompts(z, ["word " * 80], max_sequence_length=24)
    assert short["prompt_mask"].sum() == 24  # the chat-templated prompt is cut at 24 tokens


def test_published_configs_have_the_published_sizes():
    """The transcribed hub configs build (meta device, no weights) to the sizes their model cards state."""
    stated = {"wan-1.3b": (1.3e9, 1.5e9), "wan-14b": (13.5e9, 14.5e9), "qwen-image": (19.5e9, 21e9),
              "flux2-klein-4b": (3.5e9, 4.5e9), "flux2-klein-9b": (8.5e9, 9.5e9), "z-image": (5.8e9, 6.4e9),
              "sd3.5-large": (8.0e9, 8.2e9)}  # 1.3B, 14B, 20B, 4B, 9B, 6B, 8.1B
    for name, (lo, hi) in stated.items():
        transformer = families.build_published(name, "transformer")
        assert lo < sum(p.numel() for p in transformer.parameters()) < hi, name
    umt5 = families.build_published("wan-1.3b", "text_encoder")  # umt5-xxl's encoder: 5.7 B
    assert 5.6e9 < sum(p.numel() for p in umt5.parameters()) < 5.8e9


def test_sd35_large_runs_through_sd3():
    """SD3.5-Large is the sd3 family by --model-path: the same adapter, schedule and LoRA targets. The schedule
    against diffusers' scheduler of its config after set_timesteps; the adapter against StableDiffusion3Pipeline's
    __call__ on a tiny transformer of its structure (no second attention in any block, RMS qk-norm)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    pipe = models.load_pipeline("sd3-random", device="meta")
    pipe.register_modules(transformer=families.build_published("sd3.5-large", "transformer").eval())
    assert models.family(pipe).name == "sd3"
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # stabilityai/stable-diffusion-3.5-large's config
    for num_steps in (10, 28, 40):
        scheduler.set_timesteps(num_steps)
        torch.testing.assert_close(models.sigmas(pipe, num_steps, 1024), scheduler.sigmas, atol=0, rtol=0)
    linears = {n for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    for target in families.sd3.LORA_TARGETS:  # every block has them (SD3.5-Large has no second attention)
        assert sum(n.endswith("." + target) for n in linears) >= 37

    tiny = models.load_pipeline("tiny")
    with families.common.seeded_build(1, "cpu"):
        large_like = SD3Transformer2DModel.from_config(tiny.transformer.config, dual_attention_layers=()).eval()
    assert large_like.config.qk_norm == "rms_norm" and not large_like.transformer_blocks[0].use_dual_attention
    tiny.register_modules(transformer=large_like)
    x = models.initial_noise(tiny, 2, 64, generator=torch.Generator().manual_seed(0))
    call = dict(prompt=PROMPTS, negative_prompt="", num_inference_steps=4, guidance_scale=3.5, height=64, width=64,
                latents=x.clone(), max_sequence_length=0)
    expected = tiny(**call, output_type="latent").images
    embeds = models.encode_prompts(tiny, PROMPTS, guidance_scale=3.5)
    with torch.no_grad():
        ours = euler(tiny, x, models.sigmas(tiny, 4, 64), embeds, 3.5)
    assert (ours - x).abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", TWINS)
def test_train_runs_two_steps(name, tmp_path, monkeypatch):
    """`python train.py --model tiny-<family> --steps 2`, shrunk: on-policy ratio 1, finite losses, samples saved
    (an animated GIF per prompt for video)."""
    from PIL import Image

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    train.main(["--model", name, "--steps", "2", "--num-steps", "4", "--prompts-per-step", "2", "--group-size", "4",
                "--sample-batch-size", "4", "--train-batch-size", "4", "--log-images-every", "2", "--out", str(out)])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and not any(r.get("skipped") for r in rows)
    assert rows[0]["first_ratio_dev"] < 1e-5 and all(math.isfinite(r["loss"]) for r in rows)
    saved = sorted(n for n in os.listdir(out / "samples") if not n.endswith((".wav", ".mp4")))  # ltx2's sound
    if models.MODELS[name].video:
        assert saved == ["000002_0.gif", "000002_1.gif"]  # one GIF per prompt: the grid shows both prompts of the step
        gif = Image.open(out / "samples" / saved[0])
        # 64 px frames enlarged 2x for reading, each of the 4 samples captioned below its frame
        assert gif.is_animated and gif.n_frames == 5 and gif.size[0] == 4 * 128 and gif.size[1] > 128 + 12
    else:
        assert saved == ["000002.png"]


@pytest.mark.parametrize("name", ["tiny-wan2.2", "tiny-wan2.2-5b", "tiny-hunyuan-video-1.5", "tiny-qwen-image-2.1"])
def test_the_newest_families_train_two_steps_with_lora(name, tmp_path, monkeypatch):
    """The test above trains every twin in full (the tiny preset's --lora-rank 0); the newest families also train
    through their LoRA adapters (LTX-2: tests/test_ltx2.py): on-policy ratio 1, finite losses, only adapters trained,
    and they moved (Wan 2.2: on both experts, the 4 steps crossing the boundary)."""
    from safetensors.torch import load_file

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    train.main(["--model", name, "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--steps", "2",
                "--num-steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4",
                "--train-batch-size", "4", "--log-images-every", "0", "--save-every", "2", "--out", str(out)])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and not any(r.get("skipped") for r in rows)
    assert rows[0]["first_ratio_dev"] < 1e-5 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    trained = load_file(out / "checkpoints" / "2" / "trainable.safetensors")
    assert trained and all("lora" in key for key in trained)
    moved = {key.split(".")[0] for key, t in trained.items() if "lora_B" in key and t.abs().max() > 0}
    assert moved
    if len(models.MODELS[name].trained) > 1:  # several modules: each name starts with its module's
        assert moved == set(models.MODELS[name].trained)


@pytest.mark.parametrize("name", HUB)
def test_offline_hub_model_names_the_flag(name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for path in (None, "no-such-org/no-such-model", str(tmp_path)):  # default id, missing id, empty folder
        with pytest.raises(RuntimeError, match="--model-path") as error:
            models.load_pipeline(name, path)
        assert isinstance(error.value.__context__, OSError)
        assert "\n" not in str(error.value)
    with pytest.raises(RuntimeError, match="does not exist.*--model-path"):
        models.load_pipeline(name, str(tmp_path / "missing"))
