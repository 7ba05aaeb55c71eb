"""Model adapters: load a diffusers pipeline, encode prompts, guided velocity, decode, LoRA, schedule.

Everything the RL loop needs from a text-to-image (or -video) model goes through these functions,
so that `sde.py`, `losses.py`, `train.py` and `eval.py` never branch on the model family:

    encode_prompts(pipe, prompts, *, max_sequence_length=None) -> embeds (dict of [B, ...] tensors)
    initial_noise(pipe, batch, resolution, *, num_frames=None)  -> x at sigma = 1, float32 [B, *latent_shape]
    velocity(pipe, x, sigma, embeds)                             -> v, the prediction at noise level sigma
    decode(pipe, latents)                  -> uint8 images [B, H, W, 3] (videos [B, F, H, W, 3])
    generate(pipe, x, sigmas, embeds, ...)                       -> a rollout (SDE or ODE) and its images
    sigmas(pipe, num_steps, resolution, *, shift=None)           -> the family's native schedule, 1 -> 0
    add_lora / reference / save_lora                             -> the policy, its frozen base, the checkpoint

Convention (rectified flow, as diffusers' schedulers): `x_s = (1 - s) x0 + s eps`, the network
predicts `v ~ eps - x0`, and the Euler step from `s` to `s'` is `x + (s' - s) v`. SD3 takes the
timestep `s * 1000` and applies classifier-free guidance `v_u + g (v_c - v_u)` (Ho & Salimans
2022, eq. 6 with g = 1 + w, as diffusers writes it); FLUX.1-dev is guidance-distilled: it takes the timestep
`s` and the scale `g` through a guidance embedding, with one forward per sample. `tests/test_models.py`
checks all of this against `StableDiffusion3Pipeline.__call__` and `FluxPipeline.__call__`. The newer
families live in `families.py` (one adapter each, with how its conventions map onto these), checked
against their pipelines by `tests/test_families.py`.

| name          | what it is                                                                       |
| ------------- | -------------------------------------------------------------------------------- |
| `sd3`         | `stabilityai/stable-diffusion-3.5-medium`, or `--model-path` (id or local folder; |
|               | SD3.5-Large `stabilityai/stable-diffusion-3.5-large` loads the same way)         |
| `flux`        | `black-forest-labs/FLUX.1-dev`, or `--model-path`                                  |
| `wan`, `qwen-image`, `flux2-klein`, `z-image` | see families.py; by hub id or `--model-path`     |
| `tiny`        | random SD3-architecture transformer, VAE and two CLIP text encoders (no T5), built |
|               | in code, same weights every time; trains on a CPU at 64 px                        |
| `tiny-flux`   | the same for the FLUX architecture (CLIP + tiny T5)                                |
| `tiny-wan`, `tiny-qwen-image`, `tiny-flux2-klein`, `tiny-z-image` | the same for each family    |
| `flux-kontext`, `qwen-image-edit`, `qwen-image-edit-plus` | edit models (source images; families.py), and   |
|               | their `tiny-` twins                                                               |
| `sd3-random`  | the SD3.5-medium transformer and VAE at full size with random weights and tiny   |
|               | text encoders of the right widths, for `bench.py` (no download)                   |
| `shapes`      | pretrained in this repository on scenes of coloured shapes (shapes.py): SD3        |
|               | architecture in pixel space at 32 px, weights shipped in weights/                  |
| `shapes-edit` | its edit model: FLUX.1 Kontext's pipeline in pixel space at 32 px, pretrained on   |
|               | rendered edit pairs (shapes.py, "editing") by scripts/pretrain_shapes_edit.py      |

Text length (max_sequence_length, the default of encode_prompts; capped by a tiny tokenizer's
context): sd3 128 T5 tokens after the 77 CLIP ones, as Flow-GRPO encodes SD3 prompts
(scripts/train_sd3.py; diffusers' own default is 256); flux 512 (FluxPipeline's default); wan,
qwen-image, flux2-klein, z-image 512, their pipelines' defaults (and what Flow-GRPO / UniRL use).

Departures from the diffusers defaults, and why:
1. A pipeline without a T5 encoder (`tiny`) gets no T5 tokens, where diffusers would append
   zero tokens: they carry no information and would triple the CPU cost of `tiny`.
2. Trainable LoRA weights are kept in float32 even when the model runs in bf16 (as the
   diffusers LoRA training scripts do), so that small Adam updates are not rounded away.
3. Classifier-free guidance runs the unconditional and conditional halves as one batched forward
   (the Wan, Qwen-Image and FLUX.2 pipelines run two); the results agree to float rounding.
"""

import collections
import contextlib
import json
import types
import logging
import math
import os

import numpy as np
import torch

import families
import flags
import sde
import shapes

SD3_ID = "stabilityai/stable-diffusion-3.5-medium"
# Image sides must be multiples of VAE down-sampling x transformer patch; checked before a model loads.
RESOLUTION_MULTIPLE = {"tiny": 8, "tiny-flux": 8, "shapes": 4, "sd3": 16, "sd3-random": 16, "flux": 16,
                       "wan": 16, "tiny-wan": 16, "qwen-image": 16, "tiny-qwen-image": 8, "flux2-klein": 16,
                       "tiny-flux2-klein": 8, "z-image": 16, "tiny-z-image": 8, "flux-kontext": 16,
                       "tiny-flux-kontext": 8, "qwen-image-edit": 16, "tiny-qwen-image-edit": 8,
                       "qwen-image-edit-plus": 16, "tiny-qwen-image-edit-plus": 8, "shapes-edit": 4}
# Models that edit: they take a sample's source images (data.py) as reference tokens (families.py, "edit models");
# the Qwen-Image-Edit pipelines cannot run without them. Read by name, before a model loads.
SOURCE_IMAGES = {"flux-kontext": "optional", "tiny-flux-kontext": "optional", "qwen-image-edit": "required",
                 "tiny-qwen-image-edit": "required", "qwen-image-edit-plus": "required",
                 "tiny-qwen-image-edit-plus": "required", "flux2-klein": "optional", "tiny-flux2-klein": "optional",
                 "shapes-edit": "required"}  # shapes-edit: Kontext's pipeline, trained on edits only
FLUX_ID = "black-forest-labs/FLUX.1-dev"
SD3_T5_TOKENS = 128  # Flow-GRPO's T5 context for SD3 (scripts/train_sd3.py; diffusers' default is 256)
FLUX_T5_TOKENS = 512  # FLUX.1-dev's T5 context, the FluxPipeline default

# LoRA targets. SD3: Flow-GRPO's list (attention of the joint blocks, image and text streams;
# SD3.5's second image-only attention `attn2` is left out, as there). FLUX: the list of
# diffusers' FLUX LoRA scripts (also hits `attn.to_q/k/v` of the single-stream blocks).
LORA_TARGETS = {
    "sd3": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"],
    "flux": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
             "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
             "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"],
}

# SD3.5-medium as published (transformer/config.json and vae/config.json of the hub repo).
SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
def sd3(model_path=None, dtype=torch.float32, device="cpu"):
    from diffusers import StableDiffusion3Pipeline

    return families.from_pretrained(StableDiffusion3Pipeline, "sd3", model_path or SD3_ID, SD3_ID, dtype)


