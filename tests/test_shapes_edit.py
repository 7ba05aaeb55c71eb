"""Editing in the shapes world: the edit tasks, the exact judge on rendered and spoiled edits, the prompt files and
their source images, the `shapes_edit` reward, and the `shapes-edit` model (FLUX.1 Kontext's pipeline in pixel
space) against the pipeline's own __call__, its pretraining and its held-out accuracy."""

import json
import os

import numpy as np
import pytest
import torch

import data
import families
import geneval
import models
import rewards
import shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("one_thread")


def examples(n, seed=0, kind=None):
    rng = np.random.default_rng(seed)
    return [shapes.edit_example(rng, kind) for _ in range(n)]


def judge(row, image):
    return shapes.judge_edit(row, shapes.detect(image)[0])


# ----------------------------------------------------------------------------- tasks and the judge

@pytest.mark.parametrize("kind", shapes.EDITS)
def test_rendered_targets_are_correct_and_unedited_sources_are_not(kind):
    for row, source, target in examples(40, seed=1, kind=kind):
        assert row["edit"] == kind and 1 <= len(row["source"]) <= 3 and 1 <= len(row["target"]) <= 4
        got = judge(row, target)
        assert got == {"correct": 1.0, "score": 1.0, "reason": ""}, (row["prompt"], got)
        unedited = judge(row, source)  # the source handed back unchanged fails every kind of edit
        assert unedited["correct"] == 0.0 and unedited["score"] < 1.0, row["prompt"]


def test_instructions_read_as_in_the_issue():
    prompts = {k: [r["prompt"] for r, _, _ in examples(60, seed=2, kind=k)] for k in shapes.EDITS}
    assert any(p.startswith("add a ") and " to the left of the " in p for p in prompts["add"])
    assert all(p.startswith("change the ") and p.split()[-1] in shapes.COLORS for p in prompts["recolor"])
    assert "remove the square" in prompts["remove"] or "remove the circle" in prompts["remove"]
    assert "make two circles into three" in prompts["count"] + [r["prompt"] for r, _, _ in examples(
        200, seed=3, kind="count")]
    tokenizer = families.shapes.tokenizer()
    assert max(len(tokenizer(p).input_ids) for ps in prompts.values() for p in ps) <= shapes.TOKENS  # none cut


def spoil(row, how):
    """The target scene drawn wrong in one way: -> uint8 image."""
    objects = [dict(o) for o in row["source"]]
    by_at = {t["at"]: t for t in row["target"] if t.get("at") is not None}
    kept = [dict(objects[i], color=by_at[i]["color"]) for i in sorted(by_at)]
    if how == "moved":  # every kept object shifted by 6 px
        kept = [dict(o, cx=o["cx"] + (6 if o["cx"] < 16 else -6)) for o in kept]
    if how == "extra":  # one more object in a free corner
        kept.append({"shape": "circle", "color": "black", "size": 6.0, "cx": 4.0, "cy": 4.0})
    return shapes.draw(kept)


def test_the_judge_catches_each_way_of_getting_an_edit_wrong():
    rng = np.random.default_rng(4)
    while True:  # a recolor of a scene with a free top-left corner
        row, source, target = shapes.edit_example(rng, "recolor")
        if all(o["cx"] - o["size"] / 2 > 10 or o["cy"] - o["size"] / 2 > 10 for o in row["source"]):
            break
    assert judge(row, target)["correct"] == 1
    extra = judge(row, spoil(row, "extra"))
    assert extra["correct"] == 0 and extra["reason"] == "1 object(s) too many"
    assert extra["score"] == pytest.approx(len(row["target"]) / (len(row["target"]) + 1))  # every term held
    moved = judge(row, spoil(row, "moved"))
    assert moved["correct"] == 0 and "where it was" in moved["reason"]
    recolored = next(t for t in row["target"] if t["color"] != row["source"][t["at"]]["color"])
    assert judge(row, source)["reason"] == f"no {recolored['color']} {recolored['class']} where it was"
    # add: the new object on the wrong side of its anchor fails the relation term only
    row, _, target = examples(1, seed=5, kind="add")[0]
    new = row["target"][-1]
    anchor = row["source"][new["position"][1]]
    mirrored = [dict(o) for o in row["source"]] + [
        {"shape": new["class"], "color": new["color"], "size": 9.0, "cx": 32 - anchor["cx"], "cy": 32 - anchor["cy"]}]
    verdict = judge(row, shapes.draw(mirrored))
    if verdict["reason"].startswith("the "):  # (the mirror image may land on another object: then it is not drawn)
        assert verdict["correct"] == 0 and f"is not {new['position'][0]} its anchor" in verdict["reason"]


