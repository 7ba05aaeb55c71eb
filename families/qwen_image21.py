"""Qwen-Image 2.1: `qwen-image-2.1` (`Qwen/Qwen-Image-2.1`) and `tiny-qwen-image-2.1`.

Checked against diffusers/pipelines/qwenimage21/pipeline_qwenimage21.py (QwenImage21Pipeline.__call__) and
models/transformers/transformer_qwenimage21.py by tests/test_qwen_image21.py and tests/test_families.py; the
conventions are load's docstring. A file of its own, not records in qwen_image.py: the pipeline shares Qwen-Image's
names and its calculate_shift only. Its text encoder is Qwen3-VL behind a processor (Qwen-Image: Qwen2.5-VL behind a
tokenizer); its transformer is single-stream and block-causal, text and image in one sequence whose positions depend
on the text's length (Qwen-Image: a dual-stream MMDiT), takes 64-channel latents unpatched from a 16x RGBA VAE
(Qwen-Image: 2 x 2-packed 16-channel latents of an 8x RGB VAE), and its guidance is plain CFG (Qwen-Image renormalises
it). Text-to-image only here; the pipeline's source images (edits) are not wired.
"""

import math

import numpy as np
import torch

from families import common

QWEN_IMAGE21_ID = "Qwen/Qwen-Image-2.1"  # QwenImage21Pipeline's docstring example (EXAMPLE_DOC_STRING)
# Flow-Factory's Qwen-Image 2.1 adapter: every projection of the single-stream blocks (default_target_modules of
# src/flow_factory/models/qwen_image_21/qwen_image_21.py, which examples/grpo/lora/qwen_image_2_1/default.yaml
# selects with `target_modules: "default"`)
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out")
# The processor's chat template, as much of Qwen3-VL's as the pipeline uses: a message's content is a string or a list
# of text and image parts (the pipeline counts the tokens of its system message with it, then drops them).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image 2.1 (`Qwen/Qwen-Image-2.1`: a 7.1 B single-stream transformer, a Qwen3-VL-8B text encoder).

    Conventions: latents unpatched, one token per 16 x 16 px, [B, (H/16)(W/16), 64] row-major (the pipeline's
    _pack_latents is a flatten); the network predicts eps - x0 (our sign); timestep s, passed as the pipeline passes
    it (common.pipeline_timestep). The sequence is [text; target image], the target's tokens in groups of four (one
    per slot of 2 x 2 latents, img_mask), the text causal, the image bidirectional and seeing all of the text; the text
    is modulated at t = 0 (causal_condition). Guidance: plain CFG v_u + g (v_c - v_u), no guidance embedding; the
    published model samples without it (true_cfg_scale 1, the pipeline's default and the preset's). Text: the last
    decoder layer of Qwen3-VL before its final norm (the pipeline's forward hook) on "<|im_start|>system\\nComprehend
    and analyze the provided prompt.<|im_end|>\\n<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n",
    the system message's tokens dropped, each prompt at its own length. Native schedule: linspace(1, 1/N, N) (or the
    checkpoint's sample_sigmas, Turbo's), exponential time shift with mu linear in the (H/16)(W/16) image tokens
    (calculate_shift, base/max shift 0.5/0.9 over 256..8192 tokens), stretched to end at shift_terminal 0.02, then 0.
    The VAE decodes RGBA; images are its RGB channels (what PIL's convert("RGB") keeps of the pipeline's RGBA output).

    Departures from QwenImage21Pipeline.__call__, and why:
    1. The text's length sets the image's position along the frame axis of the 3-axis RoPE, and the transformer reads
       one layout per forward (row 0 of img_mask): a prompt padded to a longer one in the same batch gives another
       velocity, and the pipeline pads its batch's prompts (and runs its CFG halves as two forwards, each at its own
       length). velocity() cuts each row to its own tokens and runs one forward per distinct text length (the CFG
       halves share one where their lengths agree): every sample is the pipeline's own for its prompt alone, whatever
       else the batch holds or how the prompt cache pads it. (diffusers' tests/pipelines/qwenimage21/test_qwenimage21.py
       loosens its batch-against-single test to 2e-3 for this padding; Flow-Factory's default.yaml runs one sample per
       forward for it.)
    2. No KV cache of the text across steps (the pipeline's use_kv_cache): the LoRA trains the layers that make it, and
       the text is short next to the image; the result is the uncached pipeline's.
    3. Prompts are cut at `tokens` (512 by default, Qwen-Image's max_sequence_length; --max-sequence-length) where the
       pipeline takes any length: both encoders are causal, so a cut prompt is encoded as its first tokens are.
    """
    from diffusers import QwenImage21Pipeline

    path = model_path or QWEN_IMAGE21_ID
    pipe = common.from_pretrained(QwenImage21Pipeline, "qwen-image-2.1", path, QWEN_IMAGE21_ID, dtype)
    pipe.tokenizer = pipe.processor.tokenizer  # its context caps --max-sequence-length (models.default_tokens)
    return pipe


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image 2.1 at toy size: 2 blocks of width 32 (2 heads), a 2-layer Qwen3-VL of width 16 (a 1-block vision
    tower, 16 px patches) behind a Qwen3VLProcessor with the byte-level tokenizer (common.qwen_tokenizer, Qwen's
    vision tokens added), the Qwen-Image 2.1 VAE with 16 channels at base width 8 (still 16x, RGBA, so 64 px is 4 x 4
    tokens); the published scheduler config; seed 0. The system message the pipeline drops is counted by the
    processor's template, as the published one's."""
    from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline,
                           QwenImage21Transformer2DModel)
    from transformers import (Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)

    common.check_no_path("tiny-qwen-image-2.1", model_path)
    tokenizer = common.qwen_tokenizer(1024)
    vision = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_tokens(vision, special_tokens=True)
    start, image, end, video = tokenizer.convert_tokens_to_ids(vision)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        video_processor=Qwen3VLVideoProcessor(), tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    with common.seeded_build(0, device):
        config = Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                              "mrope_interleaved": True},
                             pad_token_id=256, eos_token_id=258,  # <|endoftext|>, <|im_end|>
                             tie_word_embeddings=False),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                               patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0]),
            image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
            tie_word_embeddings=False)
        text_encoder = Qwen3VLForConditionalGeneration(config).eval()
        transformer = QwenImage21Transformer2DModel(
            in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            context_in_dim=16, axes_dims_rope=(4, 6, 6)).eval()
        vae = AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
            latents_mean=np.linspace(-1, 1, 16).tolist(), latents_std=np.linspace(2, 4, 16).tolist()).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image-2.1 scheduler/scheduler_config.json (PUBLISHED)
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    pipe = QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                               transformer=transformer)
    pipe.tokenizer = tokenizer  # as load
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


