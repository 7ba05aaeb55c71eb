"""GenEval (Ghosh et al., arXiv:2310.11513) as a reward and as an evaluation, without mmdetection.

    reward_fn = rewards.build_reward("geneval", device="cuda")              # or geneval.reward(...)
    out = reward_fn(images, prompts, metadata)    # metadata: GenEval objects, one per image
    out["reward"]            [B] the score chosen by --geneval-score (default: the partial score the papers trained on)
    out["geneval_correct"]   [B] official 0/1 (evaluation/evaluate_images.py)
    out["geneval_strict"]    [B] the reward server's exact-count 0/1
    out["geneval_<tag>"]     [B] official 0/1 for the samples of that tag, NaN for the others (nanmean = accuracy)

An image is judged from object detections (class, score, box, mask) and, for colour clauses,
the colour of each object. Detection backends (rewards.GENEVAL_DETECTORS): `mask2former`, transformers'
Mask2Former (Swin-S, COCO instance) with mmdetection's post-processing re-implemented, plus CLIP
ViT-L/14 zero-shot colours, for photographs; `shapes`, the exact detector of the synthetic
shapes world (module `shapes`), which also gives colours.

Sources (pinned): djghosh13/geneval af4902f (evaluation/evaluate_images.py = "eval L..",
evaluation/summary_scores.py, prompts/create_prompts.py), yifan123/reward-server 92ac29f
(reward_server/gen_eval.py = "server L..", byte-identical logic in AWM's copy), mmdetection's
MaskFormerFusionHead.instance_postprocess and Mask2FormerHead test path.

Rules of the official judge (`geneval_judge(...)["correct"]`)
-------------------------------------------------------------
- Detections of a class are kept when score > 0.3, or > 0.9 when the tag is "counting" (strictly
  greater, eval L230-233, L286-287), sorted by score, at most 16 per class (eval L234, L288).
  Same-class NMS exists but is off by default (max_overlap 1.0, eval L239-242, L289): not done here.
- Include clauses, in order (eval L173-213): the `count` best detections of the class must exist;
  if the clause has a colour, all of those `count` objects must be classified as that colour; if
  it has a position [relation, i], clause i must have matched and every pair (object, target
  object) must satisfy `relative_position`. A failed clause leaves no target for later clauses.
- Exclude clauses (eval L215-219): fail when the class has >= count kept detections. Counting
  prompts exclude count + 1, so counting is exact. Departure: detections of class UNKNOWN (a detector
  that splits the image into components, as the shapes world's, reports so what it cannot name: a
  deformed object, a speck) count too, whatever their score, as possibly the excluded object; the
  official rule ignores what scores under the threshold, so an extra object deformed past recognition
  would pass as absent. The `correct` and `corrected` verdicts read them, and so do the count terms of
  `partial` and `strict` on a counting prompt, where the count stands in for the exclude clause;
  `unexplained` in the verdict says how many there were.
- Departure, per detector: the counting tag's threshold (`counting_threshold`, 0.9 above) is the
  detector's. Mask2Former scores a plain object in a photograph above 0.9; the shapes world's detector
  scores a clean but imperfect shape anywhere from 0.35 to 0.9 (a template fit), so at 0.9 an extra
  object it recognises as the class at 0.5 passes unseen as the exclude clause's count + 1, and RL
  learns to draw it (four squares for "two squares"). The shapes world keeps counting detections above
  0.3, as every other tag. `official` in the verdict (`geneval_official` in the reward) is GenEval's
  own rule on the same detections: 0.9, UNKNOWN components ignored.
- `relative_position(A, B)` (eval L140-157): centre offset minus 0.1 x (size A + size B) per axis,
  clipped at 0 (keeps its sign); no relation if both parts < 1e-3; otherwise the clipped offset
  divided by the length of the raw offset gives (dx, dy), and dx < -0.5 "left of", dx > 0.5
  "right of", dy < -0.5 "above", dy > 0.5 "below" (image y grows downward; strict inequalities).

The partial score (`score="partial"`, what Flow-GRPO, DiffusionNFT and AWM trained on)
--------------------------------------------------------------------------------------
The reward server's `evaluate_reward` (server L201-264) averages a list of terms, with these quirks:
1. Per include clause a count term 1 - |count - n| / count, where n counts ALL kept detections
   of the class, not the best `count` (server L218-219): over-detection is punished, and the term
   goes negative (a single object detected 3 times scores -1.0; 5 detected for "two" scores -0.5).
2. A count mismatch fails the clause and, if it has a colour or position, appends one 0.0 term
   for it (server L220-224).
3. Colour (count exact only): 1 - |count - n_colour| / count (server L226-229).
4. Position (count and colour exact only): target clause failed -> 0.0 (server L240-243);
   otherwise the first violating pair appends 0.0, and a 1.0 is appended AFTER THE LOOP EVEN
   WHEN IT FOUND A VIOLATION (server L254-258): a wrong relation scores 0.75 on a two-clause
   position prompt (terms 1, 1, 0, 1) instead of 2/3.
5. Exclude clauses are never read (the loop is over `include` only): the exact count of the
   count term stands in for them.
6. The mean of no terms is 0 (server L263).
`strict` is that function's verdict (server L291): every clause with an exact count, all colours
right, all relations right; stricter than the official rule for non-counting tags (two benches
for "a photo of a bench" are officially correct, strictly wrong, partial score 0.0).
The server also fed RGB arrays to mmdet's `inference_detector`, which takes arrays as BGR
(server L267): its detector saw channel-swapped images. Official GenEval loads files (BGR, right);
this module feeds RGB as the model expects, i.e. it follows the official evaluation.

The corrected score (`score="corrected"`, this module's design)
---------------------------------------------------------------
A dense version of the official rules, in [0, 1], equal to 1 exactly when `correct` is 1:
mean of per-clause terms, times a penalty per exclude clause.
- count term min(n, count) / count, over the best `count` detections (extra detections of an
  include clause do not fail it officially, so they cost nothing here);
- colour term: objects of the best `count` with the required colour / count;
- position term: 0 if the target clause did not match (officially), else the fraction of
  (object, target object) pairs in the required relation, over count x target count pairs;
- each exclude clause (class, k) with n >= k kept detections multiplies by (k - 1) / n.
Worked values: wrong relation 2/3 (not 0.75); three benches for "a bench" 1.0; "two" with
1, 2, 3, 5 detections 0.5, 1.0, 2/3, 0.4; wrong colour 0.5; missing object 0.0.

Aggregation (summary_scores.py L36-45): accuracy per tag, then the UNWEIGHTED mean of the six
tag accuracies is GenEval's overall score; the mean over images (printed by some training
scripts, e.g. DiffusionNFT's scripts/evaluation.py) weights tags by their prompt counts.
"""

