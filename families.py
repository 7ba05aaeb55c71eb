"""Adapters for the newer families behind models.py: Wan 2.1, Qwen-Image, FLUX.2 [klein], Z-Image.

models.py dispatches here by family (models.family(pipe) is a key of FAMILIES, a literal dict of
plain functions); train.py, sde.py and losses.py never see it. Every adapter maps its family onto
the repository's convention

    x_s = (1 - s) x0 + s eps,    v ~ eps - x0,    Euler step  x + (s' - s) v,    s = 1 is noise,

and its docstring says how (timestep scale, sign of the output, guidance, latent layout, native
schedule), citing the diffusers 0.42 pipeline it was checked against; tests/test_families.py runs
each pipeline's own __call__ on the tiny twin and asserts our velocity, Euler step and schedule
reproduce it.

Our guidance scale g has one meaning in every family: classifier-free guidance
v = v_u + g (v_c - v_u) (Ho & Salimans 2022, eq. 6 with g = 1 + w), off at g = 1, and the
unconditional and conditional halves run as one batched forward. A family whose pipeline counts
guidance differently (Z-Image: its w = g - 1) converts at the boundary; a family without guidance
(a step-distilled FLUX.2 [klein]) ignores g, as its pipeline does.

| name          | what it is                                                                        |
| ------------- | --------------------------------------------------------------------------------- |
| `wan`         | `Wan-AI/Wan2.1-T2V-1.3B-Diffusers`; the 14B by `--model-path`                     |
| `qwen-image`  | `Qwen/Qwen-Image`                                                                 |
| `flux2-klein` | `black-forest-labs/FLUX.2-klein-base-4B` (undistilled, CFG); the distilled 4-step |
|               | `FLUX.2-klein-4B` and the 9B variants by `--model-path`                           |
| `z-image`     | `Tongyi-MAI/Z-Image` (undistilled, CFG); `Z-Image-Turbo` by `--model-path`         |
| `tiny-<name>` | the same classes at toy width, random weights, seed 0, built in code; CPU seconds  |

The tiny twins' Qwen tokenizers are byte-level BPE without merges (one token per UTF-8 byte) with
the Qwen special tokens and a Qwen3-style chat template, built offline: the same pipeline code paths
(chat template, masks, the system-prompt drop of Qwen-Image) at a toy vocabulary. PUBLISHED holds the
real models' configs for parameter counts and memory estimates on the meta device.
"""

import contextlib
import functools
import gzip
import importlib.util
import math
import os

import numpy as np
import torch

import sde

WAN_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
QWEN_IMAGE_ID = "Qwen/Qwen-Image"
KLEIN_ID = "black-forest-labs/FLUX.2-klein-base-4B"
Z_IMAGE_ID = "Tongyi-MAI/Z-Image"


# ----------------------------------------------------------------------------- shared helpers

SD35_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
    layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
    scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
)


# ----------------------------------------------------------------------------- tokenizers

@functools.lru_cache(maxsize=1)
def clip_bpe():
    """CLIP's byte-level BPE (Radford et al. 2021) from the vocabulary file open_clip ships.

    Returns (vocab: token -> id, merges: list of pairs), the same ids as OpenAI's CLIP and
    `openai/clip-vit-large-patch14`. The file is read without importing open_clip (seconds).
    """
    spec = importlib.util.find_spec("open_clip")
    if spec is None:
        raise RuntimeError("the tiny models need the CLIP vocabulary that open_clip ships: pip install open_clip_torch")
    path = os.path.join(spec.submodule_search_locations[0], "bpe_simple_vocab_16e6.txt.gz")
    lines = gzip.open(path, "rt", encoding="utf-8").read().split("\n")
    merges = [tuple(line.split()) for line in lines[1:49152 - 256 - 2 + 1]]  # 48894 merges, as CLIP
    tokens = byte_alphabet()
    tokens = tokens + [t + "</w>" for t in tokens] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def byte_alphabet():
    """The 256 printable characters that byte-level BPE uses for the bytes, in CLIP's (= GPT-2's)
    vocabulary order: printable Latin-1 bytes as themselves, the others as code points after 255."""
    byte_ids = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = byte_ids[:], 0
    for b in range(256):
        if b not in byte_ids:
            byte_ids.append(b)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def clip_tokenizer():
    """transformers' CLIPTokenizer with CLIP's real vocabulary, built offline (tiny models, reward stand-ins)."""
    from transformers import CLIPTokenizer

    vocab, merges = clip_bpe()
    return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=77)


def t5_tokenizer(max_length):
    """A small sentencepiece-style (Unigram) tokenizer with T5's special tokens (pad 0, eos 1,
    unk 2): whole English words from CLIP's vocabulary, then single characters as fallback."""
    from transformers import T5Tokenizer

    vocab, _ = clip_bpe()
    words = [t[:-4] for t in vocab if t.endswith("</w>") and len(t) > 5]  # whole words of 2+ characters
    words = [w for w in words if w.isascii() and w.isalnum()]
    chars = [chr(c) for c in range(33, 127)]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + w, -1.0) for w in words[:8000]]  # most frequent first (merge order)
    pieces += [(c, -3.0) for c in chars] + [("▁" + c, -3.0) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


# ----------------------------------------------------------------------------- building

@contextlib.contextmanager
def seeded_build(seed, device):
    """Build modules on `device` with weights drawn from `seed`, leaving the global RNG as it was."""
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device):
            yield


def clip_encoder(hidden, layers, heads, ffn, *, projection=True):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=49408, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=77, projection_dim=hidden,
        bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,  # pooled at the first <|endoftext|>
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def t5_encoder(vocab_size, d_model, layers, heads, d_kv, ffn):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_kv, d_ff=ffn, num_layers=layers, num_heads=heads,
        relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    return T5EncoderModel(config).eval()


def small_vae(latent_channels, scaling_factor, shift_factor):
    from diffusers import AutoencoderKL

    return AutoencoderKL(  # 3 blocks: 4x down-sampling, 64 px -> 16 x 16 latents
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=8, sample_size=64, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


def check_no_path(name, model_path):
    if model_path is not None:
        raise ValueError(f"model {name!r} is built in code and takes no --model-path; "
                         "drop the flag or pick a hub model (sd3, flux, wan, ...)")


def from_pretrained(cls, name, path, default_id, dtype):
    """`cls.from_pretrained`, turning every way a hub model can be missing into one sentence."""
    from huggingface_hub.errors import HFValidationError

    local = os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)
    if local and not os.path.isdir(os.path.expanduser(path)):
        raise RuntimeError(f"model folder {path!r} for {name!r} does not exist; pass a downloaded diffusers folder "
                           f"of {default_id} with --model-path")
    try:
        return cls.from_pretrained(os.path.expanduser(path), torch_dtype=dtype)
    except (OSError, HFValidationError) as e:  # offline, gated without a token, not cached, not a pipeline
        raise RuntimeError(
            f"cannot load {name!r} from {path!r} ({type(e).__name__}: offline, gated without a token, or not a "
            f"diffusers pipeline folder); download {default_id} where the hub is reachable "
            f"(`hf download {default_id}`) "
            f"and pass the local folder with --model-path"
        ) from None


def decode_kl(vae, latents):
    """Latents [B, C, h, w] of an AutoencoderKL with scaling and shift -> uint8 [B, H, W, 3] on the CPU."""
    images = []
    for chunk in latents.split(8):  # the VAE decoder's activations dominate memory at 1024 px
        z = chunk.to(vae.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]  # [b, 3, H, W] in [-1, 1]
        images.append(_to_uint8(image).permute(0, 2, 3, 1).cpu())
    return torch.cat(images)


