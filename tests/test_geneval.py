"""geneval.py: the judge against verdicts derived by hand from GenEval's rules, the detector's
post-processing against hand-built logits, tiny random Mask2Former / open_clip plumbing, and the
reward end to end with a stubbed detector (also through train.py's held-out evaluation)."""

import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import data
import geneval
import rewards
from geneval import geneval_judge, relative_position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(ROOT, "prompts")


def det(name, score=0.95, box=(0, 0, 10, 10), color=None):
    return {"class": name, "score": score, "box": list(box), "color": color}


SINGLE = {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
TWO = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]}
COUNT2 = {"tag": "counting", "include": [{"class": "bus", "count": 2}], "exclude": [{"class": "bus", "count": 3}]}
RED_CAR = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
ATTR = {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"},
                                         {"class": "bus", "count": 1, "color": "blue"}]}
# "a photo of a dog right of a cat": the target (cat) is clause 0, the dog clause 1 (create_prompts.py L110-116)
DOG_RIGHT_OF_CAT = {"tag": "position", "include": [{"class": "cat", "count": 1},
                                                   {"class": "dog", "count": 1, "position": ["right of", 0]}]}
CAT = det("cat", box=(0, 0, 10, 10))  # centre (5, 5), 10 x 10


def verdict(metadata, detections):
    v = geneval_judge(metadata, detections)
    return v["correct"], v["strict"], v["partial"], v["score_corrected"]


# ----------------------------------------------------------------------------- relative_position

def test_relative_position_by_hand():
    # B = [0, 0, 10, 10]: centre (5, 5). margin = 0.1 x (10 + 10) = 2 on each axis for 10 x 10 boxes.
    b = [0, 0, 10, 10]
    # A 20 px to the right: offset (20, 0), revised (18, 0), |offset| 20 -> dx 0.9 > 0.5
    assert relative_position([20, 0, 30, 10], b) == {"right of"}
    assert relative_position(b, [20, 0, 30, 10]) == {"left of"}
    # image y grows downward: A lower in the image is "below"
    assert relative_position([0, 20, 10, 30], b) == {"below"}
    assert relative_position(b, [0, 20, 10, 30]) == {"above"}
    # offset (20, 20): revised (18, 18) / 28.28 = (0.636, 0.636): both relations
    assert relative_position([20, 20, 30, 30], b) == {"right of", "below"}
    # offset (20, 6): revised (18, 4) / 20.88 = (0.862, 0.192): only right of
    assert relative_position([20, 6, 30, 16], b) == {"right of"}
    # exactly at the threshold: offset (4, 0), revised 4 - 2 = 2, dx = 2 / 4 = 0.5, and the rule is dx > 0.5
    assert relative_position([4, 0, 14, 10], b) == set()
    assert relative_position([4.5, 0, 14.5, 10], b) == {"right of"}  # (4.5 - 2) / 4.5 = 0.56
    assert relative_position([3.5, 0, 13.5, 10], b) == set()  # (3.5 - 2) / 3.5 = 0.43
    # inside the size margin: offset (1.5, 1.5) < 2 on both axes -> revised (0, 0) -> no relation at all
    assert relative_position([1.5, 1.5, 11.5, 11.5], b) == set()
    # the margin grows with the sizes: 40 px wide boxes, offset 12 < 0.1 x 80 + 4 ... revised 4 / 12 = 0.33
    assert relative_position([12, 0, 52, 10], [0, 0, 40, 10]) == set()


# ----------------------------------------------------------------------------- thresholds and the filter

def test_score_thresholds_are_strict():
    # a non-counting tag keeps score > 0.3; exactly 0.3 is dropped
    assert verdict(SINGLE, [det("bench", 0.3)]) == (0, 0, 0.0, 0.0)
    assert verdict(SINGLE, [det("bench", 0.30001)]) == (1, 1, 1.0, 1.0)
    assert verdict(SINGLE, [det("bench", 0.9)]) == (1, 1, 1.0, 1.0)  # 0.9 only matters for counting
    # counting keeps score > 0.9: two buses at 0.95 and 0.9 are one bus
    v = geneval_judge(COUNT2, [det("bus", 0.95), det("bus", 0.9)])
    assert (v["correct"], v["strict"], v["partial"], v["score_corrected"]) == (0, 0, 0.5, 0.5)
    assert v["reason"] == "expected bus>=2, found 1" and v["counts"] == {"bus": 1}
    assert verdict(COUNT2, [det("bus", 0.95), det("bus", 0.91)]) == (1, 1, 1.0, 1.0)


def test_at_most_16_per_class_best_first():
    cups = [det("cup", 0.31 + 0.03 * i) for i in range(20)]  # 20 above 0.3
    kept = geneval.kept_detections(cups, "single_object")
    assert [d["score"] for d in kept["cup"]] == sorted((d["score"] for d in cups), reverse=True)[:16]
    # one cup asked, 16 kept: officially correct (the best one exists); partial 1 - |1 - 16| / 1 = -14
    assert verdict({"tag": "single_object", "include": [{"class": "cup", "count": 1}]}, cups) == (1, 0, -14.0, 1.0)


# ----------------------------------------------------------------------------- each tag, each rule

def test_single_object_and_the_partial_score_quirks():
    assert verdict(SINGLE, [det("bench")]) == (1, 1, 1.0, 1.0)
    # three benches: officially correct (>= 1), strictly wrong (!= 1), partial 1 - |1 - 3| / 1 = -1.0
    assert verdict(SINGLE, [det("bench")] * 3) == (1, 0, -1.0, 1.0)
    # missing: count term 1 - 1 / 1 = 0
    assert verdict(SINGLE, [det("cat")]) == (0, 0, 0.0, 0.0)


