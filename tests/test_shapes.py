"""The shapes world: prompts against GenEval's templates, the renderer, the exact detector, the
GenEval judge's verdicts on hand-made scenes, and the pretrained `shapes` model."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import families
import geneval
import models
import shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREY = np.array(shapes.BACKGROUND)


def obj(shape, color, cx, cy, size):
    return {"shape": shape, "color": color, "cx": cx, "cy": cy, "size": size}


def verdict(prompt, image):
    """The shapes world's GenEval verdict (0/1) of `image` for one of this world's prompts."""
    rows = {r["prompt"]: r["metadata"] for tag in shapes.TAGS for r in shapes.prompt_rows(tag)}
    return geneval.geneval_judge(rows[prompt], shapes.detect(image)[0],
                                 counting_threshold=shapes.COUNTING_THRESHOLD)["correct"]


def degrade(images, rng, blur=0.7, noise=8.0):
    """Gaussian blur (std in px) and Gaussian pixel noise, as a small model's samples have."""
    x = torch.from_numpy(images).float().permute(0, 3, 1, 2)
    r = 3
    k = torch.exp(-torch.arange(-r, r + 1.0) ** 2 / (2 * blur ** 2))
    k = k / k.sum()
    x = torch.nn.functional.pad(x, (r, r, r, r), mode="replicate")
    x = torch.nn.functional.conv2d(x, k.view(1, 1, 1, -1).repeat(3, 1, 1, 1), groups=3)
    x = torch.nn.functional.conv2d(x, k.view(1, 1, -1, 1).repeat(3, 1, 1, 1), groups=3)
    x = x.permute(0, 2, 3, 1).numpy() + rng.normal(0, noise, images.shape)
    return np.clip(np.round(x), 0, 255).astype(np.uint8)


# ----------------------------------------------------------------------------- prompts

def test_prompts_follow_genevals_templates():
    counts = {tag: len(shapes.prompt_rows(tag)) for tag in shapes.TAGS}
    # 3 shapes, 6 colours: 3, 3 x 2 ordered pairs, 3 x counts 2-4, 3 x 6, 6 pairs x 4 relations, 6 pairs x 6 x 5 colours
    assert counts == {"single_object": 3, "two_object": 6, "counting": 9, "colors": 18, "position": 24, "color_attr": 180}
    rows = {r["prompt"]: r["metadata"] for tag in shapes.TAGS for r in shapes.prompt_rows(tag)}
    assert rows["a photo of a circle"] == {"tag": "single_object", "include": [{"class": "circle", "count": 1}], "exclude": []}
    assert rows["a photo of three squares"] == {
        "tag": "counting", "include": [{"class": "square", "count": 3}], "exclude": [{"class": "square", "count": 4}]}
    assert rows["a photo of a circle left of a square"] == {  # the target object comes first, as in GenEval
        "tag": "position", "include": [{"class": "square", "count": 1},
                                       {"class": "circle", "count": 1, "position": ["left of", 0]}], "exclude": []}
    assert rows["a photo of a red circle and a blue triangle"]["include"] == [
        {"class": "circle", "count": 1, "color": "red"}, {"class": "triangle", "count": 1, "color": "blue"}]
    assert rows["a photo of a white square"]["include"] == [{"class": "square", "count": 1, "color": "white"}]
    assert set(shapes.COLORS) <= set(geneval.COLORS) and shapes.BACKGROUND not in shapes.COLORS.values()
    for metadata in rows.values():
        geneval.check_metadata(metadata)
    assert geneval._with_article("orange") == "an orange" and geneval._plural("bus") == "buses"


