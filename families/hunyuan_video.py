"""HunyuanVideo 1.5 text to video: `hunyuan-video-1.5` (`hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v`,
the 480p text-to-video transformer of 8.3 B) and `tiny-hunyuan-video-1.5`.

Checked against diffusers/pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py (HunyuanVideo15Pipeline.__call__),
models/transformers/transformer_hunyuan_video15.py and models/autoencoders/autoencoder_kl_hunyuanvideo15.py (diffusers
0.42) by tests/test_video_families.py; the conventions are load's docstring. Samples are videos [B, F, H, W, 3] (the
record's video); --num-frames sets F. The tiny twin's Qwen tokenizer is byte-level BPE without merges
(common.qwen_tokenizer): the pipeline's chat template, masks and system-prompt crop at a toy vocabulary; ByT5's
tokenizer is bytes, built offline as it is.
"""

import numpy as np
import torch

from families import common, qwen_image

HUNYUAN_VIDEO_ID = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
# HunyuanVideo15Pipeline.__call__ takes no guidance scale: its guider's, as the hub repo's guider/config.json and
# diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py write it (ClassifierFreeGuidance(guidance_scale=6.0))
GUIDANCE_SCALE = 6.0
# UniRL's HunyuanVideo-1.5 recipe (recipes/diffusion/configs/hunyuan_video15/hunyuan_video15_t2v_dancegrpo_trainside
# .yaml, lora_cfg.target_modules): both streams' attention projections and MLPs (also the token refiner's attention
# and MLP, whose names end the same)
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """HunyuanVideo 1.5 T2V 480p (`hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v`, the id of diffusers'
    docs and UniRL's recipe, where the pipeline's docstring writes `.../HunyuanVideo-1.5-480p_t2v`; 720p by
    --model-path).

    Conventions: latents [B, 32, F', H/16, W/16], F' = (F - 1) / 4 + 1, unpacked (the transformer patches 1 x 1 x 1),
    decoded as latents / scaling_factor (no shift). The transformer takes the latents with, on the channels, a zero
    condition latent and a zero mask (65 channels; prepare_cond_latents_and_mask for text to video) and zero image
    embeddings (729 SigLIP tokens, masked out as the transformer does when they are all zero); it predicts eps - x0
    (our sign) at the timestep 1000 s in the transformer's dtype (`t.expand(B).to(dtype)`, t the scheduler's float32
    timestep). Guidance: true CFG v_u + g (v_c - v_u), as the pipeline's ClassifierFreeGuidance guider (published
    scale 6.0, guidance_rescale 0); the pipeline takes no guidance argument, our g replaces the guider's, and the
    halves run as one batch. Text: Qwen2.5-VL-7B's third-last hidden layer on a system-prompt chat template whose first
    108 tokens are cropped, padded to 1000 tokens with a mask (the pipeline's tokenizer_max_length; the record's
    tokens), plus ByT5 on the quoted text of the prompt ('Text "..."', 256 tokens with a mask, all masked without
    quotes). The transformer puts the valid tokens first and masks the rest both ways, so encode cuts the text after
    the batch's longest prompt and zeroes its padding: the same velocity to float rounding (tests/test_video_families.py
    against __call__, which pads to 1000). Native schedule: FlowMatchEuler, linspace(1, 0, N + 1)[:-1] shifted
    statically by the scheduler's shift (5.0 for 480p, 9.0 for 720p T2V: diffusers'
    scripts/convert_hunyuan_video1_5_to_diffusers.py), then 0; the pipeline integrates it with Euler, our step, so
    whole trajectories match. The VAE stays in `dtype`, as the pipeline decodes.
    """
    from diffusers import HunyuanVideo15Pipeline

    return common.from_pretrained(HunyuanVideo15Pipeline, "hunyuan-video-1.5", model_path or HUNYUAN_VIDEO_ID,
                                  HUNYUAN_VIDEO_ID, dtype)


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """HunyuanVideo 1.5 at toy size: 2 blocks of width 32 (2 heads) and a 1-block token refiner, a 3-layer Qwen2.5-VL
    text model of width 16, a 1-layer ByT5-style T5 of width 16, the HunyuanVideo 1.5 VAE (16x spatial, 4x temporal,
    32 latent channels) at widths 8-64; the published scheduler (shift 5) and guider (scale 6); seed 0. The pipeline's
    fixed lengths at toy size: 64 text tokens (the tokenizer's context), 16 ByT5 tokens, 8 image tokens."""
    from diffusers import (AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline,
                           HunyuanVideo15Transformer3DModel)
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    common.check_no_path("tiny-hunyuan-video-1.5", model_path)
    tokenizer = common.qwen_tokenizer(64)
    tokenizer_2 = ByT5Tokenizer()
    with common.seeded_build(0, device):
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(  # 3 layers: the third-last hidden state is layer 1's
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            pad_token_id=256, bos_token_id=256, eos_token_id=258)).eval()
        text_encoder_2 = common.t5_encoder(len(tokenizer_2), 16, 1, 2, 8, 32)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=65, out_channels=32, num_attention_heads=2, attention_head_dim=16, num_layers=2,
            num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=16,
            image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=64, task_type="t2v").eval()
        vae = AutoencoderKLHunyuanVideo15(latent_channels=32, block_out_channels=(8, 16, 32, 64, 64),
                                          layers_per_block=1).eval()
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE))
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length, pipe.vision_num_semantic_tokens = 64, 16, 8
    # The pipeline crops the system prompt by a token count of the real tokenizer (108); ours counts bytes.
    template = tokenizer.apply_chat_template([{"role": "system", "content": pipe.system_message},
                                              {"role": "user", "content": "\x00"}], tokenize=False)
    pipe.prompt_template_encode_start_idx = len(tokenizer(template.split("\x00")[0], verbose=False).input_ids)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def shape(pipe, height, width, num_frames):
    common.check_multiple(height, width, pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size)
    f, config = pipe.vae_scale_factor_spatial, pipe.transformer.config
    frame_tokens = (height // f // config.patch_size) * (width // f // config.patch_size)  # patch_size_t 1
    samples = common.forward_samples(pipe)
    frames = common.video_frames("HunyuanVideo 1.5", num_frames, 121, pipe.vae_scale_factor_temporal, frame_tokens,
                                 common.sample_tokens(pipe.transformer, pipe._execution_device, samples),
                                 samples)  # 121: __call__'s
    return (pipe.num_channels_latents, frames, height // f, width // f)


def noise(pipe, batch, height, width, num_frames, generator):
    """As HunyuanVideo15Pipeline.prepare_latents draws it, in float32 (the pipeline draws in the transformer's dtype:
    the same numbers for a float32 load)."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor((batch, *shape(pipe, height, width, num_frames)), generator=generator,
                        device=pipe._execution_device, dtype=torch.float32)


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    """prompt_embeds / prompt_mask (Qwen2.5-VL, the mask on the CPU, cut to the longest prompt) and glyph_embeds /
    glyph_mask (ByT5 on the quoted text, pipe.tokenizer_2_max_length tokens), each by the pipeline's own encoder
    functions; `tokens` is its tokenizer_max_length."""
    device = pipe._execution_device

    def encode_texts(texts):
        embeds, mask = pipe._get_mllm_prompt_embeds(
            text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, prompt=list(texts), device=device,
            tokenizer_max_length=tokens, system_message=pipe.system_message,
            crop_start=pipe.prompt_template_encode_start_idx)
        glyph, glyph_mask = pipe._get_byt5_prompt_embeds(
            tokenizer=pipe.tokenizer_2, text_encoder=pipe.text_encoder_2, prompt=list(texts), device=device,
            tokenizer_max_length=pipe.tokenizer_2_max_length)
        mask = common.host_mask(mask, embeds)  # read on the CPU from here on
        length = int(mask.any(0).nonzero().max()) + 1  # past the longest prompt (right-padded): padding alone
        # the padding within zeroed, as the transformer zeroes it (and as the prompt cache pads a row)
        embeds = embeds[:, :length] * mask[:, :length, None].to(embeds.device, embeds.dtype)
        return {"prompt_embeds": embeds, "prompt_mask": mask[:, :length], "glyph_embeds": glyph,
                "glyph_mask": glyph_mask.bool()}

    out = encode_texts(prompts)
    if guidance_scale <= 1:
        return out
    return common.with_negative(out, encode_texts, negative_prompt, len(prompts), masked=True)


def velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    """The transformer as HunyuanVideo15Pipeline.__call__ runs it for text to video (load's conventions), both CFG
    halves in one batch where the pipeline's guider runs two."""
    model = modules["transformer"]
    dtype = pipe.transformer.dtype
    keys = ["prompt_embeds", "prompt_mask", "glyph_embeds", "glyph_mask"]
    text, mask, glyph, glyph_mask = common.cfg_halves(embeds, keys) if guidance_scale > 1 else [embeds[k] for k in keys]
    if guidance_scale > 1:  # both halves in one forward
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
    x = x.to(dtype)
    batch, _, frames, height, width = x.shape
    # text to video: a zero condition latent and mask on the channels, zero image embeddings (the pipeline's)
    hidden = torch.cat([x, torch.zeros_like(x), x.new_zeros((batch, 1, frames, height, width))], dim=1)
    image = x.new_zeros((batch, pipe.vision_num_semantic_tokens, pipe.transformer.config.image_embed_dim))
    v = model(hidden_states=hidden, image_embeds=image,
              timestep=(sigma * pipe.scheduler.config.num_train_timesteps).to(dtype),  # the scheduler's t, cast
              encoder_hidden_states=text.to(dtype), encoder_attention_mask=mask.to(x.device, dtype),
              encoder_hidden_states_2=glyph.to(dtype), encoder_attention_mask_2=glyph_mask.to(x.device, dtype),
              return_dict=False)[0]
    if guidance_scale > 1:
        v, _ = common.guided(v, guidance_scale)
    return v


@torch.no_grad()
def decode(pipe, latents):
    vae = pipe.vae
    videos = []
    for chunk in latents.split(1):  # one video at a time: the 3D decoder's activations are large
        z = chunk.to(vae.device, vae.dtype) / vae.config.scaling_factor  # the pipeline's order: cast, then divide
        video = vae.decode(z, return_dict=False)[0]  # [1, 3, F, H, W] in [-1, 1]
        videos.append(common.to_uint8(video).permute(0, 2, 3, 4, 1).cpu())  # [1, F, H, W, 3]
    return torch.cat(videos)


def sigmas(pipe, num_steps, height, width, shift):
    config = pipe.scheduler.config
    kind = type(pipe.scheduler).__name__
    if kind != "FlowMatchEulerDiscreteScheduler" or config.use_dynamic_shifting:
        raise ValueError(f"hunyuan-video-1.5: expected FlowMatchEulerDiscreteScheduler with a static shift, got {kind}")
    base = np.linspace(1.0, 0.0, num_steps + 1)[:-1]  # HunyuanVideo15Pipeline.__call__
    return common.flow_match_sigmas(config, base, shift=shift)


def unused(transformer):
    """The last block's text-stream output layers: only the video tokens leave the model, so the last block's update
    of the text tokens (its to_add_out and context MLP) gets no gradient."""
    last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
    return [f"{last}.attn.to_add_out", f"{last}.ff_context.net.0.proj", f"{last}.ff_context.net.2"]


def save_lora(pipe, modules, folder):
    """The adapter as `folder/pytorch_lora_weights.safetensors` in the diffusers format (`transformer.`-prefixed peft
    keys, the LoraConfig as metadata), as a pipeline's LoRA loader mixin writes it (common.save_lora). In diffusers 0.42
    HunyuanVideo15Pipeline has no LoRA loader (no save_lora_weights or load_lora_weights): the file is written by
    HunyuanVideo's mixin (the same format) and loads with `pipe.transformer.load_lora_adapter(folder,
    weight_name="pytorch_lora_weights.safetensors")`; with a diffusers whose pipeline has the loader, common.save_lora,
    and load_lora_weights."""
    if hasattr(type(pipe), "save_lora_weights"):
        return common.save_lora(pipe, modules, folder)
    from diffusers.loaders import HunyuanVideoLoraLoaderMixin
    from peft.utils import get_peft_model_state_dict

    (transformer,) = modules.values()
    HunyuanVideoLoraLoaderMixin.save_lora_weights(
        folder, transformer_lora_layers=get_peft_model_state_dict(transformer),
        transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict())


# ----------------------------------------------------------------------------- published configs
# name -> component -> (class, config): the diffusers class defaults are the published transformer (480p T2V) and VAE
# (diffusers' convert_hunyuan_video1_5_to_diffusers.py builds both from them, and the pipeline's scheduler as
# FlowMatchEulerDiscreteScheduler(shift=5.0), its guider as ClassifierFreeGuidance(guidance_scale=6.0)); the text
# encoder is Qwen2.5-VL-7B-Instruct's language model (the script's load_mllm), the second google/byt5-small's encoder
# (whose vocabulary the glyph tokens extend by a few hundred rows, left out here).
_BYT5_SMALL = dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                   feed_forward_proj="gated-gelu")
PUBLISHED = {"hunyuan-video-1.5": dict(transformer=("HunyuanVideo15Transformer3DModel", {}),
                                       text_encoder=("Qwen2_5_VLTextModel", qwen_image.QWEN25_VL_7B["text_config"]),
                                       text_encoder_2=("T5EncoderModel", _BYT5_SMALL),
                                       vae=("AutoencoderKLHunyuanVideo15", {}))}


# ----------------------------------------------------------------------------- records (families.MODELS)

HUNYUAN_VIDEO = dict(name="hunyuan-video-1.5", load=load, hub_id=HUNYUAN_VIDEO_ID, hub=True, multiple=16,
                     preset=dict(common.HUB, guidance_scale=GUIDANCE_SCALE),
                     preset_notes=dict(guidance_scale="the published guider's scale (the pipeline takes none)"),
                     tokens=1000, shape=shape, noise=noise, encode=encode, velocity=velocity,
                     decode=decode, sigmas=sigmas, lora_targets=LORA_TARGETS, unused=unused, save_lora=save_lora,
                     video=True, temporal=4)  # AutoencoderKLHunyuanVideo15's temporal_compression_ratio
TINY = dict(HUNYUAN_VIDEO, load=tiny, hub_id=None, hub=False, preset=dict(common.TINY, num_frames=5),  # 2 latent
            preset_notes=None)