def dynamic_shift_mu(config, image_tokens):
    """FLUX's resolution-dependent shift (diffusers' calculate_shift, pipeline_flux.py): mu linear in
    the number of image tokens, from base_shift at base_image_seq_len to max_shift at max_image_seq_len."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_tokens * m + base_shift - m * base_len


def flow_match_sigmas(config, base, *, mu=None, shift=None):
    """What FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=base, mu=mu) stores as its sigmas
    (scheduling_flow_match_euler_discrete.py), computed in float32 as there: float32 [N + 1], 1 -> 0.

    Dynamic configs shift by mu: exponential exp(mu) / (exp(mu) + 1/t - 1) (FLUX, arXiv:2403.03206
    applied per resolution) or linear mu / (mu + 1/t - 1); static ones by config.shift. `shift` (--shift)
    replaces either with that static shift (MixGRPO samples FLUX.1 with a static shift of 3 on this same
    grid). shift_terminal then stretches the schedule so that its last nonzero sigma equals it (LTX-Video's
    rule, as diffusers applies it)."""
    t = np.asarray(base).astype(np.float32)
    if shift is not None:
        t = sde.time_shift(t, shift)
    elif config.get("use_dynamic_shifting", False):
        if config.get("time_shift_type", "exponential") == "exponential":
            t = math.exp(mu) / (math.exp(mu) + (1 / t - 1))
        else:
            t = mu / (mu + (1 / t - 1))
    else:
        t = sde.time_shift(t, config.get("shift", 1.0) if shift is None else shift)
    if config.get("shift_terminal"):
        one_minus = 1 - t
        t = 1 - one_minus / (one_minus[-1] / (1 - config["shift_terminal"]))
    if any(config.get(k) for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas")):
        raise ValueError("karras / exponential / beta / inverted sigmas are not supported; "
                         "use the model's own scheduler config")
    return torch.cat([torch.from_numpy(np.asarray(t, dtype=np.float32)), torch.zeros(1)])



def _pad_tokens(embeds, mask, length):
    """Right-pad [B, L, D] embeddings with zeros and their [B, L] mask with False to `length` tokens."""
    extra = length - embeds.shape[1]
    if extra == 0:
        return embeds, mask
    return (torch.nn.functional.pad(embeds, (0, 0, 0, extra)),
            torch.nn.functional.pad(mask, (0, extra), value=False))


def host_mask(mask, embeds):
    """A prompt mask as the embeddings keep it: bool [B, L], right-padded, on the CPU (all valid when None). Copied
    there once per encode, so that the forwards read it on the host (Qwen-Image's all-valid test, Z-Image's prompt
    lengths) without waiting on the GPU each time; they move it to the device where the transformer needs it."""
    return torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool().cpu()


def _with_negative(out, encode, negative_prompt, batch, masked):
    """Add `neg_prompt_embeds` (and `neg_prompt_mask`): the negative prompt encoded once and expanded
    to the batch; with masks, both sides are right-padded to a common length so that the
    unconditional and conditional halves can share one forward."""
    neg = encode([negative_prompt])
    if masked:
        length = max(out["prompt_embeds"].shape[1], neg["prompt_embeds"].shape[1])
        out["prompt_embeds"], out["prompt_mask"] = _pad_tokens(out["prompt_embeds"], out["prompt_mask"], length)
        neg["prompt_embeds"], neg["prompt_mask"] = _pad_tokens(neg["prompt_embeds"], neg["prompt_mask"], length)
    for key, value in neg.items():
        out["neg_" + key] = value.expand(batch, *value.shape[1:])
    return out


def _cfg_halves(embeds, keys):
    """[negative; conditional] stacked along the batch for each of `keys` (diffusers' order)."""
    if "neg_prompt_embeds" not in embeds:
        raise ValueError("guidance_scale > 1 needs embeds from encode_prompts(..., guidance_scale > 1)")
    return [torch.cat([embeds["neg_" + k], embeds[k]]) for k in keys]


def _guided(v, guidance_scale):
    """Classifier-free guidance (Ho & Salimans 2022, eq. 6 with g = 1 + w) of a forward on [negative; conditional]
    halves: v_u + g (v_c - v_u). Returns (guided [B, ...], v_c)."""
    v_uncond, v_cond = v.chunk(2)
    return v_uncond + guidance_scale * (v_cond - v_uncond), v_cond


def _pipeline_timestep(pipe, sigma, dtype):
    """The timestep FluxPipeline, Flux2KleinPipeline and QwenImagePipeline hand their transformer:
    `t.expand(B).to(latents.dtype)`, then `timestep / 1000`, with t = the scheduler's timestep (sigmas x
    num_train_timesteps, float32). In bf16 1000 s is rounded first and divided after, which differs from
    s.to(bf16) for about a quarter of the sigmas (up to 0.8 %). sigma: float32 [B]."""
    return (sigma * pipe.scheduler.config.num_train_timesteps).to(dtype) / 1000


def _to_uint8(images):
    """[-1, 1] float -> uint8, as the pipelines' "np" output x 255."""
    return ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def _square(name, height, width):
    if height != width:
        raise ValueError(f"{name} latents are packed into tokens without their grid; pass a square --resolution")


def _check_multiple(height, width, multiple):
    if height % multiple or width % multiple:
        raise ValueError(f"--resolution {height}x{width} must be a multiple of {multiple} for this model")


def _no_frames(num_frames):
    if num_frames not in (None, 1):
        raise ValueError("--num-frames is for video models (wan); this model makes images")


def image_tokens(pipe, height, width):
    """Image tokens after 2 x 2 patching: the sequence length of the resolution-dependent shifts."""
    f = pipe.vae_scale_factor
    return (height // (2 * f)) * (width // (2 * f))


def _qwen_tokenizer(max_length):
    """Byte-level BPE with no merges (one token per UTF-8 byte, GPT-2's byte alphabet) plus the Qwen
    special tokens and a Qwen3 chat template (a `<think>` block closed when enable_thinking is off,
    as Qwen3's own template writes it). Ids: 256 bytes, then the specials."""
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(byte_alphabet())}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    template = (
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        "{%- endif %}"
    )
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=max_length, padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    tokenizer.chat_template = template
    return tokenizer


def _qwen3_encoder(cls, vocab_size, hidden, layers):
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=hidden // 2,
                         max_position_embeddings=512, pad_token_id=256, bos_token_id=256,
                         eos_token_id=258)  # <|endoftext|>, <|im_end|>
    return cls(config).eval()


# ----------------------------------------------------------------------------- Wan 2.1 (video)
# Checked against diffusers/pipelines/wan/pipeline_wan.py (WanPipeline.__call__) and
# schedulers/scheduling_unipc_multistep.py (UniPCMultistepScheduler.set_timesteps).

def wan(model_path=None, dtype=torch.float32, device="cpu"):
    """Wan 2.1 text-to-video (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`, or the 14B by --model-path).

    Conventions: latents [B, 16, F', H/8, W/8] with F' = (F - 1) / 4 + 1 (unpacked; the transformer
    patches 1 x 2 x 2 itself); the network predicts the flow velocity eps - x0 directly (same sign as
    ours); it is conditioned on the integer timestep floor(1000 s), because UniPC stores its flow
    timesteps as int64 (Flow-GRPO's train_wan2_1.py trains on these too). Guidance: true CFG
    v_u + g (v_c - v_u), one forward per half in the pipeline, batched here. Text: UMT5-XXL, padded
    with zeros to max_sequence_length (512, WanPipeline.__call__'s default and Flow-GRPO's) and no
    mask. Native schedule: UniPC flow sigmas, linspace(1, 1/1000, N + 1)[:-1] shifted statically by
    flow_shift (3 for the T2V checkpoints, diffusers' convert_wan_to_diffusers.py), the first one
    lowered by 1e-6, then 0. The pipeline integrates it with UniPC (2nd order); its first step is
    exactly Euler, our step. The VAE is kept in float32 whatever `dtype` (diffusers' and
    Flow-GRPO's advice: bf16 decoding of the Wan VAE loses detail).
    """
    from diffusers import WanPipeline

    pipe = from_pretrained(WanPipeline, "wan", model_path or WAN_ID, WAN_ID, dtype)
    pipe.vae.to(torch.float32)
    return pipe


