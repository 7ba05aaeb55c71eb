"""FLUX.1-dev: `flux` (`black-forest-labs/FLUX.1-dev`, or --model-path) and `tiny-flux` (its architecture at toy size).

Conventions, checked against diffusers' FluxPipeline.__call__ by tests/test_models.py: latents 2 x 2-packed into
tokens [B, (H/16)(W/16), 64]; the network predicts eps - x0 (our sign) at the timestep s (`common.pipeline_timestep`;
the transformer multiplies by 1000). FLUX.1-dev is guidance-distilled: the scale g enters through a guidance
embedding, with one forward per sample and no negative prompt (the record's guidance_embedded). Text: T5-XXL, 512
tokens (FluxPipeline's default), and CLIP's pooled output. Native schedule: FluxPipeline's linspace(1, 1/N, N) with its
resolution-dependent exponential shift (common.linspace_sigmas).
"""

import math

import torch

from families import common

FLUX_ID = "black-forest-labs/FLUX.1-dev"
FLUX_T5_TOKENS = 512  # FLUX.1-dev's T5 context, the FluxPipeline default
# The list of diffusers' FLUX LoRA scripts (also hits `attn.to_q/k/v` of the single-stream blocks).
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
FLUX_HUB = dict(guidance_scale=3.5, num_steps=16)  # distilled guidance, no CFG (MixGRPO uses 16 steps)


def load(model_path=None, dtype=torch.float32, device="cpu"):
    from diffusers import FluxPipeline

    return common.from_pretrained(FluxPipeline, "flux", model_path or FLUX_ID, FLUX_ID, dtype)


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """FLUX architecture at toy size (1 double- and 1 single-stream block, width 32, guidance
    embedding; 4x VAE with 16 latent channels; CLIP and T5 encoders of width 32), seed 0."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    common.check_no_path("tiny-flux", model_path)
    tokenizer_2 = common.t5_tokenizer(32)
    with common.seeded_build(0, device):
        text_encoder = common.clip_encoder(32, 2, 4, 64, projection=False)
        text_encoder_2 = common.t5_encoder(len(tokenizer_2), 32, 2, 4, 8, 64)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ).eval()
        vae = common.small_vae(16, 0.3611, 0.1159)  # FLUX.1's VAE scaling and shift
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's: resolution-dependent shift
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
        tokenizer=common.clip_tokenizer(), text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
    )
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def shape(pipe, height, width, num_frames):
    common.no_frames(num_frames)
    common.square("FLUX.1", height, width)
    f = pipe.vae_scale_factor
    common.check_multiple(height, width, 2 * f)
    side = height // (2 * f)  # 2 x 2 latent patches are packed into one token
    return (side * side, pipe.transformer.config.in_channels)


def noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    tokens, channels = shape(pipe, height, width, num_frames)
    channels, side = channels // 4, int(math.isqrt(tokens)) * 2
    x = randn_tensor((batch, channels, side, side), generator=generator, device=pipe._execution_device,
                     dtype=torch.float32)
    return pipe._pack_latents(x, batch, channels, side, side)  # [B, L, 4 C]


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, device=pipe._execution_device,
                                           max_sequence_length=tokens)
    return {"prompt_embeds": embeds, "pooled": pooled}  # guidance-distilled: no negative prompt


def velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    model = modules["transformer"]
    dtype = pipe.transformer.dtype
    batch = x.shape[0]
    x = x.to(dtype)
    side = math.isqrt(x.shape[1])
    assert side * side == x.shape[1], "flux latents must be packed from a square image"
    guidance = None
    if pipe.transformer.config.guidance_embeds:  # FLUX.1-dev: distilled guidance, no CFG
        guidance = torch.full((batch,), float(guidance_scale), device=x.device)
    return model(
        hidden_states=x,
        timestep=common.pipeline_timestep(pipe, sigma, dtype),  # FluxTransformer2DModel multiplies by 1000
        guidance=guidance,
        pooled_projections=embeds["pooled"].to(dtype),
        encoder_hidden_states=embeds["prompt_embeds"].to(dtype),
        txt_ids=torch.zeros(embeds["prompt_embeds"].shape[1], 3, device=x.device, dtype=dtype),
        img_ids=pipe._prepare_latent_image_ids(batch, side, side, x.device, dtype),
        return_dict=False,
    )[0]


@torch.no_grad()
def decode(pipe, latents):
    side = math.isqrt(latents.shape[1]) * 2 * pipe.vae_scale_factor  # image side in pixels
    latents = pipe._unpack_latents(latents, side, side, pipe.vae_scale_factor)  # [B, C, h, w]
    return common.decode_kl(pipe.vae, latents)


# ----------------------------------------------------------------------------- records (families.MODELS)

FLUX = dict(name="flux", load=load, hub_id=FLUX_ID, hub=True, multiple=16, preset=dict(common.HUB, **FLUX_HUB),
            tokens=FLUX_T5_TOKENS, tokenizer="tokenizer_2", shape=shape, noise=noise, encode=encode, velocity=velocity,
            decode=decode, sigmas=common.linspace_sigmas, lora_targets=LORA_TARGETS, guidance_embedded=True)
TINY = dict(FLUX, load=tiny, hub_id=None, hub=False, multiple=8, preset=dict(common.TINY, guidance_scale=3.5))