def flux(model_path=None, dtype=torch.float32, device="cpu"):
    from diffusers import FluxPipeline

    return families.from_pretrained(FluxPipeline, "flux", model_path or FLUX_ID, FLUX_ID, dtype)


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """SD3 architecture at toy size (MMDiT with SD3.5's dual attention and RMS qk-norm, 2 blocks,
    width 64; 4x VAE with 16 latent channels; CLIP encoders of widths 32 and 48), seed 0."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    families.check_no_path("tiny", model_path)
    with families.seeded_build(0, device):
        text_encoder = families.clip_encoder(32, 2, 4, 64)
        text_encoder_2 = families.clip_encoder(48, 2, 4, 96)
        transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16,
            # CLIP 32 + 48 = 80, zero-padded to 96 as SD3 pads 2048 to 4096
            num_attention_heads=4, joint_attention_dim=96,
            caption_projection_dim=64, pooled_projection_dim=80, out_channels=16, pos_embed_max_size=32,
            dual_attention_layers=(0,), qk_norm="rms_norm",
        ).eval()
        vae = families.small_vae(16, families.SD35_VAE["scaling_factor"], families.SD35_VAE["shift_factor"])
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=families.clip_tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=families.clip_tokenizer(), text_encoder_3=None, tokenizer_3=None,
    )
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def tiny_flux(model_path=None, dtype=torch.float32, device="cpu"):
    """FLUX architecture at toy size (1 double- and 1 single-stream block, width 32, guidance
    embedding; 4x VAE with 16 latent channels; CLIP and T5 encoders of width 32), seed 0."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    families.check_no_path("tiny-flux", model_path)
    tokenizer_2 = families.t5_tokenizer(32)
    with families.seeded_build(0, device):
        text_encoder = families.clip_encoder(32, 2, 4, 64, projection=False)
        text_encoder_2 = families.t5_encoder(len(tokenizer_2), 32, 2, 4, 8, 64)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ).eval()
        vae = families.small_vae(16, 0.3611, 0.1159)  # FLUX.1's VAE scaling and shift
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's: resolution-dependent shift
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
        tokenizer=families.clip_tokenizer(), text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
    )
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def tiny_flux_kontext(model_path=None, dtype=torch.float32, device="cpu"):
    """`tiny-flux` (FLUX.1's architecture at toy size, guidance embedding, seed 0) in a FluxKontextPipeline
    (families.py, "edit models")."""
    from diffusers import FluxKontextPipeline

    families.check_no_path("tiny-flux-kontext", model_path)
    pipe = tiny_flux(dtype=torch.float32, device=device)
    pipe = FluxKontextPipeline(**{k: v for k, v in pipe.components.items() if v is not None})
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def sd3_random(model_path=None, dtype=torch.float32, device="cpu"):
    """SD3.5-medium's transformer (2.2 B parameters) and VAE at full size with random weights,
    and one-layer text encoders of the real widths (CLIP-L 768, CLIP-G 1280, T5-XXL 4096, so the
    transformer sees 77 + 128 text tokens, as Flow-GRPO encodes SD3.5). Built directly on `device`."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    families.check_no_path("sd3-random", model_path)
    tokenizer_3 = families.t5_tokenizer(SD3_T5_TOKENS)
    with families.seeded_build(0, device):
        text_encoder = families.clip_encoder(768, 1, 12, 64)
        text_encoder_2 = families.clip_encoder(1280, 1, 20, 64)
        text_encoder_3 = families.t5_encoder(len(tokenizer_3), 4096, 1, 2, 64, 64)
        transformer = SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER).eval()
        vae = AutoencoderKL(**families.SD35_VAE).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=families.clip_tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=families.clip_tokenizer(), text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


# ----------------------------------------------------------------------------- the shapes model
# The shapes world's pretrained model (shapes.py holds the world, its architecture config and weight file name).

def _pixel_space(device):
    """The VAE slot of a pixel-space pipeline: decode is the identity on [-1, 1] images.

    It carries the config fields the SD3 pipeline and models.decode read (a single block, so
    vae_scale_factor = 1; scaling 1 and shift 0, so latents are the images) and one buffer, so that
    .device and .dtype follow .to() as for a real VAE.
    """
    class PixelSpace(torch.nn.Module):
        config = types.SimpleNamespace(block_out_channels=(3,), latent_channels=3, scaling_factor=1.0, shift_factor=0.0)

        def __init__(self):
            super().__init__()
            self.register_buffer("anchor", torch.zeros(()), persistent=False)

        device = property(lambda self: self.anchor.device)
        dtype = property(lambda self: self.anchor.dtype)

        def encode(self, images):  # images in [-1, 1] -> latents, for symmetry with AutoencoderKL users
            return images

        def decode(self, latents, return_dict=True):
            return (latents,) if not return_dict else types.SimpleNamespace(sample=latents)

    return PixelSpace().to(device)


def shapes_tokenizer():
    """CLIP's BPE tokenizer (families.clip_tokenizer) with this model's 16-token context."""
    tok = families.clip_tokenizer()
    tok.model_max_length = shapes.TOKENS
    return tok


def build_shapes(*, seed=0, device="cpu"):
    """The `shapes` StableDiffusion3Pipeline with weights drawn from `seed` (before any training)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    def clip():
        t = shapes.TEXT_ENCODER
        config = CLIPTextConfig(
            vocab_size=49408, hidden_size=t["hidden"], intermediate_size=t["ffn"], num_hidden_layers=t["layers"],
            num_attention_heads=t["heads"], max_position_embeddings=shapes.TOKENS, projection_dim=t["hidden"],
            bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
        )
        return CLIPTextModelWithProjection(config).eval()

    with families.seeded_build(seed, device):
        text_encoder, text_encoder_2 = clip(), clip()
        transformer = SD3Transformer2DModel(**shapes.TRANSFORMER).eval()
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_pixel_space(device),
        text_encoder=text_encoder, tokenizer=shapes_tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=shapes_tokenizer(), text_encoder_3=None, tokenizer_3=None,
    )


SHAPES_FROZEN = "text_model.embeddings.token_embedding"  # CLIP's 49408-row token table stays at its seeded values


def _frozen(key):
    """Whether a text encoder's parameter is its token table (CLIPTextModel names it without "text_model.")."""
    return key.startswith(SHAPES_FROZEN) or key.startswith(SHAPES_FROZEN.removeprefix("text_model."))


def shapes_trained_state(pipe):
    """The weights that pretraining trains, by component-prefixed name: the parameters of the transformer
    and both text encoders (buffers such as the sin-cos position table are rebuilt), except the token
    tables. Those (49408 x 64 each, 25 MB in float32) stay at their seeded initialisation: the tokens of
    this world's prompts get distinct random vectors that the encoder layers learn to read, and the
    file need not carry 49 382 rows that no prompt uses."""
    return {f"{name}.{key}": value for name in ("transformer", "text_encoder", "text_encoder_2")
            for key, value in getattr(pipe, name).named_parameters() if not _frozen(key)}


def shapes_trainable_parameters(pipe):
    """The parameters of shapes_trained_state, with requires_grad set (the token tables frozen)."""
    params = []
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        for key, param in getattr(pipe, name).named_parameters():
            param.requires_grad_(not _frozen(key))
            if param.requires_grad:
                params.append(param)
    return params


def save_shapes_weights(pipe, path):
    """Write shapes_trained_state(pipe) in float16 (half the size; the model runs in float32) to a safetensors file."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu").half().contiguous() for k, v in shapes_trained_state(pipe).items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(state, path)


def save_shapes_ema(pipe, params, ema, path):
    """save_shapes_weights of the EMA `ema` of the trained `params` (pretraining's saved weights), leaving the trained
    ones in place."""
    with torch.no_grad():
        trained = [q.detach().clone() for q in params]
        for e, q in zip(ema, params):
            q.copy_(e)
        save_shapes_weights(pipe, path)
        for t, q in zip(trained, params):
            q.copy_(t)


def load_shapes_weights(pipe, path, *, script="scripts/pretrain_shapes.py"):
    """Copy weights written by save_shapes_weights into a pipeline from build_shapes (or build_shapes_edit, whose
    weights `script` writes; same seed)."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no shapes weights there; the repository ships {shapes.WEIGHTS} "
                                f"(git checkout it) and scripts/pretrain_shapes.py writes new ones")
    state = load_file(path)
    expected = shapes_trained_state(pipe)
    if set(state) != set(expected):
        raise ValueError(f"{path} does not hold shapes weights of this architecture "
                         f"({len(set(state) ^ set(expected))} names differ); "
                         f"write them with {script}")
    with torch.no_grad():
        for key, value in expected.items():
            value.copy_(state[key])
    return pipe


