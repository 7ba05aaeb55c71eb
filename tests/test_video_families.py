"""Wan 2.2 TI2V-5B (families/wan.py) and HunyuanVideo 1.5 (families/hunyuan_video.py) against their diffusers
pipelines, on the tiny twins (no download).

Wan 2.2 TI2V-5B: its first UniPC step (an Euler step) through models.velocity is WanPipeline.__call__'s with
expand_timesteps, alone and as the first of four, the transformer given the pipeline's per-token timesteps; the decode
is its frames; the noise its prepare_latents. HunyuanVideo 1.5: whole Euler trajectories through models.velocity are
HunyuanVideo15Pipeline.__call__'s (its scheduler is FlowMatchEuler), with its CFG guider on and off; models.sigmas is
the schedule __call__ set up; the decode is its frames; the noise its prepare_latents; in bf16 the transformer sees
what __call__ hands it, bit for bit. The registry tests of tests/test_families.py (schedule at several resolutions,
first-update ratio, LoRA round trip, train.py two steps) run both twins too.
"""

import pytest
import torch

import families
import models

PROMPTS = ['a sign that says "hello"', "a red cube on a blue sphere"]  # the first brings ByT5 glyph text
WAN = "tiny-wan2.2-5b"
HUNYUAN = "tiny-hunyuan-video-1.5"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def pipes():
    return {name: models.load_pipeline(name) for name in (WAN, HUNYUAN)}


def noise(pipe, seed=0, batch=2):
    return models.initial_noise(pipe, batch, 64, num_frames=5, generator=torch.Generator().manual_seed(seed))


def euler(pipe, x, sigmas, embeds, guidance_scale):
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
            x = x + (s_next - s) * models.velocity(pipe, x, s, embeds, guidance_scale=guidance_scale).float()
    return x


def transformer_calls(pipe):
    """A forward hook recording each call's keyword inputs and output: (calls, the hook's handle)."""
    calls = []
    handle = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((dict(kwargs), out[0])), with_kwargs=True)
    return calls, handle


# ----------------------------------------------------------------------------- Wan 2.2 TI2V-5B

def test_wan22_5b_first_step_timesteps_and_decode_match_the_pipeline(pipes):
    pipe = pipes[WAN]
    x = noise(pipe)
    assert x.shape == (2, 48, 2, 4, 4)  # 48 channels; 16x spatial (2 x 2 patchify, then 8x), 4x temporal
    assert pipe.config.expand_timesteps and models.family(pipe).multiple == 32
    call = dict(prompt=list(PROMPTS), negative_prompt="", num_inference_steps=1, guidance_scale=4.5, height=64,
                width=64, num_frames=5, latents=x.clone(), max_sequence_length=models.default_tokens(pipe))
    calls, handle = transformer_calls(pipe)
    try:
        expected = pipe(**call, output_type="latent").frames  # two forwards: conditional, then unconditional
        embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.5)
        ours = euler(pipe, x, models.sigmas(pipe, 1, 64), embeds, 4.5)  # one forward, both halves
    finally:
        handle.remove()
    (theirs, _), _, (mine, _) = calls
    assert theirs["timestep"].shape == (2, 2 * 2 * 2)  # [B, F' (h / 2)(w / 2)]: a timestep per token
    assert (theirs["timestep"] == 999).all() and theirs["timestep"].dtype == torch.float32
    torch.testing.assert_close(mine["timestep"], torch.cat([theirs["timestep"]] * 2), atol=0, rtol=0)
    assert (ours - x).abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        assert (models.velocity(pipe, x, 0.9, embeds) - models.velocity(pipe, x, 0.9, embeds, guidance_scale=4.5)
                ).abs().max() > 1e-3  # CFG is used
    video = models.decode(pipe, ours)
    assert video.shape == (2, 5, 64, 64, 3) and video.dtype == torch.uint8 and video.float().std() > 1
    frames = torch.from_numpy(pipe(**call, output_type="np").frames * 255)
    assert (video.float() - frames).abs().max() <= 1
    # the first step of a 4-step schedule (t = floor(1000 s) of a sigma below 1, per token)
    stop = lambda p, i, t, kw: (setattr(p, "_interrupt", True), kw)[1]
    first = pipe(**dict(call, num_inference_steps=4), output_type="latent", callback_on_step_end=stop).frames
    torch.testing.assert_close(euler(pipe, x, models.sigmas(pipe, 4, 64)[:2], embeds, 4.5), first, atol=1e-4,
                               rtol=1e-4)