import argparse
import difflib
import json
import math
import os

import numpy as np

# GenEval's class names (evaluation/object_names.txt): the 80 COCO thing classes in COCO order,
# so a COCO-instance detector's label i is OBJECT_NAMES[i].
OBJECT_NAMES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")  # eval L76
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")  # order of the metadata file
RELATIONS = ("left of", "right of", "above", "below")  # create_prompts.py L104

THRESHOLD = 0.3  # keep detections with score > this (eval L286)
UNKNOWN = "unknown"  # the class of a detection its detector could not name: never kept, counted by exclude clauses
COUNTING_THRESHOLD = 0.9  # ... > this for the "counting" tag (eval L287)
MAX_OBJECTS = 16  # per class, best first (eval L288)
POSITION_MARGIN = 0.1  # x (size A + size B), subtracted from the centre offset (eval L290)
BACKGROUND = (153, 153, 153)  # "#999": colour crops show the object on grey (eval L84-88)
COLOR_TEMPLATES = ("a photo of a {c} {classname}", "a photo of a {c}-colored {classname}",
                   "a photo of a {c} object")  # eval L113-117
SCORES = ("partial", "strict", "correct", "corrected")  # what `geneval_judge(..., score=)` returns under "score"
DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
PROMPT_FORMAT = ('{"prompt": "a photo of a cat", "metadata": {"tag": "single_object", "include": '
                 '[{"class": "cat", "count": 1}]}} (as prompts/geneval_test.jsonl, read with --input-key prompt)')


# ----------------------------------------------------------------------------- the judge

def relative_position(box_a, box_b, *, margin=POSITION_MARGIN):
    """The relations of box A to box B, a set of RELATIONS (eval L140-157); boxes are [x1, y1, x2, y2].

    offset = centre A - centre B; per axis, revised = sign(offset) max(|offset| - margin (size A +
    size B), 0); no relation when both |revised| < 1e-3; else (dx, dy) = revised / |offset|_2 and
    each of dx < -0.5, dx > 0.5, dy < -0.5, dy > 0.5 adds left of / right of / above / below.
    Float64 here; the original computes in the detector's float32, which only matters at exact ties.
    """
    (ax1, ay1, ax2, ay2), (bx1, by1, bx2, by2) = [float(v) for v in box_a[:4]], [float(v) for v in box_b[:4]]
    offset = ((ax1 + ax2) / 2 - (bx1 + bx2) / 2, (ay1 + ay2) / 2 - (by1 + by2) / 2)
    size = (abs(ax2 - ax1) + abs(bx2 - bx1), abs(ay2 - ay1) + abs(by2 - by1))
    revised = [math.copysign(max(abs(o) - margin * s, 0.0), o) for o, s in zip(offset, size)]
    if all(abs(r) < 1e-3 for r in revised):
        return set()
    norm = math.hypot(*offset)
    dx, dy = revised[0] / norm, revised[1] / norm
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def kept_detections(detections, tag, *, counting_threshold=COUNTING_THRESHOLD):
    """GenEval's filter (eval L230-244): class -> its detections with score > 0.3 (> `counting_threshold`, 0.9,
    for "counting"), best first, at most 16. Ties keep the input order (the original's argsort order
    among equal scores is arbitrary). NMS is off by default in GenEval and is not done."""
    threshold = counting_threshold if tag == "counting" else THRESHOLD
    by_class = {}
    for det in sorted(detections, key=lambda d: -float(d["score"])):
        if float(det["score"]) > threshold:
            by_class.setdefault(det["class"], []).append(det)
    return {name: dets[:MAX_OBJECTS] for name, dets in by_class.items()}


INCLUDE_KEYS, EXCLUDE_KEYS = ("class", "count", "color", "position"), ("class", "count")  # what the judge reads


def _known(kind, value, names, detector):
    """A one-line error for a class or colour the detector never reports, or None."""
    if names is None or value in names:
        return None
    close = difflib.get_close_matches(str(value), names, n=1)
    shown = ", ".join(names) if len(names) <= 12 else f"GenEval's {len(names)} COCO classes (geneval.OBJECT_NAMES)"
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"{kind} {value!r} is not one the {detector} detector reports, so the clause would score as if the "
            f"object were never there; the {detector} detector knows {shown}: fix the row{hint}, or pick the "
            f"detector with --geneval-detector")