def _shapes_pipeline(weights=shapes.WEIGHTS, *, device="cpu"):
    """The pretrained `shapes` pipeline: built from shapes.py's config, the weights loaded."""
    return load_shapes_weights(build_shapes(device=device), flags.shipped(weights))


def shapes_model(model_path=None, dtype=torch.float32, device="cpu"):
    """The pretrained model of the shapes world (shapes.py): SD3 architecture in pixel space at 32 px,
    built from shapes.TRANSFORMER / TEXT_ENCODER with the shipped weights/shapes.safetensors, or the
    safetensors file given as --model-path (written by scripts/pretrain_shapes.py)."""
    pipe = _shapes_pipeline(model_path or shapes.WEIGHTS, device=device)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


# The edit model of the shapes world (shapes.py, "editing"; its architecture there): FLUX.1 Kontext's pipeline in
# pixel space. Its trained weights go through shapes_trained_state / save_shapes_weights / load_shapes_weights too.

def _space_to_depth(device):
    """The VAE slot of the edit pipeline: encode folds 2 x 2 pixels into channels, decode unfolds them (exact).
    Config fields as the Kontext pipeline and models.decode read them (two blocks: vae_scale_factor 2; 12 latent
    channels; scaling 1 and shift 0); a buffer so that .device and .dtype follow .to()."""
    class SpaceToDepth(torch.nn.Module):
        config = types.SimpleNamespace(block_out_channels=(12, 12), latent_channels=12, scaling_factor=1.0,
                                       shift_factor=0.0)

        def __init__(self):
            super().__init__()
            self.register_buffer("anchor", torch.zeros(()), persistent=False)

        device = property(lambda self: self.anchor.device)
        dtype = property(lambda self: self.anchor.dtype)

        def encode(self, images, return_dict=True):  # [B, 3, H, W] in [-1, 1] -> [B, 12, H/2, W/2]
            latents = torch.nn.functional.pixel_unshuffle(images, 2)
            return types.SimpleNamespace(latents=latents) if return_dict else (latents,)

        def decode(self, latents, return_dict=True):
            images = torch.nn.functional.pixel_shuffle(latents, 2)
            return types.SimpleNamespace(sample=images) if return_dict else (images,)

    return SpaceToDepth().to(device)


def build_shapes_edit(*, seed=0, device="cpu"):
    """The `shapes-edit` FluxKontextPipeline with weights drawn from `seed` (before any training): shapes.py's
    EDIT_TRANSFORMER, two CLIP text encoders of the shapes model's size (pooled and sequence, in the CLIP and T5
    slots), the space-to-depth VAE slot."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    def clip():
        t = shapes.TEXT_ENCODER
        return CLIPTextModel(CLIPTextConfig(
            vocab_size=49408, hidden_size=t["hidden"], intermediate_size=t["ffn"], num_hidden_layers=t["layers"],
            num_attention_heads=t["heads"], max_position_embeddings=shapes.TOKENS, bos_token_id=49406,
            eos_token_id=49407, pad_token_id=49407)).eval()

    with families.seeded_build(seed, device):
        text_encoder, text_encoder_2 = clip(), clip()
        transformer = FluxTransformer2DModel(**shapes.EDIT_TRANSFORMER).eval()
    return FluxKontextPipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_space_to_depth(device),
        text_encoder=text_encoder, tokenizer=shapes_tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=shapes_tokenizer())


def shapes_edit_model(model_path=None, dtype=torch.float32, device="cpu"):
    """The edit model of the shapes world (shapes.py, "editing"): FLUX.1 Kontext's pipeline in pixel space at 32 px,
    built by build_shapes_edit with the weights of weights/shapes_edit.safetensors, or the safetensors file given as
    --model-path (written by scripts/pretrain_shapes_edit.py)."""
    weights = flags.shipped(model_path or shapes.EDIT_WEIGHTS)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{weights}: no shapes-edit weights there; scripts/pretrain_shapes_edit.py writes "
                                f"them (to {shapes.EDIT_WEIGHTS}, or to --out, then pass --model-path)")
    pipe = load_shapes_weights(build_shapes_edit(device=device), weights, script="scripts/pretrain_shapes_edit.py")
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


_TRUNCATION_SEEN = set()


def _truncation_once(record):
    """A logging filter for the pipelines' prompt-truncation warnings: each distinct one once, cut to 300 characters
    (diffusers repeats the whole cut-off text at every encode: a 1 MB prompt would log 1 MB per step)."""
    message = record.getMessage()
    if "truncated" not in message:
        return True
    if message in _TRUNCATION_SEEN:
        return False
    _TRUNCATION_SEEN.add(message)
    if len(message) > 300:
        record.msg, record.args = f"{message[:300]}... ({len(message)} characters)", ()
    return True


def load_pipeline(name, model_path=None, *, dtype=torch.float32, device="cpu"):
    """Build or load model `name` (a key of MODELS), frozen, on `device`."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    pipe = MODELS[name](model_path, dtype=dtype, device=device).to(device)
    pipeline_log = logging.getLogger(type(pipe).__module__)
    if _truncation_once not in pipeline_log.filters:
        pipeline_log.addFilter(_truncation_once)
    for module in _modules(pipe):
        module.requires_grad_(False)  # add_lora decides what trains
    return pipe


def _modules(pipe):
    return [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]


# ----------------------------------------------------------------------------- the adapter

def family(pipe):
    """The family key of a pipeline, from its class: 'sd3', 'flux', or a key of families.FAMILIES."""
    kind = type(pipe).__name__
    for name, spec in families.FAMILIES.items():
        if kind == spec["pipeline"]:
            return name
    if kind.startswith("StableDiffusion3"):
        return "sd3"
    if kind.startswith("Flux") and not kind.startswith("Flux2"):
        return "flux"
    supported = ["StableDiffusion3Pipeline", "FluxPipeline"] + [f["pipeline"] for f in families.FAMILIES.values()]
    supported = ", ".join(supported)
    raise ValueError(f"unsupported pipeline {kind}; models.py handles {supported}")


def is_video(pipe):
    """True for families whose samples are videos [B, F, H, W, 3] (wan)."""
    spec = families.FAMILIES.get(family(pipe))
    return bool(spec and spec["video"])


def _hw(resolution):
    """--resolution as (height, width): an int is a square, a pair is (height, width)."""
    if isinstance(resolution, int):
        return resolution, resolution
    height, width = resolution
    return int(height), int(width)


