"""Tiny reward-model stand-ins for tests and bench.py --rewards: random-initialised, built from configs, each saved in
the layout its real model ships in, so that rewards.py and reward_models.py run their model scorers' code paths
without a download."""

import json
import math
import os

import torch

import families


def tiny_pickscore(folder, *, seed=0, image_size=32, patch_size=8):
    """Save a random-initialised tiny CLIPModel + CLIPProcessor (real CLIP tokenizer) into `folder`:
    pass it as pickscore_processor_path and pickscore_model_path."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = families.common.clip_tokenizer()
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
    clip_vocab, _ = families.common.clip_bpe()
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
    tokenizer = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(families.common.byte_alphabet())}, merges=[],
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


def tiny_clap(folder, seed=0):
    """A random CLAP (RoBERTa text tower, HTSAT audio tower) with its processor, saved as a hub folder: the tokenizer
    byte-level BPE without merges (RoBERTa's specials, GPT-2's byte alphabet), the features 16 mel bins at 48 kHz over
    2 s (the published: 64 over 10 s)."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor, RobertaTokenizer

    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>"] + families.common.byte_alphabet())}
    processor = ClapProcessor(feature_extractor=ClapFeatureExtractor(feature_size=16, max_length_s=2,
                                                                     truncation="rand_trunc"),
                              tokenizer=RobertaTokenizer(vocab=vocab, merges=[], model_max_length=64))
    with families.common.seeded_build(seed, "cpu"):
        model = ClapModel(ClapConfig(
            text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=80),
            audio_config=dict(window_size=4, num_mel_bins=16, spec_size=64, patch_size=4, patch_stride=(4, 4),
                              depths=[1, 1], num_attention_heads=[1, 2], hidden_size=32, patch_embeds_hidden_size=16,
                              projection_hidden_size=16, enable_fusion=False),
            projection_dim=16)).eval()
    processor.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder
