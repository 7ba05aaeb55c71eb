"""Every published recipe parses and runs one training step on the tiny model of its family (--model overridden)."""
import glob
import json
import os

import pytest

import losses
import reward_fixtures
import rewards
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.args")))
# Shrinks a recipe to CPU size; everything else (loss, SDE, window, reward, KL, LoRA...) stays as published.
SHRINK = ["--resolution", "32", "--prompts-per-step", "2", "--group-size", "4",
          "--sample-batch-size", "4", "--train-batch-size", "2", "--mixed-precision", "no", "--eval-every", "0",
          "--log-images-every", "0", "--no-fsdp"]
TWIN = {"sd3": ["--model", "tiny"], "flux": ["--model", "tiny"], "wan": ["--model", "tiny-wan", "--num-frames", "5"],
        "qwen-image": ["--model", "tiny-qwen-image"], "flux2-klein": ["--model", "tiny-flux2-klein"],
        "z-image": ["--model", "tiny-z-image"], "flux-kontext": ["--model", "tiny-flux-kontext"],
        "qwen-image-edit": ["--model", "tiny-qwen-image-edit"],
        "shapes": []}  # the CPU model that stands in for each hub model (the shapes world's is its own)
TWIN["wan2.2"] = ["--model", "tiny-wan2.2"]  # Wan 2.2 A14B: two tiny experts (its recipe samples 5 frames)
TWIN["hunyuan-video-1.5"] = ["--model", "tiny-hunyuan-video-1.5"]  # its recipe samples 5 frames
TWIN["qwen-image-2.1"] = ["--model", "tiny-qwen-image-2.1"]
TWIN["ltx2"] = ["--model", "tiny-ltx2", "--num-frames", "5"]  # its recipe samples 121 frames
TWIN["wan2.2-5b"] = ["--model", "tiny-wan2.2-5b"]  # Wan 2.2 TI2V-5B: its recipe samples 9 frames (4k + 1)


@pytest.fixture(scope="module")
def tiny_reward_models(tmp_path_factory):
    """Stand-ins for the hub reward models: tiny random PickScore, HPS, HPSv3, ImageReward, aesthetic predictor and
    CLAP built from configs, and for GenEval's detector and colour classifier a tiny random Mask2Former (80 labels) and
    open_clip model."""
    folder = str(tmp_path_factory.mktemp("reward_models"))
    pick = reward_fixtures.tiny_pickscore(os.path.join(folder, "pickscore"))
    hps_name, hps_path = reward_fixtures.tiny_hps(os.path.join(folder, "hps"))
    image_reward = os.path.join(folder, "imagereward")
    reward_fixtures.tiny_imagereward(image_reward)
    aesthetic_clip, aesthetic_mlp = reward_fixtures.tiny_aesthetic(os.path.join(folder, "aesthetic"))
    hpsv3_base, hpsv3_path = reward_fixtures.tiny_hpsv3(os.path.join(folder, "hpsv3"))
    clap = reward_fixtures.tiny_clap(os.path.join(folder, "clap"))
    return ["--hpsv3-base-path", hpsv3_base, "--hpsv3-checkpoint-path", hpsv3_path, "--clap-model-path", clap,
            "--pickscore-model-path", pick, "--pickscore-processor-path", pick, "--image-similarity-model-path", pick,
            "--hps-checkpoint-path", hps_path, "--hps-model-name", hps_name,
            "--imagereward-model-path", image_reward, "--imagereward-tokenizer-path", image_reward,
            "--aesthetic-clip-path", aesthetic_clip, "--aesthetic-mlp-path", aesthetic_mlp,
            *tiny_geneval_models(os.path.join(folder, "geneval"))]


