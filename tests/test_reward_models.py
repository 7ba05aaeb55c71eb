"""The model scorers of rewards.py added for issue 24 (imagereward, hpsv3, clipscore, aesthetic) and the unifiedreward
preset: each formula against an independent computation on a tiny random stand-in saved in the real model's layout,
the authors' checkpoint keys, video frames, one training step with each scorer, and the preset's request and reply
against a local server. No downloads."""

import base64
import hashlib
import io
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import reward_fixtures
import reward_models
import rewards
import reward_services
import train
from reward_server import JsonServer, chat_reply
from rewards import RewardServiceError, build_reward
from test_train import SMALL, metrics


def make(name, **options):
    """One factory of REWARDS with the flags' defaults for the options not given."""
    return rewards.REWARDS[name](device="cpu", **{**rewards.option_defaults(), **options})


def random_images(n, height=40, width=48, seed=0, frames=None):
    shape = (n, height, width, 3) if frames is None else (n, frames, height, width, 3)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


PROMPTS = ["a red cat", "two dogs on a mat", "a very long prompt about a house by the lake " * 4]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, one_thread):
    """Every stand-in, built once: {name: the options that point the scorer at it}."""
    root = tmp_path_factory.mktemp("stand_ins")
    ir = reward_fixtures.tiny_imagereward(str(root / "imagereward"))
    base, checkpoint = reward_fixtures.tiny_hpsv3(str(root / "hpsv3"))
    clip = reward_fixtures.tiny_pickscore(str(root / "clip"))
    aesthetic_clip, mlp = reward_fixtures.tiny_aesthetic(str(root / "aesthetic"))
    hps_name, hps_path = reward_fixtures.tiny_hps(str(root / "hps"))
    return {"imagereward": dict(imagereward_model_path=ir, imagereward_tokenizer_path=ir),
            "hpsv3": dict(hpsv3_base_path=base, hpsv3_checkpoint_path=checkpoint),
            "clipscore": dict(clipscore_model_path=clip),
            "aesthetic": dict(aesthetic_clip_path=aesthetic_clip, aesthetic_mlp_path=mlp),
            "hps": dict(hps_model_name=hps_name, hps_checkpoint_path=hps_path)}


# ----------------------------------------------------------------------------- ImageReward

def _linear(state, prefix, x):
    return x @ state[prefix + ".weight"].T + state[prefix + ".bias"]


def _layer_norm(state, prefix, x, eps):
    return F.layer_norm(x, x.shape[-1:], state[prefix + ".weight"], state[prefix + ".bias"], eps)


def _heads(x, heads):  # [B, N, D] -> [B, heads, N, D / heads]
    return x.view(*x.shape[:2], heads, -1).transpose(1, 2)


def _vit(state, pixels, heads):
    """BLIP's ViT (ImageReward/models/BLIP/vit.py) in plain torch, on the authors' key names."""
    p = "blip.visual_encoder."
    w = state[p + "patch_embed.proj.weight"]
    x = F.conv2d(pixels, w, state[p + "patch_embed.proj.bias"], stride=w.shape[-1]).flatten(2).transpose(1, 2)
    x = torch.cat([state[p + "cls_token"].expand(len(x), -1, -1), x], 1) + state[p + "pos_embed"]
    blocks = sorted({int(k.split(".")[3]) for k in state if k.startswith(p + "blocks.")})
    for i in blocks:
        b = f"{p}blocks.{i}."
        q, k, v = _linear(state, b + "attn.qkv", _layer_norm(state, b + "norm1", x, 1e-6)).chunk(3, -1)
        q, k, v = (_heads(t, heads) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1) @ v
        x = x + _linear(state, b + "attn.proj", att.transpose(1, 2).flatten(2))
        h = _layer_norm(state, b + "norm2", x, 1e-6)
        x = x + _linear(state, b + "mlp.fc2", F.gelu(_linear(state, b + "mlp.fc1", h)))
    return _layer_norm(state, p + "norm", x, 1e-6)


