"""Qwen-Image 2.1 (families/qwen_image21.py) against QwenImage21Pipeline, on the tiny twin (no download).

Whole Euler trajectories through models.velocity are QwenImage21Pipeline.__call__'s (its scheduler is FlowMatchEuler),
with CFG and without, its text KV cache on and off, and the decode is its images' RGB channels; each prompt of a batch
of different lengths gets the velocity the pipeline gives it alone (departure 1 of load's docstring), where the
pipeline's own padded batch does not; models.sigmas is the schedule __call__ sets up (also a checkpoint's
sample_sigmas); the noise is prepare_latents'; in bf16 the transformer sees what __call__ hands it, bit for bit. The
registry tests of tests/test_families.py (schedule at several resolutions, first-update ratio, LoRA round trip,
train.py two steps, the offline hub load) run the twin and the hub record too.
"""

import pytest
import torch

import families
import models

NAME = "tiny-qwen-image-2.1"
PROMPTS = ['a sign that says "hello"', "a red cube on a blue box"]  # the same length: the pipeline pads neither
UNEQUAL = ["a cat", "a red cube on a blue sphere at noon"]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def pipe():
    return models.load_pipeline(NAME)


def noise(pipe, seed=0, batch=2, resolution=64):
    return models.initial_noise(pipe, batch, resolution, generator=torch.Generator().manual_seed(seed))


def euler(pipe, x, sigmas, embeds, guidance_scale):
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
            x = x + (s_next - s) * models.velocity(pipe, x, s, embeds, guidance_scale=guidance_scale).float()
    return x


def call(pipe, prompts, x, g, **kwargs):
    """__call__ at 64 px from the latents x, CFG with the empty negative prompt where g > 1."""
    negative = dict(negative_prompt=[""] * len(prompts)) if g > 1 else {}
    return dict(prompt=list(prompts), num_inference_steps=4, height=64, width=64, latents=x.clone(), true_cfg_scale=g,
                **negative, **kwargs)


@pytest.mark.parametrize("g", [1.0, 4.0])
def test_euler_and_decode_match_the_pipeline(pipe, g):
    x = noise(pipe)
    assert x.shape == (2, 16, 16)  # 64 px / 16 = 4 x 4 tokens of 16 channels, unpatched
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=g)
    assert embeds["prompt_mask"].all()  # equal lengths: nothing padded, here or in the pipeline
    ours = euler(pipe, x, models.sigmas(pipe, 4, 64), embeds, g)
    assert (ours - x).abs().mean() > 0.1
    for cache in (False, True):  # the pipeline's text KV cache (its default) computes the same, to rounding
        expected = pipe(**call(pipe, PROMPTS, x, g, use_kv_cache=cache), output_type="latent").images
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    if g > 1:
        with torch.no_grad():
            guided = models.velocity(pipe, x, 0.6, embeds, guidance_scale=g)
            assert (models.velocity(pipe, x, 0.6, embeds) - guided).abs().max() > 1e-3  # CFG is used
    images = models.decode(pipe, ours)
    assert images.shape == (2, 64, 64, 3) and images.dtype == torch.uint8 and images.float().std() > 1
    rgba = pipe(**call(pipe, PROMPTS, x, g, use_kv_cache=False), output_type="np").images  # [B, H, W, 4]
    assert rgba.shape == (2, 64, 64, 4)
    assert (images.float() - torch.from_numpy(rgba[..., :3] * 255)).abs().max() <= 1


def test_each_prompt_gets_its_velocity_alone(pipe):
    """Departure 1: the text's length moves the image along RoPE's frame axis, so the pipeline's batch of a short and
    a long prompt (the short one padded) gives the short one another image than it gets alone; ours gives each prompt
    its image alone, in any batch, however its embeddings are padded, with CFG and without."""
    x = noise(pipe, seed=1)
    alone = [pipe(**call(pipe, [p], x[i:i + 1], 1.0, use_kv_cache=False), output_type="latent").images
             for i, p in enumerate(UNEQUAL)]
    batched = pipe(**call(pipe, UNEQUAL, x, 1.0, use_kv_cache=False), output_type="latent").images
    assert (batched[0] - alone[0][0]).abs().max() > 1e-3  # padding changes the pipeline's short prompt
    torch.testing.assert_close(batched[1], alone[1][0], atol=1e-4, rtol=1e-4)  # the longest is not padded
    sigmas = models.sigmas(pipe, 4, 64)
    embeds = models.encode_prompts(pipe, UNEQUAL)
    lengths = embeds["prompt_mask"].sum(dim=1).tolist()
    assert lengths[0] < lengths[1] and embeds["prompt_embeds"].shape[1] == lengths[1]
    ours = euler(pipe, x, sigmas, embeds, 1.0)
    torch.testing.assert_close(ours, torch.cat(alone), atol=1e-4, rtol=1e-4)
    padded = dict(zip(["prompt_embeds", "prompt_mask"], families.common.pad_tokens(
        embeds["prompt_embeds"], embeds["prompt_mask"], lengths[1] + 7)))  # as a longer prompt of the step pads it
    torch.testing.assert_close(euler(pipe, x, sigmas, padded, 1.0), ours, atol=1e-5, rtol=1e-5)
    # with CFG: the negative's rows and each prompt's at their own lengths, against __call__ per prompt
    guided = euler(pipe, x, sigmas, models.encode_prompts(pipe, UNEQUAL, guidance_scale=3.0), 3.0)
    expected = [pipe(**call(pipe, [p], x[i:i + 1], 3.0, use_kv_cache=False), output_type="latent").images
                for i, p in enumerate(UNEQUAL)]
    torch.testing.assert_close(guided, torch.cat(expected), atol=1e-4, rtol=1e-4)


