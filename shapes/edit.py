"""The shapes world's edit tasks: a source scene, an instruction, and the target state the instruction asks for.

    add      "add a red circle to the left of the blue square"   one new object, in a relation to a named one
    recolor  "change the green triangle to yellow"               one object's colour; the rest as it was
    remove   "remove the square"                                 one object gone; the rest as it was
    count    "make two circles into three"                       one more object of a class, of any colour

    edit_example(rng, kind)        an edit task: row, source and target scenes
    judge_edit(metadata, dets)     the exact verdict on an edited image; edit_reward: the `shapes_edit` reward
    write_edit_prompts()           prompts/shapes_edit_{train,test,unseen}.jsonl and their source PNGs

A row of prompts/shapes_edit_{train,test}.jsonl (read with --input-key prompt --metadata-key ""):
    {"prompt", "image": the source PNG (data.py), "edit": kind, "source": the source's objects as drawn,
     "target": [{"class", "color" (null: any), "at": index of the source object it keeps (null: a new object),
                 "position": [relation, target index] (the new object of "add")}]}
`judge_edit` checks the target exactly with the detector: every clause present (class and colour), each kept
object where it was (its box overlapping the source box by EDIT_PLACE_IOU), the new object in its relation
(GenEval's rule), and nothing else in the image.
"""

import json
import os

import numpy as np

import geneval
from shapes.world import COLORS, GAP, MARGIN, SHAPES, SIZE_RANGE, apart, detect, draw, object_box

EDITS = ("add", "recolor", "remove", "count")
EDIT_RELATIONS = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}
EDIT_THRESHOLD = 0.5  # detections scoring above this are objects (GenEval keeps > 0.3, > 0.9 for counting)
EDIT_PLACE_IOU = 0.5  # a kept object must overlap its source box by this IoU: not moved, not resized
EDIT_ROWS = {"train": 150, "test": 50}  # rows per kind


def _box_iou(a, b):
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union if union > 0 else 0.0


def _place(objects, placed, size, rng, side_range, relation=None, tries=50):
    """`objects` ({shape, color}) at random places, each GAP from the others (and from `placed`) and MARGIN from the
    border, sides drawn from side_range (px of a 32 px image), positions rounded to 1/100 px -> the list, or None.
    relation (rel, anchor): the first object must stand in that relation, and no other, to `anchor`, as `layout`
    keeps it (boxes grown by 2 px)."""
    scale, out = size / 32, []
    for obj in objects:
        for _ in range(tries):
            side = round(rng.uniform(*side_range) * scale, 2)
            half = side / 2 + MARGIN * scale
            new = dict(obj, size=side, cx=round(rng.uniform(half, size - half), 2),
                       cy=round(rng.uniform(half, size - half), 2))
            if not apart(placed + out + [new], GAP * scale):
                continue
            if relation is not None and not out:
                rel, anchor = relation
                grow = 2 * scale
                a = [v + d for v, d in zip(object_box(new), (-grow, -grow, grow, grow))]
                b = [v + d for v, d in zip(object_box(anchor), (-grow, -grow, grow, grow))]
                plain = geneval.relative_position(object_box(new), object_box(anchor))
                if geneval.relative_position(a, b) != {rel} or plain != {rel}:
                    continue
            out.append(new)
            break
        else:
            return None
    return out


def _distinct_objects(n, rng, taken=()):
    """n objects {shape, color} whose (shape, color) pairs differ from each other and from `taken`."""
    pairs = [(s, c) for s in SHAPES for c in COLORS if (s, c) not in taken]
    return [{"shape": s, "color": c} for s, c in (pairs[i] for i in rng.choice(len(pairs), n, replace=False))]


