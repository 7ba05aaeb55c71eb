"""The judge cannot be gamed by deforming an object: what the shapes detector cannot name (a component that fits no
template, a speck under MIN_AREA) is reported as class "unknown" and counts as something there wherever a verdict
needs a scene empty of an object or holding exactly N (GenEval's exclude clauses, the edit judge's extra objects).
Hand-made scenes: a removed square squashed into a bar, a speck beside a counted group, an extra deformed object."""

import numpy as np
import pytest

import geneval
import shapes


def obj(shape, color, cx, cy, size):
    return {"shape": shape, "color": color, "cx": cx, "cy": cy, "size": size}


def paint(image, color, rows, cols):
    """A flat patch of a palette colour (a bar, a speck) painted over a drawn scene."""
    out = image.copy()
    out[rows[0]:rows[1], cols[0]:cols[1]] = shapes.COLORS[color]
    return out


def metadata(prompt):
    rows = {r["prompt"]: r["metadata"] for tag in shapes.TAGS for r in shapes.prompt_rows(tag)}
    return rows[prompt]


def judge(prompt, image):
    return geneval.geneval_judge(metadata(prompt), shapes.detect(image)[0], score="corrected")


SQUARE, CIRCLE = obj("square", "green", 9.0, 16.0, 11.0), obj("circle", "red", 24.0, 16.0, 11.0)
REMOVE = {"prompt": "remove the square", "edit": "remove", "source": [SQUARE, CIRCLE],
          "target": [{"class": "circle", "color": "red", "at": 1}]}
BAR = ((14, 17), (3, 15))  # rows, cols: 3 x 12 px, the square's 121 px squashed to 36 where it stood


def test_a_squashed_square_is_unknown_not_absent():
    (det,) = shapes.detect(paint(np.full((32, 32, 3), shapes.BACKGROUND, np.uint8), "green", *BAR))[0]
    assert (det["class"], det["box"], det["color"]) == ("unknown", [3, 14, 15, 17], "green")
    assert det["score"] <= shapes.UNEXPLAINED  # aspect 1/4: no template fits


def test_removal_with_the_object_squashed_into_a_bar_is_wrong():
    done = shapes.draw([CIRCLE])
    assert shapes.judge_edit(REMOVE, shapes.detect(done)[0]) == {"correct": 1.0, "score": 1.0, "reason": ""}
    gamed = shapes.judge_edit(REMOVE, shapes.detect(paint(done, "green", *BAR))[0])
    # the circle's term holds; the bar is one object too many: score 1 x 1 / (1 + 1)
    assert gamed == {"correct": 0.0, "score": 0.5, "reason": "1 object(s) too many (1 unexplained)"}


def test_a_speck_breaks_an_exact_count_and_nothing_else():
    three = shapes.draw([obj("square", c, x, y, 10.0) for c, x, y in (("red", 7, 7), ("blue", 24, 8), ("white", 15, 24))])
    speck = paint(three, "black", (28, 31), (28, 31))  # 9 px: under MIN_AREA (20.5 px)
    assert judge("a photo of three squares", three)["correct"] == 1
    verdict = judge("a photo of three squares", speck)
    # exclude "square" count 4: 3 squares + 1 unexplained >= 4; corrected penalty (4 - 1) / 4
    assert (verdict["correct"], verdict["unexplained"], verdict["score"]) == (0.0, 1, 0.75)
    assert verdict["reason"] == "expected square<4, found 4 (1 unexplained)"
    assert verdict["partial"] == pytest.approx(2 / 3)  # its count term stands in for the exclude clause: 4 for 3
    assert judge("a photo of a square", speck)["correct"] == 1  # no exclude clause: an extra speck is allowed
    assert judge("a photo of a red square", speck)["correct"] == 1


def test_an_extra_deformed_object_breaks_a_count():
    two = shapes.draw([obj("circle", "blue", 8.0, 8.0, 11.0), obj("circle", "yellow", 24.0, 8.0, 11.0)])
    squashed = paint(two, "white", (24, 27), (6, 26))  # a third circle pressed flat: 3 x 20 px
    assert judge("a photo of two circles", two)["correct"] == 1
    verdict = judge("a photo of two circles", squashed)
    assert (verdict["correct"], verdict["counts"], verdict["unexplained"]) == (0.0, {"circle": 2}, 1)
    # edit count: "make one circle into two" with a flattened third circle is one object too many
    row = {"prompt": "make one circle into two", "edit": "count", "source": [obj("circle", "blue", 8.0, 8.0, 11.0)],
           "target": [{"class": "circle", "color": "blue", "at": 0}, {"class": "circle", "color": None, "at": None}]}
    assert shapes.judge_edit(row, shapes.detect(two)[0])["correct"] == 1
    assert shapes.judge_edit(row, shapes.detect(squashed)[0])["reason"] == "1 object(s) too many (1 unexplained)"


def test_an_object_under_the_edit_threshold_is_extra():
    """A component of a known class scoring under the edit judge's 0.5 but over UNEXPLAINED: no clause takes it,
    it is still there."""
    dets = [{"class": "circle", "score": 0.95, "box": [19, 11, 30, 22], "color": "red"},
            {"class": "square", "score": 0.4, "box": [3, 11, 14, 22], "color": "green"}]
    verdict = shapes.judge_edit(REMOVE, dets)
    assert verdict == {"correct": 0.0, "score": 0.5, "reason": "1 object(s) too many (1 unexplained)"}


@pytest.mark.parametrize("tag", ["counting", "two_object"])
def test_detectors_without_unknowns_keep_genevals_rules(tag):
    """Mask2Former never reports UNKNOWN: its low-scoring detections stay out of every rule, as in GenEval."""
    meta = geneval.template(tag, "dog", "cat", count=2) if tag == "counting" else geneval.template(tag, "dog", "cat")
    meta = {"tag": tag, "include": meta[1], "exclude": meta[2]}
    dogs = [{"class": "dog", "score": 0.95, "box": [0, 0, 10, 10]}, {"class": "dog", "score": 0.95, "box": [20, 0, 30, 10]},
            {"class": "dog", "score": 0.2, "box": [0, 20, 10, 30]}]
    cats = [{"class": "cat", "score": 0.95, "box": [20, 20, 30, 30]}]
    verdict = geneval.geneval_judge(meta, dogs + cats if tag == "two_object" else dogs)
    assert (verdict["correct"], verdict["unexplained"]) == (1.0, 0)
