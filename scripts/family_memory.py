"""Parameter counts and a per-GPU memory estimate of training for the published models (no download).

    python scripts/family_memory.py            # two markdown tables: LoRA per model; recipes term by term

Counts come from families.PUBLISHED built on the meta device (each family's published configs; FLUX.1-dev
is FLUX.1 Kontext [dev]'s architecture and encoders). The LoRA estimate, per GPU:
  weights      transformer and text encoders in bf16 (2 bytes), the VAE in bf16 (Wan's in float32, 4 bytes);
  LoRA + Adam  16 bytes per LoRA parameter (float32 weight, gradient, Adam's two moments), the targets
               of models.add_lora at the recipe's rank;
  activations  of one training forward kept for its backward, per block and sample in bf16 with flash
               attention (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.1, whose 34 L h for an MLP ratio
               r = 4 counts two dropout masks a DiT does not have, and an attention-score term that flash
               attention does not store): (16 + 4 r) L h bytes, 32 L h at r = 4, of which 12 for the attention
               (its norm's and projections' inputs, q, k, v, its output) and 4 + 4 r for a GELU MLP (its norm's
               and first layer's inputs, the GELU's input and output); a SwiGLU MLP (FLUX.2 [klein], Z-Image)
               keeps gate, up, SiLU(gate) and their product, 4 + 8 r; Wan's cross-attention to its T = 512 text
               tokens adds 8 L h + 4 T h (norm and query inputs, q, the output; k and v over the text); SD3.5-M's
               second self-attention in blocks 0-12 adds 12 L h over the image tokens. L the tokens a block
               attends over (image and text for the joint-attention models), h its width. With gradient
               checkpointing 2 L h per block plus one block's full set. Under training CFG the batch doubles.
               Left out: the qk-norms' and rotary embeddings' inputs, the modulation vectors.
The recipe estimate (recipe_terms) takes a recipe's own flags (train.parse_args) and world size, and counts, per GPU:
  weights           the frozen transformer in the load dtype (policy.py: half precision under LoRA) plus the float32
                    adapter, or a full fine-tune's float32 weights / the FSDP world size;
  gathered          FSDP2's unsharded blocks in flight (the block in use and the prefetched one), float32 without a
                    MixedPrecisionPolicy, bf16 with one;
  weight_casts      autocast's bf16 copy of each float32 weight, saved by its matmul for the backward (a full
                    fine-tune: every weight, one block's under checkpointing; none when FSDP2 gathers bf16);
  copies            the EMA and the old copy of NFT / AWM, float32, sharded like the weights; the KL reference is the
                    base with the adapter off and costs nothing;
  optimizer         AdamW's two float32 moments; gradients, float32, sharded under FSDP, plus a full unsharded float32
                    set while micro-batches accumulate without a reduce-scatter; ddp_buckets DDP's flat gradient copy;
  activations       the formula above at the recipe's tokens and micro-batch;
  peft_copies       peft casts a LoRA layer's input to float32 and autocast casts it back for lora_A's matmul: a bf16
                    copy of each LoRA layer's input that its backward keeps, not shared with the base layer's;
  rollout           a step's latents at every sampler step, float32; prompt_embeddings those of a step's prompts;
  text_encoders     in the run's mixed precision, a full fine-tune's too (policy._frozen_in); vae float32 under fp16
                    or a full fine-tune;
  reward            the reward models, float32 on every rank (reward_models.py).
Each is an order-of-magnitude guide (about +-30 %): left out are the rollout's VAE decode and text encoding
(transient, outside the update), the CUDA context (about 0.5 GB) and allocator fragmentation.
"""
import argparse
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import families  # noqa: E402
import losses  # noqa: E402
import train  # noqa: E402