def tiny_wan(model_path=None, dtype=torch.float32, device="cpu"):
    """Wan 2.1 at toy size: 2 blocks of width 24 (2 heads), UMT5 encoder of width 32, a causal 3D VAE
    with 8x spatial / 4x temporal compression and base width 8; UniPC with flow_shift 3; seed 0."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    check_no_path("tiny-wan", model_path)
    tokenizer = t5_tokenizer(32)
    with seeded_build(0, device):
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32).eval()
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True]).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def _wan_shape(pipe, height, width, num_frames):
    multiple = pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]
    _check_multiple(height, width, multiple)
    frames = 81 if num_frames is None else num_frames  # WanPipeline.__call__'s default
    if frames < 1 or (frames - 1) % pipe.vae_scale_factor_temporal:
        raise ValueError(f"--num-frames {frames} must be {pipe.vae_scale_factor_temporal} k + 1 for Wan (e.g. 33, 81)")
    f = pipe.vae_scale_factor_spatial
    return (pipe.transformer.config.in_channels, (frames - 1) // pipe.vae_scale_factor_temporal + 1,
            height // f, width // f)


def _wan_noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    shape = (batch, *_wan_shape(pipe, height, width, num_frames))
    return randn_tensor(shape, generator=generator, device=pipe._execution_device, dtype=torch.float32)


def _wan_encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    def encode(texts):
        embeds, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, max_sequence_length=tokens,
                                       device=pipe._execution_device)
        return {"prompt_embeds": embeds}

    out = encode(prompts)
    return _with_negative(out, encode, negative_prompt, len(prompts), masked=False) if guidance_scale > 1 else out


def _wan_velocity(pipe, model, x, sigma, embeds, guidance_scale):
    dtype = pipe.transformer.dtype
    timestep = torch.floor(sigma.double() * pipe.scheduler.config.num_train_timesteps).long()  # int64, as UniPC's
    (text,) = _cfg_halves(embeds, ["prompt_embeds"]) if guidance_scale > 1 else (embeds["prompt_embeds"],)
    if guidance_scale > 1:
        x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
    v = model(hidden_states=x.to(dtype), timestep=timestep, encoder_hidden_states=text.to(dtype), return_dict=False)[0]
    if guidance_scale > 1:
        v, _ = _guided(v, guidance_scale)
    return v


@torch.no_grad()
def _wan_decode(pipe, latents):
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    videos = []
    for chunk in latents.split(1):  # one video at a time: the 3D decoder's activations are large
        z = chunk.to(vae.device, torch.float32) * std.to(vae.device) + mean.to(vae.device)  # the pipeline's
        video = vae.decode(z.to(vae.dtype), return_dict=False)[0]  # [1, 3, F, H, W] in [-1, 1]
        videos.append(_to_uint8(video).permute(0, 2, 3, 4, 1).cpu())  # [1, F, H, W, 3]
    return torch.cat(videos)


def _wan_sigmas(pipe, num_steps, height, width, shift):
    config = pipe.scheduler.config
    kind = type(pipe.scheduler).__name__
    if kind != "UniPCMultistepScheduler" or not config.use_flow_sigmas or config.use_dynamic_shifting:
        raise ValueError(f"wan: expected the UniPC flow-sigma scheduler with a static flow_shift, got {kind}")
    base = np.linspace(1, 1 / config.num_train_timesteps, num_steps + 1)[:-1]  # float64, as UniPC computes it
    s = sde.time_shift(base, config.flow_shift if shift is None else shift)
    if config.shift_terminal:
        raise ValueError("wan: a shift_terminal scheduler is not supported")
    if abs(s[0] - 1) < 1e-6:
        s[0] -= 1e-6  # UniPC keeps the first sigma below 1
    return torch.from_numpy(np.concatenate([s, [0.0]]).astype(np.float32))


# ----------------------------------------------------------------------------- Qwen-Image
# Checked against diffusers/pipelines/qwenimage/pipeline_qwenimage.py (QwenImagePipeline.__call__).

def qwen_image(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image (`Qwen/Qwen-Image`, a 20 B MMDiT with a Qwen2.5-VL-7B text encoder).

    Conventions: latents 2 x 2-packed into tokens [B, (H/16)(W/16), 64] as FLUX.1's; the network
    predicts eps - x0 (our sign); timestep s, passed as the pipeline passes it (`_pipeline_timestep`).
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
    pipe = from_pretrained(QwenImagePipeline, "qwen-image", path, QWEN_IMAGE_ID, dtype)
    pipe.vae.to(torch.float32)  # as Flow-GRPO's train_qwenimage.py L404, whatever the mixed precision
    return pipe


def tiny_qwen_image(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image at toy size: 2 blocks of width 32 (2 heads), a 2-layer Qwen2.5-VL of width 16 (its
    vision tower tiny too), the Qwen-Image 3D VAE with 4x compression and 16 channels; the published
    scheduler config (dynamic shift 0.5 .. 0.9 over 256 .. 8192 tokens, exponential, terminal 0.02);
    seed 0."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    check_no_path("tiny-qwen-image", model_path)
    tokenizer = _qwen_tokenizer(1024)
    with seeded_build(0, device):
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
        pipe.vae.to(torch.float32)  # as qwen_image
    return pipe


def _packed_shape(pipe, height, width, num_frames):
    _no_frames(num_frames)
    _square("this model's", height, width)
    f = pipe.vae_scale_factor
    _check_multiple(height, width, 2 * f)
    return ((height // (2 * f)) * (width // (2 * f)), pipe.transformer.config.in_channels)


def _qwen_noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    tokens, channels = _packed_shape(pipe, height, width, num_frames)
    side = 2 * math.isqrt(tokens)  # latent side
    x = randn_tensor((batch, 1, channels // 4, side, side), generator=generator, device=pipe._execution_device,
                     dtype=torch.float32)  # QwenImagePipeline.prepare_latents draws [B, 1, C, h, w], then packs
    return pipe._pack_latents(x, batch, channels // 4, side, side)


def _qwen_encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    def encode(texts):
        embeds, mask = pipe.encode_prompt(list(texts), device=pipe._execution_device, max_sequence_length=tokens)
        # the mask is read once here, onto the CPU (host_mask), where every forward then reads it without a sync
        return {"prompt_embeds": embeds, "prompt_mask": host_mask(mask, embeds)}

    out = encode(prompts)
    return _with_negative(out, encode, negative_prompt, len(prompts), masked=True) if guidance_scale > 1 else out


def _qwen_velocity(pipe, model, x, sigma, embeds, guidance_scale):
    dtype = pipe.transformer.dtype
    length = x.shape[1]
    side = math.isqrt(length)
    keys = ["prompt_embeds", "prompt_mask"]
    text, mask = _cfg_halves(embeds, keys) if guidance_scale > 1 else [embeds[k] for k in keys]
    shapes = [(1, side, side)]
    if "ref_latents" in embeds:  # Qwen-Image-Edit: the references' tokens after the target's (conditioning only)
        x = torch.cat([x, embeds["ref_latents"].to(x.device, x.dtype)], dim=1)  # [B, L + L_ref, C]
        shapes += [(1, rows, cols) for rows, cols in _reference_grids(embeds)]
    if guidance_scale > 1:
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
    v = model(hidden_states=x.to(dtype), timestep=_pipeline_timestep(pipe, sigma, dtype),
              encoder_hidden_states=text.to(dtype),
              # the pipeline drops an all-valid mask; read on the CPU (host_mask), it costs no sync per forward
              encoder_hidden_states_mask=None if mask.all() else mask.to(x.device),
              img_shapes=[shapes] * x.shape[0], return_dict=False)[0]
    v = v[:, :length]  # the target's tokens
    if guidance_scale > 1:
        combined, v_cond = _guided(v, guidance_scale)
        # Qwen-Image's true CFG keeps each token's conditional norm (pipeline_qwenimage.py, the do_true_cfg branch)
        v = combined * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
    return v


@torch.no_grad()
def _qwen_decode(pipe, latents):
    vae = pipe.vae
    side = math.isqrt(latents.shape[1]) * 2 * pipe.vae_scale_factor
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    images = []
    for chunk in latents.split(8):
        z = pipe._unpack_latents(chunk.to(vae.device, torch.float32), side, side, pipe.vae_scale_factor)  # [b,C,1,h,w]
        z = z * std.to(z.device) + mean.to(z.device)
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0][:, :, 0]  # [b, 3, H, W]
        images.append(_to_uint8(image).permute(0, 2, 3, 1).cpu())
    return torch.cat(images)


def _qwen_unused(transformer):
    """The last block's text-stream output layers: every block updates the text tokens, but the last
    one's update is discarded (only image tokens leave the model), so these get no gradient."""
    last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
    return [f"{last}.attn.to_add_out", f"{last}.txt_mlp.net.0.proj", f"{last}.txt_mlp.net.2"]