@pytest.fixture(scope="module")
def tiny_dinov2(tmp_path_factory):
    """A stand-in for the DINOv2 image features of --diversity dinov2 (GARDO's diversity-aware advantage)."""
    import torch
    from transformers import Dinov2Config, Dinov2Model

    folder = tmp_path_factory.mktemp("dinov2")
    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             image_size=32, patch_size=8)).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def counting_edits(tmp_path_factory):
    """A stand-in for Flow-GRPO's dataset/counting_edit (not shipped): GenEval counting rows, each naming a source."""
    import numpy as np
    from PIL import Image

    folder = tmp_path_factory.mktemp("counting_edit")
    rows = []
    for i, (name, count) in enumerate([("cup", 2), ("apple", 3), ("dog", 2), ("car", 4)]):
        image = np.random.default_rng(i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(image).save(folder / f"{i}.png")
        rows.append({"tag": "counting", "include": [{"class": name, "count": count}],
                     "exclude": [{"class": name, "count": count + 1}], "image": f"{i}.png",
                     "prompt": f"make it {count} {name}s"})
    (folder / "train_metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder / "train_metadata.jsonl")


def tiny_geneval_models(folder):
    import open_clip
    import torch
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    torch.manual_seed(0)
    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=backbone, num_labels=80, num_queries=10, hidden_dim=32,
                               mask_feature_size=32, feature_size=32, encoder_layers=1, decoder_layers=2,
                               num_attention_heads=2, dim_feedforward=32, encoder_feedforward_dim=32)
    detector = os.path.join(folder, "mask2former")
    Mask2FormerForUniversalSegmentation(config).save_pretrained(detector)
    name = "tiny-recipes-clip"
    clip_config = {"embed_dim": 16,
                   "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
                   "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    with open(os.path.join(folder, name + ".json"), "w") as f:
        json.dump(clip_config, f)
    open_clip.add_model_config(os.path.join(folder, name + ".json"))
    clip = os.path.join(folder, "clip.pt")
    torch.save(open_clip.create_model(name, pretrained=None, force_quick_gelu=True).state_dict(), clip)
    return ["--geneval-detector-path", detector, "--geneval-clip-path", clip, "--geneval-clip-model", name]


def test_every_published_setup_has_a_recipe():
    names = {os.path.basename(r) for r in RECIPES}
    for expected in ("sd3_ocr_grpo.args", "sd3_pickscore_grpo.args", "sd3_hps_grpo.args", "sd3_fast_nocfg_cps.args",
                     "sd3_guard_ocr.args", "sd3_flowdppo_pickscore.args", "flux_mixgrpo.args",
                     "flux_mixgrpo_flash.args", "sd3_ocr_pickscore_mix.args", "wan_ocr_grpo.args",
                     "qwen_image_pickscore_grpo.args", "sd3_guard_pickscore.args", "sd3_nft_geneval.args",
                     "sd3_nft_pickscore.args", "sd3_nft_ocr.args", "sd3_awm_geneval.args", "sd3_awm_ocr.args",
                     "sd3_awm_pickscore.args", "wan22_pickscore_grpo.args", "hunyuan_video15_pickscore_grpo.args",
                     "qwen_image21_pickscore_grpo.args", "ltx2_clap_grpo.args", "wan22_5b_hpsv3_dancegrpo.args"):
        assert expected in names
    for recipe in RECIPES:  # each cites what it reproduces
        assert open(recipe).readline().startswith("# ")


@pytest.mark.parametrize("recipe", RECIPES, ids=[os.path.basename(r) for r in RECIPES])
def test_recipe_runs_one_step_on_tiny(recipe, tmp_path, tiny_reward_models, counting_edits, tiny_dinov2, monkeypatch):
    monkeypatch.chdir(ROOT)
    parser, published = train.parse_args([f"@{recipe}"])
    assert published.model in TWIN
    out = str(tmp_path / "run")
    shrink = SHRINK + TWIN[published.model]
    if losses.LOSSES[published.loss].unit == "group":  # micro-batches of whole groups (DGPO)
        shrink += ["--train-batch-size", "4"]
    if published.diversity in ("dinov2", "clip"):  # image features (GARDO's advantage): a tiny model of the family
        shrink += ["--diversity-path", tiny_dinov2]
    if published.num_steps > 6 and getattr(published, "sde_window", None) in (None, "all") \
            and published.train_timesteps is None:  # windows and strata of steps keep the published count
        shrink += ["--num-steps", "6"]  # the published 10 to 40 rollout steps cost more and test nothing 6 do not
    if not os.path.exists(published.prompts):  # the edit recipes name the authors' prompt files, not shipped
        shrink += ["--prompts", counting_edits, "--eval-prompts", counting_edits]
    train.main([f"@{recipe}", *shrink, *tiny_reward_models, "--steps", "1", "--out", out])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(rows) == 1 and not rows[0].get("skipped")
    assert rows[0]["reward_mean"] == rows[0]["reward_mean"] and rows[0]["loss"] == rows[0]["loss"]
    args = json.load(open(os.path.join(out, "args.json")))["args"]
    # Every flag the recipe sets, except the few SHRINK overrides and the reward models' paths (the tiny stand-ins'),
    # reaches the run unchanged.
    flags = {tok for line in open(recipe) if not line.startswith("#") for tok in line.split() if tok.startswith("--")}
    name = lambda flag: flag[2:].replace("-", "_").removeprefix("no_")
    keys = {name(f) for f in flags} - {name(f) for f in [*shrink, *tiny_reward_models] if f.startswith("--")} - {"steps"}
    assert {"loss", "reward", "lora_rank", "lr"} <= keys
    assert ("sampler" if losses.LOSSES[published.loss].process == "forward" else "sde") in keys
    for key in keys:
        value = getattr(published, key)
        assert args[key] == (list(value) if isinstance(value, tuple) else value), key