def edit_example(rng, kind=None, size=32):
    """One edit task: (row without "image", source uint8 [size, size, 3], target uint8 [size, size, 3]).

    Sources hold 1-3 objects with distinct (class, colour) pairs (count: k = 1-3 of one class and colour, and
    at most one other object), so every object an instruction names is unique; all objects of a scene take the
    sizes of SIZE_RANGE for the larger of its two object counts. The target keeps the other objects exactly."""
    kind = kind or EDITS[rng.integers(len(EDITS))]
    if kind not in EDITS:
        raise ValueError(f"unknown edit {kind!r}; this world has {', '.join(EDITS)}")
    while True:
        if kind == "add":
            src = _distinct_objects(rng.integers(1, 3), rng)
            new = _distinct_objects(1, rng, taken={(o["shape"], o["color"]) for o in src})[0]
            anchor, rel = int(rng.integers(len(src))), geneval.RELATIONS[rng.integers(len(geneval.RELATIONS))]
            sides = SIZE_RANGE[len(src) + 1]
        elif kind == "count":
            k, shape = int(rng.integers(1, 4)), SHAPES[rng.integers(len(SHAPES))]
            color = list(COLORS)[rng.integers(len(COLORS))]
            others = [] if k == 3 or rng.random() < 0.5 else [
                {"shape": s, "color": list(COLORS)[rng.integers(len(COLORS))]} for s in
                [[s for s in SHAPES if s != shape][rng.integers(2)]]]
            src = [{"shape": shape, "color": color} for _ in range(k)] + others
            sides = SIZE_RANGE[len(src) + 1]
        else:
            src = _distinct_objects(rng.integers(1, 4) if kind == "recolor" else rng.integers(2, 4), rng)
            sides = SIZE_RANGE[len(src)]
        source = _place(src, [], size, rng, sides)
        if source is None:
            continue
        target = [{"class": o["shape"], "color": o["color"], "at": i} for i, o in enumerate(source)]
        drawn = [dict(o) for o in source]  # the target scene
        if kind == "add":
            placed = _place([new], source, size, rng, sides, relation=(rel, source[anchor]))
            if placed is None:
                continue
            a = source[anchor]
            prompt = (f"add {geneval._with_article(new['color'])} {new['shape']} {EDIT_RELATIONS[rel]} "
                      f"the {a['color']} {a['shape']}")
            target.append({"class": new["shape"], "color": new["color"], "at": None, "position": [rel, anchor]})
            drawn += placed
        elif kind == "count":
            placed = _place([dict(src[0])], source, size, rng, sides)  # the picture shows one more alike
            if placed is None:
                continue
            numbers = geneval.NUMBERS
            prompt = f"make {numbers[k]} {geneval._plural(shape) if k > 1 else shape} into {numbers[k + 1]}"
            target.append({"class": shape, "color": None, "at": None})
            drawn += placed
        elif kind == "recolor":
            i = int(rng.integers(len(source)))
            o = source[i]
            taken = {(p["shape"], p["color"]) for p in source}  # o's own pair too: the colour changes
            choices = [c for c in COLORS if (o["shape"], c) not in taken]
            color = choices[rng.integers(len(choices))]
            prompt = f"change the {o['color']} {o['shape']} to {color}"
            target[i]["color"] = drawn[i]["color"] = color
        else:  # remove
            i = int(rng.integers(len(source)))
            o = source[i]
            unique = sum(p["shape"] == o["shape"] for p in source) == 1
            prompt = f"remove the {o['shape']}" if unique else f"remove the {o['color']} {o['shape']}"
            del target[i], drawn[i]
        row = {"prompt": prompt, "edit": kind, "source": source, "target": target}
        return row, draw(source, size), draw(drawn, size)


