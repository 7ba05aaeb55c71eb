"""Parameter counts and a per-GPU memory estimate of LoRA training for the published models (no download).

    python scripts/family_memory.py            # a markdown table

Counts come from families.PUBLISHED built on the meta device. The estimate, per GPU:
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
               tokens adds 8 L h + 4 T h (norm and query inputs, q, the output; k and v over the text). L the
               tokens a block attends over (image and text for the joint-attention models), h its width. With
               gradient checkpointing 2 L h per block plus one block's full set. Under training CFG the batch
               doubles. Left out: the qk-norms' and rotary embeddings' inputs, the modulation vectors.
This is an order-of-magnitude guide (about +-30 %): it leaves out the rollout's VAE decode and text
encoding (transient, before the update) and allocator fragmentation.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import families  # noqa: E402
import models  # noqa: E402

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
    "sd3.5-large": ("sd3_ocr_grpo at 8B: 512 px, batch 8, CFG", "sd3", 32, 1024 + 205, 2432, 38, 4, False, 0, 16,
                    False, 2),
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
PUBLISHED_AS = {"qwen-image-edit-2509": "qwen-image-edit", "flux2-klein-4b-edit": "flux2-klein-4b"}  # same weights


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


def estimate(name):
    setting, kind, rank, tokens, width, blocks, mlp, swiglu, text_tokens, batch, checkpointing, vae_bytes = \
        SETTINGS[name]
    published = PUBLISHED_AS.get(name, name)
    counts = {c: sum(p.numel() for p in families.build_published(published, c).parameters())
              for c in families.PUBLISHED[published]}
    text = sum(v for k, v in counts.items() if k.startswith("text_encoder"))
    targets = models.LORA_TARGETS.get(kind) or families.FAMILIES[kind]["lora_targets"]
    lora = lora_parameters(families.build_published(published, "transformer"), targets, rank)
    weights = 2 * (counts["transformer"] + text) + vae_bytes * counts["vae"]
    per_block = block_bytes(tokens, width, mlp, swiglu=swiglu, text_tokens=text_tokens) * batch
    activations = (2 * tokens * width * batch * blocks + per_block) if checkpointing else per_block * blocks
    return dict(setting=setting, transformer=counts["transformer"], text=text, vae=counts["vae"], lora=lora,
                weights=weights, adam=16 * lora, activations=activations)


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
    main()
