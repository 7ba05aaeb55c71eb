"""The shapes world: coloured shapes on a grey background, where prompt following can be measured exactly.

GenEval (Ghosh et al. 2023) scores a text-to-image model by detecting the objects its images show
and checking counts, colours and relative positions against the prompt's metadata. Here the
objects are simple shapes, so the detector can be exact and the whole loop runs on a CPU:

    prompt_rows(tag)               GenEval's six prompt templates over this world's shapes and colours
    split(seed)                    the held-out split: prompts/shapes_{train,train_hard,test}.jsonl (write_prompts)
    layout(metadata, size, rng)    object list satisfying a prompt's metadata (positions by GenEval's rule)
    draw(objects, size)            the scene, anti-aliased (4 x 4 supersampled), uint8 [size, size, 3]
    render(metadata, size, rng)    draw(layout(...)): pretraining data
    detect(images)                 per image, GenEval-style detections {class, score, box, mask, color}

Prompt metadata is GenEval's JSONL format (prompts/evaluation_metadata.jsonl of djghosh13/geneval):
`tag`, `include`: [{class, count, color?, position?: [relation, index]}], `exclude`: [{class, count}],
with this world's shape names as classes and GenEval's colour words. The pretrained model's architecture and
weight file are named at the bottom (families/shapes.py builds it).
"""

import collections
import functools
import hashlib
import itertools
import json
import math
import os
import threading

import numpy as np

import geneval