def test_wan22_5b_noise_shapes_and_frames(pipes):
    pipe = pipes[WAN]
    theirs = pipe.prepare_latents(2, 48, 64, 64, 5, torch.float32, "cpu", torch.Generator().manual_seed(3))
    assert torch.equal(noise(pipe, seed=3), theirs)
    assert models.latent_shape(pipe, 64, num_frames=33) == (48, 9, 4, 4)
    assert models.latent_shape(pipe, (32, 96), num_frames=1) == (48, 1, 2, 6)
    with pytest.raises(ValueError, match="multiple of 32"):
        models.latent_shape(pipe, 48, num_frames=5)
    with pytest.raises(ValueError, match="4 k \\+ 1"):
        models.latent_shape(pipe, 64, num_frames=6)


# ----------------------------------------------------------------------------- HunyuanVideo 1.5

@pytest.mark.parametrize("g", [4.0, 1.0])
def test_hunyuan_video_trajectory_and_decode_match_the_pipeline(g, pipes):
    """The pipeline takes no guidance argument: its guider's scale is set to ours (1: the guider runs one forward)."""
    from diffusers.guiders import ClassifierFreeGuidance

    pipe = pipes[HUNYUAN]
    x = noise(pipe)
    assert x.shape == (2, 32, 2, 4, 4)
    guider = pipe.guider
    call = dict(prompt=list(PROMPTS), negative_prompt=None, num_inference_steps=4, height=64, width=64, num_frames=5,
                latents=x.clone())
    try:
        pipe.register_modules(guider=ClassifierFreeGuidance(guidance_scale=g))
        expected = pipe(**call, output_type="latent").frames
        torch.testing.assert_close(models.sigmas(pipe, 4, 64), pipe.scheduler.sigmas, atol=0, rtol=0)
        # its decode, a video at a time: in diffusers 0.42 the VAE's mid-block attention cannot take a batch (a causal
        # mask [B, L, L] against queries [B, 1, L, C]), so __call__ decodes one prompt only
        frames = torch.cat([torch.from_numpy(pipe(**dict(call, prompt=[p], latents=x[i:i + 1].clone()),
                                                  output_type="np").frames * 255) for i, p in enumerate(PROMPTS)])
    finally:
        pipe.register_modules(guider=guider)
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=g)
    assert ("neg_prompt_embeds" in embeds) == (g > 1)
    # the text cut to the longest prompt (the pipeline pads to its 64); the quoted text of the first prompt in ByT5
    assert embeds["prompt_mask"][:, -1].any() and embeds["prompt_embeds"].shape[1] < pipe.tokenizer_max_length
    assert embeds["glyph_mask"][0].any() and not embeds["glyph_mask"][1].any()
    ours = euler(pipe, x, models.sigmas(pipe, 4, 64), embeds, g)
    assert (ours - x).abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    video = models.decode(pipe, ours)
    assert video.shape == (2, 5, 64, 64, 3) and video.dtype == torch.uint8 and video.float().std() > 1
    assert (video.float() - frames).abs().max() <= 1
    if g > 1:
        with torch.no_grad():
            guided = models.velocity(pipe, x, 0.6, embeds, guidance_scale=g)
            assert (models.velocity(pipe, x, 0.6, embeds) - guided).abs().max() > 1e-3  # CFG is used


def test_hunyuan_video_noise_shapes_and_schedule(pipes):
    pipe = pipes[HUNYUAN]
    theirs = pipe.prepare_latents(2, 32, 64, 64, 5, torch.float32, "cpu", torch.Generator().manual_seed(3))
    assert torch.equal(noise(pipe, seed=3), theirs)
    assert models.latent_shape(pipe, 64, num_frames=33) == (32, 9, 4, 4)
    assert models.latent_shape(pipe, (48, 80), num_frames=1) == (32, 1, 3, 5)
    with pytest.raises(ValueError, match="multiple of 16"):
        models.latent_shape(pipe, 40, num_frames=5)
    with pytest.raises(ValueError, match="4 k \\+ 1"):
        models.latent_shape(pipe, 64, num_frames=6)
    # a static shift: the same at every resolution; --shift replaces it
    torch.testing.assert_close(models.sigmas(pipe, 10, 64), models.sigmas(pipe, 10, 256), atol=0, rtol=0)
    t = torch.linspace(1, 0, 11, dtype=torch.float64)
    torch.testing.assert_close(models.sigmas(pipe, 10, 64, shift=3.0), (3 * t / (1 + 2 * t)).float(), atol=1e-6,
                               rtol=0)