def judge_edit(metadata, detections, *, threshold=EDIT_THRESHOLD):
    """The verdict on one edited image: {"correct": 0/1, "score": in [0, 1], "reason": the first failure}.

    Objects are the detections scoring above `threshold`. Each kept clause ("at") takes the unused detection of
    its class and colour that overlaps its source box most, if by EDIT_PLACE_IOU; then each new clause the best
    unused detection of its class (and colour, if given). Terms: one per clause (matched), one per position
    clause (matched, anchor matched, and the relation holds by geneval.relative_position). The score is their
    mean times target / (target + extra objects); correct means every term holds and no object is extra.
    Extra is every component the detector reports and no clause took, whatever its score: one that fits no
    template (UNKNOWN, e.g. the removed square squashed into a bar), a speck, an object scoring under
    `threshold`: each is something where the target has nothing."""
    found = sorted((d for d in detections if d["score"] > threshold), key=lambda d: -d["score"])
    unnamed = sum(d["score"] <= threshold for d in detections)  # components no clause can take
    source, target = metadata["source"], metadata["target"]
    match, used = [None] * len(target), set()

    def fits(d, clause):
        return d["class"] == clause["class"] and clause.get("color") in (None, d["color"])

    for i, clause in enumerate(target):
        if clause.get("at") is not None:
            box = object_box(source[clause["at"]])
            overlaps = [(_box_iou(d["box"], box), j) for j, d in enumerate(found) if j not in used and fits(d, clause)]
            iou, j = max(overlaps, default=(0.0, None))
            if j is not None and iou >= EDIT_PLACE_IOU:
                match[i] = j
                used.add(j)
    for i, clause in enumerate(target):
        if clause.get("at") is None:
            j = next((j for j, d in enumerate(found) if j not in used and fits(d, clause)), None)
            if j is not None:
                match[i] = j
                used.add(j)
    terms, reasons = [], []
    for i, clause in enumerate(target):
        terms.append(float(match[i] is not None))
        what = f"{clause.get('color') or ''} {clause['class']}".strip()
        if match[i] is None:
            reasons.append(f"no {what}" + (" where it was" if clause.get("at") is not None else ""))
        if clause.get("position"):
            rel, k = clause["position"]
            holds = match[i] is not None and match[k] is not None and rel in geneval.relative_position(
                found[match[i]]["box"], found[match[k]]["box"])
            terms.append(float(holds))
            if not holds and match[i] is not None:
                reasons.append(f"the {what} is not {rel} its anchor")
    extra = len(found) - len(used) + unnamed
    if extra:
        reasons.append(f"{extra} object(s) too many" + (f" ({unnamed} unexplained)" if unnamed else ""))
    score = sum(terms) / len(terms) * len(target) / (len(target) + extra) if target else float(extra == 0)
    return {"correct": float(not reasons), "score": score, "reason": reasons[0] if reasons else ""}


EDIT_SCORES = ("correct", "partial")


def add_arguments(parser):
    """The option of the `shapes_edit` reward (rewards.add_arguments wires it in)."""
    group = parser.add_argument_group("shapes_edit reward")
    group.add_argument("--shapes-edit-score", default="correct", choices=EDIT_SCORES,
                       help="the trained reward: correct (judge_edit's 0/1, the held-out metric) or partial (its "
                            "partial score: the mean of the clauses held, less for extra objects)")
    return group


def edit_row_check(metadata):
    """The check at load of a row the shapes_edit reward will judge: its source and target lists."""
    if not isinstance(metadata.get("target"), list) or not isinstance(metadata.get("source"), list):
        raise ValueError("shapes_edit judges rows of prompts/shapes_edit_*.jsonl (their source and target); "
                         "read them with --input-key prompt --metadata-key ''")


def edit_reward(*, shapes_edit_score, **_):
    """The `shapes_edit` reward (rewards.REWARDS): each image detected and judged against its row's target
    (judge_edit). Returns {"reward": the `shapes_edit_score`, "edit_correct": 0/1, "edit_partial": the partial score,
    "edit_<kind>": 0/1 for the samples of that kind, NaN for the others (nanmean: accuracy per kind)}.

    The 0/1 verdict is the default, the held-out metric: the partial score's kept-object terms dominate it, so it
    can rise while the edits themselves stay wrong."""
    import torch

    if shapes_edit_score not in EDIT_SCORES:
        raise ValueError(f"--shapes-edit-score must be one of {', '.join(EDIT_SCORES)}, got {shapes_edit_score!r}")

    def score(images, prompts, metadata):
        images = np.asarray(images)
        for m in metadata:
            edit_row_check(m)
        verdicts = [judge_edit(m, d) for m, d in zip(metadata, detect(images))]
        out = {"edit_correct": torch.tensor([v["correct"] for v in verdicts]),
               "edit_partial": torch.tensor([v["score"] for v in verdicts])}
        out["reward"] = out["edit_correct" if shapes_edit_score == "correct" else "edit_partial"].clone()
        for kind in EDITS:
            out[f"edit_{kind}"] = torch.tensor([v["correct"] if m.get("edit") == kind else float("nan")
                                                for v, m in zip(verdicts, metadata)])
        return out

    return score