def test_prompt_files_are_the_split_and_disjoint():
    train, test = shapes.split()
    for name, rows in (("train", train), ("test", test), ("train_hard", shapes.hard_rows(train))):
        with open(os.path.join(ROOT, "prompts", f"shapes_{name}.jsonl")) as f:
            assert [json.loads(line) for line in f] == rows, f"prompts/shapes_{name}.jsonl is stale: python -m shapes --write-prompts"
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert {r["metadata"]["tag"] for r in shapes.hard_rows(train)} == set(shapes.TAGS) - {"single_object", "colors"}
    tags = [r["metadata"]["tag"] for r in test]
    assert all(tags.count(t) == shapes.ROWS_PER_TAG["test"] for t in shapes.TAGS)
    assert {r["prompt"] for r in test if r["metadata"]["tag"] == "single_object"} == {
        "a photo of a circle", "a photo of a square", "a photo of a triangle"}
    counting = {(r["metadata"]["include"][0]["class"], r["metadata"]["include"][0]["count"])
                for r in test if r["metadata"]["tag"] == "counting"}
    assert len({c for c, _ in counting}) == 3 and len({n for _, n in counting}) == 3  # spread over shapes and counts
    prompts, metadata = __import__("data").load_prompts(os.path.join(ROOT, "prompts", "shapes_test.jsonl"), input_key="prompt")
    assert prompts[0] == test[0]["prompt"] and metadata[0] == test[0]["metadata"]


# ----------------------------------------------------------------------------- renderer

def test_draw_is_exact_on_the_pixel_grid():
    # a square covering pixels 4..11 exactly, and a circle of radius 3 centred on a pixel corner
    image = shapes.draw([obj("square", "red", 8.0, 8.0, 8.0), obj("circle", "blue", 22.0, 22.0, 6.0)], 32)
    assert (image[4:12, 4:12] == shapes.COLORS["red"]).all()
    assert (image[3, :] == GREY).all() and (image[12, 4:12] == GREY).all()
    assert (image[20:24, 20:24] == shapes.COLORS["blue"]).all()  # pixels entirely inside the disc
    half = shapes.draw([obj("square", "white", 8.0, 8.0, 7.0)], 32)  # edges at 4.5 and 11.5: half-covered pixels
    assert (half[6, 4] == np.round((GREY + np.array(shapes.COLORS["white"])) / 2)).all()
    corner = shapes.coverage(obj("triangle", "red", 16.0, 16.0, 8.0), 32)
    assert corner.sum() == pytest.approx(32.0, abs=0.1)  # area 8 x 8 / 2
    assert corner[12, 12:20].sum() < corner[19, 12:20].sum()  # apex up


@pytest.mark.parametrize("tag", shapes.TAGS)
def test_rendered_scenes_are_judged_correct(tag):
    rng = np.random.default_rng(0)
    rows = shapes.prompt_rows(tag)
    for i in range(12):
        metadata = rows[rng.integers(len(rows))]["metadata"]
        objects = shapes.layout(metadata, 32, rng)
        assert len(objects) == sum(c["count"] for c in metadata["include"])
        for a in range(len(objects)):  # never touching, never cut by the border
            box = shapes.object_box(objects[a])
            assert min(box) >= shapes.MARGIN - 1e-9 and max(box) <= 32 - shapes.MARGIN + 1e-9
        image = shapes.draw(objects, 32)
        result = geneval.geneval_judge(metadata, shapes.detect(image)[0])
        assert result["correct"] == 1 and result["strict"] == 1 and result["partial"] == 1, result["reason"]