def test_judge_is_robust_to_a_small_models_blur():
    from scipy.ndimage import gaussian_filter

    rng = np.random.default_rng(6)
    correct = []
    for row, _, target in examples(120, seed=7):
        blurred = np.stack([gaussian_filter(target[..., c].astype(float), 0.6) for c in range(3)], -1)
        noisy = np.clip(blurred + rng.normal(0, 6, blurred.shape), 0, 255).round().astype(np.uint8)
        correct.append(judge(row, noisy)["correct"])
    assert np.mean(correct) >= 0.95, np.mean(correct)


# ----------------------------------------------------------------------------- prompt files and the reward

def test_prompt_files_are_what_write_edit_prompts_writes(tmp_path):
    shapes.write_edit_prompts(str(tmp_path))
    for split in ("train", "test"):
        name = f"shapes_edit_{split}.jsonl"
        assert (tmp_path / name).read_bytes() == open(os.path.join(ROOT, "prompts", name), "rb").read()
        prompts, metadata = data.load_prompts(os.path.join(ROOT, "prompts", name), input_key="prompt",
                                              metadata_key="")
        assert len(prompts) == 4 * shapes.EDIT_ROWS[split]
        assert {m["edit"] for m in metadata} == set(shapes.EDITS)
        for i in (0, len(metadata) // 2, len(metadata) - 1):  # each source PNG is its row's scene, drawn exactly
            shipped = os.path.join(ROOT, "prompts", metadata[i]["image"])
            assert (tmp_path / metadata[i]["image"]).read_bytes() == open(shipped, "rb").read()
            assert np.array_equal(data.source_images(metadata[i])[0], shapes.draw(metadata[i]["source"]))
    files = [os.path.join(ROOT, "prompts", f"shapes_edit_{split}.jsonl") for split in ("train", "test")]
    scenes = [{json.dumps(m["source"]) for m in data.load_prompts(f, input_key="prompt", metadata_key="")[1]}
              for f in files]
    assert not scenes[0] & scenes[1]  # held-out scenes
    name = "shapes_edit_unseen.jsonl"
    assert (tmp_path / name).read_bytes() == open(os.path.join(ROOT, "prompts", name), "rb").read()


def test_the_unseen_split_holds_instructions_training_never_has():
    """prompts/shapes_edit_test.jsonl is held out by scene; shapes_edit_unseen.jsonl by instruction too, for the kinds
    whose instructions can be held out: all 9 count instructions the world can phrase are in training, and 20 of the
    21 removals."""
    def rows(split):
        return data.load_prompts(os.path.join(ROOT, "prompts", f"shapes_edit_{split}.jsonl"), input_key="prompt",
                                 metadata_key="")
    train, (unseen, metadata) = set(rows("train")[0]), rows("unseen")
    assert len(unseen) == 50 * len(shapes.UNSEEN_EDITS) and not set(unseen) & train
    assert sorted({m["edit"] for m in metadata}) == sorted(shapes.UNSEEN_EDITS) == ["add", "recolor"]
    test = rows("test")
    assert sum(p in train for p in test[0]) == 146  # the scene split's instructions are mostly seen ones
    numbers = geneval.NUMBERS
    counts = {f"make {numbers[k]} {geneval._plural(s) if k > 1 else s} into {numbers[k + 1]}"
              for s in shapes.SHAPES for k in (1, 2, 3)}
    removals = {f"remove the {s}" for s in shapes.SHAPES} | {f"remove the {c} {s}" for s in shapes.SHAPES
                                                              for c in shapes.COLORS}
    assert counts <= train and len(counts) == 9
    assert len(removals) == 21 and {p for p in train if p.startswith("remove")} <= removals
    assert len(removals - train) == 1  # "remove the white square": one instruction, too few to make a split of
    assert all(metadata[i]["source"] and np.array_equal(data.source_images(metadata[i])[0],
                                                        shapes.draw(metadata[i]["source"])) for i in (0, 50, 99))


def test_shapes_edit_reward():
    rows = [r for kind in shapes.EDITS for r in examples(2, seed=8, kind=kind)]
    images = np.stack([t for _, _, t in rows])
    images[0] = rows[0][1]  # the first sample left unedited
    reward = rewards.build_reward("shapes_edit")
    out = reward(images, [r["prompt"] for r, _, _ in rows], [r for r, _, _ in rows])
    assert out["edit_correct"].tolist() == [0.0] + [1.0] * 7 and out["reward"].tolist() == out["edit_correct"].tolist()
    assert 0 <= out["edit_partial"][0] < 1 and out["edit_partial"][1:].tolist() == [1.0] * 7
    partial = rewards.build_reward("shapes_edit", shapes_edit_score="partial")
    assert torch.equal(partial(images, [r["prompt"] for r, _, _ in rows], [r for r, _, _ in rows])["reward"],
                       out["edit_partial"])
    assert torch.isnan(out["edit_add"][2:]).all() and out["edit_add"][:2].tolist() == [0.0, 1.0]
    assert out["edit_count"][6:].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="--metadata-key ''"):
        reward(images[:1], ["x"], [{"tag": "counting"}])