# name -> (setting, family for LoRA targets, LoRA rank, tokens L per sample, width h, blocks, MLP ratio, SwiGLU MLP,
#          text tokens of a cross-attention (0: none), samples per training forward (x2 under CFG), gradient
#          checkpointing, VAE bytes per parameter)
SETTINGS = {
    "wan-1.3b": ("wan_ocr_grpo: 240x416, 33 frames, batch 8, CFG", "wan", 32, 9 * 15 * 26, 1536, 30, 8960 / 1536,
                 False, 512, 16, True, 4),
    "wan-14b": ("same recipe, 14B by --model-path", "wan", 32, 9 * 15 * 26, 5120, 40, 13824 / 5120, False, 512, 16,
                True, 4),
    "qwen-image": ("qwen_image_pickscore_grpo: 512 px, batch 4, CFG", "qwen-image", 64, 1024 + 64, 3072, 60, 4, False,
                   0, 8, True, 2),
    "flux2-klein-4b": ("UniRL klein: 512 px, 512 text tokens, batch 1, no CFG", "flux2-klein", 16, 1024 + 512, 3072,
                       25, 3, True, 0, 1, False, 2),
    "flux2-klein-9b": ("same, 9B", "flux2-klein", 16, 1024 + 512, 4096, 32, 3, True, 0, 1, False, 2),
    "z-image": ("Flow-Factory z_image: 512 px, batch 1, CFG", "z-image", 64, 1024 + 128, 3840, 32, 8 / 3, True, 0, 2,
                False, 2),
    "sd3.5-medium": ("sd3_ocr_grpo: 512 px, batch 9, CFG", "sd3", 32, 1024 + 205, 1536, 24, 4, False, 0, 18, False,
                     2),
    "sd3.5-large": ("sd3_ocr_grpo at 8B: 512 px, batch 8, CFG", "sd3", 32, 1024 + 205, 2432, 38, 4, False, 0, 16,
                    False, 2),
    "flux1-dev": ("flux_mixgrpo with LoRA r64: 720 px, 512 text tokens, batch 1, no CFG, checkpointing", "flux", 64,
                  2025 + 512, 3072, 57, 4, False, 0, 1, True, 2),
    # Edit models: the references' tokens join every block's sequence (a 512 px source: 1024 tokens). Qwen-Image-Edit
    # also reads the source in its VL text: a 1024^2 px image is 37 x 37 = 1369 tokens, a 384^2 px one 14 x 14 = 196.
    "flux1-kontext": ("flux_kontext_counting_grpo: 512 px + a 512 px source, 128 text tokens, batch 3, no CFG",
                      "flux-kontext", 64, 1024 + 1024 + 128, 3072, 57, 4, False, 0, 3, False, 2),
    "qwen-image-edit": ("qwen_image_edit_counting_grpo: 512 px + its source at 1024^2 px, batch 4, CFG",
                        "qwen-image-edit", 64, 1024 + 4096 + 1400, 3072, 60, 4, False, 0, 8, True, 2),
    "qwen-image-edit-2509": ("Edit-Plus, two sources at 1024^2 px (VL 384^2), 512 px, batch 4, CFG",
                             "qwen-image-edit-plus", 64, 1024 + 2 * 4096 + 450, 3072, 60, 4, False, 0, 8, True, 2),
    "flux2-klein-4b-edit": ("klein 4B, one 512 px reference: 512 px, 512 text tokens, batch 1, no CFG", "flux2-klein",
                            16, 1024 + 1024 + 512, 3072, 25, 3, True, 0, 1, False, 2),
}
PUBLISHED_AS = {"qwen-image-edit-2509": "qwen-image-edit", "flux2-klein-4b-edit": "flux2-klein-4b",  # same weights
                "flux1-dev": "flux1-kontext"}  # FLUX.1 Kontext [dev] is FLUX.1-dev's architecture and encoders
# A second self-attention over the image tokens in some blocks: SD3.5-M's dual_attention_layers 0-12 (MMDiT-X).
# name -> (blocks, image tokens)
IMAGE_ATTENTION = {"sd3.5-medium": (13, 1024)}


@functools.lru_cache(maxsize=None)  # meta modules, never changed: built once per run
def build(name, component):
    """One component of a published model on the meta device."""
    return families.build_published(PUBLISHED_AS.get(name, name), component)


def block_bytes(tokens, width, mlp_ratio, *, swiglu=False, text_tokens=0):
    """Activation bytes one block keeps for its backward, per sample (bf16, flash attention; module docstring)."""
    mlp = 4 + (8 if swiglu else 4) * mlp_ratio
    cross = 8 * tokens + 4 * text_tokens if text_tokens else 0
    return (12 + mlp) * tokens * width + cross * width


def lora_parameters(transformer, targets, rank):
    """r (in + out) for every Linear whose name ends with one of `targets` (peft's suffix match)."""
    import torch
    return sum(rank * (m.in_features + m.out_features) for n, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in targets))