def test_hunyuan_video_bf16_transformer_inputs_are_the_pipelines():
    """Loaded in bf16, the transformer gets what __call__ hands it at each of 10 steps, bit for bit: the latents with
    their zero condition channels, the timestep (the scheduler's float32 1000 s cast to bf16), the zero image tokens,
    ByT5's text and mask; the Qwen text is the pipeline's valid tokens, cut after the longest prompt and its padding
    zeroed (both masked in the transformer): the velocity agrees to one bf16 rounding, and given the pipeline's padded
    text it is the pipeline's bit for bit."""
    pipe = models.load_pipeline(HUNYUAN, dtype=torch.bfloat16)
    pipe.guider.guidance_scale = 1.0  # one forward per step (the pipeline runs CFG's halves as separate forwards)
    calls, handle = transformer_calls(pipe)
    try:
        x = noise(pipe, seed=1)
        pipe(prompt=list(PROMPTS), num_inference_steps=10, height=64, width=64, num_frames=5,
             latents=x.to(torch.bfloat16), output_type="latent")
        theirs, calls[:] = list(calls), []
        embeds = models.encode_prompts(pipe, PROMPTS)
        sigmas = models.sigmas(pipe, 10, 64)
        with torch.no_grad():
            for k, (kwargs, _) in enumerate(theirs):  # ours at the pipeline's own latents of each step
                models.velocity(pipe, kwargs["hidden_states"][:, :32], sigmas[k].item(), embeds)
    finally:
        handle.remove()
    assert len(theirs) == len(calls) == 10 and theirs[0][0]["hidden_states"].dtype == torch.bfloat16
    for k, ((t_in, t_out), (o_in, o_out)) in enumerate(zip(theirs, calls)):
        for key in ("hidden_states", "timestep", "image_embeds", "encoder_hidden_states_2", "encoder_attention_mask_2"):
            assert t_in[key].dtype == o_in[key].dtype and torch.equal(t_in[key], o_in[key]), (k, key)
        length = o_in["encoder_hidden_states"].shape[1]  # the pipeline's valid tokens all lie within the cut
        valid = t_in["encoder_attention_mask"][:, :length, None]  # its padding is the encoder's output, ours zeros
        assert torch.equal(t_in["encoder_hidden_states"][:, :length] * valid, o_in["encoder_hidden_states"]), k
        assert torch.equal(t_in["encoder_attention_mask"][:, :length], o_in["encoder_attention_mask"]), k
        assert not t_in["encoder_attention_mask"][:, length:].any() and not valid.all()
        torch.testing.assert_close(o_out, t_out, atol=2e-2, rtol=0)  # one bf16 ulp at 2: fewer padding tokens
    t_in, t_out = theirs[0]  # given the pipeline's padded text, the same velocity bit for bit
    padded = {"prompt_embeds": t_in["encoder_hidden_states"], "prompt_mask": t_in["encoder_attention_mask"].bool(),
              "glyph_embeds": t_in["encoder_hidden_states_2"], "glyph_mask": t_in["encoder_attention_mask_2"].bool()}
    with torch.no_grad():
        assert torch.equal(models.velocity(pipe, t_in["hidden_states"][:, :32], sigmas[0].item(), padded), t_out)


def test_hunyuan_video_full_finetune_leaves_out_the_last_text_stream():
    """The last block's text-stream outputs never reach the video tokens: a full fine-tune leaves them out (unused),
    and every other weight gets a gradient (with a quoted prompt, so that ByT5's projection takes part)."""
    pipe = models.load_pipeline(HUNYUAN)
    params = models.add_lora(pipe, rank=0, alpha=0)
    frozen = {n.rsplit(".", 1)[0] for n, p in pipe.transformer.named_parameters() if not p.requires_grad}
    assert frozen == set(families.hunyuan_video.unused(pipe.transformer))
    embeds = models.encode_prompts(pipe, PROMPTS)
    models.velocity(pipe, noise(pipe), 0.5, embeds).square().mean().backward()
    assert all(p.grad is not None for p in params)


def test_published_configs_have_the_published_sizes():
    """The transcribed hub configs build (meta device) to the sizes the model cards state: 5 B and 8.3 B."""
    for name, lo, hi in [("wan2.2-5b", 4.9e9, 5.1e9), ("hunyuan-video-1.5", 8.2e9, 8.4e9)]:
        transformer = families.build_published(name, "transformer")
        assert lo < sum(p.numel() for p in transformer.parameters()) < hi, name
    vae = families.build_published("wan2.2-5b", "vae")
    assert vae.config.z_dim == 48 and vae.config.scale_factor_spatial == 16 and len(vae.config.latents_std) == 48