def latent_shape(pipe, resolution, *, num_frames=None):
    """Per-sample shape of the latent that sde.rollout sees: sd3 (C, h, w), flux packed (h w / 4, 4 C),
    wan (C, F', h, w), and the families' own (families.py). `resolution`: an int (square) or
    (height, width), the latter for the unpacked families (sd3, wan, z-image)."""
    height, width = _hw(resolution)
    kind = family(pipe)
    if kind in families.FAMILIES:
        return families.FAMILIES[kind]["shape"](pipe, height, width, num_frames)
    families._no_frames(num_frames)
    f = pipe.vae_scale_factor
    if kind == "sd3":
        patch, grid = pipe.transformer.config.patch_size, pipe.transformer.config.get("pos_embed_max_size")
        families._check_multiple(height, width, f * patch)
        if grid and max(height, width) > grid * patch * f:  # SD3 crops a learnt table of grid x grid positions
            raise ValueError(f"--resolution {height}x{width} is past this model's position table ({grid * patch * f} "
                             f"px a side at most): pass --resolution {grid * patch * f} or less")
        return (pipe.transformer.config.in_channels, height // f, width // f)
    families._square("FLUX.1", height, width)
    families._check_multiple(height, width, 2 * f)
    side = height // (2 * f)  # 2 x 2 latent patches are packed into one token
    return (side * side, pipe.transformer.config.in_channels)


def initial_noise(pipe, batch, resolution, *, num_frames=None, generator=None):
    """x at sigma = 1: standard normal, float32 [B, *latent_shape], drawn as the pipelines draw it
    (so the same generator gives the same noise as pipe(..., generator=generator)).
    num_frames: video frames (wan; default its pipeline's 81), None for image models."""
    from diffusers.utils.torch_utils import randn_tensor

    height, width = _hw(resolution)
    kind = family(pipe)
    if kind in families.FAMILIES:
        return families.FAMILIES[kind]["noise"](pipe, batch, height, width, num_frames, generator)
    shape = latent_shape(pipe, resolution, num_frames=num_frames)
    device = pipe._execution_device
    if kind == "sd3":
        return randn_tensor((batch, *shape), generator=generator, device=device, dtype=torch.float32)
    channels, side = shape[1] // 4, int(math.isqrt(shape[0])) * 2
    x = randn_tensor((batch, channels, side, side), generator=generator, device=device, dtype=torch.float32)
    return pipe._pack_latents(x, batch, channels, side, side)  # [B, L, 4 C]


def default_tokens(pipe):
    """The default max_sequence_length of encode_prompts: the family's reference value (module docstring),
    capped by the tokenizer's context (the tiny models' tokenizers are short)."""
    kind = family(pipe)
    if kind == "sd3":
        return min(SD3_T5_TOKENS, pipe.tokenizer_3.model_max_length) if pipe.text_encoder_3 is not None else 0
    tokenizer = pipe.tokenizer_2 if kind == "flux" else pipe.tokenizer
    reference = FLUX_T5_TOKENS if kind == "flux" else families.FAMILIES[kind]["tokens"]
    return min(reference, tokenizer.model_max_length)


@torch.no_grad()
def encode_prompts(pipe, prompts, *, negative_prompt="", guidance_scale=1.0, max_sequence_length=None, images=None,
                   resolution=None):
    """Text embeddings, batch first. sd3: `prompt_embeds` [B, 77 + T5 tokens, D], `pooled` [B, P],
    and for guidance_scale > 1 `neg_prompt_embeds`, `neg_pooled` (the negative prompt encoded
    once, expanded to B). flux: `prompt_embeds` [B, T5 tokens, D], `pooled` [B, P] (FLUX.1-dev
    has no negative prompt: guidance enters through its guidance embedding). The families in
    families.py: `prompt_embeds` (+ `prompt_mask`, on the CPU, where prompts have their own lengths) and the
    `neg_` versions under CFG. max_sequence_length: text tokens (T5 for sd3 / flux); default
    default_tokens(pipe).

    images: per prompt, the source images of an edit (uint8 [H, W, 3], data.source_images), for the
    families that take references (families.FAMILIES[...]["references"]: flux-kontext, qwen-image-edit(-plus),
    flux2-klein). They are resized to `resolution` and encoded into `ref_latents` / `ref_shapes` (families.py,
    "edit models"), and for Qwen-Image-Edit also into the text; velocity() then conditions on them. None, or
    only empty lists, for text-to-image: every other model refuses source images in one line.

    With a prompt cache on the pipeline (prompt_cache below), each prompt is encoded once and its rows come from the
    cache afterwards; prompts with source images are always encoded afresh."""
    prompts = list(prompts)
    if images is not None and not any(len(refs) for refs in images):
        images = None  # prompts without source images: text-to-image
    cache = getattr(pipe, "prompt_cache", None)
    kwargs = dict(negative_prompt=negative_prompt, guidance_scale=guidance_scale, resolution=resolution,
                  max_sequence_length=default_tokens(pipe) if max_sequence_length is None else max_sequence_length)
    if cache is None or not prompts or images is not None or _encoders_train(pipe):  # edits: text depends on images
        with _encoders_on(pipe):
            return _encode_fresh(pipe, prompts, images=images, **kwargs)
    return _encode_cached(pipe, cache, prompts, **kwargs)


def _encode_fresh(pipe, prompts, *, negative_prompt="", guidance_scale=1.0, max_sequence_length=None, images=None,
                  resolution=None):
    """encode_prompts without the cache: the text encoders run on every prompt."""
    device = pipe._execution_device
    prompts = list(prompts)
    kind = family(pipe)
    tokens = default_tokens(pipe) if max_sequence_length is None else max_sequence_length
    if images is not None and not any(len(refs) for refs in images):
        images = None  # prompts without source images: text-to-image
    references = kind in families.FAMILIES and families.FAMILIES[kind].get("references", False)
    if images is not None:
        if not references:
            takes = ", ".join(k for k, f in families.FAMILIES.items() if f.get("references"))
            raise ValueError(f"model family {kind} generates from text alone and takes no source images; edit with "
                             f"{takes}, or drop the 'image' field of the prompt rows")
        if len(images) != len(prompts) or resolution is None:
            raise ValueError(f"encode_prompts: give one list of source images per prompt ({len(images)} for "
                             f"{len(prompts)} prompts) and the resolution to resize them to")
    if kind in families.FAMILIES:
        extra = dict(images=images, size=_hw(resolution) if images else None) if references else {}
        return families.FAMILIES[kind]["encode"](pipe, prompts, negative_prompt, guidance_scale, tokens, **extra)
    if kind == "flux":
        embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, device=device, max_sequence_length=tokens)
        return {"prompt_embeds": embeds, "pooled": pooled}

    def encode(texts):
        embeds, _, pooled, _ = pipe.encode_prompt(
            texts, prompt_2=None, prompt_3=None, device=device, do_classifier_free_guidance=False,
            max_sequence_length=tokens if pipe.text_encoder_3 is not None else 0,  # departure 1 (module docstring)
        )
        return embeds, pooled

    out = dict(zip(["prompt_embeds", "pooled"], encode(prompts)))
    if guidance_scale > 1:
        neg, neg_pooled = encode([negative_prompt])  # identical to the pipeline's negative branch
        out["neg_prompt_embeds"] = neg.expand(len(prompts), *neg.shape[1:])
        out["neg_pooled"] = neg_pooled.expand(len(prompts), *neg_pooled.shape[1:])
    return out


# ----------------------------------------------------------------------------- the prompt-embedding cache
#
# Every step encodes its prompts, and every evaluation its held-out prompts, with text encoders that stay on the
# GPU for the whole run (T5-XXL: 9.5 GB in half precision). The cache keeps each prompt's embedding rows on the CPU
# after its first encode, keyed by (text, text tokens): the cache belongs to one pipeline object (its model and
# weights) and lives as long as the process, so a changed prompt file or model can never read stale rows, and is
# bypassed while any text-encoder weight trains. The negative prompt (CFG) is one more entry, encoded once per
# (text, tokens, CFG on). Prompts with source images (edits) are not cached: Qwen-Image-Edit's VL encoder reads the
# image into the text, and the references of every edit model are VAE latents of the image.
#
# A cached row is exactly the row of the batch it was first encoded in. Another batch can round differently in the
# last bit (the matmul kernels depend on the batch size; 2e-7 on the tiny models' pooled CLIP), as any change of
# batching does: a run whose steps repeat their prompt sets (and every evaluation) reproduces the uncached run bit
# for bit, others agree to float rounding. Masked families (variable-length text) keep each row cut to its own
# tokens and are padded back to the batch's longest, as their encoders pad.

DEFAULT_PROMPT_CACHE_GB = 4.0  # SD3.5 with CFG: 1.7 MB a prompt (77 + 128 tokens x 4096, bf16): ~2400 prompts


class PromptCache:
    """Embedding rows by key, least recently used first out, within `max_bytes` (tensors on the CPU)."""

    def __init__(self, max_bytes):
        self.max_bytes, self.bytes, self.entries = int(max_bytes), 0, collections.OrderedDict()
        self.offloaded_from = None  # the device the text encoders were moved off (offload_text_encoders)
        self.hits = self.misses = 0

    def get(self, key):
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key, value):
        """Store value (a dict of tensors) unless it alone exceeds the budget; evict the oldest entries to fit."""
        size = _nbytes(value)
        if key in self.entries or size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            self.bytes -= _nbytes(self.entries.popitem(last=False)[1])
        self.entries[key] = value
        self.bytes += size

    def fits(self, value):
        return self.bytes + _nbytes(value) <= self.max_bytes