def test_two_object_one_missing():
    assert verdict(TWO, [det("cat"), det("dog")]) == (1, 1, 1.0, 1.0)
    v = geneval_judge(TWO, [det("cat")])
    # terms: cat 1, dog 1 - |1 - 0| / 1 = 0 -> 0.5 (partial and corrected agree here)
    assert (v["correct"], v["strict"], v["partial"], v["score_corrected"]) == (0, 0, 0.5, 0.5)
    assert v["reason"] == "expected dog>=1, found 0"


@pytest.mark.parametrize("n, expected", [
    (0, (0, 0, 0.0, 0.0)),         # count terms 0 and 0; exclude not hit
    (1, (0, 0, 0.5, 0.5)),         # partial 1 - 1/2; corrected min(1, 2) / 2
    (2, (1, 1, 1.0, 1.0)),
    (3, (0, 0, 0.5, 2 / 3)),       # exclude bus < 3 fails; partial 1 - 1/2; corrected 1 x (3 - 1) / 3
    (5, (0, 0, -0.5, 0.4)),        # partial 1 - 3/2; corrected 1 x 2 / 5
])
def test_counting_is_exact(n, expected):
    assert verdict(COUNT2, [det("bus")] * n) == pytest.approx(expected)


def test_exclude_clause_counts_officially_but_not_in_the_partial_score():
    no_dog = {"tag": "single_object", "include": [{"class": "cat", "count": 1}],
              "exclude": [{"class": "dog", "count": 1}]}
    v = geneval_judge(no_dog, [det("cat"), det("dog")])
    # official: dog present (1 >= 1) fails; partial never reads exclude (server L215); corrected x (1 - 1) / 1 = 0
    assert (v["correct"], v["strict"], v["partial"], v["score_corrected"]) == (0, 1, 1.0, 0.0)
    assert v["reason"] == "expected dog<1, found 1"


def test_colour_rules():
    assert verdict(RED_CAR, [det("car", color="red")]) == (1, 1, 1.0, 1.0)
    # wrong colour: terms count 1, colour 1 - |1 - 0| / 1 = 0 -> 0.5
    v = geneval_judge(RED_CAR, [det("car", color="blue")])
    assert (v["correct"], v["strict"], v["partial"], v["score_corrected"]) == (0, 0, 0.5, 0.5)
    assert v["reason"].startswith("expected red car>=1, found 0 red")
    # missing: count term 0 plus the 0.0 the server appends for a clause with a colour (server L223-224)
    assert verdict(RED_CAR, []) == (0, 0, 0.0, 0.0)
    # the colour is read only from the best `count` objects: a blue third car does not matter officially
    two_red = {"tag": "colors", "include": [{"class": "car", "count": 2, "color": "red"}]}
    cars = [det("car", 0.99, color="red"), det("car", 0.98, color="red"), det("car", 0.5, color="blue")]
    # partial: 3 != 2 -> count term 1 - 1/2 = 0.5, plus 0.0 for the colour clause -> 0.25
    assert verdict(two_red, cars) == (1, 0, 0.25, 1.0)
    # one of two objects the wrong colour: official needs both; partial 1, 1 - |2 - 1| / 2 -> 0.75
    assert verdict(two_red, cars[:1] + cars[2:]) == (0, 0, 0.75, 0.75)
    with pytest.raises(ValueError, match="no 'color'"):
        geneval_judge(RED_CAR, [det("car")])


def test_colour_attribution_one_wrong():
    assert verdict(ATTR, [det("car", color="red"), det("bus", color="blue")]) == (1, 1, 1.0, 1.0)
    # terms 1, 1 (car) and 1, 0 (bus) -> 0.75 for both scores
    assert verdict(ATTR, [det("car", color="red"), det("bus", color="red")]) == (0, 0, 0.75, 0.75)


def test_position_rules():
    right = det("dog", box=(20, 0, 30, 10))
    left = det("dog", box=(-20, 0, -10, 10))
    assert verdict(DOG_RIGHT_OF_CAT, [CAT, right]) == (1, 1, 1.0, 1.0)  # terms 1 | 1, 1
    # wrong relation: partial terms 1 | 1, 0, and the 1.0 appended after the loop anyway -> 0.75 (server L258);
    # corrected terms 1 | 1, 0 -> 2/3
    v = geneval_judge(DOG_RIGHT_OF_CAT, [CAT, left])
    assert (v["correct"], v["strict"], v["partial"]) == (0, 0, 0.75)
    assert v["score_corrected"] == pytest.approx(2 / 3)
    assert v["reason"] == "expected dog right of target, found left of"
    # target clause failed (no cat): partial terms 0 | 1, 0 (no target) -> 1/3; officially "no target"
    v = geneval_judge(DOG_RIGHT_OF_CAT, [right])
    assert (v["correct"], v["partial"]) == (0, pytest.approx(1 / 3)) and v["score_corrected"] == pytest.approx(1 / 3)
    assert v["reason"] == "expected cat>=1, found 0"
    # placed object missing: partial 1 | 0, 0.0 for the position clause -> 1/3
    assert verdict(DOG_RIGHT_OF_CAT, [CAT]) == pytest.approx((0, 0, 1 / 3, 1 / 3))
    # exactly at the direction threshold (dx = 0.5, see test_relative_position_by_hand) is not "right of"
    assert verdict(DOG_RIGHT_OF_CAT, [CAT, det("dog", box=(4, 0, 14, 10))])[0] == 0
    # two dogs, the best one right of the cat: officially correct; partial counts both -> 1 | 0, 0.0 -> 1/3
    dogs = [det("dog", 0.99, box=(20, 0, 30, 10)), det("dog", 0.5, box=(-20, 0, -10, 10))]
    assert verdict(DOG_RIGHT_OF_CAT, [CAT] + dogs) == pytest.approx((1, 0, 1 / 3, 1.0))