def _qwen_sigmas(pipe, num_steps, height, width, shift):
    base = np.linspace(1.0, 1 / num_steps, num_steps)  # QwenImagePipeline.__call__
    mu = dynamic_shift_mu(pipe.scheduler.config, image_tokens(pipe, height, width))
    return flow_match_sigmas(pipe.scheduler.config, base, mu=mu, shift=shift)


# ----------------------------------------------------------------------------- FLUX.2 [klein]
# Checked against diffusers/pipelines/flux2/pipeline_flux2_klein.py (Flux2KleinPipeline.__call__).

def flux2_klein(model_path=None, dtype=torch.float32, device="cpu"):
    """FLUX.2 [klein] (`black-forest-labs/FLUX.2-klein-base-4B`; the 9B and the step-distilled
    `FLUX.2-klein-4B` / `-9B` by --model-path).

    Conventions: latents are the VAE's 32 channels patchified 2 x 2 into 128 and flattened into
    tokens [B, (H/16)(W/16), 128] (row-major, so unpacking is a reshape); the VAE's latent batch-norm
    statistics are undone before decoding. The network predicts eps - x0 (our sign) at timestep s
    (as the pipeline: `_pipeline_timestep`). Guidance: the base models use true CFG v_u + g (v_c - v_u) with
    the empty prompt as the negative (the pipeline has no negative-prompt argument; ours defaults to
    "" too); the distilled models (`is_distilled` in the pipeline config) have no guidance at all,
    and g is ignored as the pipeline ignores it. No guidance embedding. Text: Qwen3 hidden states of
    layers 9, 18, 27 stacked into 3 x hidden channels, padded to max_sequence_length (512, the
    pipeline's default and UniRL's recipes) with no mask; positions (t, h, w, l) ids for text and
    image tokens. Native schedule: linspace(1, 1/N, N) shifted exponentially with the pipeline's
    empirical mu(image tokens, N) (compute_empirical_mu: it depends on the step count too), then 0.
    """
    from diffusers import Flux2KleinPipeline

    return from_pretrained(Flux2KleinPipeline, "flux2-klein", model_path or KLEIN_ID, KLEIN_ID, dtype)


