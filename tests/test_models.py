"""models.py against diffusers' own pipelines, on the tiny random models (no download).

The sampling tests are the contract the rest of the code relies on: an Euler ODE through
`models.velocity` reproduces `StableDiffusion3Pipeline.__call__` / `FluxPipeline.__call__`
(timestep scaling, sign, CFG order, guidance embedding, latent packing, VAE scaling).
"""

import pytest
import torch

import families
import models

PROMPTS = ['a sign that says "hello"', "a red cube on a blue sphere"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def sd3():
    return models.load_pipeline("tiny")


@pytest.fixture(scope="module")
def flux():
    return models.load_pipeline("tiny-flux")


def state(pipe):
    return {f"{name}.{k}": v for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)
            for k, v in m.state_dict().items()}


def euler(pipe, x, sigmas, embeds, guidance_scale):
    for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        x = x + (s_next - s) * models.velocity(pipe, x, s, embeds, guidance_scale=guidance_scale)
    return x


# ----------------------------------------------------------------------------- building

def test_clip_tokenizer_is_clips():
    from open_clip.tokenizer import SimpleTokenizer

    reference = SimpleTokenizer()
    tokenizer = families.common.clip_tokenizer()
    for text in PROMPTS + ["Naïve café: 42 résumés, don't STOP!!"]:
        assert tokenizer(text).input_ids == [49406] + reference.encode(text) + [49407]


def test_tiny_is_deterministic_and_leaves_global_rng_alone(sd3):
    torch.manual_seed(1)
    expected_draw = torch.rand(3)
    torch.manual_seed(1)
    other = models.load_pipeline("tiny")
    assert torch.equal(torch.rand(3), expected_draw)  # the build did not consume the global RNG
    torch.manual_seed(2)
    a, b = state(sd3), state(other)
    assert a.keys() == b.keys() and len(a) > 50
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["transformer.proj_out.weight"].std() > 0  # really random, not zeros


def test_tiny_shapes_and_images(sd3, flux):
    assert models.family(sd3).name == "sd3" and models.family(flux).name == "flux"
    assert models.latent_shape(sd3, 64) == (16, 16, 16)
    assert models.latent_shape(flux, 64) == (64, 64)  # (8 x 8 tokens, 16 channels x 2 x 2)
    x = models.initial_noise(sd3, 3, 64, generator=torch.Generator().manual_seed(0))
    assert x.shape == (3, 16, 16, 16) and x.dtype == torch.float32
    images = models.decode(sd3, x)
    assert images.shape == (3, 64, 64, 3) and images.dtype == torch.uint8 and images.device.type == "cpu"
    assert images.float().std() > 1  # a random VAE still draws something
    with pytest.raises(ValueError, match="multiple of 8"):
        models.latent_shape(sd3, 60)
    assert models.latent_shape(sd3, 256) == (16, 64, 64)  # SD3's position table: 32 x 32 patches of 2 x 2 latents
    with pytest.raises(ValueError, match=r"position table \(256 px a side at most\): pass --resolution 256"):
        models.latent_shape(sd3, 264)  # diffusers would fail inside the forward


def test_initial_noise_is_the_pipelines_noise(sd3, flux):
    for pipe in (sd3, flux):
        ours = models.initial_noise(pipe, 2, 64, generator=torch.Generator().manual_seed(3))
        theirs = pipe.prepare_latents(2, pipe.transformer.config.in_channels // (4 if pipe is flux else 1), 64, 64,
                                      torch.float32, "cpu", torch.Generator().manual_seed(3))
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        assert torch.equal(ours, theirs)


def test_bad_names_and_paths():
    with pytest.raises(ValueError, match="tiny, shapes, tiny-flux, sd3, sd3-random, flux"):
        models.load_pipeline("sd4")
    with pytest.raises(ValueError, match="model-path"):
        models.load_pipeline("tiny", "some/folder")


def test_sd3_random_is_sd35_medium_on_meta():
    pipe = models.load_pipeline("sd3-random", device="meta")
    assert 2.2e9 < sum(p.numel() for p in pipe.transformer.parameters()) < 2.3e9  # SD3.5-medium: 2.24 B
    assert pipe.vae.config.latent_channels == 16 and pipe.vae_scale_factor == 8
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.5)
    assert embeds["prompt_embeds"].shape == (2, 77 + families.sd3.SD3_T5_TOKENS, 4096) and embeds["pooled"].shape == (2, 2048)
    x = models.initial_noise(pipe, 2, 1024)
    assert x.shape == (2, 16, 128, 128)
    assert models.velocity(pipe, x, 0.5, embeds, guidance_scale=4.5).shape == x.shape


# ----------------------------------------------------------------------------- velocity

