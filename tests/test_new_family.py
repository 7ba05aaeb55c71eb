"""A model family is one file and one registry record (README, "Adding a model"): Chroma, a family the repository
does not ship, written below as a family file would be (its tiny twin, adapter functions and record), registered in
families.MODELS, reproduces ChromaPipeline.__call__ through models.velocity and trains through train.main with no
edit to models.py or train.py; and the registry's checks take it as they take the shipped families (its stored and
fresh prompt encodings equal, its schedule its pipeline's)."""
import json
import math

import pytest
import torch

import families
import models
import train
from families import common, flux, z_image
from test_families import reference_sigmas
from test_prompt_store import assert_store_equals_fresh

# ----------------------------------------------------------------------------- what families/chroma.py would hold
# Chroma (lodestones/Chroma): FLUX.1-schnell's MMDiT with its modulation distilled into an approximator, T5 text only,
# true CFG. Checked against diffusers/pipelines/chroma/pipeline_chroma.py (ChromaPipeline.__call__): latents packed as
# FLUX.1's, timestep s, txt_ids zero and img_ids (0, row, column), a text mask that keeps one padding token and is
# extended over the image tokens, FluxPipeline's schedule.


def tiny_chroma(model_path=None, dtype=torch.float32, device="cpu"):
    """Chroma at toy size: 1 double- and 1 single-stream block of width 32 (2 heads), a T5 of width 32, FLUX.1's
    4x VAE scaling and shift and its resolution-dependent scheduler; seed 0."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    common.check_no_path("tiny-chroma", model_path)
    tokenizer = common.t5_tokenizer(32)
    with common.seeded_build(0, device):
        text_encoder = common.t5_encoder(len(tokenizer), 32, 2, 4, 8, 64)
        transformer = ChromaTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
            approximator_hidden_dim=32, approximator_layers=1).eval()
        vae = common.small_vae(16, 0.3611, 0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                 base_image_seq_len=256, max_image_seq_len=4096)
    pipe = ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def chroma_encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    def encode_texts(texts):
        embeds, _, mask, *_ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False,
                                                 max_sequence_length=tokens, device=pipe._execution_device)
        return {"prompt_embeds": embeds, "text_mask": mask}  # padded to `tokens`: the same length for every prompt

    out = encode_texts(prompts)
    if guidance_scale <= 1:
        return out
    return common.with_negative(out, encode_texts, negative_prompt, len(prompts), masked=False)


def chroma_velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    model = modules["transformer"]
    dtype = pipe.transformer.dtype
    batch, length = x.shape[:2]
    side = math.isqrt(length)
    keys = ["prompt_embeds", "text_mask"]
    text, mask = common.cfg_halves(embeds, keys) if guidance_scale > 1 else [embeds[k] for k in keys]
    if guidance_scale > 1:  # both halves in one forward
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
    v = model(hidden_states=x.to(dtype), timestep=common.pipeline_timestep(pipe, sigma, dtype),
              encoder_hidden_states=text.to(dtype),
              txt_ids=torch.zeros(text.shape[1], 3, device=x.device, dtype=dtype),
              img_ids=pipe._prepare_latent_image_ids(batch, side, side, x.device, dtype),
              attention_mask=pipe._prepare_attention_mask(x.shape[0], length, dtype, mask.to(x.device)),
              return_dict=False)[0]
    if guidance_scale > 1:
        v, _ = common.guided(v, guidance_scale)
    return v


TINY_CHROMA = dict(name="chroma", load=tiny_chroma, multiple=8, preset=common.TINY, tokens=512, shape=flux.shape,
                   noise=flux.noise, encode=chroma_encode, velocity=chroma_velocity, decode=flux.decode,
                   sigmas=common.linspace_sigmas, lora_targets=flux.LORA_TARGETS)


# ----------------------------------------------------------------------------- the tests

@pytest.fixture
def chroma(monkeypatch):
    """Its one line in families.MODELS."""
    monkeypatch.setitem(families.MODELS, "tiny-chroma", families.Family(**TINY_CHROMA))


PROMPTS = ['a sign that says "hello"', "a red cube on a blue sphere"]


def test_the_new_family_is_its_pipeline(chroma, one_thread):
    pipe = models.load_pipeline("tiny-chroma")
    assert models.family(pipe).name == "chroma" and models.latent_shape(pipe, 64) == (64, 64)
    x = models.initial_noise(pipe, 2, 64, generator=torch.Generator().manual_seed(0))
    call = dict(prompt=list(PROMPTS), negative_prompt="", num_inference_steps=4, guidance_scale=4.0, height=64,
                width=64, latents=x.clone(), max_sequence_length=models.default_tokens(pipe))
    expected = pipe(**call, output_type="latent").images
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.0)
    sigmas = models.sigmas(pipe, 4, 64)
    torch.testing.assert_close(sigmas[:-1], pipe.scheduler.sigmas[:-1], atol=0, rtol=0)  # the schedule __call__ used
    ours = x
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
            ours = ours + (s_next - s) * models.velocity(pipe, ours, s, embeds, guidance_scale=4.0)
        assert (models.velocity(pipe, x, 0.6, embeds) - models.velocity(pipe, x, 0.6, embeds, guidance_scale=4.0)
                ).abs().max() > 1e-3  # CFG is used
    assert (ours - x).abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    images = torch.from_numpy(pipe(**call, output_type="np").images * 255)
    assert (models.decode(pipe, ours).float() - images).abs().max() <= 1


def test_the_new_family_trains_through_train_main(chroma, tmp_path, one_thread):
    out = tmp_path / "run"
    train.main(["--model", "tiny-chroma", "--steps", "2", "--num-steps", "4", "--prompts-per-step", "2",
                "--group-size", "4", "--sample-batch-size", "4", "--train-batch-size", "4", "--resolution", "32",
                "--guidance-scale", "2", "--lora-rank", "4", "--log-images-every", "0", "--out", str(out)])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and not any(r.get("skipped") for r in rows)
    assert rows[0]["first_ratio_dev"] < 1e-5 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    _, args = train.parse_args(["--model", "tiny-chroma"])  # its record's preset fills the flags
    assert (args.lr, args.resolution, args.reward) == (common.TINY["lr"], 64, "jpeg_compressibility")


def test_a_pipeline_without_a_record_is_refused(chroma):
    pipe = models.load_pipeline("tiny-chroma")
    pipe.model_name = "tiny-unregistered"
    with pytest.raises(ValueError, match="no model name of families.MODELS"):
        models.latent_shape(pipe, 64)


def test_the_registry_checks_take_the_new_family(chroma, tmp_path, monkeypatch, one_thread):
    """What tests/test_prompt_store.py and tests/test_families.py check of every registered family holds for the new
    one: its prompts read back from a --prompt-store equal their fresh encode bit for bit, and its schedule is the one
    ChromaPipeline.__call__ sets up."""
    pipe = models.load_pipeline("tiny-chroma")
    assert_store_equals_fresh(pipe, tmp_path / "store", monkeypatch)
    for num_steps, resolution in [(4, 64), (10, 128)]:
        torch.testing.assert_close(models.sigmas(pipe, num_steps, resolution),
                                   reference_sigmas(pipe, "tiny-chroma", num_steps, resolution).float(), atol=0, rtol=0)


def test_the_schedule_reference_counts_tokens_of_channels_first_latents(monkeypatch, one_thread):
    """A family the reference has no branch for, with channels-first latents [B, C, H, W] (Z-Image's adapter under a
    new family name, as a fork would add it): the reference is its pipeline's own, which counts (H / 2) (W / 2) tokens
    for the shift, not the C of shape[1]; models.sigmas agrees with it at every size."""
    monkeypatch.setitem(families.MODELS, "tiny-fork", families.Family(**dict(z_image.TINY, name="z-image-fork")))
    pipe = models.load_pipeline("tiny-fork")
    assert models.latent_shape(pipe, 64)[0] == pipe.transformer.in_channels  # channels first
    for num_steps, resolution in [(4, 64), (10, 256)]:
        torch.testing.assert_close(models.sigmas(pipe, num_steps, resolution),
                                   reference_sigmas(pipe, "tiny-fork", num_steps, resolution).float(), atol=0, rtol=0)
