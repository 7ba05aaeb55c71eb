"""Stable Diffusion 3.5: `sd3` (SD3.5-Medium, or SD3.5-Large by --model-path), `tiny` (its architecture at toy size,
the fastest model for plumbing tests) and `sd3-random` (SD3.5-Medium's transformer and VAE at full size, random
weights, for bench.py).

Conventions, checked against diffusers' StableDiffusion3Pipeline.__call__ by tests/test_models.py: latents
[B, 16, H/8, W/8] (unpacked; the transformer patches 2 x 2 itself); the network predicts eps - x0 (our sign) at the
timestep t = 1000 s; classifier-free guidance v_u + g (v_c - v_u) with a negative prompt, both halves in one batched
forward. Text: two CLIP encoders (77 tokens; their pooled outputs concatenated) and T5-XXL, whose 128 tokens follow the
CLIP ones, as Flow-GRPO encodes SD3 prompts (scripts/train_sd3.py; diffusers' own default is 256). Native schedule:
sde.sd3_sigmas, the scheduler's static shift (3 for SD3.5).

A pipeline without a T5 encoder (`tiny`, `shapes`) gets no T5 tokens, where diffusers would append zero tokens: they
carry no information and would triple the CPU cost of `tiny` (models.py, departure 1).
"""

import torch

import sde
from families import common

SD3_ID = "stabilityai/stable-diffusion-3.5-medium"
SD3_T5_TOKENS = 128  # Flow-GRPO's T5 context for SD3 (scripts/train_sd3.py; diffusers' default is 256)

# SD3.5-medium as published (transformer/config.json and vae/config.json of the hub repo).
SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
SD35_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
    layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
    scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
)
# Flow-GRPO's list: attention of the joint blocks, image and text streams (SD3.5's second image-only attention `attn2`
# is left out, as there).
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")


def load(model_path=None, dtype=torch.float32, device="cpu"):
    from diffusers import StableDiffusion3Pipeline

    return common.from_pretrained(StableDiffusion3Pipeline, "sd3", model_path or SD3_ID, SD3_ID, dtype)


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """SD3 architecture at toy size (MMDiT with SD3.5's dual attention and RMS qk-norm, 2 blocks,
    width 64; 4x VAE with 16 latent channels; CLIP encoders of widths 32 and 48), seed 0."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    common.check_no_path("tiny", model_path)
    with common.seeded_build(0, device):
        text_encoder = common.clip_encoder(32, 2, 4, 64)
        text_encoder_2 = common.clip_encoder(48, 2, 4, 96)
        transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16,
            # CLIP 32 + 48 = 80, zero-padded to 96 as SD3 pads 2048 to 4096
            num_attention_heads=4, joint_attention_dim=96,
            caption_projection_dim=64, pooled_projection_dim=80, out_channels=16, pos_embed_max_size=32,
            dual_attention_layers=(0,), qk_norm="rms_norm",
        ).eval()
        vae = common.small_vae(16, SD35_VAE["scaling_factor"], SD35_VAE["shift_factor"])
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=common.clip_tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=common.clip_tokenizer(), text_encoder_3=None, tokenizer_3=None,
    )
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def random_weights(model_path=None, dtype=torch.float32, device="cpu"):
    """SD3.5-medium's transformer (2.2 B parameters) and VAE at full size with random weights,
    and one-layer text encoders of the real widths (CLIP-L 768, CLIP-G 1280, T5-XXL 4096, so the
    transformer sees 77 + 128 text tokens, as Flow-GRPO encodes SD3.5). Built directly on `device`."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    common.check_no_path("sd3-random", model_path)
    tokenizer_3 = common.t5_tokenizer(SD3_T5_TOKENS)
    with common.seeded_build(0, device):
        text_encoder = common.clip_encoder(768, 1, 12, 64)
        text_encoder_2 = common.clip_encoder(1280, 1, 20, 64)
        text_encoder_3 = common.t5_encoder(len(tokenizer_3), 4096, 1, 2, 64, 64)
        transformer = SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER).eval()
        vae = AutoencoderKL(**SD35_VAE).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=common.clip_tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=common.clip_tokenizer(), text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def shape(pipe, height, width, num_frames):
    common.no_frames(num_frames)
    f = pipe.vae_scale_factor
    patch, grid = pipe.transformer.config.patch_size, pipe.transformer.config.get("pos_embed_max_size")
    common.check_multiple(height, width, f * patch)
    if grid and max(height, width) > grid * patch * f:  # SD3 crops a learnt table of grid x grid positions
        raise ValueError(f"--resolution {height}x{width} is past this model's position table ({grid * patch * f} "
                         f"px a side at most): pass --resolution {grid * patch * f} or less")
    return (pipe.transformer.config.in_channels, height // f, width // f)


def noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor((batch, *shape(pipe, height, width, num_frames)), generator=generator,
                        device=pipe._execution_device, dtype=torch.float32)


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    def encode_texts(texts):
        embeds, _, pooled, _ = pipe.encode_prompt(
            texts, prompt_2=None, prompt_3=None, device=pipe._execution_device, do_classifier_free_guidance=False,
            max_sequence_length=tokens if pipe.text_encoder_3 is not None else 0,  # departure 1 (models.py)
        )
        return embeds, pooled

    out = dict(zip(["prompt_embeds", "pooled"], encode_texts(prompts)))
    if guidance_scale > 1:
        neg, neg_pooled = encode_texts([negative_prompt])  # identical to the pipeline's negative branch
        out["neg_prompt_embeds"] = neg.expand(len(prompts), *neg.shape[1:])
        out["neg_pooled"] = neg_pooled.expand(len(prompts), *neg_pooled.shape[1:])
    return out


def velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    model = modules["transformer"]
    dtype = pipe.transformer.dtype
    x = x.to(dtype)
    timestep = sigma * pipe.scheduler.config.num_train_timesteps  # SD3 is conditioned on t = 1000 s
    text, pooled = embeds["prompt_embeds"], embeds["pooled"]
    cfg = guidance_scale > 1
    if cfg:  # unconditional and conditional in one batched forward, in diffusers' order
        text, pooled = common.cfg_halves(embeds, ["prompt_embeds", "pooled"])
        x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])  # [2B, ...]
    v = model(
        hidden_states=x, encoder_hidden_states=text.to(dtype), pooled_projections=pooled.to(dtype),
        timestep=timestep, return_dict=False,
    )[0]
    if cfg:
        v, _ = common.guided(v, guidance_scale)  # classifier-free guidance
    return v


