"""Diversity, measured: how much a model's images of one prompt differ, exactly in the shapes world and by image
features for any model. A measurement like a reward: a scorer of groups of images (the images of one prompt).

    exact = shapes_diversity(detections, prompts, metadata, size=32)   # free colours, positions, sizes
    spread = feature_diversity(features, prompts)                      # mean pairwise cosine distance per group
    figures = measure(images, prompts, metadata, diversity="dinov2", diversity_path=..., device="cpu")

The shapes world's held-out file repeats each prompt of a tag on different fixed noise (shapes.split: 20 images of
each single-object prompt, 10 of each colour prompt, ...), so the evaluation's own samples are the groups: no extra
sampling. From the detector, per group (a prompt with 2 or more images), the attributes the prompt leaves free:

- colour: the colours of the objects of every include clause that names none, pooled over the group's images; their
  entropy normalised by log 6 (0: always the same colour, 1: all six equally). The plug-in entropy of n draws is
  low by about 5 / (2 n ln 6) for six equal colours (0.07 at n = 20): compare models on the same prompts and noise.
- position, where no clause names a relation: the spread of the objects' centres, sqrt((var x + var y) / 2) in
  image sides (a centre uniform over the whole image gives 0.289).
- size, always: the standard deviation of sqrt(box area), in image sides.
Objects are the detections of the prompt's classes scoring above GenEval's 0.3 (geneval.THRESHOLD). Each figure is
the mean over groups, per tag (`diversity_<what>_<tag>`) and over all groups (`diversity_<what>`), with the
standard error over groups beside it (`_se`).

Any model: `--diversity dinov2` (or clip) embeds each image with that model (DINOv2's CLS token after its final
layer norm, as GARDO's diversity-aware advantage uses DINOv3's, arXiv:2512.24138 Sec. 3.3; CLIP's projected image
embedding), and `diversity_features` is the mean over groups of the mean pairwise cosine distance 1 - cos within a
group, logged per training step (groups: the samples of one prompt) and per evaluation. `--diversity pixels` needs
no model: the image itself, at most 32 x 32 (area-averaged), in [-1, 1], as the feature vector (an object moved
counts as much as one recoloured); for the shapes world, whose images are 32 px, and for a look without downloads.
"""

import argparse
import math
import os
from collections import defaultdict

import numpy as np

import geneval
import services
import shapes

FEATURES = ("off", "dinov2", "clip", "pixels")
DEFAULT_PATHS = {"dinov2": "facebook/dinov2-base", "clip": "openai/clip-vit-large-patch14"}


# ----------------------------------------------------------------------------- exact, in the shapes world

def entropy(labels, k=len(shapes.COLORS)):
    """Entropy of the empirical distribution of `labels`, normalised by log k: in [0, 1]."""
    counts = np.unique(np.asarray(labels), return_counts=True)[1]
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum() / math.log(k))


def free_attributes(detections, metadata, size):
    """One image's free attributes: {"colors": colours of objects whose clause names none, "centres": [(x, y)] of the
    prompt's objects in image sides (None when a clause names a relation), "sizes": sqrt(box area) in image sides}."""
    include = metadata["include"]
    classes = {c["class"] for c in include}
    free = {c["class"] for c in include if c.get("color") is None}
    objects = [d for d in detections if d["class"] in classes and float(d["score"]) > geneval.THRESHOLD]
    boxes = [[float(v) / size for v in d["box"][:4]] for d in objects]
    related = any(c.get("position") for c in include)
    return {"colors": [d["color"] for d in objects if d["class"] in free],
            "centres": None if related else [((x1 + x2) / 2, (y1 + y2) / 2) for x1, y1, x2, y2 in boxes],
            "sizes": [math.sqrt(max(x2 - x1, 0) * max(y2 - y1, 0)) for x1, y1, x2, y2 in boxes]}


def group_figures(attributes):
    """A group's figures from its images' free attributes: {"color", "position", "size"}, each absent when the prompt
    fixes it or the group has too few objects (2) to spread."""
    colors = [c for a in attributes for c in a["colors"]]
    sizes = [s for a in attributes for s in a["sizes"]]
    out = {}
    if len(colors) >= 2:
        out["color"] = entropy(colors)
    if all(a["centres"] is not None for a in attributes):
        centres = np.array([c for a in attributes for c in a["centres"]]).reshape(-1, 2)
        if len(centres) >= 2:
            out["position"] = float(math.sqrt(centres.var(axis=0).mean()))
    if len(sizes) >= 2:
        out["size"] = float(np.std(sizes))
    return out