def test_python_m_shapes_writes_the_prompt_files(tmp_path, monkeypatch):
    """`python -m shapes --write-prompts` (shapes/__main__.py) writes the shipped files again; with no flag it refuses
    in one line."""
    import subprocess
    import sys

    from shapes.__main__ import main

    done = subprocess.run([sys.executable, "-m", "shapes"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "python -m shapes: error: nothing to do: pass --write-prompts or --write-edit-prompts")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts").mkdir()
    main(["--write-prompts"])
    for name in ("train", "test", "train_hard"):
        path = os.path.join("prompts", f"shapes_{name}.jsonl")
        assert open(path, "rb").read() == open(os.path.join(ROOT, path), "rb").read()


def test_position_layouts_hold_by_a_margin():
    rng = np.random.default_rng(1)
    for row in shapes.prompt_rows("position")[:8]:
        metadata = row["metadata"]
        relation = metadata["include"][1]["position"][0]
        for _ in range(5):
            target, moved = shapes.layout(metadata, 32, rng)  # include order: target first
            a, b = shapes.object_box(moved), shapes.object_box(target)
            grown = lambda box: [box[0] - 2, box[1] - 2, box[2] + 2, box[3] + 2]  # noqa: E731
            assert geneval.relative_position(a, b) == {relation} == geneval.relative_position(grown(a), grown(b))


def test_layout_refuses_what_it_cannot_draw():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown class"):
        shapes.layout({"include": [{"class": "cat", "count": 1}]}, 32, rng)
    with pytest.raises(ValueError, match="unknown colour"):
        shapes.layout({"include": [{"class": "circle", "count": 1, "color": "orange"}]}, 32, rng)
    with pytest.raises(ValueError, match="1-4 objects"):
        shapes.layout({"include": [{"class": "circle", "count": 5}]}, 32, rng)


# ----------------------------------------------------------------------------- detector

def test_detector_on_hand_made_scenes():
    image = shapes.draw([obj("square", "red", 8.0, 8.0, 12.0), obj("circle", "blue", 24.0, 8.0, 12.0),
                         obj("triangle", "yellow", 16.0, 24.0, 12.0)], 32)
    dets = shapes.detect(image)[0]
    assert sorted((d["class"], d["color"]) for d in dets) == [("circle", "blue"), ("square", "red"), ("triangle", "yellow")]
    square = next(d for d in dets if d["class"] == "square")
    assert square["box"] == [2, 2, 14, 14] and square["mask"].sum() == 144  # x2, y2 exclusive
    assert all(d["score"] > 0.9 for d in dets)
    assert shapes.detect(np.full((2, 32, 32, 3), 128, np.uint8)) == [[], []]  # empty scenes


def test_touching_objects():
    # different colours touching: two objects; same colour touching: one blob that is no shape
    image = shapes.draw([obj("square", "red", 10.0, 16.0, 10.0), obj("square", "blue", 20.0, 16.0, 10.0)], 32)
    assert sorted((d["class"], d["color"]) for d in shapes.detect(image)[0] if d["score"] > 0.9) == [
        ("square", "blue"), ("square", "red")]
    assert verdict("a photo of two squares", image) == 1
    same = shapes.draw([obj("square", "green", 10.0, 16.0, 10.0), obj("square", "green", 20.0, 16.0, 10.0)], 32)
    dets = shapes.detect(same)[0]
    assert len(dets) == 1 and dets[0]["score"] < 0.3 and dets[0]["box"] == [5, 11, 25, 21]
    assert verdict("a photo of two squares", same) == 0


def test_objects_at_the_border():
    # touching the border: found, box from 0; cut in half by it: no shape of this world (the renderer never cuts)
    image = shapes.draw([obj("circle", "green", 6.0, 16.0, 12.0), obj("square", "white", 26.0, 26.0, 12.0)], 32)
    dets = sorted(shapes.detect(image)[0], key=lambda d: d["class"])
    assert [(d["class"], d["box"]) for d in dets] == [("circle", [0, 10, 12, 22]), ("square", [20, 20, 32, 32])]
    assert all(d["score"] > 0.9 for d in dets)
    cut = shapes.draw([obj("square", "green", 0.0, 16.0, 14.0)], 32)  # a 7 x 14 rectangle is left
    assert all(d["score"] < 0.3 for d in shapes.detect(cut)[0])
    assert verdict("a photo of a square", cut) == 0 and verdict("a photo of a circle", cut) == 0


def test_colours_between_palette_entries():
    # orange-ish between red (225, 30, 30) and yellow (240, 215, 30): residuals of the two mixture lines,
    # worked by hand: (230, 100, 30) is 1.0e3 from red's and 6.4e3 from yellow's; (240, 170, 30) the other way round
    for rgb, name in (((230, 100, 30), "red"), ((240, 170, 30), "yellow"), ((60, 60, 200), "blue"), ((50, 50, 50), "black")):
        image = np.full((1, 32, 32, 3), shapes.BACKGROUND, np.uint8)
        image[0, 10:22, 10:22] = rgb
        dets = shapes.detect(image)[0]
        # (50, 50, 50) covers 0.69 of black: a faint fit, reported as unknown with its best guess
        assert [(d.get("guess", d["class"]), d["color"]) for d in dets] == [("square", name)], rgb
    # an edge pixel half red, half grey is red (the nearest palette colour would say nothing of the kind)
    color, alpha, _ = shapes.unmix(np.array([[[(225 + 128) // 2, (30 + 128) // 2, (30 + 128) // 2]]], np.uint8))
    assert list(shapes.COLORS)[color[0, 0]] == "red" and alpha[0, 0] == pytest.approx(0.5, abs=0.01)
    specks = np.full((1, 32, 32, 3), shapes.BACKGROUND, np.uint8)
    specks[0, 5:8, 5:8] = shapes.COLORS["red"]  # 9 px, under MIN_AREA: no object, but something (unknown)
    specks[0, 20, 20:24] = shapes.COLORS["blue"]  # 4 px, under SPECK_AREA: noise, not reported
    (speck,) = shapes.detect(specks)[0]
    assert (speck["class"], speck["score"], speck["box"], speck["color"]) == ("unknown", 0.0, [5, 5, 8, 8], "red")


def precision_recall(n, rng, degraded, threshold=geneval.COUNTING_THRESHOLD):
    """{tag: (precision, recall)} of the detector's (class, colour) pairs scoring above `threshold` on n rendered
    scenes, tags in turn."""
    rows = [r for tag in shapes.TAGS for r in shapes.prompt_rows(tag)]
    by_tag = {tag: [r for r in rows if r["metadata"]["tag"] == tag] for tag in shapes.TAGS}
    tags = [shapes.TAGS[i % 6] for i in range(n)]
    scenes = [shapes.layout(by_tag[tag][rng.integers(len(by_tag[tag]))]["metadata"], 32, rng) for tag in tags]
    images = np.stack([shapes.draw(s, 32) for s in scenes])
    if degraded:
        images = degrade(images, rng)
    counts = {tag: [0, 0, 0] for tag in shapes.TAGS}  # true positives, false positives, false negatives
    for tag, scene, dets in zip(tags, scenes, shapes.detect(images)):
        truth = [(o["shape"], o["color"]) for o in scene]
        found = [(d["class"], d["color"]) for d in dets if d["score"] > threshold]
        for key in set(truth) | set(found):
            hit = min(truth.count(key), found.count(key))
            c = counts[tag]
            c[0], c[1], c[2] = c[0] + hit, c[1] + found.count(key) - hit, c[2] + truth.count(key) - hit
    return {tag: (tp / (tp + fp), tp / (tp + fn)) for tag, (tp, fp, fn) in counts.items()}


# Degraded scenes (blur 0.7 px + noise 8) of four small objects lose one object in 40-80 at GenEval's counting
# threshold of 0.9 (a blurred small triangle or circle fits its template less well): counting's recall measured
# 0.974-0.997 over seeds, every other tag 1.0. Clean scenes: 1.0 everywhere. At the judge's threshold (0.3, every
# tag: shapes.COUNTING_THRESHOLD) every object is found and nothing else, clean or degraded (600 scenes, seeds 2, 3).
FLOOR = {False: 0.98, True: 0.97}


@pytest.mark.parametrize("degraded", [False, True])
def test_detector_precision_recall(degraded):
    """Every task type's scenes, 50 each: precision and recall of the objects found at confidence 0.9."""
    result = precision_recall(300, np.random.default_rng(2), degraded)
    for tag, (precision, recall) in result.items():
        assert precision >= FLOOR[degraded] and recall >= FLOOR[degraded], (tag, precision, recall)
    assert np.mean([r for _, r in result.values()]) >= 0.98 and np.mean([p for p, _ in result.values()]) >= 0.98


@pytest.mark.parametrize("degraded", [False, True])
def test_the_judge_finds_every_rendered_object_and_nothing_else(degraded):
    """At the judge's threshold, which every tag's count now uses: precision and recall 1 on every tag."""
    result = precision_recall(300, np.random.default_rng(2), degraded, threshold=shapes.COUNTING_THRESHOLD)
    assert shapes.COUNTING_THRESHOLD < geneval.COUNTING_THRESHOLD
    assert all(pr == (1.0, 1.0) for pr in result.values()), result


@pytest.mark.slow
@pytest.mark.parametrize("degraded", [False, True])
def test_detector_precision_recall_1200_scenes(degraded):
    for tag, (precision, recall) in precision_recall(1200, np.random.default_rng(3), degraded).items():
        assert precision >= FLOOR[degraded] and recall >= FLOOR[degraded], (tag, precision, recall)


def test_detections_are_kept_by_image_and_equal_a_fresh_detection(monkeypatch):
    """An image detected before is answered from the record (the held-out reward and the diversity measure judge the
    same images); the answer equals detecting it afresh, in any batch, and the record cannot be altered through it."""
    rng = np.random.default_rng(5)
    rows = [r for tag in shapes.TAGS for r in shapes.prompt_rows(tag)][:12]
    images = degrade(np.stack([shapes.draw(shapes.layout(r["metadata"], 32, rng), 32) for r in rows]), rng)
    images = np.concatenate([images, images[:3]])  # repeats within a batch too
    monkeypatch.setattr(shapes.world, "_DETECTED", type(shapes.world._DETECTED)())  # the record lives in world.py
    monkeypatch.setattr(shapes.world, "DETECTIONS_KEPT", 8)
    fresh = [shapes.world._detect(image[None])[0] for image in images]
    calls = []
    real = shapes.world._detect
    monkeypatch.setattr(shapes.world, "_detect", lambda batch: calls.append(len(batch)) or real(batch))
    shapes.detect(images[4:10])
    kept = shapes.detect(images)
    assert calls == [6, 9] and len(shapes.world._DETECTED) == 8  # only the new images detected; the record bounded
    assert shapes.detect(images[-8:]) and calls == [6, 9]  # the 8 most recent: all answered from the record
    for got, want in zip(kept, fresh):
        assert [{k: v for k, v in d.items() if k != "mask"} for d in got] == [
            {k: v for k, v in d.items() if k != "mask"} for d in want]
        assert all(np.array_equal(a["mask"], b["mask"]) for a, b in zip(got, want))
    with pytest.raises(ValueError):
        kept[0][0]["mask"][0, 0] = True
    kept[0][0]["class"] = "hacked"
    assert shapes.detect(images[:1])[0][0]["class"] != "hacked"


# ----------------------------------------------------------------------------- the judge on hand-made scenes

def test_judge_verdicts_for_every_task_type():
    left = shapes.draw([obj("circle", "red", 7.0, 16.0, 12.0), obj("square", "blue", 25.0, 16.0, 12.0)], 32)
    assert verdict("a photo of a circle", left) == 1
    assert verdict("a photo of a triangle", left) == 0
    assert verdict("a photo of a circle and a square", left) == 1
    assert verdict("a photo of a circle and a triangle", left) == 0
    assert verdict("a photo of a red circle", left) == 1
    assert verdict("a photo of a blue circle", left) == 0
    assert verdict("a photo of a circle left of a square", left) == 1
    assert verdict("a photo of a square right of a circle", left) == 1
    assert verdict("a photo of a circle right of a square", left) == 0
    assert verdict("a photo of a circle above a square", left) == 0
    assert verdict("a photo of a red circle and a blue square", left) == 1
    assert verdict("a photo of a blue circle and a red square", left) == 0  # colours swapped: attribution fails
    stacked = shapes.draw([obj("triangle", "white", 16.0, 7.0, 11.0), obj("circle", "black", 16.0, 24.0, 11.0)], 32)
    assert verdict("a photo of a triangle above a circle", stacked) == 1
    assert verdict("a photo of a circle below a triangle", stacked) == 1
    assert verdict("a photo of a triangle below a circle", stacked) == 0
    diagonal = shapes.draw([obj("square", "green", 9.0, 9.0, 10.0), obj("circle", "green", 23.0, 23.0, 10.0)], 32)
    assert verdict("a photo of a square left of a circle", diagonal) == 1  # 45 degrees: left and above both hold
    assert verdict("a photo of a square above a circle", diagonal) == 1
    three = shapes.draw([obj("square", c, x, y, 10.0) for c, x, y in (("red", 7, 7), ("blue", 24, 8), ("white", 15, 24))], 32)
    assert verdict("a photo of three squares", three) == 1
    assert verdict("a photo of two squares", three) == 0  # exclude clause: a third square
    assert verdict("a photo of four squares", three) == 0


# ----------------------------------------------------------------------------- counting against the rendered truth
# A scene holds N clean objects of a class and M deformed ones (stretched, blurred, both, squashed into a bar, or
# small): a person counts N + M, and calls "a photo of K <class>s" right only when K = N + M. The detector scores a
# deformed object of the class from 0.3 to 0.9 (a template fit) or cannot name it (unknown): GenEval's counting
# threshold of 0.9 misses it, and so did this judge before its counting threshold became the detector's.

DEFORMATIONS = {"stretched": dict(aspect=0.7), "blurred": dict(blur=1.2), "stretched and blurred": dict(aspect=0.7,
                blur=1.0), "squashed": dict(aspect=0.45), "small": dict(side=7.0)}


def deformed_scene(shape, clean, deformed, rng):
    """A scene with `clean` objects of `shape` drawn as the renderer draws them and one of DEFORMATIONS applied to
    each of `deformed` more, at the renderer's layout -> (uint8 [32, 32, 3], the deformations used)."""
    n = clean + deformed
    placed = shapes.layout({"include": [{"class": shape, "count": n}]}, 32, rng)
    image = shapes.draw(placed[:clean], 32).astype(np.float64)
    kinds = [list(DEFORMATIONS)[rng.integers(len(DEFORMATIONS))] for _ in range(deformed)]
    for o, kind in zip(placed[clean:], kinds):
        d = DEFORMATIONS[kind]
        side = min(d.get("side", o["size"]), o["size"])
        w, h = (side, side * d.get("aspect", 1.0))[::1 if rng.random() < 0.5 else -1]
        cy = o["cy"] + (h / 6 if shape == "triangle" else 0)  # a triangle's template is centred on its centroid
        alpha = shapes.world._blur(shapes.template(shape, o["cx"], cy, w, h, 32), d.get("blur", 0.0))[..., None]
        image = image * (1 - alpha) + np.array(shapes.COLORS[o["color"]], np.float64) * alpha
    return np.round(image).astype(np.uint8), kinds


def test_counting_agrees_with_the_rendered_truth():
    """300 scenes of N clean and M deformed objects (N + M from 1 to 4, M from 0 to 2), each asked "a photo of K
    <class>s" for K = 2, 3, 4. The judge never calls a scene right whose count a person would not give as K; it calls
    every scene right whose count is K when its deformed objects stay recognisable (stretched, blurred), and wrong
    when one is squashed into a bar or shrunk to a speck (is that still one of them? it will not pay for it). GenEval's
    own rule (0.9) calls a scene with more objects than asked right in about a third of them (measured 0.37)."""
    rng = np.random.default_rng(11)
    rows = {(r["metadata"]["include"][0]["class"], r["metadata"]["include"][0]["count"]): r["metadata"]
            for r in shapes.prompt_rows("counting")}
    recognisable = {"stretched", "blurred", "stretched and blurred"}
    accepted_wrongly, missed, doubtful, too_many, official_too_many = [], [], 0, 0, 0
    for i in range(300):
        shape, deformed = shapes.SHAPES[i % 3], int(rng.integers(3))
        clean = int(rng.integers(max(1 - deformed, 0), 5 - deformed))
        image, kinds = deformed_scene(shape, clean, deformed, rng)
        detections = shapes.detect(image)[0]
        for k in (2, 3, 4):
            got = geneval.geneval_judge(rows[shape, k], detections, counting_threshold=shapes.COUNTING_THRESHOLD)
            if got["correct"] and clean + deformed != k:
                accepted_wrongly.append((shape, clean, kinds, k))
            if clean + deformed == k and set(kinds) <= recognisable and not got["correct"]:
                missed.append((shape, clean, kinds, k, got["reason"]))
            doubtful += clean + deformed == k and not set(kinds) <= recognisable and not got["correct"]
            if clean + deformed > k:
                too_many += 1
                official_too_many += got["official"] == 1.0
    assert not accepted_wrongly and not missed, (accepted_wrongly[:3], missed[:3])
    assert doubtful >= 10  # the scenes where a deformed object leaves the count in doubt exist, and are refused
    assert too_many >= 100 and 0.1 < official_too_many / too_many < 0.6, (official_too_many, too_many)


def test_partial_score_sees_the_extra_objects():
    """The trained score (the reward server's partial credit) counts on the judge's kept detections: two clean
    squares, a stretched one and a bar (an unknown component, counted where the count stands in for the exclude
    clause) for "two squares" score 1 - |2 - 4| / 2 = 0; at GenEval's 0.9 the stretched square is not seen (0.5)."""
    rng = np.random.default_rng(3)
    row = next(r["metadata"] for r in shapes.prompt_rows("counting") if r["prompt"] == "a photo of two squares")
    placed = shapes.layout({"include": [{"class": "square", "count": 4}]}, 32, rng)
    image = shapes.draw(placed[:2], 32).astype(np.float64)
    for o, (w, h) in zip(placed[2:], ((0.65, 1.0), (1.0, 0.4))):
        alpha = shapes.template("square", o["cx"], o["cy"], o["size"] * w, o["size"] * h, 32)[..., None]
        image = image * (1 - alpha) + np.array(shapes.COLORS["red"], np.float64) * alpha
    detections = shapes.detect(np.round(image).astype(np.uint8))[0]
    assert sorted(d["class"] for d in detections) == ["square", "square", "square", "unknown"]
    assert 0.3 < min(d["score"] for d in detections if d["class"] == "square") < 0.9
    honest = geneval.geneval_judge(row, detections, counting_threshold=shapes.COUNTING_THRESHOLD)
    assert (honest["correct"], honest["partial"], honest["official"]) == (0.0, 0.0, 1.0)
    assert geneval.geneval_judge(row, detections)["partial"] == 0.5  # at GenEval's 0.9 only the bar is seen


def test_generated_images_with_extra_objects_are_judged_wrong():
    """Samples of the default run trained on GenEval's own counting rule (seed 0, step 100, EMA; ODE, 10 steps, seed
    7), each labelled by a person's count (tests/data/judge/labels.json): four triangles for "three triangles", three
    squares for "two squares", and four clean answers. GenEval's rule (0.9) calls every one correct; the judge agrees
    with the person on all 13. docs/judge.md shows them, and three more where the person could go either way."""
    folder = os.path.join(ROOT, "tests", "data", "judge")
    with open(os.path.join(folder, "labels.json")) as f:
        labels = json.load(f)
    rows = {r["prompt"]: r["metadata"] for r in shapes.prompt_rows("counting")}
    images = np.stack([np.asarray(Image.open(os.path.join(folder, label["file"])).convert("RGB")) for label in labels])
    for label, detections in zip(labels, shapes.detect(images)):
        got = geneval.geneval_judge(rows[label["prompt"]], detections, counting_threshold=shapes.COUNTING_THRESHOLD)
        assert (got["correct"], got["official"]) == (label["person_verdict"], 1.0), (label, got["counts"])
    assert sum(label["person_verdict"] == 0 for label in labels) == 9


# ----------------------------------------------------------------------------- the model

@pytest.fixture(scope="module")
def pipe(one_thread):
    return models.load_pipeline("shapes")


def test_shapes_model_loads_deterministically_offline(pipe):
    import time

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    start = time.perf_counter()
    other = models.load_pipeline("shapes")
    seconds = time.perf_counter() - start
    a = {f"{n}.{k}": v for n in ("transformer", "text_encoder", "text_encoder_2") for k, v in getattr(pipe, n).state_dict().items()}
    b = {f"{n}.{k}": v for n in ("transformer", "text_encoder", "text_encoder_2") for k, v in getattr(other, n).state_dict().items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert seconds < 10, seconds  # about 0.3 s on an idle machine; generous for a loaded one
    assert os.path.getsize(os.path.join(ROOT, shapes.WEIGHTS)) < 10e6
    assert models.latent_shape(pipe, 32) == (3, 32, 32) and pipe.vae_scale_factor == 1
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    assert torch.equal(models.decode(pipe, x), ((x / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1))
    with pytest.raises(FileNotFoundError, match="pretrain_shapes"):
        models.load_pipeline("shapes", "no/such/weights.safetensors")


def test_velocity_is_a_step_of_the_sd3_pipeline(pipe):
    prompts = ["a photo of a red circle and a blue triangle", "a photo of three squares"]
    x = models.initial_noise(pipe, 2, 32, generator=torch.Generator().manual_seed(0))
    call = dict(prompt=prompts, num_inference_steps=1, guidance_scale=2.5, height=32, width=32, latents=x.clone(),
                max_sequence_length=0)
    expected = pipe(**call, output_type="latent").images  # one Euler step from sigma 1 to 0
    embeds = models.encode_prompts(pipe, prompts, guidance_scale=2.5)
    with torch.no_grad():
        ours = x - models.velocity(pipe, x, 1.0, embeds, guidance_scale=2.5)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    images = torch.from_numpy(pipe(**call, output_type="np").images * 255)
    assert (models.decode(pipe, ours).float() - images).abs().max() <= 1


def test_pretraining_encodes_as_the_adapter(pipe):
    prompts = ["a photo of a circle below a triangle", ""]
    embeds, _, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, prompt_3=None, device="cpu",
                                              do_classifier_free_guidance=False, max_sequence_length=0)
    reference = models.encode_prompts(pipe, prompts)
    assert embeds.shape == (2, shapes.TOKENS, 128)
    torch.testing.assert_close(embeds, reference["prompt_embeds"])
    torch.testing.assert_close(pooled, reference["pooled"])


def test_trained_state_is_what_trains():
    pipe = families.shapes.build()
    params = families.shapes.trainable_parameters(pipe)
    state = families.shapes.trained_state(pipe)
    assert sum(p.numel() for p in params) == sum(v.numel() for v in state.values())  # every shipped tensor trains
    frozen = [p for n in ("text_encoder", "text_encoder_2") for k, p in getattr(pipe, n).named_parameters()
              if not p.requires_grad]
    assert [p.shape for p in frozen] == [(49408, 64), (49408, 64)]  # only the token tables stay seeded


def test_pretraining_is_reproducible_and_loads(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_shapes",
                                                  os.path.join(ROOT, "scripts", "pretrain_shapes.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    paths = [str(tmp_path / f"w{i}.safetensors") for i in range(2)]
    for path in paths:
        script.main(["--steps", "3", "--batch-size", "4", "--threads", "1", "--lr", "1e-2", "--warmup", "1",
                     "--log-every", "3", "--out", path])
    assert open(paths[0], "rb").read() == open(paths[1], "rb").read()  # a pure function of the seed and threads
    trained = models.load_pipeline("shapes", paths[0])
    initial = families.shapes.build()
    a, b = families.shapes.trained_state(trained), families.shapes.trained_state(initial)
    unchanged = [k for k in a if torch.equal(a[k], b[k].half().float())]
    # three Adam steps moved every tensor but the text queries of the last block, whose text outputs SD3 drops
    assert unchanged == [f"transformer.transformer_blocks.5.attn.{k}" for k in ("add_q_proj.weight", "add_q_proj.bias",
                                                                                 "norm_added_q.weight")]
