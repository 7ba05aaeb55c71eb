"""Qwen-Image-Edit, Qwen-Image's editor: `qwen-image-edit` (`Qwen/Qwen-Image-Edit`), `qwen-image-edit-plus`
(`Qwen/Qwen-Image-Edit-2509`, several source images; 2511 by --model-path) and their `tiny-` twins. They cannot run
without source images (the records' source_images "required").

Checked against diffusers/pipelines/qwenimage/pipeline_qwenimage_edit.py (QwenImageEditPipeline.__call__) and
pipeline_qwenimage_edit_plus.py (QwenImageEditPlusPipeline.__call__) by tests/test_edit_models.py; the conventions
are load's and load_plus's docstrings. The transformer, VAE, noise, velocity, decoding and schedule are Qwen-Image's.
"""

import math

import torch

from families import common, qwen_image

QWEN_EDIT_ID = "Qwen/Qwen-Image-Edit"
QWEN_EDIT_PLUS_ID = "Qwen/Qwen-Image-Edit-2509"
QWEN_EDIT_AREA = 1024 * 1024  # px of the reference latents (VAE_IMAGE_SIZE; QwenImageEditPipeline's 1024 * 1024)
QWEN_EDIT_VL_AREA = 384 * 384  # px of the Plus pipeline's images for the VL encoder (CONDITION_IMAGE_SIZE)


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image-Edit (`Qwen/Qwen-Image-Edit`): Qwen-Image's MMDiT and VAE, its Qwen2.5-VL encoder now shown the
    source image.

    Conventions as Qwen-Image (families/qwen_image.py: packed latents, timestep s, true CFG with the norm
    renormalisation, the same schedule with mu from the target's tokens). The source image, resized to the area
    QWEN_EDIT_AREA (1024^2 px) at its own aspect ratio in multiples of 32 px (the pipeline's calculate_dimensions),
    goes twice into the model: through the VL encoder inside the edit template ("Describe the key features of the
    input image ...", the image's tokens between <|vision_start|> and <|vision_end|>, the template's first 64 tokens
    dropped), and through the VAE (its mode, normalised by the latent mean and std) as packed reference tokens
    concatenated after the target's, with img_shapes [(1, h, w) of the target, (1, h', w') of the source]; the output
    is cut back to the target's tokens. The negative prompt is encoded with the same image, per sample.
    """
    from diffusers import QwenImageEditPipeline

    path = model_path or QWEN_EDIT_ID
    pipe = common.from_pretrained(QwenImageEditPipeline, "qwen-image-edit", path, QWEN_EDIT_ID, dtype)
    pipe.vae.to(torch.float32)  # as qwen_image: the VAE stays float32 whatever the mixed precision
    return pipe


def load_plus(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image-Edit-2509 (`Qwen/Qwen-Image-Edit-2509`; Qwen-Image-Edit-2511 by --model-path), the Plus pipeline:
    several source images per prompt. As qwen-image-edit, except: each source goes to the VL encoder at the area
    QWEN_EDIT_VL_AREA (384^2 px) under "Picture k: <|vision_start|>...<|vision_end|>" before the prompt, and to the
    VAE at QWEN_EDIT_AREA; the references' tokens follow the target's in order, one img_shapes entry each.
    """
    from diffusers import QwenImageEditPlusPipeline

    path = model_path or QWEN_EDIT_PLUS_ID
    pipe = common.from_pretrained(QwenImageEditPlusPipeline, "qwen-image-edit-plus", path, QWEN_EDIT_PLUS_ID, dtype)
    pipe.vae.to(torch.float32)  # as qwen_image
    return pipe


def _tiny(cls, name, model_path, dtype, device):
    """Qwen-Image-Edit at toy size: tiny-qwen-image's transformer, VAE and scheduler (seed 0), its Qwen2.5-VL given
    real vision tokens (a 1-layer vision tower of width 16, Qwen2-VL's 14 px patches merged 2 x 2) and a
    Qwen2VLProcessor. Reference areas of 64^2 px (VL 56^2 px for Plus) stand in for the published 1024^2 (384^2),
    which a CPU test cannot afford: the attributes reference_area / condition_area of the pipeline."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    common.check_no_path(name, model_path)
    tokenizer = common.qwen_tokenizer(1024)
    vision = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_tokens(vision, special_tokens=True)
    start, image, _, video = tokenizer.convert_tokens_to_ids(vision)
    with common.seeded_build(0, device):
        config = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                             rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                             pad_token_id=256, bos_token_id=256, eos_token_id=258),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
            vocab_size=len(tokenizer), image_token_id=image, video_token_id=video, vision_start_token_id=start)
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=16, axes_dims_rope=(4, 6, 6)).eval()
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True]).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image-Edit scheduler/scheduler_config.json (Qwen-Image's)
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
                                 video_processor=Qwen2VLVideoProcessor())
    pipe = cls(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, processor=processor,
               transformer=transformer)
    # The pipelines drop the system prompt by a token count of the real tokenizer (64); ours counts bytes.
    pipe.prompt_template_encode_start_idx = len(tokenizer(pipe.prompt_template_encode.split("<|im_start|>user")[0]
                                                          + "<|im_start|>user\n").input_ids)
    pipe.reference_area, pipe.condition_area = 64 * 64, 56 * 56
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    from diffusers import QwenImageEditPipeline

    return _tiny(QwenImageEditPipeline, "tiny-qwen-image-edit", model_path, dtype, device)


def tiny_plus(model_path=None, dtype=torch.float32, device="cpu"):
    from diffusers import QwenImageEditPlusPipeline

    return _tiny(QwenImageEditPlusPipeline, "tiny-qwen-image-edit-plus", model_path, dtype, device)


def edit_dims(area, ratio):
    """(width, height) of about `area` pixels at aspect `ratio` = width / height, each a multiple of 32
    (calculate_dimensions of pipeline_qwenimage_edit.py)."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


# What Qwen-Image-Edit's VL encoder is shown of each source (--edit-vl-input; the pipeline's attribute edit_vl_input):
# diffusers' pipeline hands encode_prompt the resized PIL image; flow_grpo's qwenimage_edit_pipeline_with_logprob.py
# (L76-84) the preprocessed tensor in [-1, 1], which Qwen2VLImageProcessor still rescales by 1/255 and normalises by
# the CLIP mean / std: pixel values within 1/(255 std) ~ 0.015 of -mean/std, an almost uniform image.
EDIT_VL_INPUTS = ("diffusers", "authors")


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens, images=None, size=None):
    return _encode(pipe, prompts, negative_prompt, guidance_scale, tokens, images, size, plus=False)


def encode_plus(pipe, prompts, negative_prompt, guidance_scale, tokens, images=None, size=None):
    return _encode(pipe, prompts, negative_prompt, guidance_scale, tokens, images, size, plus=True)


def _encode(pipe, prompts, negative_prompt, guidance_scale, tokens, images, size, *, plus):
    name = "qwen-image-edit-plus" if plus else "qwen-image-edit"
    if images is None:
        raise ValueError(f"{name} edits source images: give each prompt row one under 'image' (data.py)")
    refs = common.reference_images(name, images, *size, most=None if plus else 1)
    area = getattr(pipe, "reference_area", QWEN_EDIT_AREA)
    vl_area = getattr(pipe, "condition_area", QWEN_EDIT_VL_AREA)
    process = pipe.image_processor
    shown, vae_images = [], []  # per prompt, what the VL encoder sees; per reference k, [B, 3, 1, h, w]
    for k in range(len(refs[0])):
        width, height = edit_dims(area, size[1] / size[0])
        if plus:  # the VL encoder sees a smaller copy; the VAE the reference at `area`, from the source itself
            vl = edit_dims(vl_area, size[1] / size[0])
            vl_images = [process.resize(r[k], vl[1], vl[0]) for r in refs]
            vae_images.append(torch.cat([process.preprocess(r[k], height, width) for r in refs]).unsqueeze(2))
        else:  # one resized image serves both
            vl_images = [process.resize(r[k], height, width) for r in refs]
            vae_images.append(process.preprocess(vl_images, height, width).unsqueeze(2))
            if getattr(pipe, "edit_vl_input", "diffusers") == "authors":  # the VAE's input, [3, h, w] in [-1, 1]
                vl_images = list(vae_images[-1][:, :, 0].float().cpu())
        shown.append(vl_images)
    shown = [list(per_prompt) for per_prompt in zip(*shown)]  # [prompt][k]

    def encode_texts(texts):  # one prompt at a time: each has its own images inside its text
        parts = [pipe.encode_prompt(prompt=[t], image=s if plus else s[0], device=pipe._execution_device,
                                    max_sequence_length=tokens) for t, s in zip(texts, shown)]
        length = max(e.shape[1] for e, _ in parts)
        masks = [common.host_mask(m, e) for e, m in parts]
        padded = [common.pad_tokens(e, m, length) for (e, _), m in zip(parts, masks)]
        return {"prompt_embeds": torch.cat([e for e, _ in padded]), "prompt_mask": torch.cat([m for _, m in padded])}

    out = encode_texts(prompts)
    if guidance_scale > 1:  # the negative prompt sees each sample's own images, so it is encoded per sample
        neg = encode_texts([negative_prompt] * len(prompts))
        length = max(out["prompt_embeds"].shape[1], neg["prompt_embeds"].shape[1])
        out["prompt_embeds"], out["prompt_mask"] = common.pad_tokens(out["prompt_embeds"], out["prompt_mask"], length)
        out["neg_prompt_embeds"], out["neg_prompt_mask"] = common.pad_tokens(neg["prompt_embeds"],
                                                                             neg["prompt_mask"], length)
    vae, parts = pipe.vae, []
    for image in vae_images:
        with torch.no_grad():
            z = pipe._encode_vae_image(image.to(vae.device, vae.dtype), generator=None)  # [B, C, 1, h, w], normalised
        parts.append((pipe._pack_latents(z, len(z), z.shape[1], *z.shape[3:]), (z.shape[3] // 2, z.shape[4] // 2)))
    return dict(out, **common.pack_references(parts))


# ----------------------------------------------------------------------------- records (families.MODELS)

# Flow-GRPO's train_qwenimage_edit.py trains Qwen-Image's LoRA list; Qwen-Image-Edit (and 2509 / 2511) publish
# Qwen-Image's components (qwen_image.PUBLISHED).
EDIT = dict(name="qwen-image-edit", load=load, hub_id=QWEN_EDIT_ID, hub=True, multiple=16, preset=common.HUB,
            tokens=512, shape=common.packed_shape, noise=qwen_image.noise, encode=encode, velocity=qwen_image.velocity,
            decode=qwen_image.decode, sigmas=common.linspace_sigmas, lora_targets=qwen_image.LORA_TARGETS,
            unused=qwen_image.unused, source_images="required", max_sources=1, edit_vl_input=True)
TINY = dict(EDIT, load=tiny, hub_id=None, hub=False, multiple=8, preset=common.TINY)
PLUS = dict(EDIT, name="qwen-image-edit-plus", load=load_plus, hub_id=QWEN_EDIT_PLUS_ID, encode=encode_plus,
            max_sources=None, edit_vl_input=False)
TINY_PLUS = dict(PLUS, load=tiny_plus, hub_id=None, hub=False, multiple=8, preset=common.TINY)