def test_score_selects_the_entry_and_bad_input_is_refused():
    dets = [det("bench")] * 3
    assert [geneval_judge(SINGLE, dets, score=s)["score"] for s in geneval.SCORES] == [-1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="score must be one of"):
        geneval_judge(SINGLE, dets, score="official")
    for bad in [{}, {"tag": "single_object"}, {"tag": "nope", "include": SINGLE["include"]},
                {"tag": "position", "include": [{"class": "cat", "count": 1, "position": ["left of", 0]}]},
                {"tag": "counting", "include": [{"class": "bus", "count": 0}]}]:
        with pytest.raises(ValueError, match="prompts/geneval_test.jsonl") as err:
            geneval_judge(bad, dets)
        assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- properties over the shipped prompts

def _rows(name):
    with open(os.path.join(PROMPTS, name)) as f:
        return [json.loads(line)["metadata"] for line in f]


ROWS = _rows("geneval_test.jsonl")


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(ROWS) - 1),
       st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.2, 0.3, 0.5, 0.9, 0.95]), st.integers(0, 40),
                          st.integers(0, 40), st.sampled_from(geneval.COLORS[:3])), max_size=6))
def test_scores_agree_with_the_official_verdict(row, raw):
    metadata = ROWS[row]
    names = [c["class"] for c in metadata["include"]] + ["person"]
    dets = [det(names[k % len(names)], s, (x, y, x + 10, y + 10), c) for k, s, x, y, c in raw]
    v = geneval_judge(metadata, dets)
    assert (v["score_corrected"] == 1.0) == (v["correct"] == 1.0)  # the corrected score is 1 exactly when correct
    assert 0.0 <= v["score_corrected"] <= 1.0 and v["partial"] <= 1.0
    assert v["strict"] <= v["correct"]  # on GenEval's prompts, exact counts imply the official rules
    assert (v["reason"] == "") == (v["correct"] == 1.0)


# ----------------------------------------------------------------------------- aggregation

def test_summary_is_the_mean_of_tag_means():
    tags = ["single_object"] * 4 + ["counting"] * 2 + ["position", "position"]
    correct = [1, 1, 0, 1, 0, 0, 1, float("nan")]  # NaN: a sample that was not scored
    out = geneval.summary(tags, correct)
    assert out["single_object"] == 0.75 and out["counting"] == 0.0 and out["position"] == 1.0
    assert out["overall"] == pytest.approx((0.75 + 0.0 + 1.0) / 3)  # not 4 / 7
    assert out["mean_over_images"] == pytest.approx(4 / 7)
    assert out["missing"] == ["two_object", "colors", "color_attr"]
    with pytest.raises(ValueError, match="unknown tags"):
        geneval.summary(["dogs"], [1])


# ----------------------------------------------------------------------------- prompt files

def _digits(row):
    """The grid point of a GenEval object (inverse of geneval._prompt; person = 0 is skipped in colour tags)."""
    index = geneval.OBJECT_NAMES.index
    inc = row["include"]
    if row["tag"] == "single_object":
        return [index(inc[0]["class"])]
    if row["tag"] == "two_object":
        a, b = index(inc[0]["class"]), index(inc[1]["class"])
        return [a, b - (b > a)]
    if row["tag"] == "counting":
        return [index(inc[0]["class"]), inc[0]["count"] - 2]
    if row["tag"] == "colors":
        return [index(inc[0]["class"]) - 1, geneval.COLORS.index(inc[0]["color"])]
    if row["tag"] == "position":
        a, b = index(inc[1]["class"]), index(inc[0]["class"])
        return [a, b - (b > a), geneval.RELATIONS.index(inc[1]["position"][0])]
    a, b = index(inc[0]["class"]), index(inc[1]["class"])
    ca, cb = geneval.COLORS.index(inc[0]["color"]), geneval.COLORS.index(inc[1]["color"])
    return [a - 1, b - 1 - (b > a), ca, cb - (cb > ca)]


def test_templates_rewrite_every_official_prompt():
    # create_prompts.py's templates, as geneval._prompt writes them, give back each of the 553 official objects exactly
    assert len(ROWS) == 553
    for row in ROWS:
        assert geneval._prompt(row["tag"], _digits(row)) == row


def test_shipped_prompt_files():
    for name in ("geneval_test.jsonl", "geneval_train.jsonl"):
        prompts, metadata = data.load_prompts(os.path.join(PROMPTS, name), input_key="prompt")
        for p, m in zip(prompts, metadata):
            geneval.check_metadata(m)
            assert m["prompt"] == p
    test = {p.lower() for p in data.load_prompts(os.path.join(PROMPTS, "geneval_test.jsonl"), input_key="prompt")[0]}
    train = _rows("geneval_train.jsonl")
    assert not test & {m["prompt"].lower() for m in train}
    assert len(train) == len({m["prompt"] for m in train}) == 3256
    # the shipped train split is what `python geneval.py --make-prompts` writes
    assert geneval.make_prompts(800, seed=0, exclude=test) == train