def test_cfg_is_one_batched_forward_of_two(sd3):
    embeds = models.encode_prompts(sd3, PROMPTS, negative_prompt="blurry", guidance_scale=4.5)
    x = torch.randn(2, 16, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = models.velocity(sd3, x, 0.6, embeds, guidance_scale=4.5)
        cond = models.velocity(sd3, x, 0.6, embeds)
        uncond = models.velocity(sd3, x, 0.6, {"prompt_embeds": embeds["neg_prompt_embeds"], "pooled": embeds["neg_pooled"]})
        assert (cond - uncond).abs().max() > 1e-3  # the prompt matters, so the check below has teeth
        torch.testing.assert_close(v, uncond + 4.5 * (cond - uncond), atol=1e-5, rtol=1e-5)

        class Wrapper(torch.nn.Module):  # stands in for DDP / FSDP / torch.compile
            def __init__(self, inner):
                super().__init__()
                self.inner, self.batches = inner, []

            def forward(self, **kwargs):
                self.batches.append(kwargs["hidden_states"].shape[0])
                return self.inner(**kwargs)

        wrapper = Wrapper(sd3.transformer)
        wrapped = models.velocity(sd3, x, 0.6, embeds, guidance_scale=4.5, modules={"transformer": wrapper})
        torch.testing.assert_close(wrapped, v)
        assert wrapper.batches == [4]  # one forward over uncond + cond
        # the negative prompt was encoded once and is the encoding of "blurry" as a prompt
        torch.testing.assert_close(embeds["neg_prompt_embeds"][1], models.encode_prompts(sd3, ["blurry"])["prompt_embeds"][0])


@pytest.mark.parametrize("model", ["sd3", "flux"])
def test_sigma_float_tensor_and_per_sample(model, request):
    pipe = request.getfixturevalue(model)
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=3.0)
    x = models.initial_noise(pipe, 2, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        v = models.velocity(pipe, x, 0.7, embeds, guidance_scale=3.0)
        assert v.shape == x.shape
        torch.testing.assert_close(v, models.velocity(pipe, x, torch.tensor([0.7, 0.7]), embeds, guidance_scale=3.0))
        mixed = models.velocity(pipe, x, torch.tensor([0.2, 0.9]), embeds, guidance_scale=3.0)
        for i, s in enumerate([0.2, 0.9]):
            single = {k: e[i:i + 1] for k, e in embeds.items()}
            torch.testing.assert_close(mixed[i:i + 1], models.velocity(pipe, x[i:i + 1], s, single, guidance_scale=3.0),
                                       atol=1e-5, rtol=1e-5)
        assert (mixed[0] - v[0]).abs().max() > 1e-3


def test_euler_matches_sd3_pipeline(sd3):
    x = models.initial_noise(sd3, 2, 64, generator=torch.Generator().manual_seed(0))
    call = dict(prompt=PROMPTS, negative_prompt="blurry", num_inference_steps=4, guidance_scale=4.5,
                height=64, width=64, latents=x.clone(), max_sequence_length=0)
    expected = sd3(**call, output_type="latent").images
    sigmas = sd3.scheduler.sigmas  # the schedule the pipeline just used, 1 -> 0
    assert len(sigmas) == 5 and sigmas[0] == 1 and sigmas[-1] == 0
    embeds = models.encode_prompts(sd3, PROMPTS, negative_prompt="blurry", guidance_scale=4.5)
    with torch.no_grad():
        ours = euler(sd3, x, sigmas, embeds, 4.5)
    assert (ours - x).abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    images = torch.from_numpy(sd3(**call, output_type="np").images * 255)
    assert (models.decode(sd3, ours).float() - images).abs().max() <= 1  # the same pixels, up to rounding


def test_euler_matches_flux_pipeline(flux):
    x = models.initial_noise(flux, 2, 64, generator=torch.Generator().manual_seed(0))
    call = dict(prompt=PROMPTS, num_inference_steps=4, guidance_scale=3.5, height=64, width=64,
                latents=x.clone(), max_sequence_length=32)
    expected = flux(**call, output_type="latent").images
    sigmas = flux.scheduler.sigmas
    embeds = models.encode_prompts(flux, PROMPTS, guidance_scale=3.5)
    assert embeds["prompt_embeds"].shape == (2, 32, 32) and embeds["pooled"].shape == (2, 32)
    with torch.no_grad():
        ours = euler(flux, x, sigmas, embeds, 3.5)
        assert (models.velocity(flux, x, 0.5, embeds, guidance_scale=1.0)
                - models.velocity(flux, x, 0.5, embeds, guidance_scale=5.0)).abs().max() > 1e-4  # guidance is used
    assert (ours - x).abs().mean() > 0.05
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    images = torch.from_numpy(flux(**call, output_type="np").images * 255)
    assert (models.decode(flux, ours).float() - images).abs().max() <= 1


def test_flux_decode_unpacks_what_initial_noise_packs(flux):
    z = torch.randn(2, 16, 16, 16, generator=torch.Generator().manual_seed(4))  # [B, C, h, w]
    packed = flux._pack_latents(z, 2, 16, 16, 16)
    assert packed.shape == (2, 64, 64)
    assert torch.equal(flux._unpack_latents(packed, 64, 64, flux.vae_scale_factor), z)
    vae = flux.vae
    with torch.no_grad():
        image = vae.decode(z / vae.config.scaling_factor + vae.config.shift_factor).sample
    expected = ((image / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(models.decode(flux, packed), expected)


# ----------------------------------------------------------------------------- LoRA

@pytest.mark.parametrize("name", ["tiny", "tiny-flux"])
def test_lora_trains_only_lora_reference_is_base_and_save_load_roundtrips(name, tmp_path):
    pipe = models.load_pipeline(name)
    embeds = models.encode_prompts(pipe, PROMPTS)
    x = models.initial_noise(pipe, 2, 64, generator=torch.Generator().manual_seed(2))

    def v(p):
        with torch.no_grad():
            return models.velocity(p, x, 0.5, embeds, guidance_scale=3.0 if name == "tiny-flux" else 1.0)

    base = v(pipe)
    params = models.add_lora(pipe, rank=4, alpha=8)  # alpha != rank: the saved scale must survive loading
    trainable = {n for n, p in pipe.transformer.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and len(params) == len(trainable)
    assert any("add_q_proj" in n for n in trainable) and any("to_add_out" in n for n in trainable)
    assert not any(p.requires_grad for m in models._modules(pipe) if m is not pipe.transformer for p in m.parameters())
    torch.testing.assert_close(v(pipe), base)  # LoRA B starts at zero

    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(p.shape)))
    tuned = v(pipe)
    assert (tuned - base).abs().max() > 1e-2
    models.velocity(pipe, x, 0.5, embeds).square().mean().backward()
    named = {n: p for n, p in pipe.transformer.named_parameters() if p.requires_grad}
    assert all(p.grad is not None for p in named.values())  # also what DDP needs
    no_signal = {n.split(".lora_")[0] for n, p in named.items() if p.grad.abs().sum() == 0}
    assert no_signal == ({"transformer_blocks.1.attn.add_q_proj"} if name == "tiny" else set())  # SD3's last block drops its text output
    with models.reference(pipe):
        torch.testing.assert_close(v(pipe), base, atol=0, rtol=0)
    torch.testing.assert_close(v(pipe), tuned, atol=0, rtol=0)
    assert {n for n, p in pipe.transformer.named_parameters() if p.requires_grad} == trainable

    models.save_lora(pipe, tmp_path)
    assert (tmp_path / "pytorch_lora_weights.safetensors").exists()
    fresh = models.load_pipeline(name)
    fresh.load_lora_weights(tmp_path)
    torch.testing.assert_close(v(fresh), tuned, atol=1e-5, rtol=1e-5)


def test_lora_targets_and_full_finetune():
    pipe = models.load_pipeline("tiny")
    models.add_lora(pipe, rank=2, alpha=2)
    names = {n for n, p in pipe.transformer.named_parameters() if p.requires_grad}
    assert not any("attn2" in n for n in names)  # SD3.5's image-only attention stays out, as in Flow-GRPO
    expected = {f"transformer_blocks.{b}.attn.{m}" for b in (0, 1) for m in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj")}
    expected.add("transformer_blocks.0.attn.to_add_out")  # the last block has no text output
    assert {n.rsplit(".lora_", 1)[0] for n in names} == expected

    full = models.load_pipeline("tiny")
    params = models.add_lora(full, rank=0, alpha=0)
    assert len(params) == len(list(full.transformer.parameters())) and all(p.requires_grad for p in params)
    with pytest.raises(RuntimeError, match="LoRA rank"):
        with models.reference(full):
            pass


def test_bf16_runs_with_float32_lora():
    pipe = models.load_pipeline("tiny", dtype=torch.bfloat16)
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.5)
    x = models.initial_noise(pipe, 2, 64, generator=torch.Generator().manual_seed(0))
    params = models.add_lora(pipe, rank=4, alpha=4)
    assert {p.dtype for p in params} == {torch.float32}
    v = models.velocity(pipe, x, 0.5, embeds, guidance_scale=4.5)
    assert v.dtype == torch.bfloat16 and v.shape == x.shape
    v.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    assert models.decode(pipe, x).shape == (2, 64, 64, 3)


def test_truncation_warning_once():
    """diffusers logs the whole cut-off text at every encode; a 20 kB prompt must not log 20 kB per step."""
    import logging
    pipe = models.load_pipeline("tiny")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(type(pipe).__module__)  # diffusers' loggers do not propagate to the root
    logger.addHandler(handler)
    try:
        for _ in range(3):
            models.encode_prompts(pipe, ["a red cube " * 2000])
    finally:
        logger.removeHandler(handler)
    truncations = [m for m in seen if "truncated" in m]
    assert len(truncations) == 1 and len(truncations[0]) < 400


@pytest.mark.parametrize("name", [n for n, f in models.MODELS.items() if f.hub_id is None and not f.hub])
def test_resolution_multiple_matches_the_built_model(name):
    """train.py refuses resolutions by the record's multiple before loading; it must agree with the model itself."""
    pipe = models.load_pipeline(name)
    multiple = models.MODELS[name].multiple
    models.latent_shape(pipe, 2 * multiple)  # accepted
    with pytest.raises(ValueError):
        models.latent_shape(pipe, 2 * multiple + multiple // 2)