@torch.no_grad()
def decode(pipe, latents):
    return common.decode_kl(pipe.vae, latents)


def sigmas(pipe, num_steps, height, width, shift):
    config = pipe.scheduler.config
    if config.get("use_dynamic_shifting", False):
        raise ValueError("sd3: a scheduler with use_dynamic_shifting is not supported")
    return sde.sd3_sigmas(num_steps, shift=config.shift if shift is None else shift)


# ----------------------------------------------------------------------------- published configs

_CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
               projection_dim=1280, hidden_act="gelu")
_SD35_LARGE = dict(transformer=("SD3Transformer2DModel", dict(
                       sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                       num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                       pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")),
                   text_encoder=("CLIPTextModelWithProjection", common.CLIP_L),
                   text_encoder_2=("CLIPTextModelWithProjection", _CLIP_G),
                   text_encoder_3=("T5EncoderModel", common.T5_XXL), vae=("AutoencoderKL", SD35_VAE))
# name -> component -> (class, config); SD3.5-Medium has Large's text encoders and VAE
PUBLISHED = {"sd3.5-large": _SD35_LARGE,
             "sd3.5-medium": dict(_SD35_LARGE, transformer=("SD3Transformer2DModel", SD35_MEDIUM_TRANSFORMER))}


# ----------------------------------------------------------------------------- records (families.MODELS)

SD3 = dict(name="sd3", load=load, hub_id=SD3_ID, hub=True, multiple=16, preset=common.HUB,
           tokens=SD3_T5_TOKENS, tokenizer="tokenizer_3", shape=shape, noise=noise, encode=encode, velocity=velocity,
           decode=decode, sigmas=sigmas, lora_targets=LORA_TARGETS)
TINY = dict(SD3, load=tiny, hub_id=None, hub=False, multiple=8, preset=common.TINY)
RANDOM = dict(SD3, load=random_weights, hub_id=None)  # full size: the hub preset and the losses' hub defaults