def lora_targets(kind):
    return families.MODELS[kind].lora_targets


@functools.lru_cache(maxsize=None)
def component_counts(name):
    """{component: parameters} of a published model (no weights: the meta device)."""
    return {c: sum(p.numel() for p in build(name, c).parameters())
            for c in families.PUBLISHED[PUBLISHED_AS.get(name, name)]}


def estimate(name):
    setting, kind, rank, tokens, width, blocks, mlp, swiglu, text_tokens, batch, checkpointing, vae_bytes = \
        SETTINGS[name]
    counts = component_counts(name)
    text = sum(v for k, v in counts.items() if k.startswith("text_encoder"))
    lora = lora_parameters(build(name, "transformer"), lora_targets(kind), rank)
    weights = 2 * (counts["transformer"] + text) + vae_bytes * counts["vae"]
    per_block = block_bytes(tokens, width, mlp, swiglu=swiglu, text_tokens=text_tokens) * batch
    activations = (2 * tokens * width * batch * blocks + per_block) if checkpointing else per_block * blocks
    if name in IMAGE_ATTENTION and not checkpointing:  # the second attention's 12 L h, over the image tokens
        n, image = IMAGE_ATTENTION[name]
        activations += 12 * image * width * batch * n
    return dict(setting=setting, transformer=counts["transformer"], text=text, vae=counts["vae"], lora=lora,
                weights=weights, adam=16 * lora, activations=activations)


# ----------------------------------------------------------------------------- recipes, term by term
# Reward models as train.py loads them (reward_models.py: float32, on every rank). Parameter counts from the published
# configs, built on the meta device: PickScore and HPSv2.1 are OpenCLIP ViT-H-14 (laion/CLIP-ViT-H-14 config.json:
# vision 1280 wide, 32 layers, patch 14; text 1024 wide, 24 layers; projection 1024); ImageReward is BLIP's ViT-L/16
# and BERT-base with cross-attention (bench.reward_flops) and its MLP head 768-1024-128-64-16-1.
RECIPES = {
    # name: (model, recipe, flags the README adds, world size, rewards)
    "sd3_pickscore_grpo": ("sd3.5-medium", "sd3_pickscore_grpo", [], 8, ["clip-h"]),
    "sd3_nft_pickscore": ("sd3.5-medium", "sd3_nft_pickscore", [], 8, ["clip-h"]),
    "sd3_pickscore_grpo full": ("sd3.5-medium", "sd3_pickscore_grpo",
                                ["--lora-rank", "0", "--kl-beta", "0", "--mixed-precision", "bf16", "--fsdp"], 8,
                                ["clip-h"]),
    "flux_mixgrpo": ("flux1-dev", "flux_mixgrpo", [], 8, ["clip-h", "clip-h", "imagereward"]),
}
# Per recipe model: block width, blocks (FLUX.1: 19 double-stream + 38 single-stream), MLP ratio, the CLIP tokens
# that SD3 puts before the T5 ones (FLUX.1 pools CLIP), the width of the text embeddings.
ARCH = {"sd3.5-medium": dict(width=1536, blocks=24, mlp=4, clip_tokens=77, text_width=4096),
        "flux1-dev": dict(width=3072, blocks=57, mlp=4, clip_tokens=0, text_width=4096)}


@functools.lru_cache(maxsize=None)
def reward_parameters(kind):
    """Parameters of a reward model from its published config (the meta device)."""
    import torch
    from transformers import (BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel, CLIPConfig,
                              CLIPModel)
    with torch.device("meta"):
        if kind == "clip-h":
            modules = [CLIPModel(CLIPConfig(
                projection_dim=1024, text_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                                      num_attention_heads=16),
                vision_config=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                   num_attention_heads=16, patch_size=14, image_size=224)))]
        else:  # imagereward
            modules = [BlipVisionModel(BlipVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                                        num_attention_heads=16, image_size=224, patch_size=16)),
                       BlipTextModel(BlipTextConfig(vocab_size=30524, hidden_size=768, intermediate_size=3072,
                                                    num_hidden_layers=12, num_attention_heads=12,
                                                    encoder_hidden_size=1024, is_decoder=True),
                                     add_pooling_layer=False),
                       torch.nn.Sequential(torch.nn.Linear(768, 1024), torch.nn.Linear(1024, 128),
                                           torch.nn.Linear(128, 64), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))]
    return sum(p.numel() for m in modules for p in m.parameters())