def check_metadata(metadata, *, vocabulary=None, detector="the"):
    """Raise a one-line ValueError unless `metadata` is a GenEval object the judge can read; with `vocabulary`
    (classes, colours) that the detector named `detector` can report (rewards.GENEVAL_VOCABULARY), also unless
    every class and colour of the row is one of them.

    Refused: no `tag` or an unknown one; no `include` clause; a clause without a class name, with a `count`
    that is not an integer >= 1 (true, 2.0 and "2" included), or with a key the judge does not read (a
    "colour" would be ignored); a colour that is not a name; a `position` that is not [one of RELATIONS,
    index of an earlier include clause].
    """
    def bad(why):
        return ValueError(f"GenEval metadata {why}; rows must look like {PROMPT_FORMAT}")

    def integer(value):
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(metadata, dict) or not metadata.get("include"):
        raise bad(f"needs 'tag' and a non-empty 'include' list, got {str(metadata)[:120]!r}")
    if metadata.get("tag") not in TAGS:
        raise bad(f"'tag' {metadata.get('tag')!r} is not one of {', '.join(TAGS)}")
    classes, colours = vocabulary or (None, None)
    for key, allowed in (("include", INCLUDE_KEYS), ("exclude", EXCLUDE_KEYS)):
        clauses = metadata.get(key, [])
        if not isinstance(clauses, list):
            raise bad(f"{key!r} must be a list of clauses")
        for i, clause in enumerate(clauses):
            if not (isinstance(clause, dict) and isinstance(clause.get("class"), str)
                    and integer(clause.get("count")) and clause["count"] >= 1):
                raise bad(f"{key} clause {i} needs a 'class' name and a 'count' that is an integer >= 1, "
                          f"got {clause!r}")
            unknown = sorted(set(clause) - set(allowed))
            if unknown:
                raise bad(f"{key} clause {i} has {', '.join(map(repr, unknown))}, which the judge does not read "
                          f"(an {key} clause takes {', '.join(allowed)})")
            if key == "include" and "color" in clause and not isinstance(clause["color"], str):
                raise bad(f"include clause {i}: 'color' must be a colour name, got {clause['color']!r}")
            if key == "include" and "position" in clause:
                position = clause["position"]
                if not (isinstance(position, (list, tuple)) and len(position) == 2 and position[0] in RELATIONS
                        and integer(position[1]) and 0 <= position[1] < i):
                    raise bad(f"include clause {i}: 'position' must be [relation, index of an earlier clause] "
                              f"with a relation in {RELATIONS}, got {position!r}")
            error = _known("class", clause["class"], classes, detector) or (
                _known("colour", clause["color"], colours, detector) if "color" in clause else None)
            if error:
                raise ValueError(f"GenEval metadata, {key} clause {i}: {error}")


def _colours(objects, name):
    """The colours of detections a colour clause looks at; each must carry one."""
    out = []
    for det in objects:
        if det.get("color") is None:
            raise ValueError(f"a detection of {name!r} has no 'color' but a colour clause needs it; "
                             f"classify it first (clip_colour_classifier) or use a detector that gives colours")
        out.append(det["color"])
    return out


def _official(metadata, objects, unexplained=0):
    """evaluate() of eval L160-220 -> (correct, reasons, matched groups); `unexplained` UNKNOWN detections count
    towards every exclude clause (module docstring)."""
    reasons, groups = [], []  # groups[i]: the objects of include clause i if it matched, else None
    for clause in metadata["include"]:
        name, count = clause["class"], clause["count"]
        found = objects.get(name, [])[:count]
        matched = True
        if len(found) < count:
            matched = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in clause:
                hits = _colours(found, name).count(clause["color"])
                if hits < count:
                    matched = False
                    reasons.append(f"expected {clause['color']} {name}>={count}, found {hits} {clause['color']}")
            if "position" in clause and matched:
                relation, target = clause["position"]
                if groups[target] is None:
                    matched = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    for obj in found:
                        bad = [t for t in groups[target] if relation not in relative_position(obj["box"], t["box"])]
                        if bad:
                            matched = False
                            seen = " and ".join(sorted(relative_position(obj["box"], bad[0]["box"]))) or "no relation"
                            reasons.append(f"expected {name} {relation} target, found {seen}")
                            break
        groups.append(found if matched else None)
    for clause in metadata.get("exclude", []):
        n = len(objects.get(clause["class"], [])) + unexplained  # an unnamed component may be one more
        if n >= clause["count"]:
            what = f" ({unexplained} unexplained)" if unexplained else ""
            reasons.append(f"expected {clause['class']}<{clause['count']}, found {n}{what}")
    return not reasons, reasons, groups


def _partial(metadata, objects, unexplained=0):
    """evaluate_reward() of server L201-264, quirks kept (module docstring) -> (strict, score); on a clause whose
    class an exclude clause caps, `unexplained` UNKNOWN detections count as possibly more of it."""
    terms, groups, strict = [], [], True
    capped = {clause["class"] for clause in metadata.get("exclude", [])}
    for clause in metadata["include"]:
        name, count = clause["class"], clause["count"]
        found = objects.get(name, [])  # quirk 1: every kept detection, not the best `count`
        n = len(found) + (unexplained if name in capped else 0)  # quirk 5's exact count stands in for the exclude
        matched = True
        terms.append(1 - abs(count - n) / count)  # server L219, can be negative
        if n != count:
            strict = matched = False
            if "color" in clause or "position" in clause:
                terms.append(0.0)  # quirk 2, server L223-224
        else:
            if "color" in clause:
                hits = _colours(found, name).count(clause["color"])
                terms.append(1 - abs(count - hits) / count)  # server L229
                if hits != count:
                    strict = matched = False
            if "position" in clause and matched:
                relation, target = clause["position"]
                if groups[target] is None:
                    strict = matched = False
                    terms.append(0.0)  # server L243
                else:
                    pairs = [(o["box"], t["box"]) for o in found for t in groups[target]]
                    if any(relation not in relative_position(a, b) for a, b in pairs):
                        strict = matched = False
                        terms.append(0.0)  # server L254, first violation
                    terms.append(1.0)  # quirk 4, server L258: appended even after a violation
        groups.append(found if matched else None)
    # quirk 5: metadata["exclude"] is never read
    return strict, (sum(terms) / len(terms) if terms else 0.0)  # quirk 6, server L263


def _corrected(metadata, objects, official_groups, unexplained=0):
    """This module's dense form of the official rules (module docstring): in [0, 1], 1 iff correct."""
    terms = []
    for clause in metadata["include"]:
        name, count = clause["class"], clause["count"]
        found = objects.get(name, [])[:count]
        terms.append(len(found) / count)
        if "color" in clause:
            terms.append(_colours(found, name).count(clause["color"]) / count)
        if "position" in clause:
            relation, target = clause["position"]
            targets = official_groups[target]
            if targets is None:
                terms.append(0.0)
            else:
                hits = sum(relation in relative_position(o["box"], t["box"]) for o in found for t in targets)
                terms.append(hits / (count * len(targets)))
    penalty = 1.0
    for clause in metadata.get("exclude", []):
        n, k = len(objects.get(clause["class"], [])) + unexplained, clause["count"]
        if n >= k:
            penalty *= (k - 1) / n
    return min(max(sum(terms) / len(terms) * penalty, 0.0), 1.0)


def geneval_judge(metadata, detections, *, score="partial", counting_threshold=COUNTING_THRESHOLD):
    """GenEval's verdict on one image.

    metadata: a GenEval object {"tag", "include": [{"class", "count", "color"?, "position"?:
    [relation, clause index]}], "exclude"?: [{"class", "count"}]}. detections: dicts {"class",
    "score", "box": [x1, y1, x2, y2] pixels, "color": name or None}, unfiltered (extra keys such as
    "mask" are ignored); the filter of `kept_detections` is applied here, with the detector's
    `counting_threshold` (module docstring). Detections that a colour clause looks at (the best `count` of its
    class) must carry a colour.

    Returns {"correct": official 0/1 (eval L160-220), "strict": the reward server's exact 0/1,
    "partial": its partial score with its quirks (server L201-264), "score_corrected": the corrected
    score, "score": the one named by `score` (partial | strict | correct | corrected), "reason":
    the first failed official rule ("" when correct), "counts": {class: kept detections}, "unexplained": the
    detections of class UNKNOWN, which the exclude clauses count, "official": GenEval's own 0/1 on the same
    detections (0.9 for counting, UNKNOWN ignored): `correct` without this module's departures}.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
    check_metadata(metadata)
    objects = kept_detections(detections, metadata["tag"], counting_threshold=counting_threshold)
    unexplained = sum(d["class"] == UNKNOWN for d in detections)
    correct, reasons, groups = _official(metadata, objects, unexplained)
    strict, partial = _partial(metadata, objects, unexplained)
    corrected = _corrected(metadata, objects, groups, unexplained)
    official = _official(metadata, kept_detections(detections, metadata["tag"]))[0]
    values = {"partial": partial, "strict": float(strict), "correct": float(correct), "corrected": corrected}
    return {"correct": float(correct), "strict": float(strict), "partial": partial, "score_corrected": corrected,
            "score": values[score], "reason": reasons[0] if reasons else "",
            "counts": {name: len(dets) for name, dets in objects.items()}, "unexplained": unexplained,
            "official": float(official)}


# ----------------------------------------------------------------------------- aggregation

def summary(tags, correct):
    """Per-tag accuracy and GenEval's overall score (summary_scores.py L36-45).

    Returns {tag: accuracy for each tag present, "overall": unweighted mean of those tag accuracies
    (the official number when all six are present), "mean_over_images": mean of `correct`,
    "missing": the TAGS absent from the data (left out of "overall")}. NaN entries of `correct`
    (samples not scored) are skipped.
    """
    tags, correct = list(tags), [float(c) for c in correct]
    if len(tags) != len(correct):
        raise ValueError(f"summary: {len(tags)} tags for {len(correct)} verdicts")
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise ValueError(f"summary: unknown tags {unknown}; GenEval's tags are {', '.join(TAGS)}")
    pairs = [(t, c) for t, c in zip(tags, correct) if not math.isnan(c)]
    out = {}
    for tag in TAGS:
        values = [c for t, c in pairs if t == tag]
        if values:
            out[tag] = sum(values) / len(values)
    present = [out[t] for t in TAGS if t in out]
    out["overall"] = sum(present) / len(present) if present else float("nan")
    out["mean_over_images"] = sum(c for _, c in pairs) / len(pairs) if pairs else float("nan")
    out["missing"] = [t for t in TAGS if t not in out]
    return out


def summary_of_scores(scores, key="geneval_correct"):
    """`summary` from a reward output: the verdicts under `key` (geneval_correct, or geneval_official: GenEval's own
    rule) grouped by the per-tag geneval_<tag> entries."""
    import torch

    correct = torch.as_tensor(scores[key]).float()
    tags = [None] * len(correct)
    for tag in TAGS:
        if f"geneval_{tag}" in scores:
            mine = ~torch.as_tensor(scores[f"geneval_{tag}"]).float().isnan()
            for i in mine.nonzero().flatten().tolist():
                tags[i] = tag
    scored = [i for i, t in enumerate(tags) if t is not None]
    return summary([tags[i] for i in scored], correct[scored].tolist())


# ----------------------------------------------------------------------------- prompts

def _with_article(name):
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"  # create_prompts.py L19-22


def _plural(name):
    return f"{name}es" if name.endswith("s") else f"{name}s"  # create_prompts.py L26-29 ("sheeps", "skises")


NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _others(k, skip):
    """The k-th of the indices 0, 1, 2, ... that are not in `skip`."""
    for s in sorted(skip):
        if k >= s:
            k += 1
    return k


def template(tag, a, b=None, *, count=1, color=None, color_b=None, relation=None):
    """GenEval's prompt and metadata clauses of one object (create_prompts.py L33-133 templates): classes a and b,
    a count (counting: 2-4, with an exclude clause at count + 1), colours of a and b, a relation of a to b (the
    target is named second: "a circle left of a square" includes [square, circle at ["left of", 0]]).
    -> (prompt, include, exclude). The one grammar of GenEval prompts here, over COCO's classes and the shapes
    world's alike."""
    if tag == "single_object":
        return f"a photo of {_with_article(a)}", [{"class": a, "count": 1}], []
    if tag == "two_object":
        return f"a photo of {_with_article(a)} and {_with_article(b)}", [{"class": a, "count": 1},
                                                                         {"class": b, "count": 1}], []
    if tag == "counting":
        return (f"a photo of {NUMBERS[count]} {_plural(a)}", [{"class": a, "count": count}],
                [{"class": a, "count": count + 1}])
    if tag == "colors":
        return f"a photo of {_with_article(color)} {a}", [{"class": a, "count": 1, "color": color}], []
    if tag == "position":
        return (f"a photo of {_with_article(a)} {relation} {_with_article(b)}",
                [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}], [])
    if tag == "color_attr":
        return (f"a photo of {_with_article(color)} {a} and {_with_article(color_b)} {b}",
                [{"class": a, "count": 1, "color": color}, {"class": b, "count": 1, "color": color_b}], [])
    raise ValueError(f"unknown GenEval tag {tag!r}; choose one of {', '.join(TAGS)}")