SHAPES = ("circle", "square", "triangle")
# A subset of GenEval's ten colour words that stays apart after a small model's blur; the
# background is a grey that is none of them (GenEval's colour crops use #999 for the same reason).
COLORS = {
    "red": (225, 30, 30),
    "yellow": (240, 215, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 225),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
BACKGROUND = (128, 128, 128)
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

# ----------------------------------------------------------------------------- prompts

def prompt_rows(tag):
    """Every prompt of one GenEval task type in this world, as rows {"prompt", "metadata"}: GenEval's templates
    (geneval.template) over this world's shapes and colours. Two objects are always of different classes,
    counts are 2-4, colour attribution uses two different colours."""
    colors = list(COLORS)
    if tag == "single_object":
        rows = [geneval.template(tag, a) for a in SHAPES]
    elif tag == "two_object":
        rows = [geneval.template(tag, a, b) for a, b in itertools.permutations(SHAPES, 2)]
    elif tag == "counting":
        rows = [geneval.template(tag, a, count=n) for a, n in itertools.product(SHAPES, (2, 3, 4))]
    elif tag == "colors":
        rows = [geneval.template(tag, a, color=c) for a, c in itertools.product(SHAPES, colors)]
    elif tag == "position":
        rows = [geneval.template(tag, a, b, relation=rel)
                for (a, b), rel in itertools.product(itertools.permutations(SHAPES, 2), geneval.RELATIONS)]
    elif tag == "color_attr":
        rows = [geneval.template(tag, a, b, color=ca, color_b=cb) for (a, b), (ca, cb) in
                itertools.product(itertools.permutations(SHAPES, 2), itertools.permutations(colors, 2))]
    else:
        raise ValueError(f"unknown GenEval tag {tag!r}; choose one of {', '.join(TAGS)}")
    return [{"prompt": p, "metadata": {"tag": tag, "include": inc, "exclude": exc}} for p, inc, exc in rows]


# ----------------------------------------------------------------------------- prompt files

TEST_FRACTION = 1 / 3  # of each tag's prompts held out; all single-object prompts are held out (see split)
ROWS_PER_TAG = {"train": 120, "test": 60}


def split(seed=0):
    """(train rows, test rows): disjoint prompts, each tag cycled to ROWS_PER_TAG rows so that tags
    weigh the same in training and the overall accuracy equals the mean over images.

    Every single-object prompt is held out, as in Flow-GRPO's GenEval training set: it was filtered
    against GenEval's test prompts (dataset/geneval_filter_test.py), which hold a single-object prompt
    for each class, so none can remain. Of the other tags a seeded third is held out, spread over the
    classes, colours, counts and relations (in rounds, each taking rows whose values are new to the
    round). Repeated test rows are sampled with different noise (eval.seeded_noise seeds by row
    index), as Flow-GRPO repeats each GenEval test prompt 4 times.
    """
    rng = np.random.default_rng(seed)
    train, test = [], []
    for tag in TAGS:
        rows = prompt_rows(tag)
        order = rng.permutation(len(rows)).tolist()
        held = len(rows) if tag == "single_object" else max(1, round(len(rows) * TEST_FRACTION))
        chosen = []
        while len(chosen) < held:  # rounds; a round takes rows whose classes, colours, counts, relations are new to it
            seen = set()
            for i in order:
                features = _features(rows[i]["metadata"])
                if len(chosen) < held and i not in chosen and not features & seen:
                    chosen.append(i)
                    seen |= features
        test.append([rows[i] for i in sorted(chosen)])
        train.append([rows[i] for i in range(len(rows)) if i not in chosen])
    cycle = lambda rows, n: [rows[i % len(rows)] for i in range(n)] if rows else []  # noqa: E731
    return ([r for rows in train for r in cycle(rows, ROWS_PER_TAG["train"])],
            [r for rows in test for r in cycle(rows, ROWS_PER_TAG["test"])])


def _features(metadata):
    """What a prompt varies: its classes, colours, relations and counts above one."""
    return {(key, str(clause.get(key))) for clause in metadata["include"]
            for key in ("class", "count", "color", "position") if clause.get(key) not in (None, 1)}


def hard_rows(train):
    """The training rows without the colours tag (prompts/shapes_train_hard.jsonl): the base model gets a single
    object's colour right 0.77-0.85 of the time and RL takes it past 0.9 within 50 steps, so this mix spends those
    steps on two objects, counting, position and colour attribution. Measured in docs/long_run.md ("The plateau"): on
    seed 1 it trails the five-tag mix and learns even position and colour attribution less."""
    return [r for r in train if r["metadata"]["tag"] != "colors"]


def write_prompts(folder="prompts", seed=0):
    """Write prompts/shapes_train.jsonl, its hard_rows as prompts/shapes_train_hard.jsonl and
    prompts/shapes_test.jsonl (read with --input-key prompt)."""
    train, test = split(seed)
    for name, rows in (("train", train), ("test", test), ("train_hard", hard_rows(train))):
        path = os.path.join(folder, f"shapes_{name}.jsonl")
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {path}: {len(rows)} rows, {len({r['prompt'] for r in rows})} distinct prompts")


# ----------------------------------------------------------------------------- scenes

def object_box(obj):
    """The box [x1, y1, x2, y2] (float pixels) of a drawn object {shape, color, cx, cy, size}."""
    h = obj["size"] / 2
    return [obj["cx"] - h, obj["cy"] - h, obj["cx"] + h, obj["cy"] + h]


# object side in px of a 32 px image, by the number of objects in the scene
SIZE_RANGE = {1: (12, 16), 2: (11, 15), 3: (10, 13), 4: (9, 12)}
GAP = 2.0  # px (of 32) between the boxes of two objects, so that same-coloured objects never touch
MARGIN = 1.0  # px (of 32) between a box and the image border


def layout(metadata, size, rng, *, max_tries=1000):
    """Objects [{shape, color, cx, cy, size}] (pixel units of a `size` image) that satisfy `metadata`.

    Each include clause gives `count` objects of its class, with its colour or a random one;
    nothing else is drawn, so exclude clauses hold too. Sizes depend on how many objects share the
    image (SIZE_RANGE). A position clause holds by GenEval's rule with a clear margin: the asked
    relation, and no other, holds after the boxes grow by 2 px on every side (so a small model that
    is a few pixels off still draws the relation). Objects keep GAP apart and MARGIN from the border.
    """
    include = metadata.get("include") or []
    if not include:
        raise ValueError("metadata has no include clause; a scene needs at least one object "
                         "({'class': 'circle', 'count': 1})")
    objects, position = [], None
    for index, clause in enumerate(include):
        if clause["class"] not in SHAPES:
            raise ValueError(f"unknown class {clause['class']!r}; this world has {', '.join(SHAPES)}")
        if clause.get("color") is not None and clause["color"] not in COLORS:
            raise ValueError(f"unknown colour {clause['color']!r}; this world has {', '.join(COLORS)}")
        if clause.get("position"):
            position = (clause["position"][0], index, clause["position"][1])
        for _ in range(int(clause["count"])):
            color = clause.get("color") or list(COLORS)[rng.integers(len(COLORS))]
            objects.append({"shape": clause["class"], "color": color, "clause": index})
    if not 1 <= len(objects) <= 4:
        raise ValueError(f"a scene holds 1-4 objects, the metadata asks for {len(objects)}")
    scale = size / 32
    lo, hi = SIZE_RANGE[len(objects)]
    for _ in range(max_tries):
        placed = []
        for obj in objects:  # one at a time, each with a few tries to keep clear of the ones placed
            side = rng.uniform(lo, hi) * scale
            half = side / 2 + MARGIN * scale
            for _ in range(50):
                new = dict(obj, size=side, cx=rng.uniform(half, size - half), cy=rng.uniform(half, size - half))
                if apart(placed + [new], GAP * scale):
                    placed.append(new)
                    break
        if len(placed) < len(objects):
            continue
        if position is not None:
            rel, i, j = position
            first = lambda k: next(o for o in placed if o["clause"] == k)  # noqa: E731 (one object per clause here)
            grow = 2 * scale
            a = [v + d for v, d in zip(object_box(first(i)), (-grow, -grow, grow, grow))]
            b = [v + d for v, d in zip(object_box(first(j)), (-grow, -grow, grow, grow))]
            plain = geneval.relative_position(object_box(first(i)), object_box(first(j)))
            if geneval.relative_position(a, b) != {rel} or plain != {rel}:
                continue
        return [{k: v for k, v in o.items() if k != "clause"} for o in placed]
    raise RuntimeError(f"no layout found for {metadata} in {max_tries} tries")


def apart(objects, gap):
    """Whether every two objects' boxes keep `gap` (px) apart."""
    for a, b in itertools.combinations(objects, 2):
        ba, bb = object_box(a), object_box(b)
        if ba[0] < bb[2] + gap and bb[0] < ba[2] + gap and ba[1] < bb[3] + gap and bb[1] < ba[3] + gap:
            return False
    return True


SUPERSAMPLE = 4


def coverage(obj, size, supersample=SUPERSAMPLE):
    """Fraction of each pixel of a `size` image that the object covers: float [size, size].

    Each pixel is the mean of supersample x supersample point tests (only pixels near the object are tested)."""
    cx, cy, h = obj["cx"], obj["cy"], obj["size"] / 2
    out = np.zeros((size, size))
    x0, x1 = max(int(cx - h) - 1, 0), min(int(cx + h) + 2, size)  # pixel window around the object
    y0, y1 = max(int(cy - h) - 1, 0), min(int(cy + h) + 2, size)
    if x0 >= x1 or y0 >= y1:
        return out
    x = (np.arange(x0 * supersample, x1 * supersample) + 0.5)[None, :] / supersample  # sub-pixel centres
    y = (np.arange(y0 * supersample, y1 * supersample) + 0.5)[:, None] / supersample
    if obj["shape"] == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= h * h
    elif obj["shape"] == "square":
        inside = (np.abs(x - cx) <= h) & (np.abs(y - cy) <= h)
    elif obj["shape"] == "triangle":  # apex up, base down: |x - cx| <= half-width at that height
        t = (y - (cy - h)) / (2 * h)  # 0 at the apex, 1 at the base
        inside = (t >= 0) & (t <= 1) & (np.abs(x - cx) <= h * t)
    else:
        raise ValueError(f"unknown shape {obj['shape']!r}; this world has {', '.join(SHAPES)}")
    out[y0:y1, x0:x1] = inside.reshape(y1 - y0, supersample, x1 - x0, supersample).mean(axis=(1, 3))
    return out


def draw(objects, size=32):
    """The scene: background, then each object painted over it by its pixel coverage -> uint8 [size, size, 3]."""
    image = np.empty((size, size, 3), dtype=np.float64)
    image[:] = BACKGROUND
    for obj in objects:
        alpha = coverage(obj, size)[..., None]
        image = image * (1 - alpha) + np.array(COLORS[obj["color"]], dtype=np.float64) * alpha
    return np.round(image).astype(np.uint8)


def render(metadata, size=32, rng=None):
    """A scene that satisfies `metadata` (GenEval JSONL fields) -> uint8 [size, size, 3]."""
    rng = rng if rng is not None else np.random.default_rng()
    return draw(layout(metadata, size, rng), size)


# ----------------------------------------------------------------------------- detector

def unmix(images):
    """Each pixel as background + alpha x (palette colour - background), for its best-fitting colour.

    A small model's blur mixes an object's colour with the background along their edges; fitting
    that mixture (least squares in RGB, alpha clipped to [0, 1]) names the colour of an edge pixel
    correctly where the nearest palette colour would not (half red, half grey is nearer brown than
    red). Returns (color index int [B, H, W], alpha float [B, H, W], residual float [B, H, W]).
    """
    x = np.asarray(images, dtype=np.float32) - np.array(BACKGROUND, dtype=np.float32)  # [B, H, W, 3]
    d = np.array(list(COLORS.values()), dtype=np.float32) - np.array(BACKGROUND, dtype=np.float32)  # [K, 3]
    alpha = np.clip(x @ d.T / (d * d).sum(1), 0, 1)  # [B, H, W, K]
    residual = ((x[..., None, :] - alpha[..., None] * d) ** 2).sum(-1)  # [B, H, W, K]
    best = residual.argmin(-1)
    take = lambda a: np.take_along_axis(a, best[..., None], -1)[..., 0]  # noqa: E731
    return best, take(alpha), take(residual)


def template(shape, cx, cy, w, h, size, supersample=SUPERSAMPLE):
    """Coverage [size, size] of a shape stretched to a w x h box centred at (cx, cy): an ellipse, a
    rectangle or an apex-up triangle. The detector's templates; scenes are drawn by `coverage`."""
    out = np.zeros((size, size))
    x0, x1 = max(int(cx - w / 2) - 1, 0), min(int(cx + w / 2) + 2, size)
    y0, y1 = max(int(cy - h / 2) - 1, 0), min(int(cy + h / 2) + 2, size)
    if x0 >= x1 or y0 >= y1:
        return out
    dx = (np.arange(x0 * supersample, x1 * supersample) + 0.5)[None, :] / supersample - cx
    dy = (np.arange(y0 * supersample, y1 * supersample) + 0.5)[:, None] / supersample - cy
    if shape == "circle":
        inside = (dx / (w / 2)) ** 2 + (dy / (h / 2)) ** 2 <= 1
    elif shape == "square":
        inside = (np.abs(dx) <= w / 2) & (np.abs(dy) <= h / 2)
    else:
        t = dy / h + 0.5  # 0 at the apex, 1 at the base
        inside = (t >= 0) & (t <= 1) & (np.abs(dx) <= w / 2 * t)
    out[y0:y1, x0:x1] = inside.reshape(y1 - y0, supersample, x1 - x0, supersample).mean(axis=(1, 3))
    return out


def fit_templates(alpha):
    """How well an object's coverage map matches each shape: {shape: (soft IoU, aspect)}.

    alpha: float [H, W], the object's coverage (0 outside it); soft IoU = sum(min(alpha, t)) /
    sum(max(alpha, t)) with the template t of the shape, fitted in closed form two ways:
    1. square box from the area (circle 2 sqrt(A / pi), square sqrt(A), triangle sqrt(2 A)), which blur keeps;
    2. free width and height from the second moments, so a stretched or squashed shape still matches its
       kind (a disc of diameter d has variance d^2 / 16 per axis, a square of side s s^2 / 12, a
       triangle of base b and height h b^2 / 24 across and h^2 / 18 along); for each blur tried, its
       variance and a pixel's 1/12 are taken off first.
    The centre is the centroid (a triangle's lies a sixth of its height below its box centre). Each
    template is tried sharp and blurred by each of BLURS, so a small model's softness costs little.
    The best fit counts; aspect is its short side / long side (1 for every object this world draws).
    """
    h, w = alpha.shape
    size = max(h, w)
    area = alpha.sum()
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    cx, cy = (alpha * xs).sum() / area, (alpha * ys).sum() / area
    var_x, var_y = (alpha * (xs - cx) ** 2).sum() / area, (alpha * (ys - cy) ** 2).sum() / area
    side = {"circle": 2 * math.sqrt(area / math.pi), "square": math.sqrt(area), "triangle": math.sqrt(2 * area)}
    per_var = {"circle": (16, 16), "square": (12, 12), "triangle": (24, 18)}  # box side^2 / variance, across and along
    best = {}
    for shape in SHAPES:
        for blur in BLURS:
            sigma = blur * size / 32
            boxes = [(side[shape], side[shape])]
            vx, vy = var_x - 1 / 12 - sigma ** 2, var_y - 1 / 12 - sigma ** 2
            if vx > 0.25 and vy > 0.25:
                boxes.append((math.sqrt(per_var[shape][0] * vx), math.sqrt(per_var[shape][1] * vy)))
            for bw, bh in boxes:
                centre_y = cy - bh / 6 if shape == "triangle" else cy
                t = _blur(template(shape, cx, centre_y, bw, bh, size)[:h, :w], sigma)
                iou = float(np.minimum(alpha, t).sum() / np.maximum(alpha, t).sum())
                if iou > best.get(shape, (-1.0, 0.0))[0]:
                    best[shape] = (iou, min(bw, bh) / max(bw, bh))
    return best


BLURS = (0.0, 0.5, 0.8, 1.1, 1.4)  # Gaussian std (px of a 32 px image) tried for each template: the best one counts


def _blur(image, sigma):
    """Separable Gaussian blur of a 2-D array (zero outside), as K_y @ image @ K_x^T."""
    if sigma <= 0:
        return image
    return _blur_matrix(image.shape[0], sigma) @ image @ _blur_matrix(image.shape[1], sigma).T


@functools.lru_cache(maxsize=256)
def _blur_matrix(n, sigma):
    """K [n, n] of `_blur` (a few sizes and sigmas recur for every component: built once each)."""
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    k = np.exp(-d ** 2 / (2 * sigma ** 2)) / math.sqrt(2 * math.pi * sigma ** 2)
    k.flags.writeable = False
    return k


def classify(fits):
    """Template fits {shape: (IoU, aspect)} -> (class, score in [0, 1]): the best-fitting shape, scored
    by how well it fits (IoU from IOU_RANGE[0] to IOU_RANGE[1] maps to 0..1), by its lead over the
    second best (full from MARGIN_FULL) and by its aspect (ASPECT_RANGE maps to 0..1). A blob between
    two shapes, or two objects merged into one, scores low."""
    (best, (first, aspect)), (_, (second, _)) = sorted(fits.items(), key=lambda kv: -kv[1][0])[:2]
    fit = np.clip((first - IOU_RANGE[0]) / (IOU_RANGE[1] - IOU_RANGE[0]), 0, 1)
    lead = np.clip((first - second) / MARGIN_FULL, 0, 1)
    stretch = np.clip((aspect - ASPECT_RANGE[0]) / (ASPECT_RANGE[1] - ASPECT_RANGE[0]), 0, 1)
    return best, float(fit * lead * stretch)


ASPECT_RANGE = (0.5, 0.75)
IOU_RANGE = (0.6, 0.85)
MARGIN_FULL = 0.08
MIN_AREA = 0.02  # components under this fraction of the image are specks, not objects (the smallest object is ~0.045)
SPECK_AREA = 0.005  # under this (5 px of 1024) noise; from here to MIN_AREA a speck, reported as unknown
UNKNOWN = geneval.UNKNOWN  # the class of a component the detector cannot name (a speck, a fit scoring <= UNEXPLAINED)
UNEXPLAINED = geneval.THRESHOLD  # the lowest score any rule keeps (GenEval's 0.3): a fit at or under it is unknown
# A score here is a template fit, not a confidence calibrated on photographs: a clean shape a person names at once
# scores from 0.35 to 0.9. So a counting prompt counts every shape above GenEval's 0.3, as the other tags do, not
# only those above GenEval's 0.9, which let RL draw four squares for "two squares" (geneval.py, departures).
COUNTING_THRESHOLD = geneval.THRESHOLD


def _dilate(mask):
    padded = np.pad(mask, 1)
    h, w = mask.shape
    return np.any([padded[1 + dy:1 + dy + h, 1 + dx:1 + dx + w] for dy in (-1, 0, 1) for dx in (-1, 0, 1)], axis=0)


def detect(images):
    """GenEval-style detections of uint8 images [B, H, W, 3] (or one [H, W, 3]).

    Returns, per image, a list of {"class", "score", "box": [x1, y1, x2, y2] (pixels, x2 and y2
    exclusive, as mmdet's mask2bbox), "mask": bool [H, W], "color"}, best score first. Pixels are
    unmixed into palette colour + coverage (`unmix`); pixels covered at least half form 8-connected
    components of one colour (the masks); each component's coverage, over its mask grown by a pixel,
    is matched against the three shapes (`fit_templates`, `classify`). Components under MIN_AREA of
    the image are no object and those up to twice that are scaled down, so a speck of noise is no object.

    Every component of SPECK_AREA or more is reported, though: one that fits no template (scoring at most
    UNEXPLAINED, e.g. a square squashed into a bar) or is under MIN_AREA comes back as class UNKNOWN (its best
    guess under "guess"; a speck scores 0). No rule keeps it as an object, but the rules that need a scene to be
    empty of an object or to hold exactly N count it as possibly that object (geneval's exclude clauses,
    `judge_edit`'s extra objects): a component the detector cannot name is still something there, and a judge
    that dropped it could be satisfied by deforming an object instead of removing it.
    """
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[None]
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"detect takes uint8 images [B, H, W, 3], got shape {images.shape}")
    keys = [hashlib.blake2b(image.tobytes(), digest_size=16).digest() + repr(image.shape).encode()
            for image in images]
    with _DETECTED_LOCK:
        known = {key: _DETECTED[key] for key in keys if key in _DETECTED}
    missing = [i for i, key in enumerate(keys) if key not in known]
    if missing:
        known.update((keys[i], found) for i, found in zip(missing, _detect(images[missing])))
    with _DETECTED_LOCK:  # the reward may judge in another thread
        for key in keys:
            _DETECTED[key] = known[key]
            _DETECTED.move_to_end(key)
        while len(_DETECTED) > DETECTIONS_KEPT:
            _DETECTED.popitem(last=False)
    return [[dict(d) for d in known[key]] for key in keys]  # masks are read-only: the record stays as detected