def peft_copy_bytes(transformer, targets, image_tokens, text_tokens):
    """Per sample: the bf16 copy of its input that each LoRA layer's lora_A keeps for its backward. peft casts the
    input to the adapter's float32 (peft/tuners/lora/layer.py Linear.forward, _cast_input_dtype) and autocast casts it
    back to bf16 for the matmul, a new tensor that the matmul saves: the base layer's saved input is not shared. Text
    tokens for the context stream (add_*, *context*), both for FLUX's single blocks, image tokens otherwise."""
    import torch
    total = 0
    for n, m in transformer.named_modules():
        if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in targets):
            tokens = text_tokens if ("add_" in n or "context" in n) else image_tokens
            if n.startswith("single_transformer_blocks"):
                tokens = image_tokens + text_tokens
            total += 2 * tokens * m.in_features
    return total


def largest_block(transformer):
    """Parameters of the largest transformer block: FSDP2's unit of all-gather (distributed.shard_transformer)."""
    blocks = [b for name in ("transformer_blocks", "single_transformer_blocks") for b in getattr(transformer, name, [])]
    return max(sum(p.numel() for p in b.parameters()) for b in blocks)


def recipe_args(recipe, extra):
    _, args = train.parse_args([f"@{os.path.join(ROOT, 'recipes', recipe + '.args')}", *extra])
    return args


# The memory changes of issue 30 (its item numbers): 6 the text encoders off the GPU, 7 FSDP2 in bf16 with sharded
# gradient accumulation, 8 DDP's gradients as bucket views. -> a column header of recipe_table
FIXES = {6: "encoders off the GPU", 7: "FSDP2 bf16, sharded accumulation", 8: "DDP bucket view"}