def _prompt(tag, digits):
    """The GenEval object of one point of a tag's grid over COCO's classes and GenEval's colours."""
    person = OBJECT_NAMES.index("person")  # colour prompts never name a colour of a person (L91-92, L123-124)
    names, kw = OBJECT_NAMES, {}
    if tag == "single_object":
        a, b = digits[0], None
    elif tag == "two_object":
        a, b = digits[0], _others(digits[1], [digits[0]])
    elif tag == "counting":
        a, b, kw = digits[0], None, dict(count=digits[1] + 2)  # counts 2-4
    elif tag == "colors":
        a, b, kw = _others(digits[0], [person]), None, dict(color=COLORS[digits[1]])
    elif tag == "position":
        a, b, kw = digits[0], _others(digits[1], [digits[0]]), dict(relation=RELATIONS[digits[2]])
    elif tag == "color_attr":
        a = _others(digits[0], [person])
        b = _others(digits[1], [person, a])
        kw = dict(color=COLORS[digits[2]], color_b=COLORS[_others(digits[3], [digits[2]])])
    else:
        raise ValueError(f"unknown tag {tag!r}")
    prompt, include, exclude = template(tag, names[a], None if b is None else names[b], **kw)
    return {"tag": tag, "include": include, **({"exclude": exclude} if exclude else {}), "prompt": prompt}


def _grid(tag):
    """Sizes of the axes that enumerate every prompt of a tag (mixed radix)."""
    n, c = len(OBJECT_NAMES), len(COLORS)
    return {"single_object": (n,), "two_object": (n, n - 1), "counting": (n, 3), "colors": (n - 1, c),
            "position": (n, n - 1, len(RELATIONS)), "color_attr": (n - 1, n - 2, c, c - 1)}[tag]


def make_prompts(per_tag=800, *, seed=0, exclude=()):
    """GenEval objects drawn without replacement from every prompt create_prompts.py can write.

    Each tag's prompts are enumerated on a grid (class, second class, count, colour, relation),
    shuffled with `seed`, and the first `per_tag` whose prompt text (case-insensitive) is not in
    `exclude` are kept: a train split disjoint from the test prompts. Tags with fewer prompts give
    what they have (single_object: 80 prompts in all, all of them in GenEval's test set).
    """
    rng = np.random.default_rng(seed)
    taken = {p.lower() for p in exclude}
    rows = []
    for tag in TAGS:
        sizes = _grid(tag)
        kept = 0
        for index in rng.permutation(int(np.prod(sizes))):
            if kept == per_tag:
                break
            digits, rest = [], int(index)
            for size in reversed(sizes):
                rest, d = divmod(rest, size)
                digits.append(d)
            row = _prompt(tag, digits[::-1])
            if row["prompt"].lower() not in taken:
                taken.add(row["prompt"].lower())
                rows.append(row)
                kept += 1
    return rows


def write_prompts(path, objects):
    """One JSON line per GenEval object: {"prompt": its prompt, "metadata": the object as it is}."""
    with open(path, "w") as f:
        for obj in objects:
            f.write(json.dumps({"prompt": obj["prompt"], "metadata": obj}) + "\n")


# ----------------------------------------------------------------------------- Mask2Former detector

def _load_error(what, path, flag, err):
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return RuntimeError(f"geneval: cannot load the {what} {path!r} ({type(err).__name__}: {first[:200]}); "
                        f"download it where the hub is reachable and point {flag} at the local copy")


def resized_size(height, width, *, short_edge=800, long_edge=1333):
    """mmcv.imrescale's keep-ratio size for scale (1333, 800): factor min(long / max side, short /
    min side), each side int(side x factor + 0.5) -> (height, width). 512 x 512 -> 800 x 800."""
    factor = min(long_edge / max(height, width), short_edge / min(height, width))
    return int(height * factor + 0.5), int(width * factor + 0.5)


