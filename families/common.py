"""What several families share: tokenizers and encoders for the tiny twins, hub loading, latent checks, text
padding and classifier-free guidance, decoding, the flow-matching schedules, reference images, the LoRA export and
the base presets. Nothing here is keyed by a model name: that sits in the model's family file.

Text padding here (pad_tokens, with_negative) is the padding the prompt cache and the prompt store assemble batches
with: a family's encode that pads as they do gives the same rows stored and fresh (families/__init__.py, last
paragraph)."""

import contextlib
import functools
import gzip
import importlib.util
import math
import os

import numpy as np
import torch

import sde


# ----------------------------------------------------------------------------- presets
# The flags a model fills in where the command line is silent (families.preset). TINY: the CPU setting every built-in
# model starts from. HUB: the setting of every hub model, Flow-GRPO's SD3.5-M setup (arXiv:2505.05470, Sec. 5.1 and
# its config/grpo.py); anything given on the command line wins.
TINY = dict(loss="grpo", resolution=64, num_steps=10, guidance_scale=1.0, eta=0.7, group_size=8, prompts_per_step=4,
            sample_batch_size=16, train_batch_size=16, minibatches=1, lora_rank=0, lr=3e-3, clip_range=0.2,
            kl_beta=0.0, steps=60, mixed_precision="no", prompts="prompts/tiny.txt", reward="jpeg_compressibility",
            global_std=False, log_images_every=20, input_key="input", eval_every=0, eval_steps=40,
            eval_samples_per_prompt=1, sde="flow", ema_decay=0.0)
HUB = dict(loss="grpo", resolution=512, num_steps=10, guidance_scale=4.5, eta=0.7, group_size=24, prompts_per_step=48,
           sample_batch_size=8, train_batch_size=8, minibatches=2, lora_rank=32, lora_alpha=64, lr=3e-4,
           clip_range=1e-4, kl_beta=0.04, steps=10000, mixed_precision="bf16", prompts="prompts/ocr_train.txt",
           reward="ocr", global_std=True, log_images_every=50, input_key="input", eval_every=0, eval_steps=40,
           eval_samples_per_prompt=1, sde="flow", ema_decay=0.0)
# Where a hub preset's value comes from, for --print-config (families.settle_guidance); a family whose preset takes its
# pipeline's own value names it in its record's preset_notes.
HUB_NOTES = dict(guidance_scale="Flow-GRPO's SD3.5-M setting (families/common.py HUB), not this pipeline's default")


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


def qwen_tokenizer(max_length):
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


def qwen3_encoder(cls, vocab_size, hidden, layers):
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=hidden // 2,
                         max_position_embeddings=512, pad_token_id=256, bos_token_id=256,
                         eos_token_id=258)  # <|endoftext|>, <|im_end|>
    return cls(config).eval()


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


# ----------------------------------------------------------------------------- latents

def square(name, height, width):
    if height != width:
        raise ValueError(f"{name} latents are packed into tokens without their grid; pass a square --resolution")


def check_multiple(height, width, multiple):
    if height % multiple or width % multiple:
        raise ValueError(f"--resolution {height}x{width} must be a multiple of {multiple} for this model")


def no_frames(num_frames):
    if num_frames not in (None, 1):
        raise ValueError("--num-frames is for video models (wan); this model makes images")