# The detections of the last images seen, by their bytes: a held-out evaluation judges its images for the reward and
# again for their diversity (diversity.measure), and detection is most of the judge's time.
DETECTIONS_KEPT = 4096
_DETECTED = collections.OrderedDict()
_DETECTED_LOCK = threading.Lock()


def _detect(images):
    from scipy.ndimage import label

    best, alpha, _ = unmix(images)
    names = list(COLORS)
    b, h, w = alpha.shape
    out = []
    for i in range(b):
        found = []
        for k, color in enumerate(names):
            ids, n = label((best[i] == k) & (alpha[i] >= 0.5), structure=np.ones((3, 3)))  # 8-connected
            for cid in range(1, n + 1):
                mask = ids == cid
                mask.flags.writeable = False
                area = mask.sum()
                if area < SPECK_AREA * h * w:
                    continue  # noise: a stray pixel or two
                ys, xs = np.nonzero(mask)
                box = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
                if area < MIN_AREA * h * w:  # a speck: too small to name, big enough to be something
                    found.append({"class": UNKNOWN, "score": 0.0, "box": box, "mask": mask, "color": color,
                                  "guess": None})
                    continue
                soft = np.where(_dilate(mask) & (best[i] == k), alpha[i], 0.0)
                name, score = classify(fit_templates(soft))
                score *= min((area / (h * w) - MIN_AREA) / MIN_AREA, 1.0)
                if score <= UNEXPLAINED:
                    found.append({"class": UNKNOWN, "score": score, "box": box, "mask": mask, "color": color,
                                  "guess": name})
                    continue
                found.append({"class": name, "score": score, "box": box, "mask": mask, "color": color})
        out.append(sorted(found, key=lambda d: -d["score"]))
    return out


# ----------------------------------------------------------------------------- the pretrained model's shape
# A StableDiffusion3Pipeline at toy size that works in pixel space (built by families/shapes.py): the "latent"
# is the 32 x 32 RGB image itself (in [-1, 1]), so the VAE slot holds an identity. Trained from scratch by
# scripts/pretrain_shapes.py; the weights ship in weights/shapes.safetensors.

WEIGHTS = "weights/shapes.safetensors"
RESOLUTION = 32
TOKENS = 16  # CLIP context: the longest prompt of this world is 12 tokens with its start and end
TRANSFORMER = dict(  # SD3 MMDiT: 8 x 8 patches of 4 x 4 pixels, 6 joint blocks of width 128 (4 heads x 32)
    sample_size=RESOLUTION, patch_size=4, in_channels=3, out_channels=3, num_layers=6, attention_head_dim=32,
    num_attention_heads=4, joint_attention_dim=128, caption_projection_dim=128, pooled_projection_dim=128,
    pos_embed_max_size=RESOLUTION // 4, qk_norm="rms_norm",
)
TEXT_ENCODER = dict(hidden=64, layers=3, heads=4, ffn=256)  # each of the two CLIP encoders; 64 + 64 = joint width 128