def preprocess(images, *, short_edge=800, long_edge=1333, divisor=32):
    """uint8 [B, H, W, 3] RGB -> (pixels [B, 3, H', W'] float, (h, w) resized size) as mmdet's test
    pipeline: keep-ratio bilinear resize (rounded to uint8 levels, as cv2 on uint8 images), ImageNet
    mean/std of 0-255 pixels (mean 123.675 116.28 103.53, std 58.395 57.12 57.375), zero padding at
    the bottom and right to a multiple of 32. RGB order: official GenEval loads BGR files and its
    pipeline converts them (to_rgb=True)."""
    import torch
    import torch.nn.functional as F

    x = images.permute(0, 3, 1, 2).float()  # [B, 3, H, W]
    h, w = resized_size(x.shape[2], x.shape[3], short_edge=short_edge, long_edge=long_edge)
    x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False).round().clamp(0, 255)
    mean = torch.tensor([123.675, 116.28, 103.53], device=x.device).view(1, 3, 1, 1)
    std = torch.tensor([58.395, 57.12, 57.375], device=x.device).view(1, 3, 1, 1)
    x = (x - mean) / std
    pad_h, pad_w = -h % divisor, -w % divisor
    return F.pad(x, (0, pad_w, 0, pad_h)), (h, w)


def mask_boxes(masks):
    """Tight boxes of boolean masks [N, H, W] -> [N, 4] as mmdet's mask2bbox: [x_min, y_min,
    x_max + 1, y_max + 1]; an empty mask gives [0, 0, 0, 0]."""
    import torch

    boxes = torch.zeros(len(masks), 4)
    cols, rows = masks.any(dim=1), masks.any(dim=2)  # [N, W], [N, H]
    for i in range(len(masks)):
        x, y = cols[i].nonzero().flatten(), rows[i].nonzero().flatten()
        if len(x) and len(y):
            boxes[i] = torch.tensor([x[0], y[0], x[-1] + 1, y[-1] + 1], dtype=torch.float32)
    return boxes


def mask2former_postprocess(class_logits, mask_logits, *, padded_size, resized_size, original_size, top_k=100,
                            min_score=None):
    """One image's Mask2Former outputs -> detections, as mmdetection's Mask2Former test path.

    class_logits [Q, K + 1] (the last is "no object"), mask_logits [Q, h, w] at 1/4 of the padded
    input. Steps (Mask2FormerHead.simple_test, MaskFormerFusionHead.simple_test and
    instance_postprocess): mask logits bilinearly upsampled to the padded input size, cropped to the
    resized image, bilinearly resized to the original image; class probabilities = softmax over
    K + 1, no-object dropped; the top_k (query, class) pairs; binary mask = logit > 0; mask score =
    mean sigmoid inside the mask (+1e-6 in the denominator); score = class probability x mask
    score; box = tight box of the mask. No NMS. Labels index OBJECT_NAMES (K must be 80).
    `min_score` skips pairs whose class probability is <= it: their score (<= the probability,
    the mask score being at most 1) cannot pass a threshold of `min_score`, so GenEval's filtered
    result is unchanged.
    """
    import torch
    import torch.nn.functional as F

    num_queries, num_classes = class_logits.shape[0], class_logits.shape[1] - 1
    if num_classes != len(OBJECT_NAMES):
        raise ValueError(f"the detector predicts {num_classes} classes; GenEval needs the 80 COCO thing classes "
                         f"(a *-coco-instance Mask2Former checkpoint)")
    probs = class_logits.float().softmax(-1)[:, :-1]  # [Q, K]
    scores, index = probs.flatten().topk(min(top_k, probs.numel()))  # [top_k], best first
    if min_score is not None:
        keep = scores > min_score
        scores, index = scores[keep], index[keep]
    if not len(index):
        return []
    query, label = index // num_classes, index % num_classes
    masks = mask_logits[query].float()[None]  # [1, n, h, w]
    masks = F.interpolate(masks, size=padded_size, mode="bilinear", align_corners=False)
    masks = masks[:, :, :resized_size[0], :resized_size[1]]  # drop the padding
    masks = F.interpolate(masks, size=original_size, mode="bilinear", align_corners=False)[0]  # [n, H, W]
    binary = masks > 0
    mask_score = (masks.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
    det_scores = (scores * mask_score).cpu()
    binary = binary.cpu()
    boxes = mask_boxes(binary)
    return [{"class": OBJECT_NAMES[int(label[i])], "score": float(det_scores[i]), "box": boxes[i].tolist(),
             "mask": binary[i].numpy()} for i in range(len(index))]


def mask2former_detector(path=DEFAULT_DETECTOR, device="cpu", *, short_edge=800, long_edge=1333, min_score=THRESHOLD):
    """transformers' Mask2FormerForUniversalSegmentation -> detect(images uint8 [B, H, W, 3] RGB)
    -> per image a list of {"class", "score", "box", "mask" bool [H, W]} (one forward per call).

    The default checkpoint is Meta's Mask2Former Swin-S COCO-instance model converted to
    transformers; official GenEval used OpenMMLab's retrained Swin-S (mmdet config
    mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco), so detections are close but not identical.
    """
    import torch
    from transformers import Mask2FormerForUniversalSegmentation

    try:
        model = Mask2FormerForUniversalSegmentation.from_pretrained(path)
    except Exception as err:
        raise _load_error("Mask2Former checkpoint", path, "--geneval-detector-path", err) from err
    if model.config.num_labels != len(OBJECT_NAMES):
        raise ValueError(f"--geneval-detector-path {path!r} has {model.config.num_labels} labels; GenEval needs "
                         f"the 80 COCO thing classes (a *-coco-instance Mask2Former checkpoint)")
    model = model.eval().to(device)

    @torch.no_grad()
    def detect(images):
        images = torch.as_tensor(np.asarray(images))
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"detect takes uint8 images [B, H, W, 3], got {images.dtype} {tuple(images.shape)}")
        pixels, size = preprocess(images.to(device), short_edge=short_edge, long_edge=long_edge)
        out = model(pixel_values=pixels)
        return [mask2former_postprocess(out.class_queries_logits[i], out.masks_queries_logits[i],
                                        padded_size=tuple(pixels.shape[2:]), resized_size=size,
                                        original_size=tuple(images.shape[1:3]), min_score=min_score)
                for i in range(len(images))]

    return detect