def mean_and_se(values):
    """(mean, standard error of the mean) of a list; the error is NaN below two values."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return float("nan"), float("nan")
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


def shapes_diversity(detections, prompts, metadata, *, size):
    """The exact diversity figures of a set of images (module docstring): detections per image (shapes.detect),
    their prompts (the groups) and GenEval metadata; size: the image side in pixels. -> {"diversity_color", ..._se,
    "diversity_color_<tag>", ..., "diversity_groups": groups of 2 or more images}."""
    groups = defaultdict(list)
    for dets, prompt, meta in zip(detections, prompts, metadata):
        groups[prompt].append((meta.get("tag"), free_attributes(dets, meta, size)))
    per = defaultdict(list)  # (what, tag or None) -> group values
    n = 0
    for members in groups.values():
        if len(members) < 2:
            continue  # one image shows no spread
        n += 1
        tag = members[0][0]
        for what, value in group_figures([a for _, a in members]).items():
            per[(what, None)].append(value)
            per[(what, tag)].append(value)
    out = {"diversity_groups": n}
    for (what, tag), values in sorted(per.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        key = f"diversity_{what}" + (f"_{tag}" if tag else "")
        out[key], out[f"{key}_se"] = mean_and_se(values)
    return out


def is_shapes_rows(metadata):
    """True when every row is GenEval metadata over the shapes world's classes (not an edit row)."""
    return bool(metadata) and all(isinstance(m, dict) and m.get("tag") in geneval.TAGS and "edit" not in m and all(
        c.get("class") in shapes.SHAPES for c in m.get("include", [])) for m in metadata)


# ----------------------------------------------------------------------------- features, for any model

def feature_diversity(features, prompts):
    """Mean pairwise cosine distance within groups: features [N, D] (torch or numpy), prompts [N] (the groups).
    -> {"diversity_features", "diversity_features_se"}: the mean over groups of 2 or more images of
    mean_{i < j} (1 - cos(f_i, f_j)), and its standard error over groups."""
    f = np.asarray(features.detach().cpu().float() if hasattr(features, "detach") else features, dtype=np.float64)
    f = f / np.linalg.norm(f, axis=1, keepdims=True).clip(min=1e-12)
    groups = defaultdict(list)
    for i, prompt in enumerate(prompts):
        groups[prompt].append(i)
    values = []
    for members in groups.values():
        if len(members) >= 2:
            g = f[members]
            cos = g @ g.T
            m = len(members)
            values.append(float((1 - cos[np.triu_indices(m, 1)]).mean()))
    mean, se = mean_and_se(values)
    return {"diversity_features": mean, "diversity_features_se": se}


_FEATURIZERS = {}  # (name, path, device) -> featurize, built once (the step log and the evaluation share it)


def featurizer(name, path=None, device="cpu"):
    """name (dinov2 | clip) -> featurize(images uint8 [N, H, W, 3]) -> float [N, D]; None for off. The model loads
    through transformers from `path` (a hub id or a local folder; default DEFAULT_PATHS[name]); offline and absent,
    a ValueError naming --diversity-path."""
    if name in (None, "off"):
        return None
    if name not in FEATURES:
        raise ValueError(f"--diversity {name!r}: choose one of {', '.join(FEATURES)}")
    if name == "pixels":
        return pixel_features
    path = path or DEFAULT_PATHS[name]
    key = (name, path, str(device))
    if key not in _FEATURIZERS:
        _FEATURIZERS[key] = _build(name, path, device)
    return _FEATURIZERS[key]