def tiny_flux2_klein(model_path=None, dtype=torch.float32, device="cpu"):
    """FLUX.2 [klein] (base, with CFG) at toy size: 1 double- and 1 single-stream block of width 32
    (2 heads), a 28-layer Qwen3 of width 16 (so that layers 9, 18, 27 exist), the FLUX.2 VAE with
    4x compression and 4 latent channels (16 after patchifying); FLUX.1-dev's scheduler config, which
    diffusers' convert_flux2_to_diffusers.py gives FLUX.2; seed 0."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from diffusers import Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    check_no_path("tiny-flux2-klein", model_path)
    tokenizer = _qwen_tokenizer(128)
    with seeded_build(0, device):
        text_encoder = _qwen3_encoder(Qwen3ForCausalLM, len(tokenizer), 16, 28)
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


def _klein_noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    tokens, channels = _packed_shape(pipe, height, width, num_frames)
    side = math.isqrt(tokens)
    x = randn_tensor((batch, channels, side, side), generator=generator, device=pipe._execution_device,
                     dtype=torch.float32)  # Flux2KleinPipeline.prepare_latents draws patchified latents
    return pipe._pack_latents(x).contiguous()  # [B, h w, C]; contiguous like every stored state, so bits match


def _klein_cfg(pipe, guidance_scale):
    return guidance_scale > 1 and not pipe.config.is_distilled


def _klein_encode(pipe, prompts, negative_prompt, guidance_scale, tokens, images=None, size=None):
    def encode(texts):
        embeds, _ = pipe.encode_prompt(list(texts), device=pipe._execution_device, max_sequence_length=tokens)
        return {"prompt_embeds": embeds}

    out = encode(prompts)
    if images is not None:  # reference images (edit section below)
        out.update(_klein_references(pipe, _reference_images("flux2-klein", images, *size, most=None)))
    if not _klein_cfg(pipe, guidance_scale):
        return out
    return _with_negative(out, encode, negative_prompt, len(prompts), masked=False)


def _klein_references(pipe, refs):
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
    return _references(parts)


def _klein_velocity(pipe, model, x, sigma, embeds, guidance_scale):
    dtype = pipe.transformer.dtype
    side = math.isqrt(x.shape[1])
    cfg = _klein_cfg(pipe, guidance_scale)
    (text,) = _cfg_halves(embeds, ["prompt_embeds"]) if cfg else (embeds["prompt_embeds"],)
    if cfg:
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
    img_ids = pipe._prepare_latent_ids(x.new_empty(x.shape[0], 1, side, side)).to(x.device)  # (t, h, w, l) per token
    length = x.shape[1]
    if "ref_latents" in embeds:  # references after the target, at t = 10, 20, ... (conditioning only)
        ref = embeds["ref_latents"].to(x.device, x.dtype)
        ref_ids = pipe._prepare_image_ids([x.new_empty(1, 1, rows, cols) for rows, cols in _reference_grids(embeds)])
        x = torch.cat([x, torch.cat([ref, ref]) if cfg else ref], dim=1)  # [B, L + L_ref, C]
        img_ids = torch.cat([img_ids, ref_ids.to(x.device).expand(x.shape[0], -1, -1)], dim=1)
    v = model(hidden_states=x.to(dtype), timestep=_pipeline_timestep(pipe, sigma, dtype), guidance=None,
              encoder_hidden_states=text.to(dtype), txt_ids=pipe._prepare_text_ids(text).to(x.device),
              img_ids=img_ids, return_dict=False)[0]
    v = v[:, :length]  # the target's tokens
    if cfg:
        v, _ = _guided(v, guidance_scale)
    return v


@torch.no_grad()
def _klein_decode(pipe, latents):
    vae = pipe.vae
    side = math.isqrt(latents.shape[1])
    mean = vae.bn.running_mean.view(1, -1, 1, 1).float()
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).float() + vae.config.batch_norm_eps)
    images = []
    for chunk in latents.split(8):
        z = chunk.to(vae.device, torch.float32).permute(0, 2, 1).reshape(len(chunk), -1, side, side)  # [b, C, h, w]
        z = pipe._unpatchify_latents(z * std + mean)  # batch-norm statistics undone, 2 x 2 patches unfolded
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        images.append(_to_uint8(image).permute(0, 2, 3, 1).cpu())
    return torch.cat(images)


def klein_mu(image_tokens, num_steps):
    """FLUX.2's empirical shift (compute_empirical_mu, pipeline_flux2_klein.py): above 4300 image tokens
    mu = 1.6927e-4 L + 0.45667; below, linear in the step count N between its fits at N = 10
    (8.738e-5 L + 1.89833) and N = 200 (the large-L line)."""
    mu_200 = 0.00016927 * image_tokens + 0.45666666
    if image_tokens > 4300:
        return mu_200
    mu_10 = 8.73809524e-05 * image_tokens + 1.89833333
    slope = (mu_200 - mu_10) / 190.0
    return slope * num_steps + mu_200 - 200.0 * slope


def _klein_sigmas(pipe, num_steps, height, width, shift):
    base = np.linspace(1.0, 1 / num_steps, num_steps)  # Flux2KleinPipeline.__call__
    mu = klein_mu(image_tokens(pipe, height, width), num_steps)
    return flow_match_sigmas(pipe.scheduler.config, base, mu=mu, shift=shift)


# ----------------------------------------------------------------------------- Z-Image
# Checked against diffusers/pipelines/z_image/pipeline_z_image.py (ZImagePipeline.__call__).

def z_image(model_path=None, dtype=torch.float32, device="cpu"):
    """Z-Image (`Tongyi-MAI/Z-Image`, a 6 B single-stream DiT with a Qwen3-4B text encoder;
    `Tongyi-MAI/Z-Image-Turbo`, step-distilled, by --model-path with --guidance-scale 1).

    Conventions: latents [B, 16, H/8, W/8] (unpacked; the transformer patches 2 x 2 and takes a
    list of [C, 1, h, w]). The network is conditioned on t = 1 - s (the pipeline passes
    (1000 - t) / 1000) and predicts x0 - eps: the pipeline negates its output before the Euler
    step, and so do we. Guidance: the pipeline's guidance_scale w counts from 0
    (pred = c + w (c - u)), which is our g = 1 + w: `--guidance-scale 5` here is the pipeline's 4.
    CFG-truncation and -normalisation are left at the pipeline's defaults (off). Text: the
    second-to-last Qwen3 hidden layer over the chat-templated prompt (thinking enabled, so no
    empty think block), padded to max_sequence_length (512, the pipeline's default) for the encoder
    and then cut to each prompt's own tokens (kept here as a zero-padded tensor and a mask).
    Native schedule: linspace(1, 1/N, N) shifted by the scheduler (static shift 3 for Z-Image-Turbo;
    the pipeline also passes a resolution-dependent mu, used only when the config shifts
    dynamically), then 0.
    """
    from diffusers import ZImagePipeline

    return from_pretrained(ZImagePipeline, "z-image", model_path or Z_IMAGE_ID, Z_IMAGE_ID, dtype)


def tiny_z_image(model_path=None, dtype=torch.float32, device="cpu"):
    """Z-Image at toy size: 2 main and 1 refiner layers of width 32 (2 heads), a 2-layer Qwen3 of width
    16, a 4x VAE with 16 channels and FLUX.1's scaling; static shift 3 (Z-Image-Turbo's scheduler);
    seed 0. The transformer's padding tokens, left uninitialised by diffusers, are drawn from the seed."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    check_no_path("tiny-z-image", model_path)
    tokenizer = _qwen_tokenizer(128)
    with seeded_build(0, device):
        text_encoder = _qwen3_encoder(Qwen3Model, len(tokenizer), 16, 2)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]).eval()
        with torch.no_grad():
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
        vae = small_vae(16, 0.3611, 0.1159)  # FLUX.1's VAE scaling and shift, which Z-Image reuses
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def _z_shape(pipe, height, width, num_frames):
    _no_frames(num_frames)
    f = pipe.vae_scale_factor
    _check_multiple(height, width, 2 * f)
    return (pipe.transformer.in_channels, height // f, width // f)


def _z_noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    shape = (batch, *_z_shape(pipe, height, width, num_frames))
    return randn_tensor(shape, generator=generator, device=pipe._execution_device, dtype=torch.float32)


def _z_encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    def encode(texts):
        # ZImagePipeline._encode_prompt writes the chat template into the list it is given: pass a copy
        per_prompt = pipe._encode_prompt(list(texts), device=pipe._execution_device, max_sequence_length=tokens)
        length = max(len(e) for e in per_prompt)
        embeds = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, length - len(e))) for e in per_prompt])
        mask = torch.stack([torch.arange(length) < len(e) for e in per_prompt])  # on the CPU (host_mask)
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    out = encode(prompts)
    return _with_negative(out, encode, negative_prompt, len(prompts), masked=True) if guidance_scale > 1 else out


def _z_velocity(pipe, model, x, sigma, embeds, guidance_scale):
    dtype = pipe.transformer.dtype
    keys = ["prompt_embeds", "prompt_mask"]
    text, mask = _cfg_halves(embeds, keys) if guidance_scale > 1 else [embeds[k] for k in keys]
    if guidance_scale > 1:
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
    # each prompt's own tokens, as the pipeline passes them: the first n of its right-padded row (the same as e[m]),
    # n counted on the CPU (host_mask), where e[m] on a GPU would wait for the mask's nonzero at every forward
    captions = [e[:n].to(dtype) for e, n in zip(text, mask.sum(1).tolist())]
    out = model(x=list(x.to(dtype).unsqueeze(2).unbind(0)), t=1 - sigma, cap_feats=captions,  # float32 t, as there
                return_dict=False)[0]
    pred = torch.stack([o.float() for o in out]).squeeze(2)  # predicts x0 - eps
    if guidance_scale > 1:
        pred, _ = _guided(pred, guidance_scale)  # the pipeline's cond + w (cond - uncond), with its w = g - 1
    return -pred  # eps - x0, our sign


@torch.no_grad()
def _z_decode(pipe, latents):
    return decode_kl(pipe.vae, latents)


def _z_sigmas(pipe, num_steps, height, width, shift):
    base = torch.linspace(1.0, 1 / num_steps, num_steps).numpy()  # get_default_z_image_sigmas: float32 linspace
    mu = dynamic_shift_mu(pipe.scheduler.config, image_tokens(pipe, height, width))
    return flow_match_sigmas(pipe.scheduler.config, base, mu=mu, shift=shift)


# ----------------------------------------------------------------------------- edit models: reference images
# FLUX.1 Kontext, Qwen-Image-Edit (and its Plus variant, 2509 / 2511, with several references), and FLUX.2 [klein]
# (its section above) given source images. models.encode_prompts(..., images=, resolution=) hands each prompt's
# source images (uint8 [H, W, 3], data.source_images) to the family's encode, which resizes them to the sample
# resolution (PIL's default filter, as Flow-GRPO's edit scripts do before calling their pipelines:
# `ref_image.resize((resolution, resolution))` in train_flux_kontext.py and train_qwenimage_edit(_plus).py), runs
# the pipeline's own preprocessing and VAE, and packs the latents as the target is packed. They travel in the embeds
# dict with the text, batch first like every entry, so train.py's per-sample indexing carries them to every forward:
#
#     ref_latents  [B, L_ref, C]   the tokens of every reference, one after the other
#     ref_shapes   [B, K, 2]       each reference's token grid (rows, columns); the position ids follow from it
#
# The reference tokens are conditioning only: velocity() appends them after the target's tokens and returns the
# output at the target's tokens alone (the pipelines' `noise_pred[:, : latents.size(1)]`). So the SDE step, its
# log-prob (a mean over the target's dimensions), the trajectory and every loss see the target latent and nothing
# else, whatever the size or number of the references (tests/test_edit_models.py checks both).