def test_schedule_is_the_one_call_sets_up(pipe):
    """models.sigmas against the scheduler's sigmas after __call__ (mu from (H/16)(W/16) tokens, shift_terminal 0.02),
    and a checkpoint's own sample_sigmas (the Turbo's config), which __call__ prefers to num_inference_steps."""
    x = noise(pipe, resolution=128)
    for num_steps, resolution in [(4, 64), (6, 128)]:
        pipe(prompt=PROMPTS[:1], num_inference_steps=num_steps, height=resolution, width=resolution,
             latents=x[:1, : (resolution // 16) ** 2].clone(), output_type="latent")
        ours = models.sigmas(pipe, num_steps, resolution)
        assert ours.dtype == torch.float32 and ours[-2] == pytest.approx(0.02)
        torch.testing.assert_close(ours, pipe.scheduler.sigmas, atol=0, rtol=0)
    grid = [1.0, 0.95, 0.8, 0.4]
    try:
        pipe.register_to_config(sample_sigmas=grid)
        pipe(prompt=PROMPTS[:1], num_inference_steps=40, height=64, width=64, latents=x[:1, :16].clone(),
             output_type="latent")
        assert len(pipe.scheduler.sigmas) == 5
        torch.testing.assert_close(models.sigmas(pipe, 4, 64), pipe.scheduler.sigmas, atol=0, rtol=0)
        with pytest.raises(ValueError, match="--num-steps 4"):
            models.sigmas(pipe, 10, 64)
    finally:
        pipe.register_to_config(sample_sigmas=None)
    assert (models.sigmas(pipe, 10, 512)[1:-2] > models.sigmas(pipe, 10, 64)[1:-2]).all()  # more tokens, more noise


def test_noise_shape_and_text_length(pipe):
    ours = noise(pipe, seed=3)
    theirs, references = pipe.prepare_latents(None, 2, pipe.transformer.config.in_channels, 64, 64, torch.float32,
                                              "cpu", torch.Generator().manual_seed(3))
    assert references is None and torch.equal(ours, theirs)
    assert models.latent_shape(pipe, 256) == (256, 16)
    for bad in (80, (64, 128)):  # whole 2 x 2 groups of 16 px tokens; square (the grid is not in the tokens)
        with pytest.raises(ValueError):
            models.latent_shape(pipe, bad)
    assert models.default_tokens(pipe) == 512  # the record's, under the tiny tokenizer's context of 1024
    long = models.encode_prompts(pipe, ["word " * 200, "a cat"], max_sequence_length=64)  # departure 3
    assert long["prompt_embeds"].shape[1] == 64 and long["prompt_mask"].sum(dim=1).tolist() == [64, 24]


def test_bf16_transformer_inputs_and_outputs_are_the_pipelines():
    """Loaded in bf16, models.velocity hands the transformer what __call__ hands it, bit for bit (the timestep
    t.to(latents.dtype) / 1000 of the scheduler's t), hence the same output. 10 steps, no CFG, no KV cache."""
    pipe = models.load_pipeline(NAME, dtype=torch.bfloat16)
    sigmas = models.sigmas(pipe, 10, 64)
    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((dict(kwargs), out[0])), with_kwargs=True)
    try:
        x = noise(pipe, seed=1)
        pipe(prompt=list(PROMPTS), num_inference_steps=10, height=64, width=64, latents=x.clone(),
             output_type="latent", use_kv_cache=False)
        theirs, calls[:] = list(calls), []
        assert len(theirs) == 10 and theirs[0][0]["hidden_states"].dtype == torch.bfloat16
        embeds = models.encode_prompts(pipe, PROMPTS)
        with torch.no_grad():
            for k, (kwargs, _) in enumerate(theirs):  # ours at the pipeline's own latents of each step
                models.velocity(pipe, kwargs["hidden_states"], sigmas[k].item(), embeds)
    finally:
        hook.remove()
    assert len(calls) == 10
    for k, ((t_kwargs, t_out), (o_kwargs, o_out)) in enumerate(zip(theirs, calls)):
        for key in ("hidden_states", "timestep", "encoder_hidden_states", "img_mask"):
            assert torch.equal(o_kwargs[key], t_kwargs[key]), (k, key)
        assert o_kwargs["img_shapes"] == t_kwargs["img_shapes"] and o_kwargs["encoder_hidden_states_mask"] is None
        assert torch.equal(o_out, t_out), k


def test_published_config_sizes():
    """The published components build (meta device) to their sizes: a 7.1 B transformer, Qwen3-VL-8B (8.8 B with
    its vision tower), a 0.34 B VAE."""
    sizes = {c: sum(p.numel() for p in families.build_published("qwen-image-2.1", c).parameters())
             for c in ("transformer", "text_encoder", "vae")}
    assert 7.0e9 < sizes["transformer"] < 7.2e9
    assert 8.7e9 < sizes["text_encoder"] < 8.8e9
    assert 0.3e9 < sizes["vae"] < 0.4e9
    config = families.build_published("qwen-image-2.1", "transformer").config
    assert (config.num_layers, config.in_channels, config.context_in_dim, config.causal_condition) == (32, 64, 4096,
                                                                                                     True)
    assert models.MODELS["qwen-image-2.1"].preset["guidance_scale"] == 1.0  # sampled without CFG
