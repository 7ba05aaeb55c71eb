"""FLUX.1 Kontext [dev], FLUX.1's image editor: `flux-kontext` (`black-forest-labs/FLUX.1-Kontext-dev`) and
`tiny-flux-kontext`. Without a source image it generates from the text alone.

Checked against diffusers/pipelines/flux/pipeline_flux_kontext.py (FluxKontextPipeline.__call__) by
tests/test_edit_models.py; the conventions are load's docstring.
"""

import math

import torch

from families import common, flux

KONTEXT_ID = "black-forest-labs/FLUX.1-Kontext-dev"
# Flow-GRPO's train_flux_kontext.py: the FLUX LoRA scripts' list and the single blocks' proj_mlp
LORA_TARGETS = flux.LORA_TARGETS + ("proj_mlp",)


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """FLUX.1 Kontext [dev] (`black-forest-labs/FLUX.1-Kontext-dev`), FLUX.1's image editor.

    Conventions as FLUX.1-dev (families/flux.py): latents 2 x 2-packed into tokens [B, (H/16)(W/16), 64], timestep s,
    guidance through the guidance embedding (no CFG; the pipeline's default scale 3.5, the model card's 2.5), T5 text
    (512 tokens) and pooled CLIP; FluxPipeline's schedule, its mu from the target's tokens. The source image is
    encoded by the VAE (its mode, shifted and scaled), packed the same way and appended after the target's tokens with
    position ids (1, row, column) where the target has (0, row, column); the output is cut back to the target's
    tokens. One source image per prompt (the pipeline takes one). The pipeline's _auto_resize (to the nearest of
    Kontext's preferred resolutions, 672 px and up) is not applied: sources take the sample resolution (common.py,
    "reference images").
    """
    from diffusers import FluxKontextPipeline

    path = model_path or KONTEXT_ID
    return common.from_pretrained(FluxKontextPipeline, "flux-kontext", path, KONTEXT_ID, dtype)


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """`tiny-flux` (FLUX.1's architecture at toy size, guidance embedding, seed 0) in a FluxKontextPipeline."""
    from diffusers import FluxKontextPipeline

    common.check_no_path("tiny-flux-kontext", model_path)
    pipe = flux.tiny(dtype=torch.float32, device=device)
    pipe = FluxKontextPipeline(**{k: v for k, v in pipe.components.items() if v is not None})
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    tokens, channels = common.packed_shape(pipe, height, width, num_frames)
    side = 2 * math.isqrt(tokens)  # latent side
    x = randn_tensor((batch, channels // 4, side, side), generator=generator, device=pipe._execution_device,
                     dtype=torch.float32)  # FluxKontextPipeline.prepare_latents draws [B, C, h, w], then packs
    return pipe._pack_latents(x, batch, channels // 4, side, side)


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens, images=None, size=None):
    embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, device=pipe._execution_device,
                                           max_sequence_length=tokens)
    out = {"prompt_embeds": embeds, "pooled": pooled}  # guidance-distilled: no negative prompt
    if images is None:  # no source: Kontext generates from the text alone
        return out
    refs = [r[0] for r in common.reference_images("flux-kontext", images, *size, most=1)]
    multiple = pipe.vae_scale_factor * 2
    height, width = size[0] // multiple * multiple, size[1] // multiple * multiple  # as __call__ rounds the image
    image = pipe.image_processor.preprocess(refs, height, width)  # [B, 3, h, w] in [-1, 1]
    vae = pipe.vae
    with torch.no_grad():
        z = pipe._encode_vae_image(image.to(vae.device, vae.dtype), generator=None)  # [B, C, h, w], shifted, scaled
    rows, cols = z.shape[2] // 2, z.shape[3] // 2
    packed = pipe._pack_latents(z, len(z), z.shape[1], *z.shape[2:])
    return dict(out, **common.pack_references([(packed, (rows, cols))]))


def velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    model = modules["transformer"]
    dtype = pipe.transformer.dtype
    batch, length = x.shape[:2]
    side = math.isqrt(length)
    assert side * side == length, "flux-kontext latents must be packed from a square image"
    hidden = x.to(dtype)
    ids = pipe._prepare_latent_image_ids(batch, side, side, x.device, dtype)  # [L, 3]: (0, row, column)
    if "ref_latents" in embeds:  # the source's tokens after the target's, at (1, row, column)
        (rows, cols), = common.reference_grids(embeds)
        ref_ids = pipe._prepare_latent_image_ids(batch, rows, cols, x.device, dtype)
        ref_ids[..., 0] = 1
        hidden = torch.cat([hidden, embeds["ref_latents"].to(x.device, dtype)], dim=1)  # [B, L + L_ref, C]
        ids = torch.cat([ids, ref_ids])
    guidance = None
    if pipe.transformer.config.guidance_embeds:  # Kontext [dev]: distilled guidance, no CFG
        guidance = torch.full((batch,), float(guidance_scale), device=x.device)
    v = model(hidden_states=hidden, timestep=common.pipeline_timestep(pipe, sigma, dtype), guidance=guidance,  # as flux
              pooled_projections=embeds["pooled"].to(dtype), encoder_hidden_states=embeds["prompt_embeds"].to(dtype),
              txt_ids=torch.zeros(embeds["prompt_embeds"].shape[1], 3, device=x.device, dtype=dtype), img_ids=ids,
              return_dict=False)[0]
    return v[:, :length]  # the target's tokens only: the references are conditioning


# ----------------------------------------------------------------------------- published configs
# FLUX.1 Kontext [dev]: FLUX.1-dev's MMDiT (the class defaults) with its guidance embedding, CLIP-L and T5-XXL
PUBLISHED = {"flux1-kontext": dict(transformer=("FluxTransformer2DModel", dict(guidance_embeds=True)),
                                   text_encoder=("CLIPTextModel", common.CLIP_L),
                                   text_encoder_2=("T5EncoderModel", common.T5_XXL),
                                   vae=("AutoencoderKL", common.KL_16))}


# ----------------------------------------------------------------------------- records (families.MODELS)

# tokenizer: the CLIP one, whose 77 tokens cap the T5 text (FLUX.1's record caps it by T5's own, tokenizer_2)
# guidance_scale: FluxKontextPipeline.__call__'s default (3.5 in diffusers 0.42.1), where common.HUB's 4.5 is SD3.5-M's
# CFG; the authors train and sample at 2.5, the model card's (Flow-GRPO config/grpo.py counting_flux_kontext,
# Flow-Factory examples/grpo/lora/flux1_kontext/default.yaml; recipes/flux_kontext_counting_grpo.args)
KONTEXT = dict(name="flux-kontext", load=load, hub_id=KONTEXT_ID, hub=True, multiple=16,
               preset=dict(common.HUB, guidance_scale=3.5),
               preset_notes=dict(guidance_scale="FluxKontextPipeline.__call__'s default (the authors' recipe takes "
                                                "2.5: recipes/flux_kontext_counting_grpo.args)"),
               tokens=512, shape=common.packed_shape, noise=noise, encode=encode, velocity=velocity,
               decode=flux.decode, sigmas=common.linspace_sigmas, lora_targets=LORA_TARGETS,
               source_images="optional", max_sources=1, guidance_embedded=True)
TINY = dict(KONTEXT, load=tiny, hub_id=None, hub=False, multiple=8, preset=dict(common.TINY, guidance_scale=3.5),
            preset_notes=None)
