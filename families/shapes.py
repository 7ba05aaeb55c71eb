"""The shapes world's models (the shapes/ package holds the world, its architectures and weight file names): `shapes`,
an SD3 pipeline in pixel space at 32 px pretrained in this repository (scripts/pretrain_shapes.py, weights
shipped in weights/), and `shapes-edit`, its edit model, FLUX.1 Kontext's pipeline in pixel space pretrained on
rendered edit pairs (scripts/pretrain_shapes_edit.py). They run through the SD3 and FLUX.1 Kontext adapters
(families/sd3.py, families/flux_kontext.py); here are their builders, their pretrained weights' files and their presets.
"""

import os
import types

import torch

import flags
from families import common, flux_kontext, sd3
from shapes import edit, world


# ----------------------------------------------------------------------------- the shapes model

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


class _Float32TrainingAttention:
    """SD3's joint attention (diffusers' JointAttnProcessor2_0), run with autocast off in a forward that builds a graph.

    Under bf16 autocast on a CPU, torch's fused SDPA kernel (2.14, _scaled_dot_product_flash_attention_for_cpu)
    runs its backward in bf16 about 4x slower than in float32: on the shapes model at 32 samples it took 283 ms of a
    780 ms forward + backward (64 ms in float32), eating what the bf16 matmuls save (docs/cpu_throughput.md). The
    training forward's attention therefore runs in float32 (its projections too: the processor's inputs are cast up);
    the forwards without gradients (rollouts, the old copy, evaluation) keep bf16 attention, which is faster there.
    Without autocast this calls the processor as it is: float32 runs are bit for bit what they were."""

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        device_type = hidden_states.device.type
        if not (torch.is_grad_enabled() and torch.is_autocast_enabled(device_type)):
            return self.processor(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        up = lambda t: t if t is None else t.float()
        with torch.autocast(device_type, enabled=False):
            return self.processor(attn, up(hidden_states), up(encoder_hidden_states), attention_mask, *args, **kwargs)


def tokenizer():
    """CLIP's BPE tokenizer (common.clip_tokenizer) with this model's 16-token context."""
    tok = common.clip_tokenizer()
    tok.model_max_length = world.TOKENS
    return tok


def build(*, seed=0, device="cpu"):
    """The `shapes` StableDiffusion3Pipeline with weights drawn from `seed` (before any training)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    def clip():
        t = world.TEXT_ENCODER
        config = CLIPTextConfig(
            vocab_size=49408, hidden_size=t["hidden"], intermediate_size=t["ffn"], num_hidden_layers=t["layers"],
            num_attention_heads=t["heads"], max_position_embeddings=world.TOKENS, projection_dim=t["hidden"],
            bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
        )
        return CLIPTextModelWithProjection(config).eval()

    with common.seeded_build(seed, device):
        text_encoder, text_encoder_2 = clip(), clip()
        transformer = SD3Transformer2DModel(**world.TRANSFORMER).eval()
    for module in transformer.modules():  # --mixed-precision bf16: the training forward's attention in float32
        if hasattr(module, "processor"):
            module.set_processor(_Float32TrainingAttention(module.processor))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_pixel_space(device),
        text_encoder=text_encoder, tokenizer=tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer(), text_encoder_3=None, tokenizer_3=None,
    )
    pipe.model_name = "shapes"  # its record (models.family), also before the weights are loaded or trained
    return pipe


SHAPES_FROZEN = "text_model.embeddings.token_embedding"  # CLIP's 49408-row token table stays at its seeded values


def _frozen(key):
    """Whether a text encoder's parameter is its token table (CLIPTextModel names it without "text_model.")."""
    return key.startswith(SHAPES_FROZEN) or key.startswith(SHAPES_FROZEN.removeprefix("text_model."))


def trained_state(pipe):
    """The weights that pretraining trains, by component-prefixed name: the parameters of the transformer
    and both text encoders (buffers such as the sin-cos position table are rebuilt), except the token
    tables. Those (49408 x 64 each, 25 MB in float32) stay at their seeded initialisation: the tokens of
    this world's prompts get distinct random vectors that the encoder layers learn to read, and the
    file need not carry 49 382 rows that no prompt uses."""
    return {f"{name}.{key}": value for name in ("transformer", "text_encoder", "text_encoder_2")
            for key, value in getattr(pipe, name).named_parameters() if not _frozen(key)}


def trainable_parameters(pipe):
    """The parameters of trained_state, with requires_grad set (the token tables frozen)."""
    params = []
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        for key, param in getattr(pipe, name).named_parameters():
            param.requires_grad_(not _frozen(key))
            if param.requires_grad:
                params.append(param)
    return params


def save_weights(pipe, path):
    """Write trained_state(pipe) in float16 (half the size; the model runs in float32) to a safetensors file."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu").half().contiguous() for k, v in trained_state(pipe).items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(state, path)


def save_ema(pipe, params, ema, path):
    """save_weights of the EMA `ema` of the trained `params` (pretraining's saved weights), leaving the trained
    ones in place."""
    with torch.no_grad():
        trained = [q.detach().clone() for q in params]
        for e, q in zip(ema, params):
            q.copy_(e)
        save_weights(pipe, path)
        for t, q in zip(trained, params):
            q.copy_(t)


def load_weights(pipe, path, *, script="scripts/pretrain_shapes.py"):
    """Copy weights written by save_weights into a pipeline from build (or build_edit, whose
    weights `script` writes; same seed)."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no shapes weights there; the repository ships {world.WEIGHTS} "
                                f"(git checkout it) and scripts/pretrain_shapes.py writes new ones")
    state = load_file(path)
    expected = trained_state(pipe)
    if set(state) != set(expected):
        raise ValueError(f"{path} does not hold shapes weights of this architecture "
                         f"({len(set(state) ^ set(expected))} names differ); "
                         f"write them with {script}")
    with torch.no_grad():
        for key, value in expected.items():
            value.copy_(state[key])
    return pipe


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """The pretrained model of the shapes world (shapes/world.py): SD3 architecture in pixel space at 32 px,
    built from shapes.TRANSFORMER / TEXT_ENCODER with the shipped weights/shapes.safetensors, or the
    safetensors file given as --model-path (written by scripts/pretrain_shapes.py)."""
    pipe = load_weights(build(device=device), flags.shipped(model_path or world.WEIGHTS))
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


# ----------------------------------------------------------------------------- the edit model
# Its trained weights go through trained_state / save_weights / load_weights too.


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


def build_edit(*, seed=0, device="cpu"):
    """The `shapes-edit` FluxKontextPipeline with weights drawn from `seed` (before any training): shapes/edit.py's
    EDIT_TRANSFORMER, two CLIP text encoders of the shapes model's size (pooled and sequence, in the CLIP and T5
    slots), the space-to-depth VAE slot."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    def clip():
        t = world.TEXT_ENCODER
        return CLIPTextModel(CLIPTextConfig(
            vocab_size=49408, hidden_size=t["hidden"], intermediate_size=t["ffn"], num_hidden_layers=t["layers"],
            num_attention_heads=t["heads"], max_position_embeddings=world.TOKENS, bos_token_id=49406,
            eos_token_id=49407, pad_token_id=49407)).eval()

    with common.seeded_build(seed, device):
        text_encoder, text_encoder_2 = clip(), clip()
        transformer = FluxTransformer2DModel(**edit.EDIT_TRANSFORMER).eval()
    pipe = FluxKontextPipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_space_to_depth(device),
        text_encoder=text_encoder, tokenizer=tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer())
    pipe.model_name = "shapes-edit"  # its record (models.family), also before the weights are loaded or trained
    return pipe


def load_edit(model_path=None, dtype=torch.float32, device="cpu"):
    """The edit model of the shapes world (shapes/edit.py): FLUX.1 Kontext's pipeline in pixel space at 32 px,
    built by build_edit with the weights of weights/shapes_edit.safetensors, or the safetensors file given as
    --model-path (written by scripts/pretrain_shapes_edit.py)."""
    weights = flags.shipped(model_path or edit.EDIT_WEIGHTS)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{weights}: no shapes-edit weights there; scripts/pretrain_shapes_edit.py "
                                f"writes them (to {edit.EDIT_WEIGHTS}, or to --out, then pass --model-path)")
    pipe = load_weights(build_edit(device=device), weights, script="scripts/pretrain_shapes_edit.py")
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


# ----------------------------------------------------------------------------- records (families.MODELS)
# The shapes world: its pretrained 32 px model learns to follow GenEval-style prompts in minutes on a CPU.
# DiffusionNFT, chosen by measurement: at the same 12,800 samples it rose about twice as far as GRPO (docs/shapes.md).
# 128 samples per step (the GRPO gradient's noise scale is ~15,000 samples: 32 per step is almost all noise), full
# fine-tune at lr 1e-4 (2e-4, chosen on GenEval's 0.9 counting rule, collapsed seed 1 after step 90 on the judge that
# counts every shape: docs/shapes.md) and an evaluated EMA. The reverse-process losses sample with
# coefficient-preserving steps (their rollouts score near the ODE's, Flow-GRPO's step at eta 0.7 well below).
PRESET = dict(common.TINY, loss="nft", resolution=32, prompts="prompts/shapes_train.jsonl",
              eval_prompts="prompts/shapes_test.jsonl", input_key="prompt", reward="geneval", geneval_detector="shapes",
              sde="cps", prompts_per_step=16, sample_batch_size=32, train_batch_size=32, lr=1e-4, ema_decay=0.95,
              steps=100, eval_every=25, eval_steps=10, log_images_every=25)
# Its editing task (shapes/edit.py): the same recipe on the edit prompts, judged by the exact edit judge (0/1), with
# groups of 16 (8 edits a step): an "add" or "count" edit succeeds about 1 time in 10, so a group of 8 often holds
# no success and teaches nothing (docs/editing.md, "How the preset was chosen": +0.07 in 40 steps on seed 2, against
# +0.045 with 16 edits x 8), and 100 steps: the rise builds over all of them (+0.115 to +0.148 on 3 seeds, +0.055 to
# +0.090 at step 60). 2 images per held-out edit (200 of them: one image each would leave a standard error of
# 0.035).
EDIT_PRESET = dict(PRESET, prompts="prompts/shapes_edit_train.jsonl", eval_prompts="prompts/shapes_edit_test.jsonl",
                   reward="shapes_edit", group_size=16, prompts_per_step=8, steps=100, eval_every=10, lr=2e-4,
                   eval_samples_per_prompt=2, log_images_every=10)

SHAPES = dict(sd3.TINY, load=load, multiple=4, preset=PRESET)
# Kontext's pipeline trained on edits only (every prompt brings its source), without a guidance embedding
SHAPES_EDIT = dict(flux_kontext.TINY, load=load_edit, multiple=4, preset=EDIT_PRESET, source_images="required",
                   guidance_embedded=False)