# ----------------------------------------------------------------------------- CLIP colours

def colour_crop(image, detection):
    """What the colour classifier sees of one object (eval L94-106): the image where the mask is
    set and #999999 grey elsewhere (the whole image when there is no mask), cropped to the box
    (PIL rounds the box to whole pixels)."""
    from PIL import Image

    image = np.asarray(image)
    mask = detection.get("mask")
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != image.shape[:2]:
            raise ValueError(f"mask {mask.shape} does not match image {image.shape[:2]}")
        image = np.where(mask[..., None], image, np.array(BACKGROUND, dtype=np.uint8))
    return Image.fromarray(np.ascontiguousarray(image)).crop(tuple(float(v) for v in detection["box"][:4]))


def colour_classifier(model, preprocess, tokenizer, device="cpu", *, batch_size=16):
    """Zero-shot colour of objects -> classify(items) with items = [(image uint8 [H, W, 3],
    detection, class name), ...] -> one of COLORS per item.

    Per class name, the text weights of clip_benchmark's zero_shot_classifier: each colour's three
    COLOR_TEMPLATES embedded, L2-normalised, averaged, renormalised (cached). Each crop
    (`colour_crop`) goes through `preprocess` (CLIP's val transform) in batches of `batch_size`;
    colour = argmax of the normalised image embedding @ weights (run_classification; the x100 does
    not change the argmax). Under fp16 autocast on CUDA, as clip_benchmark's default amp=True.
    """
    import torch
    import torch.nn.functional as F

    weights = {}  # class name -> [D, len(COLORS)]
    on_cuda = str(device).startswith("cuda")
    amp = torch.autocast("cuda", dtype=torch.float16) if on_cuda else torch.autocast("cpu", enabled=False)

    def text_weights(name):
        if name not in weights:
            columns = []
            for colour in COLORS:
                tokens = tokenizer([t.format(c=colour, classname=name) for t in COLOR_TEMPLATES]).to(device)
                embedding = F.normalize(model.encode_text(tokens).float(), dim=-1).mean(0)
                columns.append(embedding / embedding.norm())
            weights[name] = torch.stack(columns, dim=1)
        return weights[name]

    @torch.no_grad()
    def classify(items):
        colours = []
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            pixels = torch.stack([preprocess(colour_crop(image, det)) for image, det, _ in chunk]).to(device)
            with amp:
                features = F.normalize(model.encode_image(pixels).float(), dim=-1)  # [n, D]
                for feature, (_, _, name) in zip(features, chunk):
                    colours.append(COLORS[int((feature @ text_weights(name)).argmax())])
        return colours

    return classify


def clip_colour_classifier(path="openai", device="cpu", *, model_name="ViT-L-14", batch_size=16):
    """`colour_classifier` with open_clip's `model_name` and `path` (a pretrained tag, default
    OpenAI's weights as GenEval, eval L66-67, or a checkpoint file). QuickGELU is forced: the
    OpenAI weights were trained with it (open_clip 2.20 set it for pretrained="openai")."""
    import open_clip

    try:
        model, _, transform = open_clip.create_model_and_transforms(model_name, pretrained=path, force_quick_gelu=True)
    except Exception as err:
        raise _load_error(f"CLIP {model_name} weights", path, "--geneval-clip-path", err) from err
    return colour_classifier(model.eval().to(device), transform, open_clip.get_tokenizer(model_name), device,
                             batch_size=batch_size)


# ----------------------------------------------------------------------------- the reward

def add_arguments(parser):
    """The options of the geneval reward, declared once; argparse dests are the keywords of `reward`."""
    group = parser.add_argument_group("geneval reward")
    group.add_argument("--geneval-detector", default=None,
                       help="object detector: mask2former (photographs; colours from CLIP) or shapes (the exact "
                            "detector of the synthetic shapes world, colours included); default: shapes for "
                            "train.py --model shapes, else mask2former")
    group.add_argument("--geneval-detector-path", default=DEFAULT_DETECTOR,
                       help="hub id or local folder of a transformers Mask2Former COCO-instance checkpoint")
    group.add_argument("--geneval-clip-path", default="openai",
                       help="open_clip pretrained tag or checkpoint file of the colour classifier "
                            "(openai: OpenAI's ViT-L/14 weights from the hub, as GenEval)")
    group.add_argument("--geneval-clip-model", default="ViT-L-14", help="open_clip architecture of --geneval-clip-path")
    group.add_argument("--geneval-score", default="partial", choices=SCORES,
                       help="the trained reward: partial (Flow-GRPO/DiffusionNFT/AWM's partial credit, quirks kept), "
                            "strict (exact counts, 0/1), correct (official GenEval 0/1), corrected (partial credit "
                            "consistent with the official rules, in [0, 1])")
    group.add_argument("--geneval-batch-size", type=int, default=8,
                       help="images per detector forward and object crops per CLIP forward, per GPU")
    group.add_argument("--geneval-jpeg", action=argparse.BooleanOptionalAction, default=False,
                       help="score each image after a JPEG round trip at PIL's default quality (75), as AWM's GenEval "
                            "reward sends its images to the reward server (detection and colours see the decoded "
                            "pixels); off: the raw pixels, as DiffusionNFT's")
    return group


def options():
    """The argparse dests of `add_arguments`, i.e. the keywords `reward` needs."""
    return tuple(defaults())