def pixel_features(images, side=32):
    """The images as feature vectors, float [N, 3 side^2]: uint8 [N, H, W, 3] (video [N, F, H, W, 3]: its middle
    frame) area-averaged down to at most side x side, mapped to [-1, 1]."""
    import torch
    import torch.nn.functional as F

    images = images.cpu() if torch.is_tensor(images) else torch.as_tensor(np.asarray(images))
    if images.ndim == 5:
        images = images[:, images.shape[1] // 2]
    x = images.permute(0, 3, 1, 2).float() / 127.5 - 1  # [N, 3, H, W]
    if max(x.shape[-2:]) > side:
        x = F.adaptive_avg_pool2d(x, (min(side, x.shape[-2]), min(side, x.shape[-1])))
    return x.flatten(1)


def _build(name, path, device):
    import torch
    import torch.nn.functional as F
    import transformers

    # A hub id where the hub does not answer: the cached copy or a quick failure (the hub's five retries took 48 s;
    # transformers' AutoModel looks for an adapter config apart from the weights, hence its own local_files_only).
    offline = {} if os.path.isdir(path) or services.hub_reachable() else dict(local_files_only=True)
    try:
        if name == "dinov2":
            model = transformers.AutoModel.from_pretrained(path, **offline, **({"adapter_kwargs": offline}
                                                                                if offline else {}))
            mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as DINOv2's image processor
        else:
            model = transformers.CLIPModel.from_pretrained(path, **offline)
            mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # CLIP's
    except Exception as err:
        raise ValueError(f"--diversity {name}: cannot load {path!r} ({type(err).__name__}"
                         f"{'; the hub does not answer' if offline else ''}); point --diversity-path "
                         f"at a local copy of the weights, or pass --diversity off") from err
    model = model.eval().to(device)
    config = model.config.vision_config if name == "clip" else model.config
    side = int(config.image_size)
    mean_t = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=device).view(1, 3, 1, 1)

    @torch.no_grad()
    def featurize(images, batch_size=32):
        images = torch.as_tensor(np.asarray(images))
        if images.ndim == 5:  # video [N, F, H, W, 3]: its middle frame
            images = images[:, images.shape[1] // 2]
        out = []
        for i in range(0, len(images), batch_size):
            x = images[i:i + batch_size].to(device).permute(0, 3, 1, 2).float() / 255  # [b, 3, H, W]
            x = F.interpolate(x, size=(side, side), mode="bicubic", align_corners=False).clamp(0, 1)
            x = (x - mean_t) / std_t
            if name == "clip":
                feats = model.get_image_features(pixel_values=x)
                feats = feats if torch.is_tensor(feats) else feats.pooler_output
            else:
                feats = model(pixel_values=x).pooler_output  # the CLS token after the final layer norm
            out.append(feats.float().cpu())
        return torch.cat(out)  # [N, D]

    return featurize


# ----------------------------------------------------------------------------- flags and the one call

def add_arguments(parser):
    group = parser.add_argument_group("diversity")
    group.add_argument("--diversity", default="off", choices=FEATURES,
                       help="feature diversity logged per step and per evaluation: the mean pairwise cosine distance "
                            "of image features within a prompt's group (dinov2: DINOv2's CLS token; clip: CLIP's "
                            "image embedding; pixels: the image at most 32 px, no model); off: none. The shapes world's exact diversity is always measured")
    group.add_argument("--diversity-path", default=None,
                       help="hub id or local folder of the feature model (transformers format; default "
                            + ", ".join(f"{k}: {v}" for k, v in DEFAULT_PATHS.items()) + ")")
    return group


def measure(images, prompts, metadata, *, diversity="off", diversity_path=None, device="cpu", exact=True):
    """Every diversity figure that applies to these images (uint8 [N, H, W, 3], grouped by prompt): the shapes
    world's exact ones when `exact` and the rows are its GenEval prompts, and the feature one unless `diversity` is
    off. -> dict of floats (empty when none applies)."""
    out = {}
    images = images.detach().cpu().numpy() if hasattr(images, "detach") else np.asarray(images)
    if exact and images.ndim == 4 and is_shapes_rows(list(metadata)):
        out.update(shapes_diversity(shapes.detect(images), prompts, metadata, size=images.shape[2]))
    featurize = featurizer(diversity, diversity_path, device)
    if featurize is not None:
        out.update(feature_diversity(featurize(images), prompts))
    return out


def applies(metadata, *, diversity="off", diversity_path=None):
    """True when `measure` has something to measure on these rows (so the images are worth gathering)."""
    return diversity != "off" or is_shapes_rows(list(metadata))


def options(args):
    """The keywords of `measure` from parsed flags (argparse Namespace)."""
    return {"diversity": getattr(args, "diversity", "off"), "diversity_path": getattr(args, "diversity_path", None)}


def defaults():
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return vars(parser.parse_args([]))