def _nbytes(value):
    return sum(t.numel() * t.element_size() for t in value.values())


def _text_encoders(pipe):
    return [m for name, m in pipe.components.items() if name.startswith("text_encoder") and
            isinstance(m, torch.nn.Module)]


def _encoders_train(pipe):
    return any(p.requires_grad for m in _text_encoders(pipe) for p in m.parameters())


@contextlib.contextmanager
def _encoders_on(pipe):
    """Inside, the text encoders are on the pipeline's device, also after offload_text_encoders (a cache miss)."""
    cache = getattr(pipe, "prompt_cache", None)
    device = cache.offloaded_from if cache is not None else None
    if device is None:
        yield
        return
    for m in _text_encoders(pipe):
        m.to(device)
    try:
        yield
    finally:
        for m in _text_encoders(pipe):
            m.to("cpu")


def _to_cpu(t):
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def _split_rows(out, n):
    """encode_prompts' output for n prompts -> (n row dicts of [1, ...] CPU tensors, the negative's row dict), each
    masked row cut to its own tokens; None when the layout is not one this understands (then nothing is cached)."""
    masked = "prompt_mask" in out
    rows, neg = [{} for _ in range(n)], {}
    for key, value in out.items():
        if key.startswith("neg_"):
            if not torch.equal(value, value[:1].expand_as(value)):
                return None  # a negative that differs per row (it would see each row's images)
            neg[key] = _to_cpu(value[:1])
        else:
            for i in range(n):
                rows[i][key] = _to_cpu(value[i:i + 1])
    for part, prefix in [(r, "") for r in rows] + ([(neg, "neg_")] if neg else []):
        if masked:
            mask = part[prefix + "prompt_mask"][0]
            length = int(mask.sum())
            if not bool(mask[:length].all()):
                return None  # not right-padded: cannot be cut and padded back
            for key in (prefix + "prompt_embeds", prefix + "prompt_mask"):
                part[key] = part[key][:, :length].contiguous()
    return rows, neg


def _assemble(rows, neg, device):
    """Row dicts (and the negative's) -> encode_prompts' output on `device`: masked rows right-padded with zeros to
    the longest of the batch and the negative (families._with_negative), the negative expanded to the batch."""
    rows = [dict(r) for r in rows]
    neg = dict(neg)
    if "prompt_mask" in rows[0]:
        length = max([r["prompt_embeds"].shape[1] for r in rows] + [v.shape[1] for k, v in neg.items()
                                                                        if k == "neg_prompt_embeds"])
        for part, prefix in [(r, "") for r in rows] + ([(neg, "neg_")] if neg else []):
            e, m = families._pad_tokens(part[prefix + "prompt_embeds"], part[prefix + "prompt_mask"], length)
            part[prefix + "prompt_embeds"], part[prefix + "prompt_mask"] = e, m
    home = {k: "cpu" if k.endswith("prompt_mask") else device for k in list(rows[0]) + list(neg)}  # masks: the CPU
    out = {k: torch.cat([r[k] for r in rows]).to(home[k]) for k in rows[0]}  # (families.host_mask)
    out.update({k: v.to(home[k]).expand(len(rows), *v.shape[1:]) for k, v in neg.items()})
    return out


def _encode_cached(pipe, cache, prompts, *, negative_prompt, guidance_scale, max_sequence_length, resolution):
    """encode_prompts through the cache: the missing prompts (and the negative, the first time) encoded in one
    batch, in the order given, so that a first encode is the uncached one."""
    tokens, cfg = max_sequence_length, guidance_scale > 1
    kwargs = dict(negative_prompt=negative_prompt, guidance_scale=guidance_scale, max_sequence_length=tokens,
                  resolution=resolution)
    neg_key = ("negative", negative_prompt, tokens, cfg)
    rows = {p: cache.get(("prompt", p, tokens)) for p in prompts}
    neg = cache.get(neg_key)
    missing = [p for p in prompts if rows[p] is None]  # in order, repeats kept: all missing -> the uncached batch
    cache.hits += len(prompts) - len(missing)
    cache.misses += len(missing)
    if missing or neg is None:
        texts = missing or [negative_prompt]
        with _encoders_on(pipe):
            out = _encode_fresh(pipe, texts, **kwargs)
        split = _split_rows(out, len(texts))
        if split is None:  # a layout without per-prompt rows: encoded afresh, uncached
            if texts != prompts:
                with _encoders_on(pipe):
                    out = _encode_fresh(pipe, prompts, **kwargs)
            return out
        fresh, neg = split
        for p, row in zip(missing, fresh):
            if rows[p] is None:  # a repeated prompt takes its first row
                rows[p] = row
                cache.put(("prompt", p, tokens), row)
        cache.put(neg_key, neg)
    return _assemble([rows[p] for p in prompts], neg, pipe._execution_device)


def prompt_cache(pipe, gigabytes, *, texts=(), offload=False, guidance_scales=(1.0,), negative_prompt="",
                 max_sequence_length=None, batch_size=16):
    """Give `pipe` a prompt-embedding cache of `gigabytes` (CPU memory, per process; 0: none) -> a line for the log.

    offload: encode `texts` (training and held-out prompts, without source images) ahead, in batches of
    batch_size, for each of `guidance_scales` (whether CFG's negative is needed), until all are in or the cache is
    full, then move the text encoders to the CPU; a later miss moves them back for its encode (an edit's source
    images, a prompt that did not fit). gigabytes None: DEFAULT_PROMPT_CACHE_GB on a GPU, none on a CPU."""
    if gigabytes is None:  # GPU time is what the cache saves; the CPU runs stay as they were
        gigabytes = DEFAULT_PROMPT_CACHE_GB if offload or pipe._execution_device.type == "cuda" else 0
    if offload and gigabytes <= 0:
        raise ValueError("--offload-text-encoders reads every prompt from the prompt cache: give --prompt-cache-gb > 0")
    if gigabytes <= 0:
        return None
    pipe.prompt_cache = cache = PromptCache(gigabytes * 2**30)
    if not offload:
        return f"prompt cache: {gigabytes:g} GB"
    texts = list(dict.fromkeys(texts))
    tokens = default_tokens(pipe) if max_sequence_length is None else max_sequence_length
    for cfg in sorted({g > 1 for g in guidance_scales}):  # the negative of each CFG setting used
        encode_prompts(pipe, texts[:1] or [negative_prompt], negative_prompt=negative_prompt,
                       guidance_scale=2.0 if cfg else 1.0, max_sequence_length=tokens)
    for i in range(0, len(texts), batch_size):
        before = cache.bytes
        encode_prompts(pipe, texts[i:i + batch_size], negative_prompt=negative_prompt, max_sequence_length=tokens)
        if cache.bytes + (cache.bytes - before) > cache.max_bytes:
            break  # the next batch would evict this one: the rest are encoded when they come, the encoders moved in
    done = sum(("prompt", t, tokens) in cache.entries for t in texts)
    offload_text_encoders(pipe)
    return (f"prompt cache: {gigabytes:g} GB, {done} of {len(texts)} prompts encoded ahead "
            f"({cache.bytes / 2**30:.2f} GB); text encoders moved to the CPU")


def offload_text_encoders(pipe):
    """Move the text encoders to the CPU: encode_prompts then reads the cache, and moves them back for a miss."""
    cache = pipe.prompt_cache
    if cache.offloaded_from is None:
        cache.offloaded_from = pipe._execution_device
        for m in _text_encoders(pipe):
            m.to("cpu")


