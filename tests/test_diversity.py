"""Diversity, measured: the shapes world's exact figures (free colours, positions, sizes) on hand-made detections and
rendered scenes, the feature diversity's pairwise cosine distance, and its feature models (tiny random twins of
DINOv2 and CLIP), with one error line naming the flag when the weights are not there."""

import math
import os
import sys

import numpy as np
import pytest
import torch

import diversity
import forkserver
import shapes
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("one_thread")


def det(cls, color, box, score=0.95):
    return {"class": cls, "color": color, "box": box, "score": score}


def row(prompt):
    rows = {r["prompt"]: r["metadata"] for tag in shapes.TAGS for r in shapes.prompt_rows(tag)}
    return rows[prompt]


def test_entropy_is_normalised_by_log_six():
    assert diversity.entropy(["red"] * 5) == 0.0
    assert diversity.entropy(["red", "red", "blue", "blue"]) == pytest.approx(math.log(2) / math.log(6))
    assert diversity.entropy(list(shapes.COLORS)) == pytest.approx(1.0)


def test_free_attributes_of_one_image():
    dets = [det("circle", "red", [4, 4, 12, 12]), det("square", "blue", [20, 20, 30, 30]),  # not the prompt's class
            det("circle", "green", [20, 4, 28, 12], score=0.2)]  # under GenEval's 0.3: not an object
    a = diversity.free_attributes(dets, row("a photo of a circle"), 32)
    assert a == {"colors": ["red"], "centres": [(0.25, 0.25)], "sizes": [0.25]}
    named = diversity.free_attributes([det("circle", "red", [4, 4, 12, 12])], row("a photo of a red circle"), 32)
    assert named["colors"] == [] and named["centres"] == [(0.25, 0.25)]  # its colour is asked for: not free
    related = row("a photo of a circle left of a square")
    assert diversity.free_attributes([det("circle", "red", [4, 4, 12, 12])], related, 32)["centres"] is None


def test_figures_per_tag_and_overall_on_hand_made_groups():
    corners = [[4, 4, 12, 12], [20, 4, 28, 12], [4, 20, 12, 28], [20, 20, 28, 28]]  # centres 0.25 / 0.75 apart
    circle = [[det("circle", c, b)] for c, b in zip(("red", "red", "blue", "green"), corners)]
    square = [[det("square", "red", [4, 4, 12, 12])], [det("square", "red", [4, 4, 20, 20])]]  # sides 8 and 16 px
    lone = [[det("triangle", "white", [4, 4, 12, 12])]]  # one image: no group
    prompts = ["a photo of a circle"] * 4 + ["a photo of a red square"] * 2 + ["a photo of a triangle"]
    out = diversity.shapes_diversity(circle + square + lone, prompts, [row(p) for p in prompts], size=32)
    colour = -(0.5 * math.log(0.5) + 0.5 * math.log(0.25)) / math.log(6)  # red 2, blue 1, green 1
    assert out["diversity_groups"] == 2
    assert out["diversity_color"] == pytest.approx(colour) and out["diversity_color_single_object"] == pytest.approx(colour)
    assert "diversity_color_colors" not in out and math.isnan(out["diversity_color_se"])  # one group, one value
    # positions: the circles 0.25 per axis about their mean; the squares' centres 0.25 and 0.375 -> std 0.0625
    assert out["diversity_position_single_object"] == pytest.approx(0.25)
    assert out["diversity_position_colors"] == pytest.approx(0.0625)
    assert out["diversity_position"] == pytest.approx((0.25 + 0.0625) / 2)
    assert out["diversity_position_se"] == pytest.approx(np.std([0.25, 0.0625], ddof=1) / math.sqrt(2))
    assert out["diversity_size_single_object"] == 0.0 and out["diversity_size_colors"] == pytest.approx(0.125)


def test_exact_figures_from_rendered_scenes():
    def scene(color, x):
        return shapes.draw([{"shape": "circle", "color": color, "cx": x, "cy": 16.0, "size": 12.0}])
    images = np.stack([scene("red", 9.0), scene("red", 23.0), scene("blue", 9.0), scene("blue", 23.0)])
    prompts = ["a photo of a circle"] * 4
    out = diversity.measure(images, prompts, [row(p) for p in prompts])
    assert out["diversity_color"] == pytest.approx(math.log(2) / math.log(6))
    assert out["diversity_position"] == pytest.approx(math.sqrt((7 / 32) ** 2 / 2), abs=0.01)  # x +-7 px, y fixed
    assert out["diversity_size"] == pytest.approx(0.0, abs=0.01)


def test_feature_diversity_is_the_mean_pairwise_cosine_distance():
    features = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 0.0], [3.0, 0.0], [-1.0, 0.0], [5.0, 5.0]])
    out = diversity.feature_diversity(features, ["a", "a", "b", "b", "b", "c"])  # c: one image, no group
    # a: orthogonal, distance 1; b: pairs 0, 2, 2 -> 4/3
    assert out["diversity_features"] == pytest.approx(7 / 6)
    assert out["diversity_features_se"] == pytest.approx(1 / 6)


def tiny_dinov2(folder):
    from transformers import Dinov2Config, Dinov2Model
    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                             image_size=32, patch_size=8)).save_pretrained(folder)
    return str(folder)


def tiny_clip(folder):
    from transformers import CLIPConfig, CLIPModel
    torch.manual_seed(0)
    config = CLIPConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=8), projection_dim=16)
    CLIPModel(config).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("name, make, dim", [("dinov2", tiny_dinov2, 32), ("clip", tiny_clip, 16)])