def video_frames(name, num_frames, default, temporal, frame_tokens, most_tokens, samples=1):
    """The latent frames of a video of `num_frames` (None: the pipeline's `default`), or a ValueError in one line
    naming the nearest counts the model makes. temporal: the VAE's temporal compression (a video is temporal k + 1
    frames, the first encoded alone); frame_tokens: the transformer's tokens per latent frame; most_tokens: the most
    tokens one sample may hold (sample_tokens) in a forward of `samples` samples (forward_samples)."""
    frames = default if num_frames is None else num_frames
    if frames < 1 or (frames - 1) % temporal:
        below = max(frames - 1, 0) // temporal * temporal + 1
        raise ValueError(f"--num-frames {frames} must be {temporal} k + 1 for {name} (its VAE encodes the first frame "
                         f"alone, then {temporal} a latent frame): the nearest are {below} and {below + temporal}")
    latent = (frames - 1) // temporal + 1
    if latent * frame_tokens > most_tokens:
        most = (most_tokens // frame_tokens - 1) * temporal + 1
        fix = f"the most this size allows is {most}" if most >= 1 else "no count fits this size: lower --resolution"
        forward = "one sample's training forward"
        if samples > 1:  # a batch, the halves of CFG counted: fewer samples a forward leave each more
            forward = f"a forward of {samples} samples (a batch, twice under CFG)"
            fix += " (or fewer samples a forward: --sample-batch-size, --train-batch-size; eval.py's --batch-size)"
        raise ValueError(f"--num-frames {frames}: {latent * frame_tokens:,} tokens a sample, above the {most_tokens:,} "
                         f"that {name}'s positions or {forward} in this device's memory can hold; {fix}")
    return latent


def forward_samples(pipe):
    """The most samples one forward holds in the run that loaded `pipe` (pipe.forward_samples, which train.py and
    eval.py set from their batch sizes and guidance: families.forward_samples), 1 where none is set."""
    return getattr(pipe, "forward_samples", None) or 1


def sample_tokens(transformer, device, samples=1):
    """The most tokens one video sample may hold: below the fewest that a training forward of `samples` such samples
    through `transformer` cannot fit in the memory of `device` (the GPU's, else the host's).

    The forward keeps, by scripts/family_memory.py's formula (bf16, gradient checkpointing: the least any run keeps),
    2 L h bytes per block and one block's full set, (16 + 4 r) L h, for L tokens of width h and MLP ratio r; where
    no fused attention kernel runs (the CPU's scaled_dot_product_attention with a mask or at these lengths), the
    attention also holds its L x L scores per head in float32. A batch of n samples holds n times each (the rollouts'
    forwards, the training forward's micro-batch, CFG's two halves in one batch)."""
    config = transformer.config
    heads = config.get("num_attention_heads")
    width = heads * config.get("attention_head_dim")
    blocks = config.get("num_layers")
    ratio = config.get("ffn_dim", config.get("mlp_ratio", 4) * width) / width
    device = torch.device(device)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the host's
    if device.type == "cuda":
        with contextlib.suppress(RuntimeError, AssertionError):  # a CUDA without its driver (tests' fake CUDA): the host's
            memory = torch.cuda.get_device_properties(device).total_memory
    memory = memory / samples  # each sample's share of one forward
    linear = (2 * blocks + 16 + 4 * ratio) * width  # bytes a token
    quadratic = 0 if device.type == "cuda" else 4 * heads  # bytes a pair of tokens: the scores
    a, b = quadratic, linear  # a L^2 + b L <= memory
    return int(memory // b) if a == 0 else int((-b + math.sqrt(b * b + 4 * a * memory)) / (2 * a))


def image_tokens(pipe, height, width):
    """Image tokens after 2 x 2 patching: the sequence length of the resolution-dependent shifts."""
    f = pipe.vae_scale_factor
    return (height // (2 * f)) * (width // (2 * f))


def packed_shape(pipe, height, width, num_frames):
    no_frames(num_frames)
    square("this model's", height, width)
    f = pipe.vae_scale_factor
    check_multiple(height, width, 2 * f)
    return ((height // (2 * f)) * (width // (2 * f)), pipe.transformer.config.in_channels)


# ----------------------------------------------------------------------------- text

def pad_tokens(embeds, mask, length):
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


def with_negative(out, encode, negative_prompt, batch, masked):
    """Add `neg_prompt_embeds` (and `neg_prompt_mask`): the negative prompt encoded once and expanded
    to the batch; with masks, both sides are right-padded to a common length so that the
    unconditional and conditional halves can share one forward."""
    neg = encode([negative_prompt])
    if masked:
        length = max(out["prompt_embeds"].shape[1], neg["prompt_embeds"].shape[1])
        out["prompt_embeds"], out["prompt_mask"] = pad_tokens(out["prompt_embeds"], out["prompt_mask"], length)
        neg["prompt_embeds"], neg["prompt_mask"] = pad_tokens(neg["prompt_embeds"], neg["prompt_mask"], length)
    for key, value in neg.items():
        out["neg_" + key] = value.expand(batch, *value.shape[1:])
    return out


# ----------------------------------------------------------------------------- the forward

def cfg_halves(embeds, keys):
    """[negative; conditional] stacked along the batch for each of `keys` (diffusers' order)."""
    if "neg_prompt_embeds" not in embeds:
        raise ValueError("guidance_scale > 1 needs embeds from encode_prompts(..., guidance_scale > 1)")
    return [torch.cat([embeds["neg_" + k], embeds[k]]) for k in keys]


def guided(v, guidance_scale):
    """Classifier-free guidance (Ho & Salimans 2022, eq. 6 with g = 1 + w) of a forward on [negative; conditional]
    halves: v_u + g (v_c - v_u). Returns (guided [B, ...], v_c)."""
    v_uncond, v_cond = v.chunk(2)
    return v_uncond + guidance_scale * (v_cond - v_uncond), v_cond


def pipeline_timestep(pipe, sigma, dtype):
    """The timestep FluxPipeline, Flux2KleinPipeline and QwenImagePipeline hand their transformer:
    `t.expand(B).to(latents.dtype)`, then `timestep / 1000`, with t = the scheduler's timestep (sigmas x
    num_train_timesteps, float32). In bf16 1000 s is rounded first and divided after, which differs from
    s.to(bf16) for about a quarter of the sigmas (up to 0.8 %). sigma: float32 [B]."""
    return (sigma * pipe.scheduler.config.num_train_timesteps).to(dtype) / 1000


# ----------------------------------------------------------------------------- decoding

def to_uint8(images):
    """[-1, 1] float -> uint8, as the pipelines' "np" output x 255."""
    return ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def decode_kl(vae, latents):
    """Latents [B, C, h, w] of an AutoencoderKL with scaling and shift -> uint8 [B, H, W, 3] on the CPU."""
    images = []
    for chunk in latents.split(8):  # the VAE decoder's activations dominate memory at 1024 px
        z = chunk.to(vae.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]  # [b, 3, H, W] in [-1, 1]
        images.append(to_uint8(image).permute(0, 2, 3, 1).cpu())
    return torch.cat(images)


# ----------------------------------------------------------------------------- schedules

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
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing shift is refused below, by finite_schedule
        if shift is not None:
            t = sde.time_shift(t, shift)
        elif config.get("use_dynamic_shifting", False):
            if config.get("time_shift_type", "exponential") == "exponential":
                e = math.exp(mu) if mu < 709 else math.inf  # past float64's range
                t = e / (e + (1 / t - 1))
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
    sigmas = torch.cat([torch.from_numpy(np.asarray(t, dtype=np.float32)), torch.zeros(1)])
    return finite_schedule(sigmas, "" if mu is None else f" (its shift mu = {mu:.4g}, from the video's tokens)")


def finite_schedule(sigmas, why=""):
    """`sigmas`, or a ValueError where one is not finite: a step on a NaN sigma writes NaN latents for the whole
    rollout (a shift that overflows float32: LTX-2's mu grows with the tokens)."""
    if not bool(torch.isfinite(sigmas).all()):
        raise ValueError(f"the sampling schedule is not finite{why}; lower --num-frames or --resolution, or give "
                         "--shift")
    return sigmas


def linspace_sigmas(pipe, num_steps, height, width, shift):
    """The schedule of FluxPipeline, FluxKontextPipeline and the Qwen-Image pipelines: linspace(1, 1/N, N) shifted by
    the scheduler, mu from the target's image tokens (dynamic_shift_mu), then 0."""
    base = np.linspace(1.0, 1 / num_steps, num_steps)  # FluxPipeline.__call__, QwenImagePipeline.__call__
    mu = dynamic_shift_mu(pipe.scheduler.config, image_tokens(pipe, height, width))
    return flow_match_sigmas(pipe.scheduler.config, base, mu=mu, shift=shift)


# ----------------------------------------------------------------------------- reference images
# FLUX.1 Kontext, Qwen-Image-Edit (and its Plus variant, 2509 / 2511, with several references), and FLUX.2 [klein]
# given source images (the records with a source_images policy). models.encode_prompts(..., images=, resolution=)
# hands each prompt's source images (uint8 [H, W, 3], data.source_images) to the family's encode, which resizes them
# to the sample resolution (PIL's default filter, as Flow-GRPO's edit scripts do before calling their pipelines:
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


def reference_images(name, images, height, width, most):
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


def pack_references(parts):
    """[(packed latents [B, L_k, C], (rows, cols))] of references k -> the embeds entries ref_latents, ref_shapes."""
    latents = torch.cat([p for p, _ in parts], dim=1)  # [B, sum L_k, C]
    shapes = torch.tensor([list(hw) for _, hw in parts]).expand(len(latents), -1, -1)  # [B, K, 2]
    return {"ref_latents": latents, "ref_shapes": shapes.to(latents.device)}


def reference_grids(embeds):
    """The (rows, cols) of each reference, shared by the batch (position ids are per sequence, not per sample)."""
    shapes = embeds["ref_shapes"]
    if not bool((shapes == shapes[:1]).all()):
        raise ValueError("the references of one batch must have the same sizes; resize the source images alike")
    return [tuple(hw) for hw in shapes[0].tolist()]


# ----------------------------------------------------------------------------- LoRA

def no_unused(transformer):
    """Every layer's output reaches the model's output: nothing to leave out of training."""
    return []


def save_lora(pipe, modules, folder):
    """The adapter of each trained module ({name: module}) as `pytorch_lora_weights.safetensors`, in the diffusers format with its
    LoraConfig (rank, alpha, targets) as metadata: pipe.transformer's in `folder`, so that `pipe.load_lora_weights
    (folder)` loads it, and a second expert's in `folder/<its name>` (Wan 2.2: `pipe.load_lora_weights(folder /
    "transformer_2", load_into_transformer_2=True)`, diffusers' WanLoraLoaderMixin)."""
    from peft.utils import get_peft_model_state_dict

    for name, transformer in modules.items():
        type(pipe).save_lora_weights(
            folder if name == "transformer" else os.path.join(folder, name),
            transformer_lora_layers=get_peft_model_state_dict(transformer),
            transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
        )


# ----------------------------------------------------------------------------- published configs
# Transcribed from the hub repos' config.json files (each family's file holds its models' in PUBLISHED; these are the
# encoders and VAE several of them share). For parameter counts and memory estimates on the meta device (no
# download): scripts/family_memory.py and tests/test_families.py.

T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu")
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768)
KL_16 = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,  # FLUX.1's VAE (Z-Image)
             up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
             latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
             use_post_quant_conv=False)


def build_published(cls_name, config, device="meta"):
    """A published component, (class name, config) of a family's PUBLISHED, with random (or, on "meta", no) weights:
    a diffusers class built from its config, a transformers class from its config class."""
    import diffusers
    import transformers

    if hasattr(diffusers, cls_name):
        with torch.device(device):
            return getattr(diffusers, cls_name)(**config)
    cls = getattr(transformers, cls_name)
    with torch.device(device):
        return cls(cls.config_class(**config))