def velocity(pipe, x, sigma, embeds, *, guidance_scale=1.0, transformer=None):
    """The guided velocity v(x, sigma) ~ eps - x0, same shape as x, in the transformer's dtype
    (float32 for z-image, whose guidance the pipeline combines in float32).

    sigma: float or [B] tensor. transformer: defaults to pipe.transformer; pass the DDP / FSDP /
    compiled wrapper to train through it. Gradients flow unless the caller disables them.
    """
    with _lora_input(pipe.transformer, x.device.type):  # no float32 round trip of the LoRA inputs under autocast
        return _velocity(pipe, x, sigma, embeds, guidance_scale=guidance_scale, transformer=transformer)


def _velocity(pipe, x, sigma, embeds, *, guidance_scale=1.0, transformer=None):
    model = transformer if transformer is not None else pipe.transformer
    dtype = pipe.transformer.dtype
    batch = x.shape[0]
    assert embeds["prompt_embeds"].shape[0] == batch, "embeds and x must have the same batch size"
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(batch)  # [B]
    kind = family(pipe)
    if kind in families.FAMILIES:
        return families.FAMILIES[kind]["velocity"](pipe, model, x, sigma, embeds, guidance_scale)
    x = x.to(dtype)

    if kind == "flux":
        side = math.isqrt(x.shape[1])
        assert side * side == x.shape[1], "flux latents must be packed from a square image"
        guidance = None
        if pipe.transformer.config.guidance_embeds:  # FLUX.1-dev: distilled guidance, no CFG
            guidance = torch.full((batch,), float(guidance_scale), device=x.device)
        return model(
            hidden_states=x,
            timestep=families._pipeline_timestep(pipe, sigma, dtype),  # FluxTransformer2DModel multiplies by 1000
            guidance=guidance,
            pooled_projections=embeds["pooled"].to(dtype),
            encoder_hidden_states=embeds["prompt_embeds"].to(dtype),
            txt_ids=torch.zeros(embeds["prompt_embeds"].shape[1], 3, device=x.device, dtype=dtype),
            img_ids=pipe._prepare_latent_image_ids(batch, side, side, x.device, dtype),
            return_dict=False,
        )[0]

    timestep = sigma * pipe.scheduler.config.num_train_timesteps  # SD3 is conditioned on t = 1000 s
    text, pooled = embeds["prompt_embeds"], embeds["pooled"]
    cfg = guidance_scale > 1
    if cfg:  # unconditional and conditional in one batched forward, in diffusers' order
        text, pooled = families._cfg_halves(embeds, ["prompt_embeds", "pooled"])
        x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])  # [2B, ...]
    v = model(
        hidden_states=x, encoder_hidden_states=text.to(dtype), pooled_projections=pooled.to(dtype),
        timestep=timestep, return_dict=False,
    )[0]
    if cfg:
        v, _ = families._guided(v, guidance_scale)  # classifier-free guidance
    return v


def generate(pipe, x, sigmas, embeds, *, guidance_scale=1.0, solver=None, autocast=contextlib.nullcontext,
             **rollout):
    """Samples from the noise x [B, ...] through `sigmas`, then decoded, without gradients: an SDE rollout
    (sde.rollout's trajectory; **rollout: sde_steps, kind, eta, generator, flash, flash_ratio) or, given a
    deterministic `solver` (euler, dpm2), sde.ode_sample keeping the clean sample alone ({"latents": [B, 1, ...]}).
    The forwards and the decode run under autocast(). -> (trajectory, uint8 images [B, H, W, 3] (video:
    [B, F, H, W, 3])). The one sampling loop of train.py, eval.py and scripts/."""
    def v(x_, s_):  # what the sampler calls; CFG lives inside
        return velocity(pipe, x_, s_, embeds, guidance_scale=guidance_scale)
    with torch.no_grad(), autocast():
        if solver is not None:
            traj = {"latents": sde.ode_sample(v, x, sigmas, solver=solver)[:, None]}
        else:
            traj = sde.rollout(v, x, sigmas, **rollout)
        return traj, decode(pipe, traj["latents"][:, -1])


@torch.no_grad()
def decode(pipe, latents):
    """Latents at sigma = 0 -> uint8 images [B, H, W, 3] on the CPU (as the pipelines' "np" output, x 255);
    for video families (wan) uint8 videos [B, F, H, W, 3]."""
    kind = family(pipe)
    if kind in families.FAMILIES:
        return families.FAMILIES[kind]["decode"](pipe, latents)
    if kind == "flux":
        side = math.isqrt(latents.shape[1]) * 2 * pipe.vae_scale_factor  # image side in pixels
        latents = pipe._unpack_latents(latents, side, side, pipe.vae_scale_factor)  # [B, C, h, w]
    return families.decode_kl(pipe.vae, latents)


# ----------------------------------------------------------------------------- native schedules

def sigmas(pipe, num_steps, resolution, *, shift=None):
    """The schedule the family's own pipeline samples with at `resolution`: float32 [num_steps + 1], 1 -> 0.

    sd3: sde.sd3_sigmas(num_steps, shift) with the scheduler's shift (3 for SD3.5). flux: FluxPipeline's
    linspace(1, 1/N, N) with its resolution-dependent exponential shift (families.dynamic_shift_mu of the image
    tokens, the scheduler's base/max shift). The families: their pipelines' (families.py docstrings).
    shift: a static shift in place of the family's own (sd3, wan, z-image) or of its resolution-dependent one."""
    if num_steps < 1:
        raise ValueError(f"--num-steps must be at least 1, got {num_steps}")
    if shift is not None and shift <= 0:
        raise ValueError(f"--shift must be positive, got {shift}")
    height, width = _hw(resolution)
    kind = family(pipe)
    if kind in families.FAMILIES:
        return families.FAMILIES[kind]["sigmas"](pipe, num_steps, height, width, shift)
    config = pipe.scheduler.config
    if kind == "sd3":
        if config.get("use_dynamic_shifting", False):
            raise ValueError("sd3: a scheduler with use_dynamic_shifting is not supported")
        return sde.sd3_sigmas(num_steps, shift=config.shift if shift is None else shift)
    base = np.linspace(1.0, 1 / num_steps, num_steps)  # FluxPipeline.__call__
    mu = families.dynamic_shift_mu(config, families.image_tokens(pipe, height, width))
    return families.flow_match_sigmas(config, base, mu=mu, shift=shift)


# ----------------------------------------------------------------------------- LoRA

def add_lora(pipe, rank, alpha, *, target_modules=None):
    """Make the transformer trainable: a LoRA adapter (Hu et al. 2021) of `rank` and scale
    alpha / rank on `target_modules` (default LORA_TARGETS[family]), or, for rank 0, all of its
    weights (full fine-tune). Everything else stays frozen. Returns the trainable parameters."""
    transformer = pipe.transformer
    for module in _modules(pipe):
        module.requires_grad_(False)
    kind = family(pipe)
    # Layers whose output the model discards (Qwen-Image's last text stream) get no gradient at all,
    # which DDP refuses: they are left out of training.
    unused = families.FAMILIES[kind]["unused"](transformer) if kind in families.FAMILIES else []
    if rank == 0:
        transformer.requires_grad_(True)
        for name in unused:
            transformer.get_submodule(name).requires_grad_(False)
        return [p for p in transformer.parameters() if p.requires_grad]
    from peft import LoraConfig

    default = LORA_TARGETS[kind] if kind in LORA_TARGETS else families.FAMILIES[kind]["lora_targets"]
    targets = list(target_modules or default)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets,
                                       exclude_modules=unused or None))
    params = [p for p in transformer.parameters() if p.requires_grad]
    assert params, f"no LoRA layer matched target modules {targets}"
    for p in params:
        p.data = p.data.float()  # departure 2 (module docstring)
    from peft.tuners.tuners_utils import BaseTunerLayer
    transformer._lora_layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]  # _lora_input
    return params