def recipe_terms(name, fixed=()):
    """Bytes per GPU of a recipe, term by term (module docstring), with the changes of FIXES named in `fixed`: 6 the
    text encoders off the GPU between encodings (a prompt-embedding cache), 7 FSDP2 all-gathering bf16 weights and
    reduce-scattering each micro-batch's gradients (no unsharded float32 gradients kept over an accumulation), 8 DDP
    with gradient_as_bucket_view. On paper: what this formula gives, not a measurement."""
    model, recipe, extra, world, reward_kinds = RECIPES[name]
    args = recipe_args(recipe, extra)
    kind = "sd3" if model.startswith("sd3") else "flux"
    transformer = build(model, "transformer")
    counts = component_counts(model)
    text = sum(v for k, v in counts.items() if k.startswith("text_encoder"))
    n = counts["transformer"]
    lora = lora_parameters(transformer, lora_targets(kind), args.lora_rank) if args.lora_rank else 0
    trained = lora or n
    shard = world if args.fsdp else 1
    half = args.mixed_precision in ("bf16", "fp16")
    load = 2 if (half and args.lora_rank) else 4  # policy.py: a LoRA run loads the frozen model in half precision
    # Activations: the tokens of the recipe's resolution (VAE 8x, patch 2x2) and text, its batch (x2 under CFG).
    image = (args.resolution // 16) ** 2
    text_tokens = ARCH[model]["clip_tokens"] + args.max_sequence_length
    width, blocks, mlp = ARCH[model]["width"], ARCH[model]["blocks"], ARCH[model]["mlp"]
    batch = args.train_batch_size * (2 if args.train_cfg else 1)
    per_block = block_bytes(image + text_tokens, width, mlp) * batch
    if args.gradient_checkpointing:
        activations = 2 * (image + text_tokens) * width * batch * blocks + per_block
    else:
        activations = per_block * blocks + (12 * IMAGE_ATTENTION[model][0] * image * width * batch
                                            if model in IMAGE_ATTENTION else 0)
    peft = peft_copy_bytes(transformer, lora_targets(kind), image, text_tokens) * batch if lora else 0
    if peft and args.gradient_checkpointing:
        peft //= blocks
    loss = losses.LOSSES[args.loss]
    copies = ((args.ema_decay > 0) + bool(loss.old_copy and loss.old_copy(vars(args)))  # float32, sharded like weights
              + bool(loss.sampling_copy and loss.sampling_copy(vars(args))))
    micro = (args.prompts_per_step * args.group_size // world) // (args.train_batch_size * args.minibatches)
    gathered = largest_block(transformer) * 2  # the block in use and the one prefetched
    latent = 16 * (args.resolution // 8) ** 2
    samples = args.prompts_per_step * args.group_size // world
    terms = dict(
        weights=(load * n if lora else 4 * n // shard) + 4 * lora,  # frozen base (LoRA) or float32 shards; adapter
        gathered=(gathered * (2 if 7 in fixed else 4)) if args.fsdp else 0,  # FSDP2's unsharded blocks, in flight
        # autocast's bf16 copy of each float32 weight, saved by its matmul for the backward (one block's under
        # checkpointing); FSDP2 with a bf16 param_dtype gathers bf16 weights, whose casts are no-ops
        weight_casts=0 if lora or (7 in fixed and args.fsdp) else 2 * (largest_block(transformer) if
                                                                   args.gradient_checkpointing else n),
        copies=copies * 4 * trained // shard,
        optimizer=8 * trained // shard,
        gradients=4 * trained // shard + (4 * n if args.fsdp and micro > 1 and 7 not in fixed else 0),
        ddp_buckets=0 if args.fsdp or 8 in fixed else 4 * trained,  # DDP's flat gradient copy; item 8's bucket view: 0
        activations=activations,
        peft_copies=peft,
        rollout=samples * (args.num_steps + 1) * latent * 4,  # the latents of every step, float32, until the update
        text_encoders=0 if 6 in fixed else (2 if half else 4) * text,  # policy._frozen_in: the run's precision
        # a step's prompt embeddings (and the negative prompt's), bf16: the same with or without the cache, which
        # holds the others off the GPU
        prompt_embeddings=(args.prompts_per_step + 1) * text_tokens * ARCH[model]["text_width"] * 2,
        vae=(4 if (args.mixed_precision == "fp16" or not args.lora_rank) else 2) * counts["vae"],
        reward=4 * sum(reward_parameters(k) for k in reward_kinds),
    )
    return terms


def recipe_table():
    """Markdown: each recipe's terms per GPU, then what each of FIXES saves (on paper)."""
    gb = 1e9
    terms = {name: recipe_terms(name) for name in RECIPES}
    print("| GB per GPU | " + " | ".join(f"`{n}`" for n in RECIPES) + " |")
    print("| --- |" + " ---: |" * len(RECIPES))
    for key in terms[next(iter(RECIPES))]:
        print(f"| {key} | " + " | ".join(f"{terms[n][key] / gb:.1f}" for n in RECIPES) + " |")
    print("| total | " + " | ".join(f"{sum(terms[n].values()) / gb:.1f}" for n in RECIPES) + " |")
    print()
    print("| recipe | before | " + " | ".join(f"{label} saves" for label in FIXES.values()) + " | after all |")
    print("| --- | ---: |" + " ---: |" * (len(FIXES) + 1))
    for name in RECIPES:
        total = sum(terms[name].values())
        saved = [total - sum(recipe_terms(name, fixed=(k,)).values()) for k in FIXES]
        after = sum(recipe_terms(name, fixed=tuple(FIXES)).values())
        print(f"| `{name}` | {total / gb:.1f} | " + " | ".join(f"{v / gb:.1f}" for v in saved)
              + f" | {after / gb:.1f} |")


def main():
    gb = 1e9
    print("| model | setting | transformer | text encoder(s) | VAE | LoRA params | bf16 weights | LoRA + Adam "
          "| activations | total |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in SETTINGS:
        e = estimate(name)
        total = e["weights"] + e["adam"] + e["activations"]
        print(f"| {name} | {e['setting']} | {e['transformer'] / 1e9:.2f} B | {e['text'] / 1e9:.2f} B | "
              f"{e['vae'] / 1e6:.0f} M | {e['lora'] / 1e6:.0f} M | {e['weights'] / gb:.1f} GB | "
              f"{e['adam'] / gb:.1f} GB | "
              f"{e['activations'] / gb:.1f} GB | {total / gb:.0f} GB |")


if __name__ == "__main__":
    argparse.ArgumentParser(description="Parameter counts and per-GPU memory estimates of the published models; "
                            "takes no flags").parse_args()  # a flag given is refused, not ignored
    main()
    print()
    recipe_table()