def test_feature_models_from_a_local_folder(tmp_path, name, make, dim):
    path = make(tmp_path / name)
    featurize = diversity.featurizer(name, path)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    features = featurize(images)
    assert tuple(features.shape) == (4, dim)
    same = diversity.measure(np.stack([images[0]] * 3), ["p"] * 3, [], diversity=name, diversity_path=path)
    assert same["diversity_features"] == pytest.approx(0.0, abs=1e-5)  # identical images: no spread
    other = diversity.measure(images, ["p"] * 4, [], diversity=name, diversity_path=path)
    assert other["diversity_features"] > 1e-4


def test_pixel_features_are_the_image_area_averaged_to_32_px():
    """--diversity pixels: no model; a 64 px image becomes the mean of each 2 x 2 block, in [-1, 1]; a video its
    middle frame; a square moved is as far as (here twice) a square recoloured: pixels weigh place and colour alike."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    features = diversity.featurizer("pixels")(images)
    blocks = images.reshape(2, 32, 2, 32, 2, 3).astype(np.float64).mean(axis=(2, 4)) / 127.5 - 1  # [2, 32, 32, 3]
    assert tuple(features.shape) == (2, 3 * 32 * 32)
    assert np.allclose(features.numpy(), blocks.transpose(0, 3, 1, 2).reshape(2, -1), atol=1e-5)
    video = np.stack([images[::-1], images, images[::-1]], axis=1)  # [2, 3 frames, 64, 64, 3], the middle: images
    assert torch.equal(diversity.featurizer("pixels")(video), features)
    white = np.full((3, 32, 32, 3), 255, np.uint8)
    white[0, 4:12, 4:12] = white[1, 20:28, 20:28] = (255, 0, 0)  # red squares in two places
    white[2, 4:12, 4:12] = (0, 0, 255)  # a blue one where the first red is
    f = diversity.featurizer("pixels")(white)
    d = lambda i, j: 1 - torch.nn.functional.cosine_similarity(f[i], f[j], dim=0)  # noqa: E731
    assert d(0, 1) == pytest.approx(2 * d(0, 2)) and d(0, 2) > 0 and d(0, 0) == pytest.approx(0, abs=1e-6)


def test_pixels_refuse_a_model_path(capsys):
    parser, args = train.parse_args(["--model", "tiny", "--diversity", "pixels", "--diversity-path", "x"])
    with pytest.raises(SystemExit):
        train.check_args(parser, args, 1)
    assert "drop --diversity-path" in capsys.readouterr().err


def test_missing_weights_fail_in_one_line_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--diversity-path"):
        diversity.featurizer("dinov2", str(tmp_path / "absent"))
    proc = forkserver.run([sys.executable, "train.py", "--model", "tiny", "--steps", "1", "--out", str(tmp_path / "run"),
                           "--diversity", "dinov2", "--diversity-path", str(tmp_path / "absent")],
                          cwd=ROOT, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and lines[-1].startswith("error: --diversity dinov2") and "--diversity-path" in lines[-1]
    assert "Traceback" not in proc.stderr


def test_train_logs_diversity_per_step_and_per_evaluation(tmp_path):
    """The run's own path: feature diversity in metrics.jsonl every step, exact and feature diversity in eval.jsonl."""
    import json
    rows = [r for tag in ("single_object", "colors") for r in shapes.prompt_rows(tag)[:2]]
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows * 3))  # 4 prompts, 3 images each
    path, out = tiny_dinov2(tmp_path / "dinov2"), tmp_path / "run"
    done = forkserver.run([sys.executable, "train.py", "--model", "tiny", "--prompts", "prompts/shapes_train.jsonl",
                    "--input-key", "prompt", "--eval-prompts", str(held_out), "--reward", "geneval",
                    "--geneval-detector", "shapes", "--prompts-per-step", "2", "--group-size", "4",
                    "--sample-batch-size", "4", "--train-batch-size", "4", "--num-steps", "2", "--eval-steps", "2",
                    "--resolution", "32", "--steps", "1", "--eval-every", "1", "--diversity", "dinov2",
                    "--diversity-path", path, "--out", str(out)], cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    step = [json.loads(line) for line in open(out / "metrics.jsonl")][-1]
    assert 0 <= step["diversity_features"] <= 2
    evals = [json.loads(line) for line in open(out / "eval.jsonl")]
    assert [e["step"] for e in evals] == [0, 1]
    assert all(e["diversity_groups"] == 4 and 0 <= e["diversity_features"] <= 2 for e in evals)


def test_curves_show_diversity_beside_accuracy(tmp_path):
    import json

    import eval as evaluation
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": s, "geneval_overall": 0.3, "reward": 0.5,
                                                        "diversity_color": c, "diversity_color_se": 0.02}) + "\n"
                                            for s, c in ((0, 0.9), (25, 0.7))))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.4, "diversity_features": f})
                                               + "\n" for s, f in ((1, 0.5), (2, 0.4))))
    panels = {t: c for t, _, c in evaluation.curve_panels([evaluation.read_run(str(run), [str(run)])])}
    assert list(panels["held-out colour diversity (free colours)"].values())[0] == ([0, 25], [0.9, 0.7], [0.02, 0.02])
    assert list(panels["feature diversity within groups (--diversity)"].values())[0][1] == [0.5, 0.4]
    assert "held-out position spread (free positions)" not in panels  # not in this eval.jsonl