def write_edit_prompts(folder="prompts", seed=0):
    """Write prompts/shapes_edit_{train,test,unseen}.jsonl and their source PNGs in prompts/shapes_edit/<split>/:
    EDIT_ROWS rows of each kind, from independent streams (train seed, test seed + 1, unseen seed + 2), so the
    held-out sources are scenes training never saw.

    The test split is held out by scene, not by instruction: the instruction space of this world is small (a count
    edit has 9 possible instructions, a removal 21), and 146 of the 200 test instructions appear verbatim in
    training. The unseen split holds only instructions no training row has: 50 additions and 50 recolourings
    (UNSEEN_EDITS). Counting and removal cannot have one: training holds all 9 count instructions and 20 of the 21
    removals (the other is "remove the white square", one instruction)."""
    for offset, split_name in enumerate(("train", "test")):
        rng = np.random.default_rng(seed + offset)
        kinds = [kind for kind in EDITS for _ in range(EDIT_ROWS[split_name])]
        rows = [_edit_row(*edit_example(rng, kind)[:2], split_name, i, folder) for i, kind in enumerate(kinds)]
        _write_edit_rows(folder, split_name, rows)
        if split_name == "train":
            seen = {r["prompt"] for r in rows}  # the instructions the unseen split must avoid
    rng, rows = np.random.default_rng(seed + 2), []
    for kind in UNSEEN_EDITS:
        kept = 0
        while kept < EDIT_ROWS["test"]:
            row, source, _ = edit_example(rng, kind)
            if row["prompt"] not in seen:  # repeats among the unseen rows are allowed: other scenes, as in test
                rows.append(_edit_row(row, source, "unseen", len(rows), folder))
                kept += 1
    _write_edit_rows(folder, "unseen", rows)


UNSEEN_EDITS = ("add", "recolor")  # the kinds whose instructions can be held out (write_edit_prompts)


def _edit_row(row, source, split_name, index, folder):
    """A prompt-file row for edit_example's (row, source): the source saved as its split's index-th PNG."""
    from PIL import Image
    name = f"shapes_edit/{split_name}/{index:04d}.png"
    os.makedirs(os.path.join(folder, "shapes_edit", split_name), exist_ok=True)
    Image.fromarray(source).save(os.path.join(folder, name))
    return {"prompt": row["prompt"], "image": name, **{k: v for k, v in row.items() if k != "prompt"}}


def _write_edit_rows(folder, split_name, rows):
    path = os.path.join(folder, f"shapes_edit_{split_name}.jsonl")
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {path}: {len(rows)} rows, sources in {os.path.join(folder, 'shapes_edit', split_name)}")


# The edit model: FLUX.1 Kontext's pipeline (the `flux-kontext` family, families/flux_kontext.py) at toy size in
# pixel space.
# Its "VAE" folds each 2 x 2 block of pixels into 12 channels (a lossless space-to-depth, so vae_scale_factor 2);
# the pipeline packs 2 x 2 of those into a token: 8 x 8 tokens of 4 x 4 pixels, as the shapes model's patches.
# Source image tokens follow the target's (Kontext's position ids); text: two CLIP encoders (pooled and sequence,
# in the CLIP and T5 slots). No guidance embedding: the model is sampled without guidance. Trained from scratch by
# scripts/pretrain_shapes_edit.py into weights/shapes_edit.safetensors (families/shapes.py builds it).

EDIT_WEIGHTS = "weights/shapes_edit.safetensors"
EDIT_TRANSFORMER = dict(  # FLUX MMDiT: 4 double- and 2 single-stream blocks of width 128 (4 heads x 32)
    patch_size=1, in_channels=48, num_layers=4, num_single_layers=2, attention_head_dim=32, num_attention_heads=4,
    joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False, axes_dims_rope=(8, 12, 12))