def _bert_cls(state, config, ids, mask, image):
    """med.py's BertModel in multimodal mode (self-attention, cross-attention to the image, feed-forward, each
    with a post-LayerNorm residual) in plain torch; returns the [CLS] state."""
    t, eps, heads = "blip.text_encoder.", config["layer_norm_eps"], config["num_attention_heads"]
    x = state[t + "embeddings.word_embeddings.weight"][ids] + state[t + "embeddings.position_embeddings.weight"][
        :ids.shape[1]]
    x = _layer_norm(state, t + "embeddings.LayerNorm", x, eps)

    def attention(prefix, x, context, context_mask):
        q, k, v = (_heads(_linear(state, prefix + "self." + n, src), heads)
                   for n, src in (("query", x), ("key", context), ("value", context)))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + (1.0 - context_mask[:, None, None, :]) * -10000.0
        out = _linear(state, prefix + "output.dense", (scores.softmax(-1) @ v).transpose(1, 2).flatten(2))
        return _layer_norm(state, prefix + "output.LayerNorm", out + x, eps)

    for i in range(config["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        x = attention(b + "attention.", x, x, mask.float())
        x = attention(b + "crossattention.", x, image, torch.ones(image.shape[:2]))
        h = _linear(state, b + "output.dense", F.gelu(_linear(state, b + "intermediate.dense", x)))
        x = _layer_norm(state, b + "output.LayerNorm", h + x, eps)
    return x[:, 0]


def _laion_mlp_by_hand(state, prefix, x):
    for i in (0, 2, 4, 6, 7):  # five affine layers, no activation
        x = _linear(state, f"{prefix}{i}", x)
    return x[:, 0]


def test_imagereward_matches_a_plain_torch_computation_on_the_authors_keys(stand_ins):
    import torchvision.transforms as T
    from transformers import AutoTokenizer

    folder = stand_ins["imagereward"]["imagereward_model_path"]
    state = torch.load(f"{folder}/ImageReward.pt")
    config = json.load(open(f"{folder}/med_config.json"))
    images = random_images(3)  # 40 x 48: resized to 32 on the short side, then centre-cropped
    side = 32
    preprocess = T.Compose([T.Resize(side, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(side), T.ToTensor(),
                            T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
    tokens = AutoTokenizer.from_pretrained(folder)(PROMPTS, padding="max_length", truncation=True, max_length=35,
                                                   return_tensors="pt")
    with torch.no_grad():
        image = _vit(state, torch.stack([preprocess(Image.fromarray(i)) for i in images]), heads=1)  # width 64
        cls = _bert_cls(state, config, tokens["input_ids"], tokens["attention_mask"], image)
        expected = (_laion_mlp_by_hand(state, "mlp.layers.", cls) - 0.16717362830052426) / 1.0333394966054072

    batched = make("imagereward", **stand_ins["imagereward"])(images, PROMPTS, None)
    one = make("imagereward", **stand_ins["imagereward"], imagereward_batch_size=1)(images, PROMPTS, None)
    assert batched.dtype == torch.float32 and batched.shape == (3,)
    torch.testing.assert_close(batched, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one, expected, atol=1e-5, rtol=1e-5)
    assert float(batched.std()) > 1e-3  # the stand-in tells images and prompts apart


def test_imagereward_keys_map_onto_transformers_blip(stand_ins, tmp_path, caplog):
    folder = stand_ins["imagereward"]["imagereward_model_path"]
    state = torch.load(f"{folder}/ImageReward.pt")
    vision, text, head, ignored = reward_models.imagereward_state(state)
    assert ignored == []
    dropped = {k for k in state if k.startswith(("blip.vision_proj.", "blip.text_proj.")) or k.endswith("position_ids")}
    assert len(dropped) == 5 and len(vision) + len(text) + len(head) == len(state) - len(dropped)
    for theirs, ours in [("cls_token", "embeddings.class_embedding"), ("pos_embed", "embeddings.position_embedding"),
                         ("patch_embed.proj.weight", "embeddings.patch_embedding.weight"),
                         ("blocks.1.attn.qkv.bias", "encoder.layers.1.self_attn.qkv.bias"),
                         ("blocks.0.attn.proj.weight", "encoder.layers.0.self_attn.projection.weight"),
                         ("blocks.1.norm2.weight", "encoder.layers.1.layer_norm2.weight"),
                         ("blocks.0.mlp.fc2.bias", "encoder.layers.0.mlp.fc2.bias"),
                         ("norm.bias", "post_layernorm.bias")]:
        assert vision[ours] is state["blip.visual_encoder." + theirs]
    assert text["encoder.layer.1.crossattention.self.key.weight"].shape == (32, 64)  # keys read the 64-wide image
    assert sorted(head) == sorted(f"{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    with pytest.raises(KeyError, match="blip.visual_encoder.blocks.0.ls1.gamma"):  # an unknown ViT key
        reward_models.imagereward_state({**state, "blip.visual_encoder.blocks.0.ls1.gamma": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="blip.visual_encoder.blocks.0.ls1.gamma.*--imagereward-model-path"):
        torch.save({**state, "blip.visual_encoder.blocks.0.ls1.gamma": torch.zeros(1)}, tmp_path / "ImageReward.pt")
        (tmp_path / "med_config.json").write_text(open(f"{folder}/med_config.json").read())
        make("imagereward", imagereward_model_path=str(tmp_path), imagereward_tokenizer_path=folder)
    # A module the score does not use (as a training-time head) is ignored with a warning, as the authors' strict=False
    torch.save({**state, "itm_head.weight": torch.zeros(2, 32)}, tmp_path / "ImageReward.pt")
    images = random_images(2)
    extra = make("imagereward", imagereward_model_path=str(tmp_path), imagereward_tokenizer_path=folder)
    assert "ignoring 1 entries" in caplog.text and "itm_head.weight" in caplog.text
    torch.testing.assert_close(extra(images, PROMPTS[:2], None),
                               make("imagereward", **stand_ins["imagereward"])(images, PROMPTS[:2], None))
    smaller = {k: v for k, v in state.items() if "blocks.1." not in k or "norm1" not in k}  # a missing tensor
    torch.save(smaller, tmp_path / "ImageReward.pt")
    with pytest.raises(RuntimeError, match="its ViT.*layer_norm1.*--imagereward-model-path"):
        make("imagereward", imagereward_model_path=str(tmp_path / "ImageReward.pt"), imagereward_tokenizer_path=folder)


# ----------------------------------------------------------------------------- HPSv3

# SHA-256 of INSTRUCTION + prompt_with_special_token in hpsv3/dataset/data_collator_qwen.py of the authors' hpsv3 1.0.0
HPSV3_TEXT_SHA256 = "f6ee57479d4e9eee76b49c00dc962e1e696a5a2b3cc32cebd9b1fa76fe27502c"


def test_hpsv3_text_is_the_authors():
    assert hashlib.sha256((reward_models.HPSV3_INSTRUCTION + reward_models.HPSV3_QUERY).encode()).hexdigest() == HPSV3_TEXT_SHA256
    text = reward_models.hpsv3_text("a red cat")
    assert text.endswith("Textual prompt - a red cat\n\n\n\nPlease provide the overall ratings of this image: "
                         "<|Reward|>\n\nEND\n")


def _hpsv3_by_hand(options, images, prompts, *, positions="1d"):
    """HPSv3's score through transformers' full Qwen2VLForConditionalGeneration (lm_head included), its hidden
    states taken at the <|Reward|> token found in the text, and the reward head in plain torch."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration

    state = load_file(options["hpsv3_checkpoint_path"])
    config = AutoConfig.from_pretrained(options["hpsv3_base_path"])
    config.text_config.vocab_size = state["model.language_model.embed_tokens.weight"].shape[0]
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("rm_head.")})
    processor = AutoProcessor.from_pretrained(options["hpsv3_base_path"], padding_side="right")
    processor.tokenizer.add_tokens(["<|Reward|>"], special_tokens=True)
    scores, visual_tokens = [], []
    for image, prompt in zip(images, prompts):  # one at a time: no padding
        content = [{"type": "image"}, {"type": "text", "text": reward_models.hpsv3_text(prompt)}]
        message = [{"role": "user", "content": content}]
        text = processor.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
        batch = processor(text=text, images=[Image.fromarray(image).resize((448, 448), Image.BICUBIC)],
                          return_tensors="pt")
        ids = batch["input_ids"][0]
        visual_tokens.append(int((ids == config.image_token_id).sum()))
        at = ids.tolist().index(len(processor.tokenizer) - 1)  # <|Reward|>: the token appended last
        extra = {"position_ids": torch.arange(len(ids))[None]} if positions == "1d" else {}
        with torch.no_grad():
            out = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw",
                                                 "mm_token_type_ids")}, output_hidden_states=True, **extra)
        h = out.hidden_states[-1][0, at]
        h = F.relu(h @ state["rm_head.0.weight"].T + state["rm_head.0.bias"])
        h = F.relu(h @ state["rm_head.3.weight"].T + state["rm_head.3.bias"])
        scores.append((h @ state["rm_head.5.weight"].T + state["rm_head.5.bias"])[0])  # mu of (mu, sigma)
    return torch.stack(scores), visual_tokens


def test_hpsv3_matches_transformers_qwen2_vl_with_the_reward_head(stand_ins):
    images = random_images(3, height=32, width=32, seed=4)
    expected, visual_tokens = _hpsv3_by_hand(stand_ins["hpsv3"], images, PROMPTS)
    assert visual_tokens == [256, 256, 256]  # resized to 448 x 448: 32 x 32 patches of 14, merged 2 x 2
    got = make("hpsv3", **stand_ins["hpsv3"], hpsv3_batch_size=8)(images, PROMPTS, None)  # padded batch
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert float(got.std()) > 1e-2
    # The authors' forward leaves positions to the language model: 1-D. Qwen2-VL's own 3-D positions score otherwise.
    mrope, _ = _hpsv3_by_hand(stand_ins["hpsv3"], images[:1], PROMPTS[:1], positions="mrope")
    assert abs(float(mrope[0] - expected[0])) > 1e-3


def test_hpsv3_reads_older_key_names_and_refuses_a_mismatched_base(stand_ins, tmp_path):
    from safetensors.torch import load_file, save_file

    options = stand_ins["hpsv3"]
    state = load_file(options["hpsv3_checkpoint_path"])
    legacy = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
              for k, v in state.items()}  # the names before transformers 4.52
    assert "visual.merger.mlp.0.weight" in legacy and "model.layers.0.mlp.up_proj.weight" in legacy
    save_file(legacy, str(tmp_path / "legacy.safetensors"))
    images = random_images(2, seed=5)
    new = make("hpsv3", **options)(images, PROMPTS[:2], None)
    old = make("hpsv3", **dict(options, hpsv3_checkpoint_path=str(tmp_path / "legacy.safetensors")))(
        images, PROMPTS[:2], None)
    torch.testing.assert_close(old, new, atol=0, rtol=0)
    body, head = reward_models.hpsv3_state(state)
    assert set(head) == {f"{i}.{p}" for i in (0, 3, 5) for p in ("weight", "bias")} and "lm_head.weight" not in body
    with pytest.raises(KeyError, match="value_head.weight"):
        reward_models.hpsv3_state({**state, "value_head.weight": torch.zeros(1)})
    grown = dict(state, **{"model.language_model.embed_tokens.weight": torch.zeros(300, 16)})
    save_file(grown, str(tmp_path / "grown.safetensors"))
    with pytest.raises(RuntimeError, match="300 token embeddings.*--hpsv3-base-path"):
        make("hpsv3", **dict(options, hpsv3_checkpoint_path=str(tmp_path / "grown.safetensors")))


# ----------------------------------------------------------------------------- CLIPScore and aesthetic

def _clip_features(model, processor, images, prompts=None):
    """Projected, normalised CLIP features through the towers and projections (not get_*_features)."""
    with torch.no_grad():
        pix = processor(images=[Image.fromarray(i) for i in images], return_tensors="pt")["pixel_values"]
        v = model.visual_projection(model.vision_model(pixel_values=pix).pooler_output)
        v = v / v.norm(dim=-1, keepdim=True)
        if prompts is None:
            return v
        t = torch.stack([model.text_projection(model.text_model(
            input_ids=processor(text=[p], return_tensors="pt")["input_ids"]).pooler_output)[0] for p in prompts])
        return v, t / t.norm(dim=-1, keepdim=True)


def test_clipscore_is_the_cosine(stand_ins):
    from transformers import AutoProcessor, CLIPModel

    folder = stand_ins["clipscore"]["clipscore_model_path"]
    images = random_images(3, seed=6)
    v, t = _clip_features(CLIPModel.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder), images,
                          PROMPTS)
    expected = (v * t).sum(-1)
    got = make("clipscore", clipscore_model_path=folder)(images, PROMPTS, None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(make("clipscore", clipscore_model_path=folder, clipscore_batch_size=1)(
        images, PROMPTS, None), expected, atol=1e-5, rtol=1e-5)
    assert float(got.std()) > 1e-3 and got.abs().max() <= 1


# The published sac+logos+ava1-l14-linearMSE.pth (christophschuhmann/improved-aesthetic-predictor): names and shapes.
PUBLISHED_AESTHETIC = {"layers.0.weight": (1024, 768), "layers.0.bias": (1024,), "layers.2.weight": (128, 1024),
                       "layers.2.bias": (128,), "layers.4.weight": (64, 128), "layers.4.bias": (64,),
                       "layers.6.weight": (16, 64), "layers.6.bias": (16,), "layers.7.weight": (1, 16),
                       "layers.7.bias": (1,)}


def test_aesthetic_matches_by_hand_and_takes_the_published_layout(stand_ins, tmp_path):
    from transformers import AutoProcessor, CLIPModel

    options = stand_ins["aesthetic"]
    ours = {"layers." + k: tuple(v.shape) for k, v in reward_models._laion_mlp(768).state_dict().items()}
    assert ours == PUBLISHED_AESTHETIC
    folder, state = options["aesthetic_clip_path"], torch.load(options["aesthetic_mlp_path"])
    images = random_images(3, seed=7)
    v = _clip_features(CLIPModel.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder), images)
    with torch.no_grad():
        expected = _laion_mlp_by_hand(state, "layers.", v)
    got = make("aesthetic", **options)(images, ["ignored"] * 3, None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert float(got.std()) > 1e-3
    torch.save({k: v for k, v in state.items() if k != "layers.7.bias"}, tmp_path / "short.pth")
    with pytest.raises(RuntimeError, match="\"7.bias\".*--aesthetic-mlp-path"):
        make("aesthetic", **dict(options, aesthetic_mlp_path=str(tmp_path / "short.pth")))
    torch.save({k: torch.zeros(1024, 768) if k == "layers.0.weight" else v for k, v in state.items()},
               tmp_path / "wide.pth")
    with pytest.raises(RuntimeError, match="--aesthetic-mlp-path .*16-wide embedding of --aesthetic-clip-path"):
        make("aesthetic", **dict(options, aesthetic_mlp_path=str(tmp_path / "wide.pth")))


# ----------------------------------------------------------------------------- video, loading errors

@pytest.mark.parametrize("name", ["hps", "imagereward", "hpsv3", "clipscore", "aesthetic"])
def test_video_is_the_mean_over_evenly_spaced_frames(stand_ins, name):
    frames = 3 if name == "hpsv3" else 5
    video = random_images(2, height=32, width=32, frames=frames, seed=8)  # [2, F, 32, 32, 3]
    every = make(name, **stand_ins[name])
    per_frame = every(video.reshape(-1, 32, 32, 3), [p for p in PROMPTS[:2] for _ in range(frames)], None)
    per_frame = per_frame.view(2, frames)
    torch.testing.assert_close(every(video, PROMPTS[:2], None), per_frame.mean(1), atol=1e-5, rtol=1e-5)
    two = make(name, **stand_ins[name], **{f"{name}_num_frames": 2})  # the first and the last frame
    torch.testing.assert_close(two(video, PROMPTS[:2], None), per_frame[:, [0, frames - 1]].mean(1), atol=1e-5,
                               rtol=1e-5)
    assert float((per_frame[:, 0] - per_frame[:, -1]).abs().max()) > 1e-4  # the frames score differently
    with pytest.raises(ValueError, match=f"--{name}-num-frames must be an integer >= 0"):
        make(name, **stand_ins[name], **{f"{name}_num_frames": -1})


@pytest.mark.parametrize("name, options, flag", [
    ("imagereward", {}, "--imagereward-model-path"),
    ("hpsv3", {}, "--hpsv3-base-path"),
    ("clipscore", {}, "--clipscore-model-path"),
    ("aesthetic", {}, "--aesthetic-clip-path"),
])
def test_offline_loading_fails_in_one_line_naming_the_flag(name, options, flag, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match=f"{name}: cannot load .*point {flag} at the local copy") as err:
        make(name, **options)
    assert "\n" not in str(err.value)


def test_missing_local_files_name_their_flag(stand_ins, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ir = stand_ins["imagereward"]["imagereward_model_path"]
    with pytest.raises(RuntimeError, match="--imagereward-tokenizer-path"):
        make("imagereward", imagereward_model_path=ir, imagereward_tokenizer_path=str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="MizzenAI/HPSv3/HPSv3.safetensors.*--hpsv3-checkpoint-path"):
        make("hpsv3", hpsv3_base_path=stand_ins["hpsv3"]["hpsv3_base_path"])  # the default file is on the hub
    with pytest.raises(RuntimeError, match="--aesthetic-mlp-path"):
        make("aesthetic", **dict(stand_ins["aesthetic"], aesthetic_mlp_path=str(tmp_path / "missing.pth")))
    with pytest.raises(ValueError, match="--clipscore-batch-size must be an integer >= 1"):
        make("clipscore", **stand_ins["clipscore"], clipscore_batch_size=0)


# ----------------------------------------------------------------------------- UnifiedReward

def unified_server(reply=lambda caption: f"subject (object): 1\nFinal Score: {len(caption) % 5 + 1}"):
    """An OpenAI-compatible server replying as UnifiedReward does; the score follows the caption in the request."""
    def respond(body, headers):
        text = body["messages"][0]["content"][1]["text"]
        caption = text.rsplit("Text Caption: [", 1)[1][:-1]
        return 200, chat_reply(reply(caption)), 0.0
    return JsonServer(respond)


def test_unifiedreward_request_and_scores():
    images = random_images(3)
    with unified_server() as server:
        out = build_reward("unifiedreward", unifiedreward_url=server.url + "/v1", reward_backoff=0.001)(
            images, PROMPTS, None)
    assert out["unifiedreward"].tolist() == [len(p) % 5 + 1 for p in PROMPTS]
    body = next(b for b in server.bodies if "[two dogs on a mat]" in b["messages"][0]["content"][1]["text"])
    assert body["model"] == "UnifiedReward" and body["temperature"] == 0 and body["max_tokens"] == 4096
    assert len(body["messages"]) == 1 and body["messages"][0]["role"] == "user"  # no system turn
    image, text = body["messages"][0]["content"]
    assert text == {"type": "text", "text": reward_services.UNIFIEDREWARD_PROMPT.replace("{prompt}", "two dogs on a mat")}
    assert text["text"].startswith("You are given a text caption and a generated image")
    assert text["text"].endswith("assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as "
                                 "follows:\nText Caption: [two dogs on a mat]")
    png = Image.open(io.BytesIO(base64.b64decode(image["image_url"]["url"].removeprefix("data:image/png;base64,"))))
    assert image["type"] == "image_url" and np.array_equal(np.asarray(png), images[1])
    assert all("Authorization" not in h for h in server.headers)  # no key configured: no header


@pytest.mark.parametrize("reply, expected", [
    ("tree (object): 1\nsky (attribute): 0\nFinal Score: 4", 4.0),
    ("Final Score: 2\n... on reflection,\nFinal Score: 3.5", 3.5),  # the last one counts
    ("**Final Score:** 5", 5.0),
    ("Final Score:1", 1.0),
])
def test_unifiedreward_reply_parsing(reply, expected):
    with unified_server(lambda caption: reply) as server:
        out = build_reward("unifiedreward", unifiedreward_url=server.url + "/v1")(random_images(1), ["x"], None)
    assert out["reward"].tolist() == [expected]


@pytest.mark.parametrize("reply, match", [
    ("The image is nice.", "no 'Final Score: <n>' in the reply"),
    ("Final Score: 7", r"Final Score 7 outside \[1, 5\]"),
    ("Final Score: 0", r"Final Score 0 outside \[1, 5\]"),
])
def test_unifiedreward_bad_replies_fail_the_sample(reply, match):
    with unified_server(lambda caption: reply if caption == "tree" else "Final Score: 2") as server:
        reward = build_reward("unifiedreward", unifiedreward_url=server.url + "/v1", reward_retries=2,
                              reward_backoff=0.001)
        with pytest.raises(RewardServiceError, match=f"unifiedreward: sample 1 failed after 2 attempt.*{match}"):
            reward(random_images(2), ["a cat", "tree"], None)
        out = build_reward("unifiedreward", unifiedreward_url=server.url + "/v1", reward_retries=1,
                           reward_on_error="skip")(random_images(2), ["a cat", "tree"], None)
    assert out["failed"].tolist() == [False, True] and out["unifiedreward"][0] == 2.0


def test_unifiedreward_options_are_checked_when_built(monkeypatch):
    with pytest.raises(ValueError, match="--unifiedreward-url must be an http"):
        make("unifiedreward", unifiedreward_url="localhost:8080")
    with pytest.raises(ValueError, match="--unifiedreward-max-concurrency must be an integer >= 1"):
        make("unifiedreward", unifiedreward_max_concurrency=0)
    monkeypatch.delenv("UR_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="--unifiedreward-api-key-env: .*UR_TEST_KEY"):
        make("unifiedreward", unifiedreward_api_key_env="UR_TEST_KEY")
    with pytest.raises(ValueError, match="images only"):
        with unified_server() as server:
            scorer = make("unifiedreward", unifiedreward_url=server.url, reward_retries=1)
            scorer(random_images(1, frames=2), ["x"], None)


# ----------------------------------------------------------------------------- one training step with each scorer

@pytest.mark.parametrize("name", ["imagereward", "hpsv3", "clipscore", "aesthetic", "unifiedreward"])
def test_each_scorer_runs_a_training_step(stand_ins, name, tmp_path):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in stand_ins.get(name, {}).items()]
    server = unified_server()
    with server:
        if name == "unifiedreward":
            flags = [f"--unifiedreward-url={server.url}/v1"]
        train.main([*SMALL, "--steps", "1", "--log-images-every", "0", "--reward", name, "--out", str(tmp_path / "run"),
                    *flags])
    row, = metrics(str(tmp_path / "run"))
    assert row["step"] == 1 and not row.get("skipped"), row
    mean = row[f"reward/{name}_mean"]
    assert math.isfinite(mean) and row["reward_mean"] == pytest.approx(mean)  # the one component is the reward
    assert math.isfinite(row["loss"]) and row["trained_steps"] >= 1
    if name == "unifiedreward":
        assert len(server.bodies) == 8 and 1 <= mean <= 5  # 2 prompts x 4 samples, one request each