def test_edit_rows_load_whole_and_other_rows_are_refused_at_load(tmp_path):
    """The edit prompt files load as they are (their rows are their own metadata, data.FLAT_ROWS); trained with the
    shapes_edit reward, a file of other rows is refused when it loads, naming the line, before any model."""
    prompts, metadata = data.load_prompts(os.path.join(ROOT, "prompts", "shapes_edit_test.jsonl"), input_key="prompt",
                                          check=rewards.rows_check("shapes_edit", None))
    assert len(prompts) == 200 and {"edit", "source", "target", "source_images"} <= set(metadata[0])
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "add a red circle", "metadata": {"edit": "add"}}\n')
    with pytest.raises(ValueError, match="line 1.*--metadata-key ''"):
        data.load_prompts(str(path), input_key="prompt", check=rewards.rows_check("shapes_edit", None))


# ----------------------------------------------------------------------------- the model

def test_edit_model_is_a_step_of_the_kontext_pipeline():
    """The pixel-space Kontext pipeline (random weights): our velocity, with the source as reference tokens, is the
    pipeline's own __call__; its VAE slot folds pixels exactly; the source shapes the edit."""
    pipe = families.shapes.build_edit()
    assert models.family(pipe).name == "flux-kontext" and pipe.vae_scale_factor == 2
    assert models.latent_shape(pipe, 32) == (64, 48) and models.default_tokens(pipe) == shapes.TOKENS
    (row, source, _), (_, other, _) = examples(2, seed=9)
    prompts = [row["prompt"]] * 2
    x = models.initial_noise(pipe, 2, 32, generator=torch.Generator().manual_seed(0))
    from PIL import Image

    call = dict(prompt=prompts, image=[Image.fromarray(source), Image.fromarray(other)], num_inference_steps=3,
                guidance_scale=1.0, height=32, width=32, max_area=32 * 32, _auto_resize=False, latents=x.clone(),
                max_sequence_length=shapes.TOKENS)
    expected = pipe(**call, output_type="latent").images
    embeds = models.encode_prompts(pipe, prompts, images=[[source], [other]], resolution=32)
    sigmas = models.sigmas(pipe, 3, 32)
    with torch.no_grad():
        ours = x
        for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
            ours = ours + (s_next - s) * models.velocity(pipe, ours, s, embeds)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert (ours[0] - ours[1]).abs().max() > 1e-3  # same prompt and noise, another source: another edit
    images = torch.from_numpy(pipe(**call, output_type="np").images * 255)
    assert (models.decode(pipe, ours).float() - images).abs().max() <= 1
    pixels = torch.from_numpy(source).permute(2, 0, 1)[None].float() / 127.5 - 1
    packed = pipe._pack_latents(pipe.vae.encode(pixels).latents, 1, 12, 16, 16)
    assert torch.equal(models.decode(pipe, packed)[0], torch.from_numpy(source))  # the VAE slot is lossless