# ----------------------------------------------------------------------------- the adapter

def image_tokens(pipe, height, width):
    """The target's tokens, latents.shape[1] of the pipeline: one per 16 x 16 px (prepare_latents' rounding)."""
    f = 2 * pipe.vae_scale_factor
    return (2 * (height // f)) * (2 * (width // f))


def shape(pipe, height, width, num_frames):
    common.no_frames(num_frames)
    common.square("Qwen-Image 2.1's", height, width)
    common.check_multiple(height, width, 2 * pipe.vae_scale_factor)  # whole 2 x 2 groups of latents (img_mask slots)
    return image_tokens(pipe, height, width), pipe.transformer.config.in_channels


def noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    tokens, channels = shape(pipe, height, width, num_frames)
    side = math.isqrt(tokens)
    x = randn_tensor((batch, 1, channels, side, side), generator=generator, device=pipe._execution_device,
                     dtype=torch.float32)  # QwenImage21Pipeline.prepare_latents draws [B, 1, C, h, w], then flattens
    # Its flatten is a transposed view; made contiguous as every later latent is, so that a rollout's first step and
    # its re-scoring reduce in the same order (the first-update ratio is exactly 1).
    return pipe._pack_latents(x, batch, channels, side, side).contiguous()


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    def encode_texts(texts):
        embeds, mask, _ = pipe.encode_prompt(list(texts), device=pipe._execution_device)  # right-padded, mask or None
        mask = common.host_mask(mask, embeds)  # on the CPU: velocity() reads the lengths there without a sync
        return {"prompt_embeds": embeds[:, :tokens], "prompt_mask": mask[:, :tokens]}  # departure 3

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
    if guidance_scale > 1:
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])  # [negative; conditional]
    timestep = common.pipeline_timestep(pipe, sigma, dtype)
    lengths = mask.sum(dim=1).cpu()  # each row's text tokens (right-padded)
    rows, outputs = [], []
    for n in lengths.unique().tolist():  # departure 1: one forward per text length, each row at its own
        idx = (lengths == n).nonzero().squeeze(1)
        img_mask = torch.cat([torch.zeros(len(idx), n, dtype=torch.bool),  # text, then a slot per 2 x 2 latents
                              torch.ones(len(idx), length // 4, dtype=torch.bool)], dim=1).to(x.device)
        idx_x = idx.to(x.device)
        v = model(hidden_states=x[idx_x].to(dtype), timestep=timestep[idx_x],
                  encoder_hidden_states=text[idx_x, :n].to(dtype), encoder_hidden_states_mask=None,
                  img_shapes=[[(1, side, side)]] * len(idx), img_mask=img_mask, return_dict=False)[0]
        rows.append(idx)
        outputs.append(v[:, -length:])  # the target's tokens come last
    v = torch.cat(outputs)[torch.cat(rows).argsort().to(x.device)]  # back in the batch's order
    if guidance_scale > 1:
        v = common.guided(v, guidance_scale)[0]
    return v


@torch.no_grad()
def decode(pipe, latents):
    vae = pipe.vae
    side = math.isqrt(latents.shape[1]) * pipe.vae_scale_factor  # px
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    images = []
    for chunk in latents.split(8):
        z = pipe._unpack_latents(chunk.to(vae.device), side, side, pipe.vae_scale_factor).to(vae.dtype)  # [b,C,1,h,w]
        z = z * std.to(z.device, z.dtype) + mean.to(z.device, z.dtype)  # in the VAE's dtype, as the pipeline
        image = vae.decode(z, return_dict=False)[0][:, :3, 0]  # [b, 3, H, W]: RGB of RGBA
        images.append(common.to_uint8(image).permute(0, 2, 3, 1).cpu())
    return torch.cat(images)


def sigmas(pipe, num_steps, height, width, shift):
    base = pipe.config.get("sample_sigmas")  # a checkpoint's own grid (Turbo's), which __call__ prefers
    if base is None:
        base = np.linspace(1.0, 1 / num_steps, num_steps)  # QwenImage21Pipeline.__call__
    elif len(base) != num_steps:
        raise ValueError(f"this checkpoint samples on its own {len(base)}-step grid (its pipeline config's "
                         f"sample_sigmas); pass --num-steps {len(base)}")
    mu = common.dynamic_shift_mu(pipe.scheduler.config, image_tokens(pipe, height, width))
    return common.flow_match_sigmas(pipe.scheduler.config, base, mu=mu, shift=shift)


# ----------------------------------------------------------------------------- published configs
# name -> component -> (class, config). {}: the diffusers class defaults, which are the published model's config.json
# (transformer: 32 blocks of 32 heads x 128, context 4096, mlp ratio 3, RoPE axes 16/56/56, causal_condition; VAE:
# z_dim 64, base 96 / decoder 144, dim_mult 1/2/4/8/8, 16x, RGBA); the text encoder is Qwen3-VL-8B's config.json. The
# values (and the scheduler's, tiny above) as loaders that pin the hub repo's files transcribe them, not read from the
# repo itself: NVIDIA warp's Qwen-Image 2.1 bundle test (warp_nn.runtime.qwen_image), a Rust MLX fixture of all five
# config files, and Go/Python checkers of transformer/config.json, which agree.
QWEN3_VL_8B = dict(
    text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                       patch_size=16, deepstack_visual_indexes=[8, 16, 24]),
    tie_word_embeddings=False)
PUBLISHED = {"qwen-image-2.1": dict(transformer=("QwenImage21Transformer2DModel", {}),
                                    text_encoder=("Qwen3VLForConditionalGeneration", QWEN3_VL_8B),
                                    vae=("AutoencoderKLQwenImage21", {}))}


# ----------------------------------------------------------------------------- records (families.MODELS)

QWEN_IMAGE21 = dict(name="qwen-image-2.1", load=load, hub_id=QWEN_IMAGE21_ID, hub=True, multiple=32,
                    preset=dict(common.HUB, guidance_scale=1.0),  # sampled without CFG (true_cfg_scale 1)
                    tokens=512, shape=shape, noise=noise, encode=encode, velocity=velocity, decode=decode,
                    sigmas=sigmas, lora_targets=LORA_TARGETS, ddp=False)  # a forward per text length
TINY = dict(QWEN_IMAGE21, load=tiny, hub_id=None, hub=False, preset=common.TINY)