def defaults():
    """{dest: default} of `add_arguments`: the single source of the reward's defaults."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return vars(parser.parse_args([]))


def _as_uint8(images):
    if hasattr(images, "detach"):  # a torch tensor
        images = images.detach().cpu().numpy()
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"geneval scores uint8 images [B, H, W, 3], got {images.dtype} {images.shape}")
    return images


def jpeg_roundtrip(images):
    """uint8 [B, H, W, 3] -> the same images JPEG-encoded at PIL's default quality (75, 4:2:0) and decoded: what
    AWM's geneval_score sends (flow_grpo/rewards.py L189-196, `img.save(buffer, format="JPEG")`) and its reward
    server detects on (reward-server/app_geneval.py L33)."""
    import io

    from PIL import Image

    out = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG")
        out.append(np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")))
    return np.stack(out)


def reward(*, detect, vocabulary, device, geneval_detector, geneval_clip_path, geneval_clip_model, geneval_score,
           geneval_batch_size, geneval_jpeg, counting_threshold=COUNTING_THRESHOLD, **_):
    """GenEval reward -> score(images uint8 [B, H, W, 3], prompts, metadata) -> {"reward": the
    `geneval_score` [B], "geneval_correct": the judge's 0/1 [B], "geneval_official": GenEval's own rule's 0/1 [B]
    (they differ only by the departures of the module docstring), "geneval_strict" [B], and for each of
    the six TAGS "geneval_<tag>" [B]: the judge's 0/1 on that tag's samples, NaN elsewhere}.

    Every tag entry is always present (all NaN when the batch has none of that tag) so that every
    batch and every rank reports the same keys. detect(uint8 [b, H, W, 3]) -> b lists of detections is the
    detector named by geneval_detector (rewards.GENEVAL_DETECTORS builds it; vocabulary: the classes and colours it
    reports, or None; counting_threshold: its score that keeps a counting prompt's detection), called in batches of
    `geneval_batch_size` images; the colour classifier (only for detections without a colour) is loaded now for
    mask2former, whose detections never have one, else on first use. With `geneval_jpeg` both see each image after
    `jpeg_roundtrip`, as AWM's reward server did.
    """
    import torch

    if geneval_score not in SCORES:
        raise ValueError(f"--geneval-score must be one of {', '.join(SCORES)}, got {geneval_score!r}")
    if geneval_batch_size < 1:
        raise ValueError(f"--geneval-batch-size must be >= 1, got {geneval_batch_size}")
    classifier = []  # loaded once, when first needed

    def classify(items):
        if not classifier:
            classifier.append(clip_colour_classifier(geneval_clip_path, device, model_name=geneval_clip_model,
                                                     batch_size=geneval_batch_size))
        return classifier[0](items)

    if geneval_detector == "mask2former":  # photographs have no colour labels: fail now, not at the first colour prompt
        classify([])

    def score(images, prompts, metadata):
        images = _as_uint8(images)
        if geneval_jpeg:
            images = jpeg_roundtrip(images)
        metadata = list(metadata) if metadata is not None else [None] * len(images)
        if not len(images) == len(prompts) == len(metadata):
            raise ValueError(f"geneval: {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata")
        for i, m in enumerate(metadata):
            try:
                check_metadata(m, vocabulary=vocabulary, detector=geneval_detector)
            except ValueError as err:
                raise ValueError(f"geneval: sample {i} ({prompts[i][:60]!r}): {err}") from None
        detections = []
        for start in range(0, len(images), geneval_batch_size):
            detections += detect(images[start:start + geneval_batch_size])
        detections = [[dict(d) for d in dets] for dets in detections]  # colours are written into copies
        jobs = []  # (image index, detection, class) the colour clauses look at that have no colour yet
        for i, (m, dets) in enumerate(zip(metadata, detections)):
            kept = kept_detections(dets, m["tag"], counting_threshold=min(counting_threshold, COUNTING_THRESHOLD))
            for clause in m["include"]:
                if "color" in clause:
                    jobs += [(i, d, clause["class"]) for d in kept.get(clause["class"], [])[:clause["count"]]
                             if d.get("color") is None]
        if jobs:
            for (_, det, _), colour in zip(jobs, classify([(images[i], det, name) for i, det, name in jobs])):
                det["color"] = colour
        verdicts = [geneval_judge(m, dets, score=geneval_score, counting_threshold=counting_threshold)
                    for m, dets in zip(metadata, detections)]
        correct = torch.tensor([v["correct"] for v in verdicts])
        out = {"reward": torch.tensor([v["score"] for v in verdicts], dtype=torch.float32),
               "geneval_correct": correct, "geneval_official": torch.tensor([v["official"] for v in verdicts]),
               "geneval_strict": torch.tensor([v["strict"] for v in verdicts])}
        for tag in TAGS:
            mine = torch.tensor([m["tag"] == tag for m in metadata])
            out[f"geneval_{tag}"] = torch.where(mine, correct, torch.tensor(float("nan")))
        return out

    return score


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Write GenEval-format prompt files.")
    p.add_argument("--make-prompts", action="store_true", help="write a train split disjoint from --test")
    p.add_argument("--test", default="prompts/geneval_test.jsonl", help="held-out prompts (rows as prompts/*.jsonl)")
    p.add_argument("--out", default="prompts/geneval_train.jsonl", help="output JSONL")
    p.add_argument("--per-tag", type=int, default=800, help="prompts per tag at most")
    p.add_argument("--seed", type=int, default=0, help="shuffling seed")
    args = p.parse_args()
    if not args.make_prompts:
        p.error("nothing to do: pass --make-prompts")
    with open(args.test) as f:
        held_out = [json.loads(line)["prompt"] for line in f if line.strip()]
    rows = make_prompts(args.per_tag, seed=args.seed, exclude=held_out)
    write_prompts(args.out, rows)
    counts = {tag: sum(r["tag"] == tag for r in rows) for tag in TAGS}
    print(f"wrote {len(rows)} prompts to {args.out} ({counts}), none of the {len(held_out)} in {args.test}")