def test_trained_state_of_the_edit_model():
    pipe = families.shapes.build_edit()
    params = families.shapes.trainable_parameters(pipe)
    assert sum(p.numel() for p in params) == sum(v.numel() for v in families.shapes.trained_state(pipe).values())
    frozen = [p for n in ("text_encoder", "text_encoder_2") for p in getattr(pipe, n).parameters()
              if not p.requires_grad]
    assert [p.shape for p in frozen] == [(49408, 64), (49408, 64)]  # only the token tables stay seeded
    assert sum(p.numel() for p in params) * 2 < 10e6  # float16 weights under 10 MB


def test_pretraining_is_reproducible_and_loads(tmp_path):
    import importlib.util

    path = os.path.join(ROOT, "scripts", "pretrain_shapes_edit.py")
    spec = importlib.util.spec_from_file_location("pretrain_shapes_edit", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    paths = [str(tmp_path / f"w{i}.safetensors") for i in range(2)]
    for out in paths:
        script.main(["--steps", "2", "--batch-size", "4", "--threads", "1", "--lr", "1e-2", "--warmup", "1",
                     "--log-every", "2", "--out", out])
    assert open(paths[0], "rb").read() == open(paths[1], "rb").read()  # a pure function of the seed and threads
    trained = models.load_pipeline("shapes-edit", paths[0])
    a, b = families.shapes.trained_state(trained), families.shapes.trained_state(families.shapes.build_edit())
    moved = [k for k in a if not torch.equal(a[k], b[k].half().float())]
    assert len(moved) > 0.9 * len(a)
    with pytest.raises(FileNotFoundError, match="pretrain_shapes_edit"):
        models.load_pipeline("shapes-edit", "no/such/weights.safetensors")


def test_shipped_edit_model_edits_some_held_out_scenes_right():
    """weights/shapes_edit.safetensors (scripts/pretrain_shapes_edit.py, 4,000 steps): its 10-step ODE edits of
    the 200 held-out scenes are right about 0.40 of the time, every kind above the floor: room for RL in both
    directions."""
    import eval as evaluation
    pipe = models.load_pipeline("shapes-edit")
    prompts, metadata = data.load_prompts(os.path.join(ROOT, "prompts", "shapes_edit_test.jsonl"), input_key="prompt")
    images = evaluation.sample_images(pipe, prompts, resolution=shapes.RESOLUTION, num_steps=10, guidance_scale=1.0,
                                      batch_size=50, source_images=[data.source_images(m) for m in metadata])
    scores = rewards.build_reward("shapes_edit")(images, prompts, metadata)
    assert 0.2 <= scores["edit_correct"].mean().item() <= 0.7, scores["edit_correct"].mean()
    assert all(scores[f"edit_{kind}"].nanmean().item() > 0 for kind in shapes.EDITS)


@pytest.mark.slow
def test_edit_rl_raises_held_out_edit_accuracy_on_three_seeds(tmp_path):
    """`python train.py --model shapes-edit` as shipped on seeds 0, 1 and 2 (docs/editing.md, "The edit run": +0.148,
    +0.125, +0.115 at step 100, measured on one thread each, as here: the thread count moves the last bits; 22-30 s
    a step with two or three seeds sharing 2 cores): every seed's held-out edit accuracy ends at least four paired
    standard errors above step 0 and within 0.03 of its best evaluation, and the rises average 0.10 or more."""
    import subprocess
    import sys
    rises = []
    for seed in (0, 1, 2):
        out = tmp_path / f"edit{seed}"
        subprocess.run([sys.executable, "train.py", "--model", "shapes-edit", "--seed", str(seed), "--out", str(out)],
                       cwd=ROOT, check=True, timeout=5400, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(0, 101, 10)), rows
        last = rows[-1]
        assert last["rise"] == pytest.approx(last["edit_correct"] - rows[0]["edit_correct"], abs=1e-6)
        assert last["rise"] >= 4 * last["rise_se"], (seed, last["rise"], last["rise_se"])
        assert last["edit_correct"] >= max(r["edit_correct"] for r in rows) - 0.03, (seed, rows)
        rises.append(last["rise"])
    assert sum(rises) / 3 >= 0.10, rises



@pytest.mark.slow
def test_edit_rl_holds_on_seeds_the_preset_was_not_chosen_on(tmp_path):
    """The same command on seeds 3 and 4 (the preset was chosen on seed 2; docs/editing.md, "On seeds the preset was
    not chosen on": +0.123 +- 0.024 and +0.145 +- 0.024, one thread each, as here): each rises by 3 or more paired
    standard errors, the rises average 0.10 or more, and no kind of edit ends more than 0.03 under its step 0.
    Seed 7 does not meet this bar (+0.0375 +- 0.0235 here, +0.043 +- 0.025 as first reported: docs/editing.md)."""
    import subprocess
    import sys
    rises = []
    for seed in (3, 4):
        out = tmp_path / f"edit{seed}"
        subprocess.run([sys.executable, "train.py", "--model", "shapes-edit", "--seed", str(seed), "--out", str(out)],
                       cwd=ROOT, check=True, timeout=5400, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
        first, last = rows[0], rows[-1]
        assert last["step"] == 100 and last["rise"] >= 3 * last["rise_se"], (seed, last["rise"], last["rise_se"])
        for kind in shapes.EDITS:
            assert last[f"edit_{kind}"] >= first[f"edit_{kind}"] - 0.03, (seed, kind, first, last)
        rises.append(last["rise"])
    assert sum(rises) / len(rises) >= 0.10, rises

def test_the_edit_grid_shows_each_source_before_base_and_checkpoint(tmp_path, monkeypatch):
    """eval.py on an edit model: the grid's first column is what each edit started from, at the samples' size."""
    import eval as evaluation
    shown = {}
    real = evaluation.save_compare_grid

    def keep(folder, columns, names, prompts, notes, captions, **kw):
        shown.update(columns=columns, names=names, rows=[int(n.split("#")[1]) for n in notes], captions=captions)
        return real(folder, columns, names, prompts, notes, captions, **kw)
    monkeypatch.setattr(evaluation, "save_compare_grid", keep)
    monkeypatch.chdir(ROOT)
    evaluation.main(["--model", "shapes-edit", "--prompts", "prompts/shapes_edit_unseen.jsonl", "--input-key", "prompt",
                     "--metadata-key", "", "--reward", "shapes_edit", "--resolution", "32", "--eval-steps", "2",
                     "--max-prompts", "60", "--grid-rows", "3", "--out", str(tmp_path / "eval")])
    _, metadata = data.load_prompts(os.path.join(ROOT, "prompts", "shapes_edit_unseen.jsonl"), input_key="prompt",
                                    metadata_key="")
    assert shown["names"][0] == "source" and shown["names"][1].startswith("base")
    assert len(shown["columns"]) == 2 and shown["columns"][0].shape == (3, 32, 32, 3)
    for cell, row in enumerate(shown["rows"]):  # the grid's rows, as it chose them
        assert np.array_equal(shown["columns"][0][cell], data.source_images(metadata[row])[0])
        assert not np.array_equal(np.asarray(shown["columns"][1][cell]), shown["columns"][0][cell])  # a sample
    assert shown["captions"][0] == [("", None)] * 3 and (tmp_path / "eval" / "grid.png").is_file()
    assert not (tmp_path / "eval" / "diversity.png").exists()  # an edit's repeats edit other sources
    tall = evaluation.source_column([[], data.source_images(metadata[0])], (64, 48))  # enlarged; black for none
    assert tall.shape == (2, 64, 48, 3) and not tall[0].any() and tall[1].any()
