"""Qwen-Image: `qwen-image` (`Qwen/Qwen-Image`) and `tiny-qwen-image`.

Checked against diffusers/pipelines/qwenimage/pipeline_qwenimage.py (QwenImagePipeline.__call__) by
tests/test_families.py; the conventions are load's docstring. The tiny twin's Qwen tokenizer is byte-level BPE
without merges (common.qwen_tokenizer): the pipeline's code paths (chat template, masks, the system-prompt drop) at a
toy vocabulary.
"""

import math

import torch

from families import common

QWEN_IMAGE_ID = "Qwen/Qwen-Image"
# Flow-GRPO's train_qwenimage.py: attention of both streams and both MLPs
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image (`Qwen/Qwen-Image`, a 20 B MMDiT with a Qwen2.5-VL-7B text encoder).

    Conventions: latents 2 x 2-packed into tokens [B, (H/16)(W/16), 64] as FLUX.1's; the network
    predicts eps - x0 (our sign); timestep s, passed as the pipeline passes it (`pipeline_timestep`).
    Guidance: true CFG with a renormalisation (the pipeline's true_cfg_scale):
    v = c * |v_c| / |c| with c = v_u + g (v_c - v_u), norms over each token's channels. No guidance
    embedding. Text: the last hidden layer of Qwen2.5-VL on a system-prompt template whose first 34
    tokens are dropped, variable length with a mask (padding is masked in attention, so padded and
    unpadded prompts give the same result); max_sequence_length 512 (the pipeline's default). Native
    schedule: linspace(1, 1/N, N), exponential time shift with mu linear in the image tokens
    (calculate_shift with the scheduler's base/max shift and sequence lengths), stretched to end at
    shift_terminal (0.02 in the published scheduler config), then 0. The VAE is kept in float32 whatever
    `dtype`, as Flow-GRPO keeps it (train_qwenimage.py L404); the rollout decodes it under its autocast,
    as theirs (L655).
    """
    from diffusers import QwenImagePipeline

    path = model_path or QWEN_IMAGE_ID
    pipe = common.from_pretrained(QwenImagePipeline, "qwen-image", path, QWEN_IMAGE_ID, dtype)
    pipe.vae.to(torch.float32)  # as Flow-GRPO's train_qwenimage.py L404, whatever the mixed precision
    return pipe


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image at toy size: 2 blocks of width 32 (2 heads), a 2-layer Qwen2.5-VL of width 16 (its
    vision tower tiny too), the Qwen-Image 3D VAE with 4x compression and 16 channels; the published
    scheduler config (dynamic shift 0.5 .. 0.9 over 256 .. 8192 tokens, exponential, terminal 0.02);
    seed 0."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    common.check_no_path("tiny-qwen-image", model_path)
    tokenizer = common.qwen_tokenizer(1024)
    with common.seeded_build(0, device):
        config = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                             rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                             pad_token_id=256, bos_token_id=256, eos_token_id=258),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
            vocab_size=len(tokenizer), image_token_id=len(tokenizer) - 1, video_token_id=len(tokenizer) - 1,
            vision_start_token_id=len(tokenizer) - 1, vision_end_token_id=len(tokenizer) - 1)
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=16, axes_dims_rope=(4, 6, 6)).eval()
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True]).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image scheduler/scheduler_config.json
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    # The pipeline drops the system prompt by a token count of the real tokenizer (34); ours counts bytes.
    pipe.prompt_template_encode_start_idx = len(tokenizer(pipe.prompt_template_encode.split("{}")[0]).input_ids)
    if dtype != torch.float32:
        pipe.to(dtype=dtype)
        pipe.vae.to(torch.float32)  # as load
    return pipe


def noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    tokens, channels = common.packed_shape(pipe, height, width, num_frames)
    side = 2 * math.isqrt(tokens)  # latent side
    x = randn_tensor((batch, 1, channels // 4, side, side), generator=generator, device=pipe._execution_device,
                     dtype=torch.float32)  # QwenImagePipeline.prepare_latents draws [B, 1, C, h, w], then packs
    return pipe._pack_latents(x, batch, channels // 4, side, side)


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    def encode_texts(texts):
        embeds, mask = pipe.encode_prompt(list(texts), device=pipe._execution_device, max_sequence_length=tokens)
        # the mask is read once here, onto the CPU (host_mask), where every forward then reads it without a sync
        return {"prompt_embeds": embeds, "prompt_mask": common.host_mask(mask, embeds)}

    out = encode_texts(prompts)
    if guidance_scale <= 1:
        return out
    return common.with_negative(out, encode_texts, negative_prompt, len(prompts), masked=True)


def velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    model = modules["transformer"]
    dtype = pipe.transformer.dtype
    length = x.shape[1]
    side = math.isqrt(length)
    keys = ["prompt_embeds", "prompt_mask"]
    text, mask = common.cfg_halves(embeds, keys) if guidance_scale > 1 else [embeds[k] for k in keys]
    shapes = [(1, side, side)]
    if "ref_latents" in embeds:  # Qwen-Image-Edit: the references' tokens after the target's (conditioning only)
        x = torch.cat([x, embeds["ref_latents"].to(x.device, x.dtype)], dim=1)  # [B, L + L_ref, C]
        shapes += [(1, rows, cols) for rows, cols in common.reference_grids(embeds)]
    if guidance_scale > 1:
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
    v = model(hidden_states=x.to(dtype), timestep=common.pipeline_timestep(pipe, sigma, dtype),
              encoder_hidden_states=text.to(dtype),
              # the pipeline drops an all-valid mask; read on the CPU (host_mask), it costs no sync per forward
              encoder_hidden_states_mask=None if mask.all() else mask.to(x.device),
              img_shapes=[shapes] * x.shape[0], return_dict=False)[0]
    v = v[:, :length]  # the target's tokens
    if guidance_scale > 1:
        combined, v_cond = common.guided(v, guidance_scale)
        # Qwen-Image's true CFG keeps each token's conditional norm (pipeline_qwenimage.py, the do_true_cfg branch)
        v = combined * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
    return v


@torch.no_grad()
def decode(pipe, latents):
    vae = pipe.vae
    side = math.isqrt(latents.shape[1]) * 2 * pipe.vae_scale_factor
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    images = []
    for chunk in latents.split(8):
        z = pipe._unpack_latents(chunk.to(vae.device, torch.float32), side, side, pipe.vae_scale_factor)  # [b,C,1,h,w]
        z = z * std.to(z.device) + mean.to(z.device)
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0][:, :, 0]  # [b, 3, H, W]
        images.append(common.to_uint8(image).permute(0, 2, 3, 1).cpu())
    return torch.cat(images)


def unused(transformer):
    """The last block's text-stream output layers: every block updates the text tokens, but the last
    one's update is discarded (only image tokens leave the model), so these get no gradient."""
    last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
    return [f"{last}.attn.to_add_out", f"{last}.txt_mlp.net.0.proj", f"{last}.txt_mlp.net.2"]


# ----------------------------------------------------------------------------- published configs

QWEN25_VL_7B = dict(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
    vocab_size=152064)
# name -> component -> (class, config), from the hub repo's config.json files; {}: the diffusers class defaults, which
# are the published model
PUBLISHED = {"qwen-image": dict(transformer=("QwenImageTransformer2DModel", {}),
                                text_encoder=("Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B),
                                vae=("AutoencoderKLQwenImage", {}))}


# ----------------------------------------------------------------------------- records (families.MODELS)

QWEN_IMAGE = dict(name="qwen-image", load=load, hub_id=QWEN_IMAGE_ID, hub=True, multiple=16, preset=common.HUB,
                  tokens=512, shape=common.packed_shape, noise=noise, encode=encode, velocity=velocity, decode=decode,
                  sigmas=common.linspace_sigmas, lora_targets=LORA_TARGETS, unused=unused)
TINY = dict(QWEN_IMAGE, load=tiny, hub_id=None, hub=False, multiple=8, preset=common.TINY)