SHAPE_ROW = {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "red"}]}
BAD_ROWS = {  # metadata -> a word the one-line error must name
    "no tag": ({"include": [{"class": "circle", "count": 1}]}, "'tag'"),
    "count true": ({"tag": "counting", "include": [{"class": "circle", "count": True}]}, "'count'"),
    "count 2.0": ({"tag": "counting", "include": [{"class": "circle", "count": 2.0}]}, "'count'"),
    "count 0": ({"tag": "counting", "include": [{"class": "circle", "count": 0}]}, "'count'"),
    "exclude count true": ({"tag": "counting", "include": [{"class": "circle", "count": 2}],
                            "exclude": [{"class": "circle", "count": True}]}, "'count'"),
    "relation": ({"tag": "position", "include": [{"class": "circle", "count": 1},
                                                 {"class": "square", "count": 1, "position": ["beside", 0]}]},
                 "'position'"),
    "target true": ({"tag": "position", "include": [{"class": "circle", "count": 1},
                                                    {"class": "square", "count": 1, "position": ["above", True]}]},
                    "'position'"),
    "later target": ({"tag": "position", "include": [{"class": "circle", "count": 1, "position": ["above", 1]},
                                                     {"class": "square", "count": 1}]}, "'position'"),
    "dragon": ({"tag": "single_object", "include": [{"class": "dragon", "count": 1}]}, "'dragon'"),
    "mauve": ({"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "mauve"}]}, "'mauve'"),
    "orange": ({"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "orange"}]}, "'orange'"),
    "colour": ({"tag": "colors", "include": [{"class": "circle", "count": 1, "colour": "red"}]}, "'colour'"),
    "excluded dragon": ({"tag": "counting", "include": [{"class": "circle", "count": 2}],
                         "exclude": [{"class": "dragon", "count": 3}]}, "'dragon'"),
}


@pytest.mark.parametrize("name", sorted(BAD_ROWS))
def test_prompt_rows_are_checked_against_the_detector_when_they_load(tmp_path, name):
    """Every row, when the file loads: a row the judge cannot read, or a class or colour the detector never reports
    (which would score 0, or 1 in an exclude clause, whatever the image shows), is one line naming the file, the
    line and the fix."""
    bad, word = BAD_ROWS[name]
    path = tmp_path / "shapes_prompts.jsonl"
    rows = [SHAPE_ROW, SHAPE_ROW, bad, SHAPE_ROW]
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}", "metadata": m}) + "\n" for i, m in enumerate(rows)))
    with pytest.raises(ValueError) as err:
        data.load_prompts(path, input_key="prompt", check=rewards.geneval_rows_check("shapes"))
    message = str(err.value)
    assert message.startswith(f"{path}, line 3 ('prompt 2'): ") and word in message, message
    assert "\n" not in message and ("fix" in message or "rows must look like" in message), message
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}", "metadata": SHAPE_ROW}) + "\n" for i in range(3)))
    assert data.load_prompts(path, input_key="prompt", check=rewards.geneval_rows_check("shapes"))[1] == [SHAPE_ROW] * 3


def test_each_detector_has_its_own_classes_and_colours():
    import shapes

    assert rewards.GENEVAL_VOCABULARY["shapes"] == (shapes.SHAPES, tuple(shapes.COLORS))
    assert rewards.GENEVAL_VOCABULARY["mask2former"] == (geneval.OBJECT_NAMES, geneval.COLORS)
    geneval.check_metadata(RED_CAR, vocabulary=rewards.GENEVAL_VOCABULARY["mask2former"], detector="mask2former")
    with pytest.raises(ValueError, match="'car'.*the shapes detector knows circle, square, triangle"):
        geneval.check_metadata(RED_CAR, vocabulary=rewards.GENEVAL_VOCABULARY["shapes"], detector="shapes")
    with pytest.raises(ValueError, match="'circle'.*--geneval-detector"):
        geneval.check_metadata(SHAPE_ROW, vocabulary=rewards.GENEVAL_VOCABULARY["mask2former"], detector="mask2former")
    geneval.check_metadata(SHAPE_ROW)  # without a detector: the form only
    for name, detector in [("geneval_test.jsonl", "mask2former"), ("geneval_train.jsonl", "mask2former"),
                           ("shapes_test.jsonl", "shapes"), ("shapes_train.jsonl", "shapes")]:
        data.load_prompts(os.path.join(PROMPTS, name), input_key="prompt", check=rewards.geneval_rows_check(detector))


def test_the_authors_flat_prompt_files_load_as_they_are(tmp_path):
    """Flow-GRPO's, DiffusionNFT's and AWM's dataset/geneval/{train,test}_metadata.jsonl hold one flat object per
    line, the clauses beside the prompt: with the recipes' --input-key prompt they load without --metadata-key."""
    rows = [{"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}],
             "prompt": "a photo of three cups"},
            {"tag": "color_attr", "include": [{"class": "bench", "count": 1, "color": "green"},
                                              {"class": "kite", "count": 1, "color": "white"}],
             "prompt": "a photo of a green bench and a white kite"},
            {"tag": "position", "include": [{"class": "cat", "count": 1},
                                            {"class": "bowl", "count": 1, "position": ["below", 0]}],
             "prompt": "a photo of a bowl below a cat"}]
    path = tmp_path / "test_metadata.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))  # no newline after the last row, as theirs
    prompts, metadata = data.load_prompts(path, input_key="prompt", check=rewards.geneval_rows_check("mask2former"))
    assert prompts == [r["prompt"] for r in rows] and metadata == rows


# ----------------------------------------------------------------------------- Mask2Former post-processing

def test_preprocess_sizes_and_padding():
    # mmcv.imrescale to (1333, 800): factor min(1333 / long, 800 / short), sides int(x * factor + 0.5)
    assert geneval.resized_size(512, 512) == (800, 800)
    assert geneval.resized_size(480, 640) == (800, 1067)  # factor 800 / 480; 640 x 1.667 + 0.5 = 1067.2
    assert geneval.resized_size(100, 1000) == (133, 1333)  # factor 1333 / 1000 (the long side binds)
    image = torch.full((1, 48, 64, 3), 124, dtype=torch.uint8)
    pixels, size = geneval.preprocess(image, short_edge=60, long_edge=100)
    assert size == (60, 80) and tuple(pixels.shape) == (1, 3, 64, 96)  # padded to multiples of 32
    expected = (124 - torch.tensor([123.675, 116.28, 103.53])) / torch.tensor([58.395, 57.12, 57.375])
    assert torch.allclose(pixels[0, :, :60, :80], expected.view(3, 1, 1).expand(3, 60, 80), atol=1e-6)
    assert pixels[0, :, 60:].abs().max() == 0 and pixels[0, :, :, 80:].abs().max() == 0  # zeros after normalising


def test_postprocess_hand_built_logits():
    bus, cat, dog = (geneval.OBJECT_NAMES.index(n) for n in ("bus", "cat", "dog"))
    logits = torch.full((3, 81), float("-inf"))
    logits[0, bus], logits[0, 80] = math.log(3), 0.0  # p(bus) = 3 / (3 + 1) = 0.75
    logits[1, cat] = logits[1, dog] = logits[1, 80] = 0.0  # p(cat) = p(dog) = 1/3
    logits[2, 80] = 0.0  # only "no object"
    masks = torch.empty(3, 4, 4)
    masks[0] = torch.tensor([1.0, 1.0, -1.0, -1.0])  # every row: positive left half
    masks[1] = -1.0  # empty mask
    masks[2] = 1.0
    # Columns by hand (bilinear, align_corners=False, source x = (j + 0.5) / scale - 0.5, clamped at 0):
    #   4 -> 8 (padded input): 1, 1, 1, 0.5, -0.5, -1, -1, -1
    #   crop to the resized width 6: 1, 1, 1, 0.5, -0.5, -1
    #   6 -> 3 (original): x = 0.5, 2.5, 4.5 -> 1, (1 + 0.5) / 2 = 0.75, (-0.5 - 1) / 2 = -0.75 -> mask columns T, T, F
    # (without the crop, 8 -> 3 samples x = 0.83, 3.5, 6.17 -> 1, 0, -1 and the mask would be T, F, F)
    out = geneval.mask2former_postprocess(logits, masks, padded_size=(8, 8), resized_size=(8, 6), original_size=(4, 3),
                                          min_score=0.3)
    out = {d["class"]: d for d in out}
    assert set(out) == {"bus", "cat", "dog"}
    mask_score = (torch.sigmoid(torch.tensor(1.0)) + torch.sigmoid(torch.tensor(0.75))).item() / 2
    assert out["bus"]["score"] == pytest.approx(0.75 * mask_score, rel=1e-6)
    assert out["bus"]["box"] == [0, 0, 2, 4]  # [x_min, y_min, x_max + 1, y_max + 1]
    assert out["bus"]["mask"].tolist() == [[True, True, False]] * 4
    for name in ("cat", "dog"):  # empty mask: mask score 0 / (0 + 1e-6), box of zeros
        assert out[name]["score"] == 0.0 and out[name]["box"] == [0, 0, 0, 0] and not out[name]["mask"].any()
    # without min_score all top-100 (query, class) pairs come back, as mmdetection returns them
    everything = geneval.mask2former_postprocess(logits, masks, padded_size=(8, 8), resized_size=(8, 6),
                                                 original_size=(4, 3))
    assert len(everything) == 100 and sum(d["score"] > 0 for d in everything) == 1
    with pytest.raises(ValueError, match="80 COCO"):
        geneval.mask2former_postprocess(logits[:, :11], masks, padded_size=(8, 8), resized_size=(8, 6),
                                        original_size=(4, 3))


def test_mask_boxes_against_numpy():
    rng = np.random.default_rng(0)
    masks = rng.random((5, 7, 9)) > 0.8
    masks[4] = False
    boxes = geneval.mask_boxes(torch.from_numpy(masks))
    for m, box in zip(masks, boxes.tolist()):
        ys, xs = np.nonzero(m)
        assert box == ([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] if len(xs) else [0, 0, 0, 0])


@pytest.fixture(scope="module")
def tiny_mask2former(tmp_path_factory):
    """A random Mask2Former (tiny Swin) with 80 labels, biased so that 'bus' wins most queries."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    torch.manual_seed(0)
    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=backbone, num_labels=80, num_queries=10, hidden_dim=32,
                               mask_feature_size=32, feature_size=32, encoder_layers=1, decoder_layers=2,
                               num_attention_heads=2, dim_feedforward=32, encoder_feedforward_dim=32)
    model = Mask2FormerForUniversalSegmentation(config)
    with torch.no_grad():
        model.class_predictor.bias[geneval.OBJECT_NAMES.index("bus")] = 8.0
    path = str(tmp_path_factory.mktemp("mask2former"))
    model.save_pretrained(path)
    return path


def test_tiny_mask2former_detector(tiny_mask2former):
    images = np.random.default_rng(0).integers(0, 256, (2, 48, 40, 3), dtype=np.uint8)
    kw = dict(short_edge=64, long_edge=96)
    detect = geneval.mask2former_detector(tiny_mask2former, "cpu", **kw)
    out = detect(images)
    assert len(out) == 2 and any(out)
    for dets in out:
        for d in dets:
            assert d["class"] == "bus" and d["mask"].shape == (48, 40) and d["mask"].dtype == bool
            ys, xs = np.nonzero(d["mask"])
            assert d["box"] == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
            assert 0.3 < d["score"] <= 1.0  # pairs at or below the threshold's class probability are skipped
    # the skip changes nothing GenEval keeps: all 100 pairs, filtered afterwards, give the same detections
    full = geneval.mask2former_detector(tiny_mask2former, "cpu", min_score=None, **kw)(images)
    for dets, all_dets in zip(out, full):
        kept = [d for d in all_dets if d["score"] > 0.3]
        assert [(d["class"], d["box"]) for d in dets if d["score"] > 0.3] == [(d["class"], d["box"]) for d in kept]
        assert [d["score"] for d in dets if d["score"] > 0.3] == pytest.approx([d["score"] for d in kept])
    alone = detect(images[1:])[0]  # batching does not change an image's detections
    assert [(d["box"], round(d["score"], 5)) for d in alone] == [(d["box"], round(d["score"], 5)) for d in out[1]]


def test_detector_load_errors(tiny_mask2former, tmp_path):
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation

    for path in (str(tmp_path / "nowhere"), geneval.DEFAULT_DETECTOR):  # a missing folder; the hub id, offline
        with pytest.raises(RuntimeError, match="--geneval-detector-path") as err:
            geneval.mask2former_detector(path, "cpu")
        assert "\n" not in str(err.value)
    config = Mask2FormerConfig.from_pretrained(tiny_mask2former)
    config.id2label, config.label2id = {i: str(i) for i in range(3)}, {str(i): i for i in range(3)}
    config.num_labels = 3
    Mask2FormerForUniversalSegmentation(config).save_pretrained(str(tmp_path / "three"))
    with pytest.raises(ValueError, match="80 COCO thing classes"):
        geneval.mask2former_detector(str(tmp_path / "three"), "cpu")


# ----------------------------------------------------------------------------- colours

def test_colour_crop_pixels():
    image = np.arange(20 * 30 * 3, dtype=np.uint32).reshape(20, 30, 3).astype(np.uint8)
    mask = np.zeros((20, 30), dtype=bool)
    mask[4:7, 3:8] = True
    crop = np.array(geneval.colour_crop(image, {"box": [2, 3, 12, 9], "mask": mask}))
    expected = np.where(mask[..., None], image, 153)[3:9, 2:12]  # object on #999999, then the box
    assert crop.shape == (6, 10, 3) and (crop == expected).all()
    assert (crop[0] == 153).all() and (crop[1:4, 1:6] == image[4:7, 3:8]).all()
    # no mask: the plain box; PIL rounds a fractional box (2.4, 3.6, 11.5, 9.2) -> (2, 4, 12, 9)
    assert (np.array(geneval.colour_crop(image, {"box": [2.4, 3.6, 11.5, 9.2]})) == image[4:9, 2:12]).all()


class StubClip:
    """encode_text: one-hot of the colour named in each text (x2, unnormalised); encode_image: fixed rows."""

    def __init__(self, rows):
        self.rows, self.calls = list(rows), []

    def encode_text(self, tokens):
        return 2.0 * torch.nn.functional.one_hot(tokens[:, 0], len(geneval.COLORS)).float()

    def encode_image(self, pixels):
        self.calls.append(len(pixels))
        out, self.rows = self.rows[:len(pixels)], self.rows[len(pixels):]
        return torch.tensor(out)


def test_colour_classifier_with_stub_logits():
    crops = []

    def preprocess(pil):
        crops.append(np.array(pil))
        return torch.zeros(3, 2, 2)

    def tokenizer(texts):  # "a photo of a {c} car" / "a photo of a {c}-colored car" / "a photo of a {c} object"
        return torch.tensor([[geneval.COLORS.index(t.split()[4].split("-")[0])] for t in texts])

    rows = np.eye(10)[[4, 9, 0]] * 3 - 0.1  # image features favouring blue, white, red
    model = StubClip(rows.tolist())
    classify = geneval.colour_classifier(model, preprocess, tokenizer, "cpu", batch_size=2)
    image = np.full((8, 8, 3), 200, dtype=np.uint8)
    mask = np.zeros((8, 8), dtype=bool)
    mask[2:4, 2:4] = True
    items = [(image, {"box": [0, 0, 4, 4], "mask": mask}, "car"), (image, {"box": [2, 2, 6, 6]}, "car"),
             (image, {"box": [1, 1, 3, 3], "mask": mask}, "car")]
    assert classify(items) == ["blue", "white", "red"]
    assert model.calls == [2, 1]  # batches of 2 crops
    assert (crops[0][:2] == 153).all() and (crops[0][2:4, 2:4] == 200).all()  # grey outside the mask, pixels inside
    assert (crops[1] == 200).all() and crops[1].shape == (4, 4, 3)
    assert (crops[2][0] == 153).all() and (crops[2][1, 1] == 200).all()


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A random open_clip architecture registered under a test name, and its weights file."""
    import open_clip

    folder = str(tmp_path_factory.mktemp("clip"))
    name = "tiny-geneval-clip"
    config = {"embed_dim": 16,
              "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
              "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    with open(os.path.join(folder, name + ".json"), "w") as f:
        json.dump(config, f)
    open_clip.add_model_config(os.path.join(folder, name + ".json"))
    torch.manual_seed(0)
    path = os.path.join(folder, "weights.pt")
    torch.save(open_clip.create_model(name, pretrained=None, force_quick_gelu=True).state_dict(), path)
    return name, path


def test_clip_colour_classifier_matches_zero_shot_formula(tiny_clip, tmp_path):
    import open_clip

    name, path = tiny_clip
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
    mask = rng.random((24, 24)) > 0.3
    items = [(image, {"box": [x, y, x + 12, y + 10], "mask": mask}, c)
             for x, y, c in [(0, 0, "car"), (5, 3, "car"), (12, 14, "teddy bear"), (2, 9, "car")]]
    got = geneval.clip_colour_classifier(path, "cpu", model_name=name, batch_size=3)(items)
    # independent: clip_benchmark's zero_shot_classifier + run_classification, written out here
    model, _, transform = open_clip.create_model_and_transforms(name, pretrained=path, force_quick_gelu=True)
    tokenizer = open_clip.get_tokenizer(name)
    expected = []
    with torch.no_grad():
        for image_, d, classname in items:
            weights = []
            for c in geneval.COLORS:
                texts = [f"a photo of a {c} {classname}", f"a photo of a {c}-colored {classname}",
                         f"a photo of a {c} object"]
                e = model.encode_text(tokenizer(texts))
                e = (e / e.norm(dim=-1, keepdim=True)).mean(0)
                weights.append(e / e.norm())
            f = model.encode_image(transform(geneval.colour_crop(image_, d))[None])[0]
            expected.append(geneval.COLORS[int((torch.stack(weights) @ (f / f.norm())).argmax())])
    assert got == expected
    assert geneval.clip_colour_classifier(path, "cpu", model_name=name, batch_size=1)(items) == got
    with pytest.raises(RuntimeError, match="--geneval-clip-path") as err:
        geneval.clip_colour_classifier(str(tmp_path / "none.pt"), "cpu", model_name=name)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the reward end to end

PROMPT_ROWS = [("a photo of a bench", SINGLE), ("a photo of two buses", COUNT2), ("a photo of a red car", RED_CAR),
               ("a photo of a dog right of a cat", DOG_RIGHT_OF_CAT), ("a photo of a red car and a blue bus", ATTR)]
# what the stub detector "sees" in image k (the image's pixel value): a list of detections
SCENES = [
    [det("bench")] * 3,                                             # bench x3: correct, partial -1
    [det("bus", 0.95), det("bus", 0.92)],                           # two buses: all 1
    [det("car")],                                                   # a car of unknown colour: CLIP decides
    [CAT, det("dog", box=(-20, 0, -10, 10))],                       # dog left of cat: partial 0.75
    [det("car", color="red"), det("bus", color="blue")],            # colours given by the detector: all 1
]


def stub_detector(path, device):
    def detect(images):
        return [[dict(d) for d in SCENES[int(image[0, 0, 0])]] for image in images]
    return detect


def stub_colours(calls):
    def factory(path, device, *, model_name, batch_size):
        def classify(items):
            calls.append([(name, d["class"]) for _, d, name in items])
            return ["blue"] * len(items)
        return classify
    return factory


OPTIONS = dict(geneval_detector="stub", geneval_detector_path="unused", geneval_clip_path="unused",
               geneval_clip_model="unused", geneval_score="partial", geneval_jpeg=False)


def images_for(indices):
    return np.stack([np.full((16, 16, 3), k, dtype=np.uint8) for k in indices])


def test_reward_end_to_end(monkeypatch):
    monkeypatch.setitem(rewards.GENEVAL_DETECTORS, "stub", stub_detector)
    calls = []
    monkeypatch.setattr(geneval, "clip_colour_classifier", stub_colours(calls))
    prompts, metadata = zip(*PROMPT_ROWS)
    order = [0, 1, 2, 3, 4, 3, 0]
    score = rewards.geneval_reward(device="cpu", geneval_batch_size=3, **OPTIONS)
    out = score(images_for(order), [prompts[k] for k in order], [metadata[k] for k in order])
    # per scene: (correct, strict, partial): bench x3 (1, 0, -1); two buses (1, 1, 1); blue car for "red car"
    # (0, 0, 0.5); dog left of cat (0, 0, 0.75); red car + blue bus (1, 1, 1)
    expected = {0: (1, 0, -1.0), 1: (1, 1, 1.0), 2: (0, 0, 0.5), 3: (0, 0, 0.75), 4: (1, 1, 1.0)}
    assert out["geneval_correct"].tolist() == [expected[k][0] for k in order]
    assert out["geneval_strict"].tolist() == [expected[k][1] for k in order]
    assert out["reward"].tolist() == [expected[k][2] for k in order] and out["reward"].dtype == torch.float32
    assert calls == [[("car", "car")]]  # CLIP only for the detection a colour clause needs that had no colour
    assert set(out) == {"reward", "geneval_correct", "geneval_official", "geneval_strict"} | {
        f"geneval_{t}" for t in geneval.TAGS}
    assert torch.equal(out["geneval_official"], out["geneval_correct"])  # a photo detector: GenEval's rule as it is
    for tag in geneval.TAGS:  # official 0/1 on the tag's samples, NaN elsewhere; all six keys always present
        want = [expected[k][0] if metadata[k]["tag"] == tag else None for k in order]
        got = out[f"geneval_{tag}"].tolist()
        assert [None if math.isnan(g) else g for g in got] == want
    assert geneval.summary_of_scores(out)["overall"] == pytest.approx((1 + 1 + 0 + 0 + 1) / 5)
    # the batch size of the detector calls does not change any result
    one = rewards.geneval_reward(device="cpu", geneval_batch_size=1, **OPTIONS)(
        images_for(order), [prompts[k] for k in order], [metadata[k] for k in order])
    for key in out:
        assert torch.equal(out[key].nan_to_num(-7), one[key].nan_to_num(-7)), key
    # the other scores
    corrected = rewards.geneval_reward(device="cpu", geneval_batch_size=8, **dict(OPTIONS, geneval_score="corrected"))
    assert corrected(images_for(order), [prompts[k] for k in order], [metadata[k] for k in order])["reward"].tolist() \
        == pytest.approx([1.0, 1.0, 0.5, 2 / 3, 1.0, 2 / 3, 1.0])


def test_reward_refuses_rows_without_geneval_metadata(monkeypatch):
    monkeypatch.setitem(rewards.GENEVAL_DETECTORS, "stub", stub_detector)
    score = rewards.geneval_reward(device="cpu", geneval_batch_size=2, **OPTIONS)
    for meta in ({}, {"rm_type": "geneval"}, None):
        with pytest.raises(ValueError, match='--input-key prompt') as err:
            score(images_for([0]), ["a photo of a bench"], [meta])
        assert "\n" not in str(err.value) and "sample 0" in str(err.value)


def test_build_reward_accepts_nan_tag_entries(monkeypatch):
    import rewards

    monkeypatch.setitem(rewards.GENEVAL_DETECTORS, "stub", stub_detector)
    assert rewards.geneval_judge is geneval_judge
    reward_fn = rewards.build_reward("geneval", geneval_detector="stub", geneval_clip_path="unused")
    out = reward_fn(torch.from_numpy(images_for([0, 1])), ["a photo of a bench", "a photo of two buses"],
                    [SINGLE, COUNT2])
    assert out["geneval"].tolist() == [-1.0, 1.0] == out["reward"].tolist()  # partial score by default
    assert out["geneval_counting"][0].isnan() and out["geneval_counting"][1] == 1.0
    assert out["geneval_position"].isnan().all()


def test_missing_checkpoint_offline_names_the_flag(tmp_path):
    import rewards

    with pytest.raises(RuntimeError, match="--geneval-detector-path") as err:
        rewards.build_reward("geneval", geneval_detector_path=str(tmp_path / "no-such-checkpoint"))
    assert "\n" not in str(err.value)


def test_jpeg_option_scores_what_awms_reward_server_saw(monkeypatch):
    """AWM's geneval_score (flow_grpo/rewards.py L189-196) sends each image as a JPEG at PIL's default quality and its
    server decodes it (reward-server/app_geneval.py L33): with --geneval-jpeg the detector and the colour
    classifier see those decoded pixels; without it the raw ones (DiffusionNFT's reward)."""
    import io

    from PIL import Image

    seen = []

    def recording_detector(path, device):
        def detect(images):
            seen.append(np.array(images))
            return [[det("bench", color="red")] for _ in images]
        return detect

    monkeypatch.setitem(rewards.GENEVAL_DETECTORS, "stub", recording_detector)
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    rows = [{"tag": "colors", "include": [{"class": "bench", "count": 1, "color": "red"}]}] * 3
    expected = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG")  # quality 75, 4:2:0, PIL's defaults
        expected.append(np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")))
    expected = np.stack(expected)
    assert np.abs(expected.astype(int) - images).mean() > 5  # noise does not survive JPEG: the test can tell
    for jpeg, pixels in [(True, expected), (False, images)]:
        seen.clear()
        out = rewards.geneval_reward(device="cpu", geneval_batch_size=2, **dict(OPTIONS, geneval_jpeg=jpeg))(
            images, ["a photo of a red bench"] * 3, rows)
        assert np.array_equal(np.concatenate(seen), pixels) and out["reward"].tolist() == [1.0] * 3


def test_options_declared_once():
    import argparse

    parser = argparse.ArgumentParser()
    geneval.add_arguments(parser)
    args = parser.parse_args(["--geneval-score", "corrected", "--geneval-batch-size", "4"])
    assert set(geneval.options()) == {"geneval_detector", "geneval_detector_path", "geneval_clip_path",
                                      "geneval_clip_model", "geneval_score", "geneval_batch_size", "geneval_jpeg"}
    assert args.geneval_score == "corrected" and args.geneval_batch_size == 4
    # the detector is unset by default: geneval.reward reads None as mask2former, train.py's shapes preset fills shapes
    assert geneval.defaults()["geneval_score"] == "partial" and geneval.defaults()["geneval_detector"] is None
    for action in parser._actions[1:]:
        assert action.help, action.dest
    with pytest.raises(TypeError):  # the factory has no defaults of its own
        rewards.geneval_reward(device="cpu")


# ----------------------------------------------------------------------------- train.py's held-out evaluation

def brightness_detector(path, device):
    """Bright images show one bench and two buses, dark ones nothing: rewards differ within a group."""
    def detect(images):
        return [[det("bench"), det("bus"), det("bus")] if image.mean() > 110 else [] for image in images]
    return detect


def test_train_two_steps_with_geneval_reward(tmp_path, monkeypatch):
    import train

    monkeypatch.chdir(ROOT)
    monkeypatch.setitem(rewards.GENEVAL_DETECTORS, "stub", brightness_detector)
    prompts = tmp_path / "geneval.jsonl"
    geneval.write_prompts(prompts, [dict(SINGLE, prompt="a photo of a bench"),
                                    dict(COUNT2, prompt="a photo of two buses")])
    out = str(tmp_path / "run")
    train.main(["--model", "tiny", "--reward", "geneval", "--geneval-detector", "stub", "--prompts", str(prompts),
                "--input-key", "prompt", "--eval-prompts", str(prompts), "--eval-every", "2", "--eval-steps", "2",
                "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4", "--train-batch-size", "4",
                "--num-steps", "4", "--resolution", "32", "--log-images-every", "0", "--steps", "2", "--out", out])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and not any(r.get("skipped") for r in rows)
    for r in rows:
        assert math.isfinite(r["reward_mean"]) and math.isfinite(r["loss"])
        assert 0 <= r["reward/geneval_single_object_mean"] <= 1 and 0 <= r["reward/geneval_counting_mean"] <= 1
    evals = [json.loads(line) for line in open(os.path.join(out, "eval.jsonl"))]
    means = evals[-1]
    assert means["geneval_overall"] == pytest.approx((means["geneval_single_object"] + means["geneval_counting"]) / 2)
    assert means["geneval_mean_over_images"] == pytest.approx(means["geneval_correct"])
    # the rise since step 0 is GenEval's: the change of the overall accuracy (the tags' rises, paired per image)
    assert means["rise"] == pytest.approx(means["geneval_overall"] - evals[0]["geneval_overall"], abs=1e-6)