KONTEXT_ID = "black-forest-labs/FLUX.1-Kontext-dev"
QWEN_EDIT_ID = "Qwen/Qwen-Image-Edit"
QWEN_EDIT_PLUS_ID = "Qwen/Qwen-Image-Edit-2509"
QWEN_EDIT_AREA = 1024 * 1024  # px of the reference latents (VAE_IMAGE_SIZE; QwenImageEditPipeline's 1024 * 1024)
QWEN_EDIT_VL_AREA = 384 * 384  # px of the Plus pipeline's images for the VL encoder (CONDITION_IMAGE_SIZE)


def _reference_images(name, images, height, width, most):
    """Per prompt its source images as RGB PIL images resized to width x height; every prompt brings the same
    number of them, 1 to `most` (None: any)."""
    from PIL import Image

    counts = sorted({len(refs) for refs in images})
    if len(counts) != 1 or counts[0] < 1 or (most is not None and counts[0] > most):
        allowed = "one source image" if most == 1 else "the same number of source images (at least one)"
        raise ValueError(f"{name} takes {allowed} per prompt; the prompts of this batch bring {counts}")
    out = []
    for refs in images:
        pils = [(img if isinstance(img, Image.Image) else Image.fromarray(np.asarray(img, dtype=np.uint8)))
                .convert("RGB") for img in refs]
        out.append([img if img.size == (width, height) else img.resize((width, height)) for img in pils])
    return out


def _references(parts):
    """[(packed latents [B, L_k, C], (rows, cols))] of references k -> the embeds entries ref_latents, ref_shapes."""
    latents = torch.cat([p for p, _ in parts], dim=1)  # [B, sum L_k, C]
    shapes = torch.tensor([list(hw) for _, hw in parts]).expand(len(latents), -1, -1)  # [B, K, 2]
    return {"ref_latents": latents, "ref_shapes": shapes.to(latents.device)}


def _reference_grids(embeds):
    """The (rows, cols) of each reference, shared by the batch (position ids are per sequence, not per sample)."""
    shapes = embeds["ref_shapes"]
    if not bool((shapes == shapes[:1]).all()):
        raise ValueError("the references of one batch must have the same sizes; resize the source images alike")
    return [tuple(hw) for hw in shapes[0].tolist()]


# FLUX.1 Kontext. Checked against diffusers/pipelines/flux/pipeline_flux_kontext.py (FluxKontextPipeline.__call__).

def flux_kontext(model_path=None, dtype=torch.float32, device="cpu"):
    """FLUX.1 Kontext [dev] (`black-forest-labs/FLUX.1-Kontext-dev`), FLUX.1's image editor.

    Conventions as FLUX.1-dev (models.py): latents 2 x 2-packed into tokens [B, (H/16)(W/16), 64], timestep s,
    guidance through the guidance embedding (no CFG; the pipeline's default scale 2.5), T5 text (512 tokens) and
    pooled CLIP; FluxPipeline's schedule, its mu from the target's tokens. The source image is encoded by the VAE
    (its mode, shifted and scaled), packed the same way and appended after the target's tokens with position ids
    (1, row, column) where the target has (0, row, column); the output is cut back to the target's tokens. One
    source image per prompt (the pipeline takes one). The pipeline's _auto_resize (to the nearest of Kontext's
    preferred resolutions, 672 px and up) is not applied: sources take the sample resolution (section note).
    """
    from diffusers import FluxKontextPipeline

    path = model_path or KONTEXT_ID
    return from_pretrained(FluxKontextPipeline, "flux-kontext", path, KONTEXT_ID, dtype)


