"""FLUX.2 [klein]: `flux2-klein` (`black-forest-labs/FLUX.2-klein-base-4B`; the 9B and the step-distilled 4B / 9B by
--model-path) and `tiny-flux2-klein`. Given source images it edits (common.reference_images; the references follow
the target's tokens).

Checked against diffusers/pipelines/flux2/pipeline_flux2_klein.py (Flux2KleinPipeline.__call__) by
tests/test_families.py and tests/test_edit_models.py; the conventions are load's docstring.
"""

import math

import numpy as np
import torch

from families import common

KLEIN_ID = "black-forest-labs/FLUX.2-klein-base-4B"
# UniRL's flux2_klein recipes: every linear of the double-stream blocks, and the fused QKV + MLP projection of the
# single-stream blocks (their attn.to_out shares a name with the double blocks' to_out list, which peft cannot wrap)
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                "attn.to_qkv_mlp_proj")


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """FLUX.2 [klein] (`black-forest-labs/FLUX.2-klein-base-4B`; the 9B and the step-distilled
    `FLUX.2-klein-4B` / `-9B` by --model-path).

    Conventions: latents are the VAE's 32 channels patchified 2 x 2 into 128 and flattened into
    tokens [B, (H/16)(W/16), 128] (row-major, so unpacking is a reshape); the VAE's latent batch-norm
    statistics are undone before decoding. The network predicts eps - x0 (our sign) at timestep s
    (as the pipeline: `pipeline_timestep`). Guidance: the base models use true CFG v_u + g (v_c - v_u) with
    the empty prompt as the negative (the pipeline has no negative-prompt argument; ours defaults to
    "" too); the distilled models (`is_distilled` in the pipeline config) have no guidance at all,
    and g is ignored as the pipeline ignores it. No guidance embedding. Text: Qwen3 hidden states of
    layers 9, 18, 27 stacked into 3 x hidden channels, padded to max_sequence_length (512, the
    pipeline's default and UniRL's recipes) with no mask; positions (t, h, w, l) ids for text and
    image tokens. Native schedule: linspace(1, 1/N, N) shifted exponentially with the pipeline's
    empirical mu(image tokens, N) (compute_empirical_mu: it depends on the step count too), then 0.
    """
    from diffusers import Flux2KleinPipeline

    return common.from_pretrained(Flux2KleinPipeline, "flux2-klein", model_path or KLEIN_ID, KLEIN_ID, dtype)


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """FLUX.2 [klein] (base, with CFG) at toy size: 1 double- and 1 single-stream block of width 32
    (2 heads), a 28-layer Qwen3 of width 16 (so that layers 9, 18, 27 exist), the FLUX.2 VAE with
    4x compression and 4 latent channels (16 after patchifying); FLUX.1-dev's scheduler config, which
    diffusers' convert_flux2_to_diffusers.py gives FLUX.2; seed 0."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from diffusers import Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    common.check_no_path("tiny-flux2-klein", model_path)
    tokenizer = common.qwen_tokenizer(128)
    with common.seeded_build(0, device):
        text_encoder = common.qwen3_encoder(Qwen3ForCausalLM, len(tokenizer), 16, 28)
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False).eval()
        vae = AutoencoderKLFlux2(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, sample_size=64, use_quant_conv=False,
            use_post_quant_conv=False).eval()
        vae.bn.running_mean.normal_(0, 0.5)  # non-trivial statistics, so that decode's de-normalisation is tested
        vae.bn.running_var.uniform_(0.5, 2.0)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    tokens, channels = common.packed_shape(pipe, height, width, num_frames)
    side = math.isqrt(tokens)
    x = randn_tensor((batch, channels, side, side), generator=generator, device=pipe._execution_device,
                     dtype=torch.float32)  # Flux2KleinPipeline.prepare_latents draws patchified latents
    return pipe._pack_latents(x).contiguous()  # [B, h w, C]; contiguous like every stored state, so bits match


def uses_cfg(pipe, guidance_scale):
    return guidance_scale > 1 and not pipe.config.is_distilled


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens, images=None, size=None):
    def encode_texts(texts):
        embeds, _ = pipe.encode_prompt(list(texts), device=pipe._execution_device, max_sequence_length=tokens)
        return {"prompt_embeds": embeds}

    out = encode_texts(prompts)
    if images is not None:  # reference images (encode_references)
        out.update(encode_references(pipe, common.reference_images("flux2-klein", images, *size, most=None)))
    if not uses_cfg(pipe, guidance_scale):
        return out
    return common.with_negative(out, encode_texts, negative_prompt, len(prompts), masked=False)


def encode_references(pipe, refs):
    """Flux2KleinPipeline.__call__'s step 4 and prepare_image_latents, per sample: each reference shrunk to at most
    1024^2 px, cut to a multiple of 2 x the VAE factor (resize_mode "crop"), encoded (the VAE's mode, 2 x 2
    patchified, its batch-norm statistics taken off) and flattened like the target."""
    process, multiple, parts = pipe.image_processor, pipe.vae_scale_factor * 2, []
    for k in range(len(refs[0])):
        tensors = []
        for r in refs:
            img = r[k]
            if img.size[0] * img.size[1] > 1024 * 1024:
                img = process._resize_to_target_area(img, 1024 * 1024)
            width, height = img.size[0] // multiple * multiple, img.size[1] // multiple * multiple
            tensors.append(process.preprocess(img, height=height, width=width, resize_mode="crop"))
        vae = pipe.vae
        with torch.no_grad():
            z = pipe._encode_vae_image(torch.cat(tensors).to(vae.device, vae.dtype), generator=None)  # [B, C, h, w]
        parts.append((pipe._pack_latents(z), (z.shape[2], z.shape[3])))
    return common.pack_references(parts)


def velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    model = modules["transformer"]
    dtype = pipe.transformer.dtype
    side = math.isqrt(x.shape[1])
    cfg = uses_cfg(pipe, guidance_scale)
    (text,) = common.cfg_halves(embeds, ["prompt_embeds"]) if cfg else (embeds["prompt_embeds"],)
    if cfg:
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
    img_ids = pipe._prepare_latent_ids(x.new_empty(x.shape[0], 1, side, side)).to(x.device)  # (t, h, w, l) per token
    length = x.shape[1]
    if "ref_latents" in embeds:  # references after the target, at t = 10, 20, ... (conditioning only)
        ref = embeds["ref_latents"].to(x.device, x.dtype)
        grids = common.reference_grids(embeds)
        ref_ids = pipe._prepare_image_ids([x.new_empty(1, 1, rows, cols) for rows, cols in grids])
        x = torch.cat([x, torch.cat([ref, ref]) if cfg else ref], dim=1)  # [B, L + L_ref, C]
        img_ids = torch.cat([img_ids, ref_ids.to(x.device).expand(x.shape[0], -1, -1)], dim=1)
    v = model(hidden_states=x.to(dtype), timestep=common.pipeline_timestep(pipe, sigma, dtype), guidance=None,
              encoder_hidden_states=text.to(dtype), txt_ids=pipe._prepare_text_ids(text).to(x.device),
              img_ids=img_ids, return_dict=False)[0]
    v = v[:, :length]  # the target's tokens
    if cfg:
        v, _ = common.guided(v, guidance_scale)
    return v


@torch.no_grad()
def decode(pipe, latents):
    vae = pipe.vae
    side = math.isqrt(latents.shape[1])
    mean = vae.bn.running_mean.view(1, -1, 1, 1).float()
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).float() + vae.config.batch_norm_eps)
    images = []
    for chunk in latents.split(8):
        z = chunk.to(vae.device, torch.float32).permute(0, 2, 1).reshape(len(chunk), -1, side, side)  # [b, C, h, w]
        z = pipe._unpatchify_latents(z * std + mean)  # batch-norm statistics undone, 2 x 2 patches unfolded
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        images.append(common.to_uint8(image).permute(0, 2, 3, 1).cpu())
    return torch.cat(images)


def empirical_mu(image_tokens, num_steps):
    """FLUX.2's empirical shift (compute_empirical_mu, pipeline_flux2_klein.py): above 4300 image tokens
    mu = 1.6927e-4 L + 0.45667; below, linear in the step count N between its fits at N = 10
    (8.738e-5 L + 1.89833) and N = 200 (the large-L line)."""
    mu_200 = 0.00016927 * image_tokens + 0.45666666
    if image_tokens > 4300:
        return mu_200
    mu_10 = 8.73809524e-05 * image_tokens + 1.89833333
    slope = (mu_200 - mu_10) / 190.0
    return slope * num_steps + mu_200 - 200.0 * slope


def sigmas(pipe, num_steps, height, width, shift):
    base = np.linspace(1.0, 1 / num_steps, num_steps)  # Flux2KleinPipeline.__call__
    mu = empirical_mu(common.image_tokens(pipe, height, width), num_steps)
    return common.flow_match_sigmas(pipe.scheduler.config, base, mu=mu, shift=shift)


# ----------------------------------------------------------------------------- published configs

_KLEIN = dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256, mlp_ratio=3.0,
              axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False)
_QWEN3_8B = dict(common.QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
# name -> component -> (class, config), from the hub repos' config.json (diffusers' convert_flux2_to_diffusers.py
# writes them); {}: the diffusers class defaults, which are the published model
PUBLISHED = {
    "flux2-klein-4b": dict(transformer=("Flux2Transformer2DModel", dict(
                               _KLEIN, num_layers=5, num_single_layers=20, num_attention_heads=24,
                               joint_attention_dim=7680)),
                           text_encoder=("Qwen3ForCausalLM", common.QWEN3_4B), vae=("AutoencoderKLFlux2", {})),
    "flux2-klein-9b": dict(transformer=("Flux2Transformer2DModel", dict(
                               _KLEIN, num_layers=8, num_single_layers=24, num_attention_heads=32,
                               joint_attention_dim=12288)),
                           text_encoder=("Qwen3ForCausalLM", _QWEN3_8B), vae=("AutoencoderKLFlux2", {})),
}


# ----------------------------------------------------------------------------- records (families.MODELS)

KLEIN = dict(name="flux2-klein", load=load, hub_id=KLEIN_ID, hub=True, multiple=16, preset=common.HUB,
             tokens=512, shape=common.packed_shape, noise=noise, encode=encode, velocity=velocity, decode=decode,
             sigmas=sigmas, lora_targets=LORA_TARGETS, source_images="optional")
TINY = dict(KLEIN, load=tiny, hub_id=None, hub=False, multiple=8, preset=common.TINY)