@contextlib.contextmanager
def _lora_input(transformer, device_type):
    """Inside, under autocast, peft's LoRA layers take their input as it comes. peft (0.21, lora/layer.py
    Linear.forward) casts it to the adapter's dtype, float32 here (departure 2), and autocast casts it straight
    back for the matmuls of lora_A and lora_B, which run in the autocast dtype with a half copy of the float32
    weights (the master weights stay float32, the compute is in half): two copies of a full activation per adapted
    layer, for the same bits. Without autocast (a half-precision base called as is) peft's cast stays, as the
    dtypes must match there."""
    layers = getattr(transformer, "_lora_layers", ())
    if not layers or not torch.is_autocast_enabled(device_type):
        yield
        return
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.cast_input_dtype_enabled = True


def _has_lora(transformer):
    return bool(getattr(transformer, "_hf_peft_config_loaded", False))


@contextlib.contextmanager
def reference(pipe):
    """Inside, pipe.transformer runs without its LoRA adapter: the frozen base model, the
    reference of the KL penalty. Trainability flags are restored on exit."""
    transformer = pipe.transformer
    if not _has_lora(transformer):
        raise RuntimeError("reference() needs a LoRA adapter, and full fine-tuning (LoRA rank 0) keeps no frozen "
                           "copy; train with a LoRA rank > 0 or without the KL penalty (beta 0)")
    flags = [(p, p.requires_grad) for p in transformer.parameters()]
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()
        for p, flag in flags:
            p.requires_grad_(flag)


def has_adapter(pipe):
    """Whether pipe.transformer carries a LoRA adapter (then reference() runs the frozen base)."""
    return _has_lora(pipe.transformer)


def save_lora(pipe, folder):
    """Write the adapter as `folder/pytorch_lora_weights.safetensors` in the diffusers format,
    with its LoraConfig (rank, alpha, targets) as metadata: `pipe.load_lora_weights(folder)` loads it."""
    from peft.utils import get_peft_model_state_dict

    transformer = pipe.transformer
    if not _has_lora(transformer):
        raise RuntimeError("save_lora() needs a LoRA adapter; a full fine-tune (LoRA rank 0) is saved with "
                           "pipe.transformer.save_pretrained(folder)")
    type(pipe).save_lora_weights(
        folder,
        transformer_lora_layers=get_peft_model_state_dict(transformer),
        transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
    )


# ----------------------------------------------------------------------------- tiny reward-model stand-ins
# Random-initialised, built from configs: the model scorers' code paths of rewards.py without a download, each
# saved in the layout its real model ships in (tests, recipes on the tiny model, bench.py --rewards).

def tiny_pickscore(folder, *, seed=0, image_size=32, patch_size=8):
    """Save a random-initialised tiny CLIPModel + CLIPProcessor (real CLIP tokenizer) into `folder`:
    pass it as pickscore_processor_path and pickscore_model_path."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = families.clip_tokenizer()
    images = CLIPImageProcessor(size={"shortest_edge": image_size},
                                crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    config = CLIPConfig(
        text_config=dict(vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2,
                         max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407),
        vision_config=dict(image_size=image_size, patch_size=patch_size, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2),
        projection_dim=16)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        CLIPModel(config).save_pretrained(folder)
    return folder


def tiny_hps(folder, *, seed=0, image_size=32, patch_size=8):
    """Register a tiny open_clip architecture and save a random HPS-style checkpoint
    ({"state_dict": ...}) into `folder`; returns (hps_model_name, hps_checkpoint_path)."""
    import open_clip

    name = f"tiny-hps-{image_size}-{patch_size}"
    config = {"embed_dim": 16,
              "vision_cfg": {"image_size": image_size, "layers": 2, "width": 32, "head_width": 16,
                             "patch_size": patch_size},
              "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name + ".json"), "w") as f:
        json.dump(config, f)
    open_clip.add_model_config(os.path.join(folder, name + ".json"))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = open_clip.create_model(name, pretrained=None)
    path = os.path.join(folder, "hps_tiny.pt")
    torch.save({"state_dict": model.state_dict()}, path)
    return name, path


def _random_state(shapes, seed):
    """{name: random tensor} for {name: shape}, seeded: weights ~ N(0, 1 / fan_in) (signals keep their size
    through deep stacks), LayerNorm weights near 1, the rest (biases, embeddings) small."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=g)
        if "norm" in name.lower() and name.endswith("weight"):
            x = 1 + 0.1 * x
        elif name.endswith("weight") and len(shape) >= 2:
            x = x / math.sqrt(math.prod(shape[1:]))
        else:
            x = 0.1 * x if name.endswith("bias") else 0.5 * x
        state[name] = x
    return state


def _laion_mlp_shapes(prefix, width):
    """The parameter shapes of the LAION aesthetic MLP (ImageReward's head too): width -> 1024 -> 128 -> 64 -> 16 -> 1
    at layers 0 2 4 6 7."""
    sizes = {0: (1024, width), 2: (128, 1024), 4: (64, 128), 6: (16, 64), 7: (1, 16)}
    return {f"{prefix}{i}.{p}": (shape if p == "weight" else shape[:1]) for i, shape in sizes.items()
            for p in ("weight", "bias")}


def tiny_aesthetic(folder, *, seed=0, image_size=32, patch_size=8):
    """A tiny CLIP (as `tiny_pickscore`) and a random aesthetic MLP on its 16-wide embedding, saved as the published
    predictor is (torch.save of {"layers.N.weight": ...}); returns (aesthetic_clip_path, aesthetic_mlp_path)."""
    clip = tiny_pickscore(os.path.join(folder, "clip"), seed=seed, image_size=image_size, patch_size=patch_size)
    path = os.path.join(folder, "aesthetic_mlp.pth")
    torch.save(_random_state(_laion_mlp_shapes("layers.", 16), seed + 1), path)
    return clip, path


def _wordpiece_tokenizer():
    """A BERT-style (uncased WordPiece) tokenizer built offline: BERT's special tokens at BERT's ids (pad 0,
    unk 100, cls 101, sep 102, mask 103), then characters, their `##` continuations and a few hundred whole
    words from CLIP's vocabulary."""
    import string

    from transformers import BertTokenizer

    vocab = [f"[unused{i}]" for i in range(100)]
    vocab[0] = "[PAD]"
    vocab += ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = string.ascii_lowercase + string.digits + string.punctuation
    clip_vocab, _ = families.clip_bpe()
    words = [t[:-4] for t in clip_vocab if t.endswith("</w>") and len(t) > 6 and t[:-4].isascii() and t[:-4].isalpha()]
    vocab += list(chars) + ["##" + c for c in string.ascii_lowercase + string.digits] + words[:300]
    return BertTokenizer(vocab={t: i for i, t in enumerate(dict.fromkeys(vocab))}, do_lower_case=True)