def _kontext_noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    tokens, channels = _packed_shape(pipe, height, width, num_frames)
    side = 2 * math.isqrt(tokens)  # latent side
    x = randn_tensor((batch, channels // 4, side, side), generator=generator, device=pipe._execution_device,
                     dtype=torch.float32)  # FluxKontextPipeline.prepare_latents draws [B, C, h, w], then packs
    return pipe._pack_latents(x, batch, channels // 4, side, side)


def _kontext_encode(pipe, prompts, negative_prompt, guidance_scale, tokens, images=None, size=None):
    embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, device=pipe._execution_device,
                                           max_sequence_length=tokens)
    out = {"prompt_embeds": embeds, "pooled": pooled}  # guidance-distilled: no negative prompt
    if images is None:  # no source: Kontext generates from the text alone
        return out
    refs = [r[0] for r in _reference_images("flux-kontext", images, *size, most=1)]
    multiple = pipe.vae_scale_factor * 2
    height, width = size[0] // multiple * multiple, size[1] // multiple * multiple  # as __call__ rounds the image
    image = pipe.image_processor.preprocess(refs, height, width)  # [B, 3, h, w] in [-1, 1]
    vae = pipe.vae
    with torch.no_grad():
        z = pipe._encode_vae_image(image.to(vae.device, vae.dtype), generator=None)  # [B, C, h, w], shifted, scaled
    rows, cols = z.shape[2] // 2, z.shape[3] // 2
    return dict(out, **_references([(pipe._pack_latents(z, len(z), z.shape[1], *z.shape[2:]), (rows, cols))]))


def _kontext_velocity(pipe, model, x, sigma, embeds, guidance_scale):
    dtype = pipe.transformer.dtype
    batch, length = x.shape[:2]
    side = math.isqrt(length)
    assert side * side == length, "flux-kontext latents must be packed from a square image"
    hidden = x.to(dtype)
    ids = pipe._prepare_latent_image_ids(batch, side, side, x.device, dtype)  # [L, 3]: (0, row, column)
    if "ref_latents" in embeds:  # the source's tokens after the target's, at (1, row, column)
        (rows, cols), = _reference_grids(embeds)
        ref_ids = pipe._prepare_latent_image_ids(batch, rows, cols, x.device, dtype)
        ref_ids[..., 0] = 1
        hidden = torch.cat([hidden, embeds["ref_latents"].to(x.device, dtype)], dim=1)  # [B, L + L_ref, C]
        ids = torch.cat([ids, ref_ids])
    guidance = None
    if pipe.transformer.config.guidance_embeds:  # Kontext [dev]: distilled guidance, no CFG
        guidance = torch.full((batch,), float(guidance_scale), device=x.device)
    v = model(hidden_states=hidden, timestep=_pipeline_timestep(pipe, sigma, dtype), guidance=guidance,  # as flux
              pooled_projections=embeds["pooled"].to(dtype), encoder_hidden_states=embeds["prompt_embeds"].to(dtype),
              txt_ids=torch.zeros(embeds["prompt_embeds"].shape[1], 3, device=x.device, dtype=dtype), img_ids=ids,
              return_dict=False)[0]
    return v[:, :length]  # the target's tokens only: the references are conditioning


@torch.no_grad()
def _kontext_decode(pipe, latents):
    side = math.isqrt(latents.shape[1]) * 2 * pipe.vae_scale_factor  # image side in pixels
    return decode_kl(pipe.vae, pipe._unpack_latents(latents, side, side, pipe.vae_scale_factor))


# Qwen-Image-Edit and its Plus variant. Checked against diffusers/pipelines/qwenimage/pipeline_qwenimage_edit.py
# (QwenImageEditPipeline.__call__) and pipeline_qwenimage_edit_plus.py (QwenImageEditPlusPipeline.__call__).

def qwen_image_edit(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image-Edit (`Qwen/Qwen-Image-Edit`): Qwen-Image's MMDiT and VAE, its Qwen2.5-VL encoder now shown the
    source image.

    Conventions as Qwen-Image (above: packed latents, timestep s, true CFG with the norm renormalisation, the
    same schedule with mu from the target's tokens). The source image, resized to the area QWEN_EDIT_AREA (1024^2
    px) at its own aspect ratio in multiples of 32 px (the pipeline's calculate_dimensions), goes twice into the
    model: through the VL encoder inside the edit template ("Describe the key features of the input image ...",
    the image's tokens between <|vision_start|> and <|vision_end|>, the template's first 64 tokens dropped), and
    through the VAE (its mode, normalised by the latent mean and std) as packed reference tokens concatenated after
    the target's, with img_shapes [(1, h, w) of the target, (1, h', w') of the source]; the output is cut back to
    the target's tokens. The negative prompt is encoded with the same image, per sample.
    """
    from diffusers import QwenImageEditPipeline

    path = model_path or QWEN_EDIT_ID
    pipe = from_pretrained(QwenImageEditPipeline, "qwen-image-edit", path, QWEN_EDIT_ID, dtype)
    pipe.vae.to(torch.float32)  # as qwen_image: the VAE stays float32 whatever the mixed precision
    return pipe


def qwen_image_edit_plus(model_path=None, dtype=torch.float32, device="cpu"):
    """Qwen-Image-Edit-2509 (`Qwen/Qwen-Image-Edit-2509`; Qwen-Image-Edit-2511 by --model-path), the Plus pipeline:
    several source images per prompt. As qwen-image-edit, except: each source goes to the VL encoder at the area
    QWEN_EDIT_VL_AREA (384^2 px) under "Picture k: <|vision_start|>...<|vision_end|>" before the prompt, and to the
    VAE at QWEN_EDIT_AREA; the references' tokens follow the target's in order, one img_shapes entry each.
    """
    from diffusers import QwenImageEditPlusPipeline

    path = model_path or QWEN_EDIT_PLUS_ID
    pipe = from_pretrained(QwenImageEditPlusPipeline, "qwen-image-edit-plus", path, QWEN_EDIT_PLUS_ID, dtype)
    pipe.vae.to(torch.float32)  # as qwen_image
    return pipe


def _tiny_qwen_edit(cls, name, model_path, dtype, device):
    """Qwen-Image-Edit at toy size: tiny-qwen-image's transformer, VAE and scheduler (seed 0), its Qwen2.5-VL given
    real vision tokens (a 1-layer vision tower of width 16, Qwen2-VL's 14 px patches merged 2 x 2) and a
    Qwen2VLProcessor. Reference areas of 64^2 px (VL 56^2 px for Plus) stand in for the published 1024^2 (384^2),
    which a CPU test cannot afford: the attributes reference_area / condition_area of the pipeline."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    check_no_path(name, model_path)
    tokenizer = _qwen_tokenizer(1024)
    vision = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_tokens(vision, special_tokens=True)
    start, image, _, video = tokenizer.convert_tokens_to_ids(vision)
    with seeded_build(0, device):
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


def tiny_qwen_image_edit(model_path=None, dtype=torch.float32, device="cpu"):
    from diffusers import QwenImageEditPipeline

    return _tiny_qwen_edit(QwenImageEditPipeline, "tiny-qwen-image-edit", model_path, dtype, device)


def tiny_qwen_image_edit_plus(model_path=None, dtype=torch.float32, device="cpu"):
    from diffusers import QwenImageEditPlusPipeline

    return _tiny_qwen_edit(QwenImageEditPlusPipeline, "tiny-qwen-image-edit-plus", model_path, dtype, device)


def qwen_edit_dims(area, ratio):
    """(width, height) of about `area` pixels at aspect `ratio` = width / height, each a multiple of 32
    (calculate_dimensions of pipeline_qwenimage_edit.py)."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


# What Qwen-Image-Edit's VL encoder is shown of each source (--edit-vl-input; the pipeline's attribute edit_vl_input):
# diffusers' pipeline hands encode_prompt the resized PIL image; flow_grpo's qwenimage_edit_pipeline_with_logprob.py
# (L76-84) the preprocessed tensor in [-1, 1], which Qwen2VLImageProcessor still rescales by 1/255 and normalises by
# the CLIP mean / std: pixel values within 1/(255 std) ~ 0.015 of -mean/std, an almost uniform image.
EDIT_VL_INPUTS = ("diffusers", "authors")
EDIT_VL_MODELS = ("qwen-image-edit", "tiny-qwen-image-edit")


def _qwen_edit_encode(pipe, prompts, negative_prompt, guidance_scale, tokens, images=None, size=None):
    plus = type(pipe).__name__ == "QwenImageEditPlusPipeline"
    name = "qwen-image-edit-plus" if plus else "qwen-image-edit"
    if images is None:
        raise ValueError(f"{name} edits source images: give each prompt row one under 'image' (data.py)")
    refs = _reference_images(name, images, *size, most=None if plus else 1)
    area = getattr(pipe, "reference_area", QWEN_EDIT_AREA)
    vl_area = getattr(pipe, "condition_area", QWEN_EDIT_VL_AREA)
    process = pipe.image_processor
    shown, vae_images = [], []  # per prompt, what the VL encoder sees; per reference k, [B, 3, 1, h, w]
    for k in range(len(refs[0])):
        width, height = qwen_edit_dims(area, size[1] / size[0])
        if plus:  # the VL encoder sees a smaller copy; the VAE the reference at `area`, from the source itself
            vl = qwen_edit_dims(vl_area, size[1] / size[0])
            vl_images = [process.resize(r[k], vl[1], vl[0]) for r in refs]
            vae_images.append(torch.cat([process.preprocess(r[k], height, width) for r in refs]).unsqueeze(2))
        else:  # one resized image serves both
            vl_images = [process.resize(r[k], height, width) for r in refs]
            vae_images.append(process.preprocess(vl_images, height, width).unsqueeze(2))
            if getattr(pipe, "edit_vl_input", "diffusers") == "authors":  # the VAE's input, [3, h, w] in [-1, 1]
                vl_images = list(vae_images[-1][:, :, 0].float().cpu())
        shown.append(vl_images)
    shown = [list(per_prompt) for per_prompt in zip(*shown)]  # [prompt][k]

    def encode(texts):  # one prompt at a time: each has its own images inside its text
        parts = [pipe.encode_prompt(prompt=[t], image=s if plus else s[0], device=pipe._execution_device,
                                    max_sequence_length=tokens) for t, s in zip(texts, shown)]
        length = max(e.shape[1] for e, _ in parts)
        masks = [host_mask(m, e) for e, m in parts]
        padded = [_pad_tokens(e, m, length) for (e, _), m in zip(parts, masks)]
        return {"prompt_embeds": torch.cat([e for e, _ in padded]), "prompt_mask": torch.cat([m for _, m in padded])}

    out = encode(prompts)
    if guidance_scale > 1:  # the negative prompt sees each sample's own images, so it is encoded per sample
        neg = encode([negative_prompt] * len(prompts))
        length = max(out["prompt_embeds"].shape[1], neg["prompt_embeds"].shape[1])
        out["prompt_embeds"], out["prompt_mask"] = _pad_tokens(out["prompt_embeds"], out["prompt_mask"], length)
        out["neg_prompt_embeds"], out["neg_prompt_mask"] = _pad_tokens(neg["prompt_embeds"], neg["prompt_mask"],
                                                                       length)
    vae, parts = pipe.vae, []
    for image in vae_images:
        with torch.no_grad():
            z = pipe._encode_vae_image(image.to(vae.device, vae.dtype), generator=None)  # [B, C, 1, h, w], normalised
        parts.append((pipe._pack_latents(z, len(z), z.shape[1], *z.shape[3:]), (z.shape[3] // 2, z.shape[4] // 2)))
    return dict(out, **_references(parts))


# ----------------------------------------------------------------------------- published configs
# Transcribed from the hub repos' config.json files (and diffusers' convert_wan_to_diffusers.py /
# convert_flux2_to_diffusers.py, which write them); {} means the diffusers class defaults, which are the
# published model. For parameter counts and memory estimates on the meta device (no download):
# scripts/family_memory.py and tests/test_families.py.

_T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu")
_UMT5_XXL = dict(_T5_XXL, vocab_size=256384)  # google/umt5-xxl, Wan's text encoder
_QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
_QWEN3_8B = dict(_QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
_QWEN25_VL_7B = dict(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
    vocab_size=152064)
_CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               projection_dim=768)
_CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
               projection_dim=1280, hidden_act="gelu")
_WAN_T2V = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
_KLEIN = dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256, mlp_ratio=3.0,
              axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False)
_KL_16 = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,  # FLUX.1's VAE (Z-Image)
              up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
              latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
              use_post_quant_conv=False)

# name -> component -> (class, config); transformers classes for text encoders, diffusers classes otherwise
PUBLISHED = {
    "wan-1.3b": dict(transformer=("WanTransformer3DModel", dict(_WAN_T2V, num_attention_heads=12, ffn_dim=8960,
                                                                num_layers=30)),
                     text_encoder=("UMT5EncoderModel", _UMT5_XXL), vae=("AutoencoderKLWan", {})),
    "wan-14b": dict(transformer=("WanTransformer3DModel", dict(_WAN_T2V, num_attention_heads=40, ffn_dim=13824,
                                                               num_layers=40)),
                    text_encoder=("UMT5EncoderModel", _UMT5_XXL), vae=("AutoencoderKLWan", {})),
    "qwen-image": dict(transformer=("QwenImageTransformer2DModel", {}),
                       text_encoder=("Qwen2_5_VLForConditionalGeneration", _QWEN25_VL_7B),
                       vae=("AutoencoderKLQwenImage", {})),
    "flux2-klein-4b": dict(transformer=("Flux2Transformer2DModel", dict(
                               _KLEIN, num_layers=5, num_single_layers=20, num_attention_heads=24,
                               joint_attention_dim=7680)),
                           text_encoder=("Qwen3ForCausalLM", _QWEN3_4B), vae=("AutoencoderKLFlux2", {})),
    "flux2-klein-9b": dict(transformer=("Flux2Transformer2DModel", dict(
                               _KLEIN, num_layers=8, num_single_layers=24, num_attention_heads=32,
                               joint_attention_dim=12288)),
                           text_encoder=("Qwen3ForCausalLM", _QWEN3_8B), vae=("AutoencoderKLFlux2", {})),
    "z-image": dict(transformer=("ZImageTransformer2DModel", {}), text_encoder=("Qwen3Model", _QWEN3_4B),
                    vae=("AutoencoderKL", _KL_16)),
    # FLUX.1 Kontext [dev]: FLUX.1-dev's MMDiT (the class defaults) with its guidance embedding, CLIP-L and T5-XXL
    "flux1-kontext": dict(transformer=("FluxTransformer2DModel", dict(guidance_embeds=True)),
                          text_encoder=("CLIPTextModel", _CLIP_L), text_encoder_2=("T5EncoderModel", _T5_XXL),
                          vae=("AutoencoderKL", _KL_16)),
    "sd3.5-large": dict(transformer=("SD3Transformer2DModel", dict(
                            sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                            num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")),
                        text_encoder=("CLIPTextModelWithProjection", _CLIP_L),
                        text_encoder_2=("CLIPTextModelWithProjection", _CLIP_G),
                        text_encoder_3=("T5EncoderModel", _T5_XXL), vae=("AutoencoderKL", None)),  # SD35_VAE
}
PUBLISHED["qwen-image-edit"] = PUBLISHED["qwen-image"]  # Qwen-Image-Edit (and 2509 / 2511): Qwen-Image's components


def build_published(name, component, device="meta"):
    """One component of a PUBLISHED model with random (or, on "meta", no) weights."""
    import diffusers
    import transformers

    cls_name, config = PUBLISHED[name][component]
    if hasattr(diffusers, cls_name):
        cls = getattr(diffusers, cls_name)
        config = SD35_VAE if config is None else config  # SD3.5's VAE, defined with the medium model
        with torch.device(device):
            return cls(**config)
    cls = getattr(transformers, cls_name)
    config_cls = cls.config_class
    with torch.device(device):
        return cls(config_cls(**config))


# ----------------------------------------------------------------------------- registry

FAMILIES = {
    "wan": dict(
        pipeline="WanPipeline", video=True, tokens=512, shape=_wan_shape, noise=_wan_noise, encode=_wan_encode,
        velocity=_wan_velocity, decode=_wan_decode, sigmas=_wan_sigmas, unused=lambda transformer: [],
        # Flow-GRPO's train_wan2_1.py list, which on the T2V blocks matches these (attn1 self-, attn2 cross-attention)
        lora_targets=["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                      "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"]),
    "qwen-image": dict(
        pipeline="QwenImagePipeline", video=False, tokens=512, shape=_packed_shape, noise=_qwen_noise,
        encode=_qwen_encode, velocity=_qwen_velocity, decode=_qwen_decode, sigmas=_qwen_sigmas, unused=_qwen_unused,
        # Flow-GRPO's train_qwenimage.py: attention of both streams and both MLPs
        lora_targets=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                      "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                      "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]),
    "flux2-klein": dict(
        pipeline="Flux2KleinPipeline", video=False, tokens=512, shape=_packed_shape, noise=_klein_noise,
        encode=_klein_encode, velocity=_klein_velocity, decode=_klein_decode, sigmas=_klein_sigmas,
        unused=lambda transformer: [], references=True,
        # UniRL's flux2_klein recipes: every linear of the double-stream blocks, and the fused QKV + MLP
        # projection of the single-stream blocks (their attn.to_out shares a name with the double
        # blocks' to_out list, which peft cannot wrap)
        lora_targets=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                      "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                      "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                      "attn.to_qkv_mlp_proj"]),
    "z-image": dict(
        pipeline="ZImagePipeline", video=False, tokens=512, shape=_z_shape, noise=_z_noise, encode=_z_encode,
        velocity=_z_velocity, decode=_z_decode, sigmas=_z_sigmas, unused=lambda transformer: [],
        # Flow-Factory's z_image adapter: attention and SwiGLU MLP of every layer
        lora_targets=["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                      "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]),
    "flux-kontext": dict(
        pipeline="FluxKontextPipeline", video=False, tokens=512, shape=_packed_shape, noise=_kontext_noise,
        encode=_kontext_encode, velocity=_kontext_velocity, decode=_kontext_decode, sigmas=_qwen_sigmas,
        unused=lambda transformer: [], references=True,
        # Flow-GRPO's train_flux_kontext.py: the FLUX LoRA scripts' list and the single blocks' proj_mlp
        lora_targets=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                      "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                      "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"]),
    "qwen-image-edit": dict(
        pipeline="QwenImageEditPipeline", video=False, tokens=512, shape=_packed_shape, noise=_qwen_noise,
        encode=_qwen_edit_encode, velocity=_qwen_velocity, decode=_qwen_decode, sigmas=_qwen_sigmas,
        unused=_qwen_unused, references=True,
        # Flow-GRPO's train_qwenimage_edit.py: Qwen-Image's list
        lora_targets=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                      "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                      "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]),
}
FAMILIES["qwen-image-edit-plus"] = dict(FAMILIES["qwen-image-edit"], pipeline="QwenImageEditPlusPipeline")