def tiny_imagereward(folder, *, seed=0, image_size=32, patch_size=16):
    """Save a random ImageReward stand-in into `folder`, as the authors ship theirs (THUDM/ImageReward): an
    ImageReward.pt with their key names (BLIP's ViT as `blip.visual_encoder.*`, med.py's BERT with cross-attention
    as `blip.text_encoder.*`, the head as `mlp.layers.*`, the unused `blip.vision_proj` / `blip.text_proj`),
    their med_config.json at toy size, and a WordPiece tokenizer. Vision: width 64 (one head of 64), 2 blocks;
    text: width 32, 2 layers, 2 heads. Pass the folder as imagereward_model_path and imagereward_tokenizer_path."""
    os.makedirs(folder, exist_ok=True)
    tokenizer = _wordpiece_tokenizer()
    tokenizer.save_pretrained(folder)
    vw, depth, hidden, layers, positions = 64, 2, 32, 2, 40
    med_config = {"architectures": ["BertModel"], "hidden_act": "gelu", "hidden_size": hidden, "intermediate_size": 64,
                  "layer_norm_eps": 1e-12, "max_position_embeddings": positions, "model_type": "bert",
                  "num_attention_heads": 2, "num_hidden_layers": layers, "pad_token_id": 0,
                  "vocab_size": len(tokenizer) + 2,  # + [DEC] and [ENC], which BLIP's init_tokenizer adds
                  "encoder_width": vw, "add_cross_attention": True,
                  "bos_token_id": len(tokenizer), "eos_token_id": 102, "sep_token_id": 102}
    with open(os.path.join(folder, "med_config.json"), "w") as f:
        json.dump(med_config, f, indent=1)
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    shapes = {v + "cls_token": (1, 1, vw), v + "pos_embed": (1, (image_size // patch_size) ** 2 + 1, vw),
              v + "patch_embed.proj.weight": (vw, 3, patch_size, patch_size), v + "patch_embed.proj.bias": (vw,)}
    for i in range(depth):  # ImageReward/models/BLIP/vit.py, Block
        for name, shape in (("norm1", (vw,)), ("attn.qkv", (3 * vw, vw)), ("attn.proj", (vw, vw)), ("norm2", (vw,)),
                            ("mlp.fc1", (4 * vw, vw)), ("mlp.fc2", (vw, 4 * vw))):
            shapes[f"{v}blocks.{i}.{name}.weight"], shapes[f"{v}blocks.{i}.{name}.bias"] = shape, shape[:1]
    shapes[v + "norm.weight"], shapes[v + "norm.bias"] = (vw,), (vw,)
    shapes[t + "embeddings.word_embeddings.weight"] = (med_config["vocab_size"], hidden)
    shapes[t + "embeddings.position_embeddings.weight"] = (positions, hidden)
    shapes[t + "embeddings.LayerNorm.weight"] = shapes[t + "embeddings.LayerNorm.bias"] = (hidden,)
    for i in range(layers):  # ImageReward/models/BLIP/med.py, BertLayer with cross-attention
        for name, shape in (("attention.self.query", (hidden, hidden)), ("attention.self.key", (hidden, hidden)),
                            ("attention.self.value", (hidden, hidden)), ("attention.output.dense", (hidden, hidden)),
                            ("attention.output.LayerNorm", (hidden,)), ("crossattention.self.query", (hidden, hidden)),
                            ("crossattention.self.key", (hidden, vw)), ("crossattention.self.value", (hidden, vw)),
                            ("crossattention.output.dense", (hidden, hidden)),
                            ("crossattention.output.LayerNorm", (hidden,)), ("intermediate.dense", (64, hidden)),
                            ("output.dense", (hidden, 64)), ("output.LayerNorm", (hidden,))):
            key = f"{t}encoder.layer.{i}.{name}"
            shapes[key + ".weight"], shapes[key + ".bias"] = shape, shape[:1]
    for name, width in (("vision_proj", vw), ("text_proj", hidden)):  # BLIP_Pretrain's projections (embed_dim 256)
        shapes[f"blip.{name}.weight"], shapes[f"blip.{name}.bias"] = (256, width), (256,)
    state = _random_state({**shapes, **_laion_mlp_shapes("mlp.layers.", hidden)}, seed)
    state[t + "embeddings.position_ids"] = torch.arange(positions)[None]  # a buffer their checkpoint carries
    torch.save(state, os.path.join(folder, "ImageReward.pt"))
    return folder


QWEN2_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                     "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL-Instruct's chat template for messages of text and images: a default system turn, an image as
# <|vision_start|><|image_pad|><|vision_end|> (the processor repeats the pad once per visual token).
QWEN2_VL_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_hpsv3(folder, *, seed=0):
    """Save a random HPSv3 stand-in: `folder/base` plays Qwen2-VL-7B-Instruct (its config, and a processor whose
    tokenizer is byte-level with Qwen2-VL's special tokens and chat template; Qwen2-VL's image processor) and
    `folder/HPSv3.safetensors` the authors' checkpoint (the whole Qwen2VLRewardModelBT: `model.visual.*`,
    `model.language_model.*`, `lm_head.weight`, `rm_head.*`, with one more token row for <|Reward|>). Qwen2-VL at
    toy size: a 1-block vision tower of width 16, a 2-layer language model of width 16. Returns
    (hpsv3_base_path, hpsv3_checkpoint_path)."""
    from safetensors.torch import save_file
    from transformers import (Qwen2Tokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    base = os.path.join(folder, "base")
    tokenizer = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(families.byte_alphabet())}, merges=[],
                               padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_SPECIALS[1:]})
    ids = dict(zip(QWEN2_VL_SPECIALS, tokenizer.convert_tokens_to_ids(QWEN2_VL_SPECIALS)))
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), video_processor=Qwen2VLVideoProcessor(),
                     tokenizer=tokenizer, chat_template=QWEN2_VL_TEMPLATE).save_pretrained(base)

    def config(vocab_size):
        return Qwen2VLConfig(
            text_config=dict(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                             rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                             pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
                             eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False, initializer_range=0.5),
            vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2,
                               initializer_range=0.5),  # large weights: scores differ visibly between inputs
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False)

    config(len(tokenizer) + 8).save_pretrained(base)  # the base model's table is padded, as Qwen2-VL-7B's (152064)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config(len(tokenizer) + 1))  # + <|Reward|>
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    head = {0: (1024, 16), 3: (16, 1024), 5: (2, 16)}  # qwen2vl_trainer.py: Linear, ReLU, Dropout, Linear, ReLU, Linear
    state.update(_random_state({f"rm_head.{i}.{p}": (s if p == "weight" else s[:1]) for i, s in head.items()
                                for p in ("weight", "bias")}, seed + 1))
    path = os.path.join(folder, "HPSv3.safetensors")
    save_file(state, path)
    return base, path


MODELS = {
    "tiny": tiny,
    "shapes": shapes_model,
    "tiny-flux": tiny_flux,
    "sd3": sd3,
    "sd3-random": sd3_random,
    "flux": flux,
    "wan": families.wan,
    "tiny-wan": families.tiny_wan,
    "qwen-image": families.qwen_image,
    "tiny-qwen-image": families.tiny_qwen_image,
    "flux2-klein": families.flux2_klein,
    "tiny-flux2-klein": families.tiny_flux2_klein,
    "z-image": families.z_image,
    "tiny-z-image": families.tiny_z_image,
    "flux-kontext": families.flux_kontext,
    "tiny-flux-kontext": tiny_flux_kontext,
    "qwen-image-edit": families.qwen_image_edit,
    "tiny-qwen-image-edit": families.tiny_qwen_image_edit,
    "qwen-image-edit-plus": families.qwen_image_edit_plus,
    "tiny-qwen-image-edit-plus": families.tiny_qwen_image_edit_plus,
    "shapes-edit": shapes_edit_model,
}


def add_arguments(parser):
    """The model flags, declared once; None means the preset of --model (train.py)."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="shapes", choices=list(MODELS),
                   help="model family (shapes: pretrained, learns on a CPU in minutes; tiny: random, the fastest)")
    g.add_argument("--model-path", default=None,
                   help="hub id or local folder of the pipeline (default: the family's hub id)")
    g.add_argument("--resolution", type=flags.resolution_arg, default=None,
                   help="image side in pixels, or HEIGHTxWIDTH (sd3, wan, z-image)")
    g.add_argument("--num-frames", type=flags.POSITIVE_INT, default=None,
                   help="video models (wan): frames per sample, 4 k + 1 (default: the pipeline's 81)")
    g.add_argument("--prompt-cache-gb", type=flags.NONNEG, default=None,
                   help="CPU memory per GPU for prompt embeddings, each prompt encoded once (models.prompt_cache; "
                        f"0: none; default {DEFAULT_PROMPT_CACHE_GB:g} on a GPU, 0 on a CPU)")
    g.add_argument("--offload-text-encoders", action="store_true",
                   help="encode every training and held-out prompt ahead into the prompt cache, then keep the text "
                        "encoders on the CPU (a miss moves them back for its encode)")
    g.add_argument("--edit-vl-input", choices=list(families.EDIT_VL_INPUTS), default="diffusers",
                   help="qwen-image-edit: what its VL encoder is shown of the source. diffusers: the resized image; "
                        "authors: Flow-GRPO's preprocessed tensor in [-1, 1], almost uniform after the Qwen2-VL "
                        "processor's 1/255 rescale (default: %(default)s)")
    return g
