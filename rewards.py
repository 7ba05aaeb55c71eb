"""Reward models: one scorer per name in `REWARDS`, weighted mixtures, per-sample overrides.

    reward_fn = build_reward("ocr=0.8,pickscore=0.2", device="cuda", ocr_workers=8)
    out = reward_fn(images, prompts, metadata)   # images: uint8 [B, H, W, 3] (or video [B, F, H, W, 3])
    out["ocr"], out["pickscore"]                 # [B] float32, each component's raw score
    out["reward"]                                # [B] float32, 0.8 * ocr + 0.2 * pickscore
    out["failed"]                                # [B] bool, a reward service gave up on the sample (skip mode)

| name                     | score                                                    | range (typical)          |
| ------------------------ | -------------------------------------------------------- | ------------------------ |
| `pickscore`              | exp(logit_scale) cos(text, image) / 26 (PickScore)       | about 0.8 - 0.9          |
| `hps`                    | cos(image, text) of HPSv2 / HPSv2.1                      | about 0.25 - 0.35        |
| `imagereward`            | ImageReward's standardised BLIP + MLP score              | about -2 - 2             |
| `hpsv3`                  | mu of HPSv3's reward head on Qwen2-VL-7B                 | unbounded; > 10 is good  |
| `clipscore`              | cos(text, image) of CLIP ViT-L/14 (DiffusionNFT)         | about 0.2 - 0.35         |
| `aesthetic`              | LAION aesthetic MLP on the CLIP ViT-L/14 image embedding | about 4 - 7              |
| `unifiedreward`          | UnifiedReward's "Final Score" from your vLLM/SGLang      | [1, 5]                   |
| `ocr`                    | 1 - capped edit distance to the quoted text (Flow-GRPO)  | [0, 1]                   |
| `jpeg_compressibility`   | -(JPEG kB at quality 95) / 500 (DDPO)                    | <= 0                     |
| `jpeg_incompressibility` | +(JPEG kB at quality 95) / 500 (DDPO)                    | >= 0                     |
| `openai_api`             | a vision-language judge's JSON score, one call a sample  | [score_min, score_max]   |
| `custom_api`             | the same loop with your own request/response hooks       | yours                    |
| `remote`                 | a reward server you run, one POST per batch              | yours                    |
| `custom`                 | your function (`--custom-rm-path module.function`)       | yours                    |
| `geneval`                | GenEval verdict from detections (geneval.py)             | [0, 1]; partial <= 1     |

Options. `add_arguments(parser)` declares every option `build_reward` takes (the argparse group
"reward", shared by train.py, eval.py and bench.py) and is the only place they are defaulted:
`option_defaults()` reads the defaults back, each factory takes its own options as keyword-only
arguments without defaults, and a keyword that no flag declares is refused with the closest name.
A reward module with flags of its own (its own `add_arguments`) is wired in with one line at the
end of ours.

Conventions shared by every scorer:

- Images are quantised to uint8 by one helper, `to_uint8`: uint8 passes through; float images are
  taken to be in [0, 1], clamped, multiplied by 255 and rounded half-to-even (`torch.round`), the
  same rounding as `models.decode`. Every scorer sees exactly these pixels.
- Each factory checks its options and loads its model once, when it is called (`build_reward`
  calls the factories of the spec's components at build time, and those of `rm_type` overrides the
  first time one appears), so a bad option fails before any GPU time is spent, and a reward that
  is not used downloads and costs nothing.
- A JSONL row's `metadata.rm_type` (a name, or a spec such as "ocr=0.5,pickscore=0.5") replaces
  the global spec for that sample. A component scores all the samples that use it in one batched
  call; where it does not apply, its entry is NaN (log with nanmean). `reward` is always finite: a
  NaN or inf score raises `NonFiniteReward` naming the reward and the sample. A scorer's extra
  entries (a dict's keys besides "reward") may be NaN, meaning "does not apply to this sample".
- Model loading that fails (offline, wrong path) raises one sentence naming the flag that points
  at a local copy.
- Video [B, F, H, W, 3]: a model scorer (pickscore, hps, imagereward, hpsv3, clipscore, aesthetic)
  scores `--<name>-num-frames` evenly spaced frames (every frame by default) each against the
  sample's prompt and averages them; ocr and the JPEG rewards average every frame; the judges
  openai_api and unifiedreward take images only; `remote` sends the frames.

Reward services (`openai_api`, `custom_api`, `remote`) run on services.py: a thread pool of at
most `max_concurrency` requests in flight (per process), one deadline per attempt for everything
(name lookup, connect, send, the whole reply: `timeout_s` of the config, else `--reward-timeout`),
a cap on the reply (`--reward-max-bytes`), retries with exponential backoff, and
`reward_on_error="raise"` (stop with `RewardServiceError` naming the service, the sample and the
attempts made) or `"skip"` (the sample is marked in `failed` and gets reward 0). Secrets (the
judge's `api_key_env`, `--rm-auth-env`) are read from the environment when the reward is built and
never appear in logs, errors or args.json: every error line is masked (`services.mask_secrets`).
The `openai_api` judge uses the official `openai` client on services' transport, with its own
retries off: one retry loop serves every service alike.

The `remote` protocol (POST to `--rm-url`, Content-Type application/json, and with `--rm-auth-env
NAME` the header `Authorization: <value of $NAME>`):

    request:  {"prompts":  ["a cat", ...],                       # B strings
               "metadata": [{...}, ...],                         # B JSON objects
               "images":   ["<base64 PNG>", ...]}                # B strings; video: B lists of frames
    response: {"scores":   [0.71, ...]}                          # B finite numbers, same order

`custom` and `custom_api` import and run user code named by a dotted path: only point them at
code you trust.

Sections, each read on its own: the offline scorers, the reward services (the judge and the three
service factories; their HTTP plumbing is services.py), user code, mixtures and the option table.

Run `python bench.py --rewards` for the images/s of the offline scorers on this machine.
"""

import argparse
import base64
import difflib
import io
import json
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

import geneval  # light at import: its models load inside geneval.reward
import shapes
from geneval import geneval_judge  # noqa: F401  (rewards.geneval_judge, as DESIGN.md names it)
import services  # the HTTP plumbing of the reward services
from services import (  # noqa: F401  (rewards.post_json, http_client, BadReply, load_config: the names hooks use)
    BadReply, RewardServiceError, _HTTPStatus, _http_url, _integer, _number, _real, _serve, _service_loop, _show,
    http_client, load_config, post_json)

log = logging.getLogger(__name__)


class NonFiniteReward(ValueError):
    """A scorer returned NaN or inf; it must never reach the advantages."""


# ----------------------------------------------------------------------------- images

def to_uint8(images):
    """Images or video as a uint8 numpy array [B, H, W, 3] or [B, F, H, W, 3].

    uint8 passes through unchanged. Floats are read as [0, 1]: clamp, x * 255, round half to even
    (torch.round, as `models.decode`), so 0.5/255 steps land on the even neighbour.
    """
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a torch tensor or numpy array, got {type(images).__name__}")
    if images.ndim not in (4, 5) or images.shape[-1] != 3:
        raise ValueError(f"images must be [B, H, W, 3] or video [B, F, H, W, 3] (channels last), "
                         f"got shape {tuple(images.shape)}")
    images = images.detach().cpu()
    if images.dtype == torch.uint8:
        return images.numpy()
    if not images.is_floating_point():
        raise TypeError(f"images must be uint8 or float in [0, 1], got {images.dtype}")
    return torch.round(images.float().clamp(0, 1) * 255).to(torch.uint8).numpy()


def _frame_indices(num_frames_total, num_frames):
    """`num_frames` evenly spaced frame indices (all frames when None or 0 or more than there are)."""
    if not num_frames or num_frames >= num_frames_total:
        return np.arange(num_frames_total)
    return np.linspace(0, num_frames_total - 1, num_frames).round().astype(int)


def _frames(images, num_frames):
    """uint8 images [B, H, W, 3] or video [B, F, H, W, 3] -> (frames [B * n, H, W, 3], n): an image is its own
    frame (n = 1); a video gives `num_frames` evenly spaced frames per sample (every frame when None or 0). A
    scorer scores the frames and averages each sample's n scores: `scores.view(B, n).mean(1)`."""
    if images.ndim == 5:
        images = images[:, _frame_indices(images.shape[1], num_frames)]
    n = images.shape[1] if images.ndim == 5 else 1
    return images.reshape(-1, *images.shape[-3:]), n


def _png_base64(frame):
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _hub_error(name, path, flag, err):
    first_line = str(err).splitlines()[0] if str(err) else ""
    return RuntimeError(f"{name}: cannot load {path!r} ({type(err).__name__}: {first_line}); "
                        f"download it where the hub is reachable and point {flag} at the local copy")


# ----------------------------------------------------------------------------- PickScore

def pickscore(*, pickscore_processor_path, pickscore_model_path, pickscore_batch_size, pickscore_num_frames, device,
              **_):
    """PickScore (Kirstain et al., Pick-a-Pic, arXiv:2305.01569), scaled as Flow-GRPO does:

        score = exp(logit_scale) * <t / |t|, v / |v|> / 26        (raw logits are about 0-26)

    with t, v the CLIP text and image embeddings. Video: `pickscore_num_frames` evenly spaced
    frames (default every frame) are scored against the prompt and averaged.
    """
    from transformers import AutoProcessor, CLIPModel

    _integer(pickscore_batch_size, 1, "--pickscore-batch-size")
    if pickscore_num_frames is not None:
        _integer(pickscore_num_frames, 0, "--pickscore-num-frames")

    try:
        processor = AutoProcessor.from_pretrained(pickscore_processor_path)
    except Exception as err:
        raise _hub_error("pickscore", pickscore_processor_path, "--pickscore-processor-path", err) from err
    try:
        model = CLIPModel.from_pretrained(pickscore_model_path).eval().to(device)
    except Exception as err:
        raise _hub_error("pickscore", pickscore_model_path, "--pickscore-model-path", err) from err

    def features(out):  # transformers 5 returns a ModelOutput, 4.x a tensor
        out = out if isinstance(out, torch.Tensor) else out.pooler_output
        return out / out.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def score(images, prompts, metadata):
        images = to_uint8(images)
        if images.ndim == 5:  # video: [B, F, H, W, 3] -> [B * n, H, W, 3], prompt repeated per frame
            images = images[:, _frame_indices(images.shape[1], pickscore_num_frames)]
        n = images.shape[1] if images.ndim == 5 else 1
        frames = images.reshape(-1, *images.shape[-3:])
        texts = [p for p in prompts for _ in range(n)]
        scores = []
        for i in range(0, len(frames), pickscore_batch_size):
            batch = slice(i, i + pickscore_batch_size)
            pixels = processor(images=[Image.fromarray(f) for f in frames[batch]], return_tensors="pt")
            tokens = processor(text=texts[batch], padding=True, truncation=True, max_length=77, return_tensors="pt")
            v = features(model.get_image_features(pixel_values=pixels["pixel_values"].to(device)))
            tokens = {k: tokens[k].to(device) for k in ("input_ids", "attention_mask")}
            t = features(model.get_text_features(**tokens))
            scores.append(model.logit_scale.exp() * (t * v).sum(-1) / 26)  # the /26 maps ~0-26 logits to ~0-1
        return torch.cat(scores).float().cpu().view(len(prompts), n).mean(1)  # [B], mean over frames

    return score


# ----------------------------------------------------------------------------- HPSv2

HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}  # files of the hub repo xswu/HPSv2


def hps(*, hps_version, hps_checkpoint_path, hps_batch_size, hps_model_name, hps_num_frames, device, **_):
    """Human Preference Score v2 / v2.1 (Wu et al., arXiv:2306.09341): an open_clip ViT-H-14 whose
    weights all come from the HPS checkpoint; score = diag(image_features @ text_features.T) with
    both features L2-normalised, i.e. the cosine of each image with its own prompt. Video:
    `hps_num_frames` evenly spaced frames (default every frame), each against the prompt, averaged.
    `hps_model_name` names the open_clip architecture (tests register a tiny one).
    """
    import open_clip

    if hps_version not in HPS_FILES:
        raise ValueError(f"--hps-version must be one of {sorted(HPS_FILES)}, got {hps_version!r}")
    _integer(hps_batch_size, 1, "--hps-batch-size")
    if hps_num_frames is not None:
        _integer(hps_num_frames, 0, "--hps-num-frames")
    path = hps_checkpoint_path
    if path is None:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download("xswu/HPSv2", HPS_FILES[hps_version])
        except Exception as err:
            raise _hub_error("hps", f"xswu/HPSv2/{HPS_FILES[hps_version]}", "--hps-checkpoint-path", err) from err
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            if not os.path.exists(path):
                raise
            log.warning("hps: %s holds more than tensors (%s); loading it with weights_only=False",
                        path, type(err).__name__)
            state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise _hub_error("hps", path, "--hps-checkpoint-path", err) from err
    state = state.get("state_dict", state)
    state = {k.removeprefix("module."): v for k, v in state.items()}  # checkpoints saved from DDP
    # the architecture only (pretrained=None): the HPS checkpoint overwrites every weight, so no base CLIP download
    model, _, preprocess = open_clip.create_model_and_transforms(hps_model_name, pretrained=None, output_dict=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing:
        raise RuntimeError(f"hps: {path} does not fit open_clip {hps_model_name} (missing {missing[:3]}...); "
                           f"point --hps-checkpoint-path at an HPS_v2(.1)_compressed.pt file")
    if unexpected:
        log.warning("hps: ignoring %d unexpected checkpoint entries, e.g. %s", len(unexpected), unexpected[:3])
    model = model.eval().to(device)
    tokenizer = open_clip.get_tokenizer(hps_model_name)
    autocast = torch.autocast("cuda") if str(device).startswith("cuda") else torch.autocast("cpu", enabled=False)

    @torch.no_grad()
    def score(images, prompts, metadata):
        frames, n = _frames(to_uint8(images), hps_num_frames)
        texts = [p for p in prompts for _ in range(n)]
        scores = []
        for i in range(0, len(frames), hps_batch_size):
            pixels = torch.stack([preprocess(Image.fromarray(f)) for f in frames[i:i + hps_batch_size]]).to(device)
            text = tokenizer(texts[i:i + hps_batch_size]).to(device)
            with autocast:  # HPSv2 scores under amp on GPU
                out = model(pixels, text)  # features are L2-normalised by open_clip
            scores.append((out["image_features"].float() * out["text_features"].float()).sum(-1))  # diag(I @ T^T)
        return torch.cat(scores).cpu().view(len(prompts), n).mean(1)  # [B], mean over frames

    return score


# ----------------------------------------------------------------------------- CLIPScore and LAION aesthetics

def _clip(path, flag, name, device):
    """transformers' CLIPModel and CLIPProcessor from one hub id or local folder (both live in one repo)."""
    from transformers import AutoProcessor, CLIPModel

    try:
        processor = AutoProcessor.from_pretrained(path)
        model = CLIPModel.from_pretrained(path).eval().to(device)
    except Exception as err:
        raise _hub_error(name, path, flag, err) from err
    return processor, model


def _unit(features):
    features = features if isinstance(features, torch.Tensor) else features.pooler_output  # transformers 5: an output
    return features / features.norm(dim=-1, keepdim=True)


def clipscore(*, clipscore_model_path, clipscore_batch_size, clipscore_num_frames, device, **_):
    """CLIPScore as the flow-RL codebases train on it: the cosine of CLIP ViT-L/14's text and image embeddings,

        score = <t / |t|, v / |v|>      in [-1, 1]; about 0.2-0.35 for an image that shows its prompt

    DiffusionNFT (NVlabs/DiffusionNFT flow_grpo/clip_scorer.py, ClipScorer.__call__) trains on
    logits_per_image.diagonal() / 100 of openai/clip-vit-large-patch14, i.e. exp(logit_scale) cos / 100 with a
    logit scale of exactly 100 in that checkpoint: this cosine; Flow-Factory's rewards/clip.py returns the cosine
    too. The metric of Hessel et al. (arXiv:2104.08718, Eq. 1), 2.5 max(cos, 0), and torchmetrics' max(100 cos, 0)
    are it scaled and floored at 0: the same group advantages while the cosine is positive. Preprocessing is
    CLIPProcessor's (shortest side to 224 bicubic, centre crop, CLIP mean/std), as `pickscore`. Video:
    `clipscore_num_frames` evenly spaced frames (default every frame), each against the prompt, averaged.
    """
    batch_size = _integer(clipscore_batch_size, 1, "--clipscore-batch-size")
    if clipscore_num_frames is not None:
        _integer(clipscore_num_frames, 0, "--clipscore-num-frames")
    processor, model = _clip(clipscore_model_path, "--clipscore-model-path", "clipscore", device)

    @torch.no_grad()
    def score(images, prompts, metadata):
        frames, n = _frames(to_uint8(images), clipscore_num_frames)
        texts = [p for p in prompts for _ in range(n)]
        scores = []
        for i in range(0, len(frames), batch_size):
            pixels = processor(images=[Image.fromarray(f) for f in frames[i:i + batch_size]], return_tensors="pt")
            tokens = processor(text=texts[i:i + batch_size], padding=True, truncation=True, max_length=77,
                               return_tensors="pt")
            v = _unit(model.get_image_features(pixel_values=pixels["pixel_values"].to(device)))
            t = _unit(model.get_text_features(**{k: tokens[k].to(device) for k in ("input_ids", "attention_mask")}))
            scores.append((t * v).sum(-1))  # cos(text, image)
        return torch.cat(scores).float().cpu().view(len(prompts), n).mean(1)  # [B], mean over frames

    return score


def _laion_mlp(input_size):
    """The head of LAION's improved aesthetic predictor (christophschuhmann/improved-aesthetic-predictor,
    simple_inference.py, class MLP), which ImageReward reuses (ImageReward/ImageReward.py, class MLP): Linear
    layers to 1024, 128, 64, 16 and 1, dropout after the first three, and no activation (their ReLUs are commented
    out), so it is an affine map. Its parameter names, 0 2 4 6 7, are those of the published files' `layers.*`."""
    from torch import nn

    return nn.Sequential(nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))


def _load_state(module, state, what, flag):
    """Load `state` into `module` key for key; a missing, unexpected or misshapen tensor is one line naming `flag`."""
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        problem = " ".join(str(err).split("\n\t")[1:2]) or str(err).splitlines()[0]
        raise RuntimeError(f"{what} does not fit the expected layout ({problem[:300]}); check {flag}") from None
    return module


AESTHETIC_URL = ("https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
                 "sac%2Blogos%2Bava1-l14-linearMSE.pth")  # the file ImageReward's utils.py and Flow-GRPO load


def aesthetic(*, aesthetic_clip_path, aesthetic_mlp_path, aesthetic_batch_size, aesthetic_num_frames, device, **_):
    """LAION's improved aesthetic predictor, as DDPO and Flow-GRPO train on it (flow_grpo/aesthetic_scorer.py):

        score = MLP(v / |v|)      v: CLIP ViT-L/14's projected image embedding (768); about 4-7, at most ~10

    MLP is `_laion_mlp(768)` with the weights of sac+logos+ava1-l14-linearMSE.pth (simple_inference.py: the
    embedding L2-normalised, then the MLP). The prompt is not used. Images go through CLIPProcessor (shortest
    side to 224 bicubic, centre crop), as in Flow-GRPO; the original used OpenAI's `clip` package: the same steps,
    resampled by PIL where transformers 5 uses torchvision. Video: `aesthetic_num_frames` evenly spaced frames
    (default every frame), averaged.
    """
    batch_size = _integer(aesthetic_batch_size, 1, "--aesthetic-batch-size")
    if aesthetic_num_frames is not None:
        _integer(aesthetic_num_frames, 0, "--aesthetic-num-frames")
    processor, model = _clip(aesthetic_clip_path, "--aesthetic-clip-path", "aesthetic", device)
    source = aesthetic_mlp_path or AESTHETIC_URL
    try:  # the published file holds CUDA tensors: map_location is needed on a machine without a GPU
        if aesthetic_mlp_path:
            state = torch.load(aesthetic_mlp_path, map_location="cpu", weights_only=True)
        else:
            state = torch.hub.load_state_dict_from_url(AESTHETIC_URL, map_location="cpu", weights_only=True)
    except Exception as err:
        raise _hub_error("aesthetic", source, "--aesthetic-mlp-path", err) from err
    state = {k.removeprefix("layers."): v for k, v in state.items()}
    width = model.config.projection_dim
    mlp = _load_state(_laion_mlp(width), state, f"aesthetic: {source}", "--aesthetic-mlp-path (its input must be "
                     f"the {width}-wide embedding of --aesthetic-clip-path)").eval().to(device)

    @torch.no_grad()
    def score(images, prompts, metadata):
        frames, n = _frames(to_uint8(images), aesthetic_num_frames)
        scores = []
        for i in range(0, len(frames), batch_size):
            pixels = processor(images=[Image.fromarray(f) for f in frames[i:i + batch_size]], return_tensors="pt")
            v = _unit(model.get_image_features(pixel_values=pixels["pixel_values"].to(device)))
            scores.append(mlp(v.float())[:, 0])
        return torch.cat(scores).cpu().view(len(images), n).mean(1)  # [B], mean over frames

    return score


# ----------------------------------------------------------------------------- ImageReward

# ImageReward/ImageReward.py (THUDM/ImageReward), ImageReward.__init__: the head's output is standardised by these.
IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def _imagereward_vit_key(key):
    """A key of their BLIP ViT (ImageReward/models/BLIP/vit.py) -> transformers' BlipVisionModel name."""
    import re

    for pattern, name in ((r"cls_token$", "embeddings.class_embedding"),
                          (r"pos_embed$", "embeddings.position_embedding"),
                          (r"patch_embed\.proj\.", "embeddings.patch_embedding."), (r"norm\.", "post_layernorm."),
                          (r"blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
                          (r"blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
                          (r"blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
                          (r"blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
                          (r"blocks\.(\d+)\.mlp\.(fc[12])\.", r"encoder.layers.\1.mlp.\2.")):
        if re.match(pattern, key):
            return re.sub("^" + pattern, name, key)
    raise KeyError(key)


def imagereward_state(state):
    """The authors' ImageReward.pt -> (BlipVisionModel state, BlipTextModel state, head state, ignored keys).

    `blip.visual_encoder.*` (their ViT) is renamed to transformers' BLIP vision names (a ViT key with no counterpart
    raises KeyError); `blip.text_encoder.*` (their BERT with cross-attention, BLIP/med.py) has transformers'
    BlipTextModel names already; `mlp.layers.*` is the head. The contrastive projections (`blip.vision_proj`,
    `blip.text_proj`) and the `position_ids` buffer play no part in the score and are dropped silently; any other key
    is returned as ignored (the authors load the file with strict=False, which ignores such keys too).
    """
    vision, text, head, ignored = {}, {}, {}, []
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            try:
                vision[_imagereward_vit_key(key.removeprefix("blip.visual_encoder."))] = value
            except KeyError:
                raise KeyError(key) from None
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            text[key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp.layers."):
            head[key.removeprefix("mlp.layers.")] = value
        elif not key.startswith(("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.")):
            ignored.append(key)
    return vision, text, head, ignored


def _imagereward_files(path):
    """(ImageReward.pt, med_config.json) from a file (the config beside it), a folder, or a hub repo id."""
    if os.path.isfile(path):
        return path, os.path.join(os.path.dirname(path), "med_config.json")
    if os.path.isdir(path):
        return os.path.join(path, "ImageReward.pt"), os.path.join(path, "med_config.json")
    from huggingface_hub import hf_hub_download

    return hf_hub_download(path, "ImageReward.pt"), hf_hub_download(path, "med_config.json")


def imagereward(*, imagereward_model_path, imagereward_tokenizer_path, imagereward_batch_size,
                imagereward_num_frames, device, **_):
    """ImageReward (Xu et al., arXiv:2304.05977), as ImageReward.score computes it (ImageReward/ImageReward.py):

        score = (MLP(BERT(prompt | ViT(image))[CLS]) - 0.16717) / 1.03334      about -2 .. 2

    ViT is BLIP's ViT-L/16 at 224 px; BERT reads the prompt (BERT uncased tokens, padded to 35) with
    cross-attention to every image token, and its [CLS] state goes through the affine `_laion_mlp(768)`; the
    standardisation constants are the authors'. Built from transformers' BLIP classes (BlipVisionModel,
    BlipTextModel), not the `image-reward` package: its BLIP/med.py imports apply_chunking_to_forward from
    transformers.modeling_utils, which transformers 5 no longer has, and it needs timm, fairscale and OpenAI's `clip`
    from GitHub. `imagereward_state` maps the authors' checkpoint keys. The vision tower's size is read from the
    checkpoint (heads: width / 64, as in BLIP's ViT-B and ViT-L), the text tower's from the authors'
    med_config.json. Images: their `_transform(224)` (shortest side to 224 bicubic, centre crop, CLIP mean/std).
    Video: `imagereward_num_frames` evenly spaced frames (default every frame), averaged.
    """
    import torchvision.transforms as T
    from transformers import AutoTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    batch_size = _integer(imagereward_batch_size, 1, "--imagereward-batch-size")
    if imagereward_num_frames is not None:
        _integer(imagereward_num_frames, 0, "--imagereward-num-frames")
    flag = "--imagereward-model-path"
    try:
        weights, med_config = _imagereward_files(imagereward_model_path)
        state = torch.load(weights, map_location="cpu", weights_only=True)
        with open(med_config) as f:
            text_config = json.load(f)
    except Exception as err:
        raise _hub_error("imagereward", imagereward_model_path, flag, err) from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(imagereward_tokenizer_path)
    except Exception as err:
        raise _hub_error("imagereward", imagereward_tokenizer_path, "--imagereward-tokenizer-path", err) from err
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})  # BLIP init_tokenizer
    try:
        vision_state, text_state, head_state, ignored = imagereward_state(state)
    except KeyError as err:
        raise RuntimeError(f"imagereward: {weights} holds {err}, not a key of ImageReward.pt; check {flag}") from None
    if ignored:
        log.warning("imagereward: ignoring %d entries of %s that the score does not use, e.g. %s", len(ignored),
                    weights, ignored[:3])

    blocks = {int(k.split(".")[2]) for k in vision_state if k.startswith("encoder.layers.")}
    width = vision_state["embeddings.class_embedding"].shape[-1]
    patch = vision_state["embeddings.patch_embedding.weight"].shape[-1]
    side = math.isqrt(vision_state["embeddings.position_embedding"].shape[1] - 1) * patch  # pos_embed: 1 + patches
    vision = BlipVisionModel(BlipVisionConfig(
        hidden_size=width, intermediate_size=vision_state["encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=len(blocks), num_attention_heads=width // 64, image_size=side, patch_size=patch,
        layer_norm_eps=1e-6))  # vit.py: partial(nn.LayerNorm, eps=1e-6), nn.GELU
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings", "layer_norm_eps", "hidden_act", "pad_token_id", "bos_token_id", "eos_token_id",
            "sep_token_id")
    text = BlipTextModel(BlipTextConfig(**{k: text_config[k] for k in keys if k in text_config},
                                        encoder_hidden_size=width, is_decoder=True),  # is_decoder builds the
                         add_pooling_layer=False)                                    # cross-attention layers
    head = _laion_mlp(text.config.hidden_size)
    for module, part, what in ((vision, vision_state, "its ViT"), (text, text_state, "its BERT (med_config.json)"),
                               (head, head_state, "its MLP")):
        _load_state(module, part, f"imagereward: {weights} ({what})", flag)
    vision, text, head = (m.eval().to(device) for m in (vision, text, head))
    preprocess = T.Compose([T.Resize(side, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(side),
                            T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])

    @torch.no_grad()
    def score(images, prompts, metadata):
        frames, n = _frames(to_uint8(images), imagereward_num_frames)
        texts = [p for p in prompts for _ in range(n)]
        scores = []
        for i in range(0, len(frames), batch_size):
            pixels = torch.stack([preprocess(Image.fromarray(f)) for f in frames[i:i + batch_size]]).to(device)
            tokens = tokenizer(texts[i:i + batch_size], padding="max_length", truncation=True, max_length=35,
                               return_tensors="pt").to(device)
            image_tokens = vision(pixel_values=pixels).last_hidden_state  # [b, 1 + patches, width]
            cls = text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                       encoder_hidden_states=image_tokens).last_hidden_state[:, 0]  # [b, 768], bidirectional
            scores.append((head(cls.float())[:, 0] - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)
        return torch.cat(scores).cpu().view(len(prompts), n).mean(1)  # [B], mean over frames

    return score


# ----------------------------------------------------------------------------- HPSv3

# The reward model's text, from the authors' hpsv3 package (1.0.0, hpsv3/dataset/data_collator_qwen.py: INSTRUCTION
# and prompt_with_special_token), kept character for character, trailing spaces included (tests check its SHA-256):
# the model was trained on it. The reward is read at the <|Reward|> token.
HPSV3_INSTRUCTION = (
    "\n"
    "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and "
    "give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 "
    "being the worst and 10 being the best. \n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, "
    "such as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and "
    "easy to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other "
    "visual elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color "
    "scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should "
    "convey a sense of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, "
    "violent, or adult material. If such content is present, the image quality and satisfaction score "
    "should be the lowest possible. \n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, "
    "object) align with the textual description. The subject should match the description in terms of "
    "number, appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate "
    "how well the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in "
    "the image logically fit the scenario described in the prompt. The environment should support and "
    "enhance the subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, "
    "clothing, accessories, expressions, actions) are faithfully represented in the image. Minor "
    "deviations may be acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are "
    "captured in the image. The generated content should not introduce elements that conflict with or "
    "distort the original description.\n"
    "Textual prompt - {text_prompt}\n"
    "\n"
    "\n"
)
HPSV3_QUERY = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
HPSV3_PIXELS = 256 * 28 * 28  # HPSv3RewardInferencer.prepare_batch: min_pixels = max_pixels = 256 visual tokens


def hpsv3_text(prompt):
    """The user text HPSv3 scores an image against (after the image in the chat template)."""
    return HPSV3_INSTRUCTION.format(text_prompt=prompt) + HPSV3_QUERY


def _hpsv3_head(hidden):
    """Qwen2VLRewardModelBT's rm_head for rm_head_type "ranknet" without kwargs (hpsv3/model/qwen2vl_trainer.py):
    parameter names 0 3 5 as in the checkpoint's `rm_head.*`; output (mu, sigma) of the reward, in float32."""
    from torch import nn

    return nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2))


def hpsv3_state(state):
    """HPSv3.safetensors -> (Qwen2VLModel state, reward-head state).

    The file holds the whole Qwen2VLRewardModelBT: `model.visual.*` and `model.language_model.*` (transformers >= 4.52
    names; the older `visual.*` and `model.*` are renamed to them), `lm_head.weight` (not used by the score: dropped)
    and `rm_head.*`. Any other key raises KeyError.
    """
    body, head = {}, {}
    for key, value in state.items():
        if key.startswith("rm_head."):
            head[key.removeprefix("rm_head.")] = value
        elif key.startswith(("model.visual.", "model.language_model.")):
            body[key.removeprefix("model.")] = value
        elif key.startswith("visual."):
            body[key] = value
        elif key.startswith("model."):
            body["language_model." + key.removeprefix("model.")] = value
        elif key != "lm_head.weight":
            raise KeyError(key)
    return body, head


def hpsv3(*, hpsv3_checkpoint_path, hpsv3_base_path, hpsv3_batch_size, hpsv3_num_frames, device, **_):
    """HPSv3 (Ma et al., arXiv:2508.03789): Qwen2-VL-7B-Instruct with a reward head, as HPSv3RewardInferencer.reward
    computes it (hpsv3/inference.py and hpsv3/model/qwen2vl_trainer.py of the authors' package):

        score = mu,   (mu, sigma) = rm_head(h[<|Reward|>])      unbounded; the authors' demo calls > 10 excellent

    h is the last hidden state (after the final norm) of Qwen2-VL reading the chat-templated message [image,
    `hpsv3_text(prompt)`], taken at the <|Reward|> token (added to the tokenizer, id len(tokenizer)); rm_head is
    `_hpsv3_head`, in float32. The image is resized (bicubic) to 256 * 28 * 28 pixels (448 x 448 when square: 256
    visual tokens). Positions are 1-D (0, 1, 2, ... over the valid tokens, as the authors' forward leaves
    position_ids to the language model), not Qwen2-VL's 3-D M-RoPE positions for the image. Weights: the
    whole model from `hpsv3_checkpoint_path` (the hub file MizzenAI/HPSv3/HPSv3.safetensors by default, read by
    `hpsv3_state`); config and processor from `hpsv3_base_path`. bfloat16 on a GPU (as the authors), float32 on
    the CPU. Video: `hpsv3_num_frames` evenly spaced frames (default every frame), averaged.
    """
    from transformers import AutoConfig, AutoProcessor, Qwen2VLModel
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    batch_size = _integer(hpsv3_batch_size, 1, "--hpsv3-batch-size")
    if hpsv3_num_frames is not None:
        _integer(hpsv3_num_frames, 0, "--hpsv3-num-frames")
    try:
        processor = AutoProcessor.from_pretrained(hpsv3_base_path, padding_side="right")
        config = AutoConfig.from_pretrained(hpsv3_base_path)
    except Exception as err:
        raise _hub_error("hpsv3", hpsv3_base_path, "--hpsv3-base-path", err) from err
    processor.tokenizer.add_tokens(["<|Reward|>"], special_tokens=True)  # create_model_and_processor: appended
    reward_id = processor.tokenizer.convert_tokens_to_ids("<|Reward|>")
    path = hpsv3_checkpoint_path
    try:
        import safetensors.torch

        if path is None:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download("MizzenAI/HPSv3", "HPSv3.safetensors")
        body, head_state = hpsv3_state(safetensors.torch.load_file(path))
    except KeyError as err:
        raise RuntimeError(f"hpsv3: {path} holds {err}, not a key of HPSv3.safetensors; "
                           f"check --hpsv3-checkpoint-path") from None
    except Exception as err:
        raise _hub_error("hpsv3", path or "MizzenAI/HPSv3/HPSv3.safetensors", "--hpsv3-checkpoint-path", err) from err
    rows = body.get("language_model.embed_tokens.weight", torch.empty(0)).shape[0]
    if rows != len(processor.tokenizer):
        raise RuntimeError(f"hpsv3: {path} has {rows} token embeddings, but the tokenizer of {hpsv3_base_path} has "
                           f"{len(processor.tokenizer)} with <|Reward|>; point --hpsv3-base-path at "
                           f"Qwen2-VL-7B-Instruct")
    config.text_config.vocab_size = rows  # resize_token_embeddings(len(tokenizer)) in create_model_and_processor
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    with torch.device(device):
        model = Qwen2VLModel._from_config(config, dtype=dtype).eval()
    _load_state(model, body, f"hpsv3: {path}", "--hpsv3-checkpoint-path and --hpsv3-base-path")
    head = _load_state(_hpsv3_head(config.text_config.hidden_size), head_state, f"hpsv3: {path} (rm_head)",
                      "--hpsv3-checkpoint-path").eval().to(device)

    @torch.no_grad()
    def score(images, prompts, metadata):
        frames, n = _frames(to_uint8(images), hpsv3_num_frames)
        texts = [p for p in prompts for _ in range(n)]
        h, w = smart_resize(frames.shape[1], frames.shape[2], factor=28, min_pixels=HPSV3_PIXELS,
                            max_pixels=HPSV3_PIXELS)
        scores = []
        for i in range(0, len(frames), batch_size):
            messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": hpsv3_text(t)}]}]
                        for t in texts[i:i + batch_size]]
            resized = [Image.fromarray(f).resize((w, h), Image.BICUBIC) for f in frames[i:i + batch_size]]
            batch = processor(text=processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              images=resized, padding=True, return_tensors="pt").to(device)
            mask = batch["attention_mask"]
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # 1-D positions; padding is on the right
            hidden = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions,
                           pixel_values=batch["pixel_values"].to(dtype), image_grid_thw=batch["image_grid_thw"],
                           ).last_hidden_state  # [b, L, hidden]
            at = batch["input_ids"] == reward_id
            assert (at.sum(1) == 1).all(), "one <|Reward|> token per sample"
            scores.append(head(hidden[at].float())[:, 0])  # mu
        return torch.cat(scores).cpu().view(len(prompts), n).mean(1)  # [B], mean over frames

    return score


# ----------------------------------------------------------------------------- OCR

def ocr_score(recognized, prompt):
    """Flow-GRPO's text-rendering reward (arXiv:2505.05470, Sec. 5.1): r = max(1 - N_e / N_ref, 0).

    The target is the text between the first pair of double quotes in `prompt`. Both sides are
    lower-cased with spaces removed; a target found inside the recognised text scores 1;
    otherwise 1 - min(levenshtein, len(target)) / len(target). No quoted (or an empty) target
    scores 0.
    """
    import Levenshtein

    parts = prompt.split('"')
    if len(parts) < 3:  # fewer than two quotes: no target
        return 0.0
    target = parts[1].replace(" ", "").lower()
    recognized = recognized.replace(" ", "").lower()
    if not target:
        return 0.0
    if target in recognized:
        return 1.0
    return 1.0 - min(Levenshtein.distance(recognized, target), len(target)) / len(target)


def _rapidocr_reader(threads):
    from rapidocr_onnxruntime import RapidOCR

    # PP-OCR models shipped in the wheel; detection resizes as PaddleOCR 2.x does (longest side at most 960)
    # instead of RapidOCR's default of upscaling the shortest side to 736, which is 2-20x slower on 512 px samples
    engine = RapidOCR(intra_op_num_threads=threads, inter_op_num_threads=1, det_limit_type="max",
                      det_limit_side_len=960)

    def read(frame):
        result, _ = engine(Image.fromarray(frame), use_cls=False)  # no angle classifier, as Flow-GRPO
        return "".join(text for _, text, _ in result or [])

    return read


def _paddle_reader(threads):
    try:
        from paddleocr import PaddleOCR
    except ImportError as err:
        raise RuntimeError("ocr: --ocr-backend paddle needs PaddleOCR (pip install 'paddleocr<3' paddlepaddle), "
                           "or use --ocr-backend rapidocr") from err
    try:  # the 2.x API Flow-GRPO used: English, no angle classifier
        engine = PaddleOCR(use_angle_cls=False, lang="en", use_gpu=False, show_log=False)
    except Exception as err:
        raise RuntimeError(f"ocr: PaddleOCR could not load its English models ({type(err).__name__}: {err}); "
                           f"run it once where they can be downloaded, or use --ocr-backend rapidocr") from err

    def read(frame):
        result = engine.ocr(frame[..., ::-1].copy(), cls=False)  # PaddleOCR reads BGR arrays
        lines = result[0] if result and result[0] else []
        return "".join(text for _, (text, conf) in lines if conf > 0)

    return read


OCR_BACKENDS = {"rapidocr": _rapidocr_reader, "paddle": _paddle_reader}


def ocr(*, ocr_backend, ocr_workers, **_):
    """OCR reward: read each image with `ocr_backend`, score it with `ocr_score`. Video: mean over
    frames. OCR runs on the CPU in `ocr_workers` threads (the ONNX / Paddle kernels release the
    GIL), each with its own engine, so a batch is read in parallel rather than one image at a time.
    """
    if ocr_backend not in OCR_BACKENDS:
        raise ValueError(f"--ocr-backend must be one of {sorted(OCR_BACKENDS)}, got {ocr_backend!r}")
    workers = _integer(ocr_workers, 1, "--ocr-workers")
    threads = max(1, (os.cpu_count() or 1) // workers)  # share the cores instead of oversubscribing them
    readers = threading.local()
    first = OCR_BACKENDS[ocr_backend](threads)  # load once now: a missing backend fails at build time
    pool = ThreadPoolExecutor(workers, thread_name_prefix="ocr")

    def read(frame):
        if not hasattr(readers, "read"):
            readers.read = OCR_BACKENDS[ocr_backend](threads)  # one engine per worker thread
        return readers.read(frame)

    def score(images, prompts, metadata):
        images = to_uint8(images)
        video = images if images.ndim == 5 else images[:, None]  # [B, F, H, W, 3]
        texts = list(pool.map(read, video.reshape(-1, *video.shape[-3:])))
        f = video.shape[1]
        return torch.tensor([np.mean([ocr_score(t, p) for t in texts[i * f:(i + 1) * f]])
                             for i, p in enumerate(prompts)],
                            dtype=torch.float32)

    score.read = first  # the raw reader, for tests and debugging
    return score


# ----------------------------------------------------------------------------- JPEG (DDPO)

def _jpeg_kb(images):
    """JPEG size in kB (1000 bytes) at quality 95 per sample; video: mean over frames."""
    images = to_uint8(images)
    video = images if images.ndim == 5 else images[:, None]
    sizes = []
    for clip in video:
        per_frame = []
        for frame in clip:
            buffer = io.BytesIO()
            Image.fromarray(frame).save(buffer, format="JPEG", quality=95)
            per_frame.append(buffer.tell() / 1000)
        sizes.append(np.mean(per_frame))
    return torch.tensor(sizes, dtype=torch.float32)


def jpeg_compressibility(**_):
    """DDPO's compressibility task (Black et al., arXiv:2305.13301): r = -kB / 500, the /500 as in Flow-GRPO."""
    return lambda images, prompts, metadata: -_jpeg_kb(images) / 500


def jpeg_incompressibility(**_):
    """DDPO's incompressibility task: r = +kB / 500."""
    return lambda images, prompts, metadata: _jpeg_kb(images) / 500


# ----------------------------------------------------------------------------- reward services: the three kinds

DEFAULT_RUBRIC = """You grade an image generated from a text prompt. Rate how well the image shows \
what the prompt asks for and how well it is made, on this scale:
4: every element of the prompt is present and correct, and the image has no visible flaws.
3: the main subject and most details are right; small errors or artifacts.
2: the main subject is recognisable, but important details are missing or wrong.
1: barely related to the prompt, or badly distorted.
0: unrelated to the prompt, or not a coherent image.
Reply with JSON only, exactly of the form {"score": <number>}."""


class OpenAIJudge:
    """One image, one Chat Completions request: system rubric + generation prompt + PNG data URL;
    the reply's message content must be JSON `{"score": <number>}` inside [score_min, score_max]
    (a ```json fence around it is tolerated). The key comes from the environment variable
    `api_key_env` and is kept out of repr, logs and errors. Requests go through the official
    `openai` client on `http_client`'s transport, with its retries off (the service loop retries).

    The three methods are the hooks `custom_api` calls: subclass this (or write any class with
    them) and name it under `class` in `--custom-api-rm-config`.
    """

    def __init__(self, *, model, api_key_env=None, base_url="https://api.openai.com/v1", prompt=None,
                 score_min=0.0, score_max=4.0, temperature=0.0, max_tokens=64):
        import openai

        self._key = None
        if api_key_env:
            self._key = os.environ.get(api_key_env)
            if not self._key:
                raise ValueError(f"the environment variable {api_key_env} (api_key_env) is not set; "
                                 f"export the API key in it")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must name the judge model, got {_show(model)}")
        self.model, self.url = model, _http_url(base_url, "base_url").rstrip("/")
        self.prompt = DEFAULT_RUBRIC if prompt is None else prompt
        self.score_min, self.score_max = _real(score_min, "score_min"), _real(score_max, "score_max")
        if self.score_min >= self.score_max:
            raise ValueError(f"score_min {score_min} must be below score_max {score_max}")
        self.temperature = _real(temperature, "temperature", minimum=0)
        self.max_tokens = _integer(max_tokens, 1, "max_tokens")
        # No key (a server without auth): a placeholder keeps OPENAI_API_KEY unread and each request omits the header.
        self._client = openai.OpenAI(api_key=self._key or "none", base_url=self.url, max_retries=0,
                                     http_client=http_client())
        self._headers = None if self._key else {"Authorization": openai.Omit()}

    def __repr__(self):
        return f"{type(self).__name__}(model={self.model!r}, url={self.url!r})"

    def redact(self, text):
        return services.mask_secrets([self._key])(text)

    def build_request(self, image, prompt, metadata):
        if image.ndim != 3:
            raise ValueError(f"{type(self).__name__} scores images only, got frames of shape {image.shape}")
        return {
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "messages": [
                {"role": "system", "content": self.prompt},
                {"role": "user", "content": [
                    {"type": "text", "text": f"Prompt: {prompt}"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _png_base64(image)}},
                ]},
            ],
        }

    def send_request(self, request, timeout):
        """The Chat Completions reply as a dict. HTTP errors keep their status (for the retry rule); a failure
        without one (deadline, byte cap, refused connection) is raised as what caused it."""
        import openai

        try:
            reply = self._client.chat.completions.create(**request, timeout=timeout, extra_headers=self._headers)
        except openai.APIStatusError as err:
            raise _HTTPStatus(err.status_code, f"HTTP {err.status_code}: {err.response.text[:300]}") from None
        except openai.APIConnectionError as err:  # its own message is only "Connection error." / "Request timed out."
            raise (err.__cause__ or err) from None
        except ValueError as err:  # a body that is not JSON
            raise BadReply(f"reply is not JSON ({err})") from None
        return reply.model_dump() if hasattr(reply, "model_dump") else reply  # a non-JSON body comes back as str

    def parse_response(self, response):
        try:
            content = response["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise BadReply(f"not a Chat Completions reply: {str(response)[:200]}") from None
        text = (content or "").strip()
        if text.startswith("```"):
            text = text.strip("`").removeprefix("json").strip()
        try:
            reply = json.loads(text)
        except ValueError:
            raise BadReply(f'message is not JSON {{"score": <number>}}: {text[:200]!r}') from None
        if not isinstance(reply, dict) or "score" not in reply:
            raise BadReply(f'message is not JSON {{"score": <number>}}: {text[:200]!r}')
        value = _number(reply["score"], "score")
        if not self.score_min <= value <= self.score_max:
            raise BadReply(f"score {value} outside [{self.score_min}, {self.score_max}]")
        return value


HOOKS = ("build_request", "send_request", "parse_response")


def _api_scorer(service, client, loop):
    """The request/response loop shared by `openai_api` and `custom_api`: one request per sample."""
    redact = getattr(client, "redact", lambda s: s)

    def send(request):
        value = client.parse_response(client.send_request(request, loop["timeout"]))
        return [_number(value, "parse_response's value")]  # True or "2" are refused, not read as 1.0 or 2.0

    def score(images, prompts, metadata):
        images = to_uint8(images)
        metadata = metadata or [{}] * len(images)
        scores, failed = _serve(service, [[i] for i in range(len(images))],
                                prepare=lambda u: client.build_request(images[u], prompts[u], metadata[u]),
                                send=lambda u, request: send(request), redact=redact, **loop)
        return {"reward": scores, "failed": failed}

    return score


def _config_loop(flag, config, timeout, *options):
    """The loop settings of a config-driven service: its keys `timeout_s` (else --reward-timeout) and
    `max_concurrency` (8) are popped from `config`; `options` are the retries, backoff, on_error and byte cap."""
    timeout_name = f"{flag}: timeout_s" if "timeout_s" in config else "--reward-timeout"
    return _service_loop(config.pop("timeout_s", timeout), timeout_name, config.pop("max_concurrency", 8),
                         f"{flag}: max_concurrency", *options)


def _construct(cls, config, flag, name):
    try:
        return cls(**config)
    except (TypeError, ValueError) as err:  # a missing, unknown or bad key
        raise ValueError(f"{flag}: {name}({', '.join(sorted(config))}) failed: {err}") from None


def openai_api(*, openai_api_rm_config, reward_timeout, reward_retries, reward_backoff, reward_on_error,
               reward_max_bytes, **_):
    """A vision-language judge behind an OpenAI-compatible Chat Completions endpoint (`OpenAIJudge`).

    Config keys: model, api_key_env, base_url, prompt | prompt_path, score_min (0), score_max (4),
    temperature (0), max_tokens (64), timeout_s (--reward-timeout), max_concurrency (8, per process).
    """
    flag = "--openai-api-rm-config"
    config = load_config(openai_api_rm_config, flag)
    known = ("model", "api_key_env", "base_url", "prompt", "score_min", "score_max", "temperature", "max_tokens",
             "timeout_s", "max_concurrency")
    unknown = sorted(set(config) - set(known))
    if unknown or "model" not in config:
        raise ValueError(f"{flag}: unknown keys {unknown} or no model; keys are {sorted(known) + ['prompt_path']}")
    loop = _config_loop(flag, config, reward_timeout, reward_retries, reward_backoff, reward_on_error, reward_max_bytes)
    return _api_scorer("openai_api", _construct(OpenAIJudge, config, flag, "OpenAIJudge"), loop)


def custom_api(*, custom_api_rm_config, reward_timeout, reward_retries, reward_backoff, reward_on_error,
               reward_max_bytes, **_):
    """Your request/response hooks in the `openai_api` loop. Runs user code.

    Config: `class` (dotted path to a class with build_request(image uint8 [H, W, 3], prompt,
    metadata) -> request, send_request(request, timeout) -> response, parse_response(response) ->
    number; default `rewards.OpenAIJudge`), timeout_s, max_concurrency; every other key is passed
    to the class as a keyword. A `redact(text)` method, if present, filters its error messages.
    `send_request` gets the deadline and the byte cap of the attempt when it posts with
    `rewards.post_json` (or a `rewards.http_client()`); other HTTP code only gets `timeout`.
    """
    flag = "--custom-api-rm-config"
    config = load_config(custom_api_rm_config, flag)
    path = config.pop("class", "rewards.OpenAIJudge")
    cls = import_object(path, f"{flag} class")
    loop = _config_loop(flag, config, reward_timeout, reward_retries, reward_backoff, reward_on_error, reward_max_bytes)
    client = _construct(cls, config, flag, path)
    missing = [hook for hook in HOOKS if not callable(getattr(client, hook, None))]
    if missing:
        raise ValueError(f"{flag}: class {path} has no {', '.join(missing)}; it needs build_request, send_request "
                         f"and parse_response (see rewards.OpenAIJudge)")
    return _api_scorer("custom_api", client, loop)


def remote(*, rm_url, rm_auth_env, remote_batch_size, remote_max_concurrency, reward_timeout, reward_retries,
           reward_backoff, reward_on_error, reward_max_bytes, **_):
    """A reward server you run: the protocol in the module docstring. The batch goes in one POST,
    or in chunks of `remote_batch_size` samples with at most `remote_max_concurrency` in flight.
    With `rm_auth_env`, that environment variable's value is the Authorization header."""
    if not rm_url:
        raise ValueError("reward 'remote' needs --rm-url http://host:port/path")
    _http_url(rm_url, "--rm-url")
    batch_size = _integer(remote_batch_size, 0, "--remote-batch-size")
    loop = _service_loop(reward_timeout, "--reward-timeout", remote_max_concurrency, "--remote-max-concurrency",
                         reward_retries, reward_backoff, reward_on_error, reward_max_bytes)
    headers, redact = {}, (lambda s: s)
    if rm_auth_env:
        token = os.environ.get(rm_auth_env)
        if not token:
            raise ValueError(f"--rm-auth-env {rm_auth_env}: that environment variable is unset or empty; "
                             f"export the Authorization header value in it, e.g. {rm_auth_env}='Bearer <token>'")
        headers, redact = {"Authorization": token}, services.mask_secrets([token])
    client = http_client(headers)  # the header lives in the client only: not in args, logs or errors

    def send(body):
        reply = post_json(rm_url, body, timeout=loop["timeout"], client=client)
        if not isinstance(reply, dict) or not isinstance(reply.get("scores"), list):
            raise BadReply(f'expected {{"scores": [...]}}, got {str(reply)[:200]}')
        return [_number(s, "score") for s in reply["scores"]]

    def score(images, prompts, metadata):
        images = to_uint8(images)
        metadata = metadata or [{}] * len(images)
        size = batch_size or len(images)
        units = [list(range(i, min(i + size, len(images)))) for i in range(0, len(images), size)]

        def prepare(u):
            pngs = [_png_base64(images[i]) if images.ndim == 4 else [_png_base64(f) for f in images[i]]
                    for i in units[u]]
            return {"prompts": [prompts[i] for i in units[u]], "metadata": [metadata[i] for i in units[u]],
                    "images": pngs}

        scores, failed = _serve("remote", units, prepare, lambda u, body: send(body), redact=redact, **loop)
        return {"reward": scores, "failed": failed}

    return score


# ----------------------------------------------------------------------------- user code

def import_object(path, flag):
    """`package.module.name`, or `path/to/file.py:name`. Imports (so runs) that code."""
    import importlib
    import importlib.util

    try:
        if ":" in path:
            file, name = path.rsplit(":", 1)
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(file))[0], file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module_name, name = path.rsplit(".", 1)
            module = importlib.import_module(module_name)
        return getattr(module, name)
    except (ImportError, AttributeError, ValueError, OSError) as err:
        raise ValueError(f"{flag} {path!r}: cannot import it ({type(err).__name__}: {err}); "
                         f"give module.name importable from the working directory, or path/to/file.py:name") from err


def custom(*, custom_rm_path, custom_rm_args, **_):
    """Your function: `--custom-rm-path module.function` (or file.py:function). Runs user code.

    Called as fn(images uint8 tensor [B, H, W, 3] (or [B, F, H, W, 3]), prompts, metadata,
    custom_rm_args) where `custom_rm_args` is the opaque `--custom-rm-args` string. Return B
    scores (list, array or tensor), or a dict of named [B] scores: its "reward" entry (or its only
    entry) is this component's score, an optional bool "failed" entry marks samples to skip, and
    every other entry is reported next to the components under its own name (NaN where it does
    not apply). Anything else (None, strings, the wrong length) is a one-line error naming the flag.
    """
    if not custom_rm_path:
        raise ValueError("reward 'custom' needs --custom-rm-path module.function")
    fn = import_object(custom_rm_path, "--custom-rm-path")
    if not callable(fn):
        raise ValueError(f"--custom-rm-path {custom_rm_path!r} names a {type(fn).__name__}, not a function")

    def score(images, prompts, metadata):
        out = fn(torch.from_numpy(to_uint8(images)), prompts, metadata, custom_rm_args)
        main, failed, extras = _as_scores(out, len(prompts), f"--custom-rm-path {custom_rm_path}")
        return {"reward": main, "failed": failed, **extras}

    return score


# ----------------------------------------------------------------------------- UnifiedReward (an openai_api preset)

# The pointwise image-generation prompt of the authors (CodeGoat24/UnifiedReward,
# inference_qwen/image_generation/qwen_point_score_image_generation.py; MixGRPO's QUESTION_TEMPLATE_SCORE is the
# same), as the model was trained to read it; {prompt} is the caption.
UNIFIEDREWARD_PROMPT = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n"
    "1. Alignment with the Caption: Assess how well this image aligns with the provided caption. Consider the "
    "accuracy of depicted objects, their relationships, and attributes as described in the caption.\n"
    "2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail preservation, "
    "color accuracy, and overall aesthetic appeal.\n"
    "Extract key elements from the provided text caption, evaluate their presence in the generated image using the "
    "format: 'element (type): value' (where value=0 means not generated, and value=1 means generated), and assign a "
    "score from 1 to 5 after 'Final Score:'.\n"
    "Your task is provided as follows:\n"
    "Text Caption: [{prompt}]"
)


class UnifiedRewardJudge(OpenAIJudge):
    """UnifiedReward (Wang et al., arXiv:2503.05236) served behind an OpenAI-compatible endpoint, e.g.
    `vllm serve CodeGoat24/UnifiedReward-qwen-7b --served-model-name UnifiedReward --port 8080` (the authors'
    vllm_qwen/vllm_server.sh) or SGLang. One request per image, as the authors' client sends it: a single user
    message holding the image, then `UNIFIEDREWARD_PROMPT` with the caption; temperature 0, up to 4096 tokens.

    The reply is free text: element lines, then "Final Score: <n>". The score is the number after the last
    "Final Score:" (markdown bold around it is allowed), 1 to 5. A reply without one is a failed attempt (retried,
    then --reward-on-error), where Flow-GRPO's unifiedreward_score_sglang scores it 0; Flow-GRPO also divides the
    score by 5 (a constant factor that group normalisation removes).
    """

    def __init__(self, *, model, base_url, api_key_env=None, max_tokens=4096):
        super().__init__(model=model, base_url=base_url, api_key_env=api_key_env, prompt=UNIFIEDREWARD_PROMPT,
                         score_min=1.0, score_max=5.0, temperature=0.0, max_tokens=max_tokens)

    def build_request(self, image, prompt, metadata):
        if image.ndim != 3:
            raise ValueError(f"unifiedreward scores images only, got frames of shape {image.shape}")
        question = self.prompt.replace("{prompt}", prompt)
        return {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _png_base64(image)}},
                    {"type": "text", "text": question}]}]}

    def parse_response(self, response):
        import re

        try:
            text = response["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise BadReply(f"not a Chat Completions reply: {str(response)[:200]}") from None
        found = re.findall(r"Final Score:\s*\**\s*([0-9]+(?:\.[0-9]+)?)", text)
        if not found:
            raise BadReply(f"no 'Final Score: <n>' in the reply: {text[-200:]!r}")
        value = float(found[-1])
        if not self.score_min <= value <= self.score_max:
            raise BadReply(f"Final Score {value:g} outside [{self.score_min:g}, {self.score_max:g}]")
        return value


def unifiedreward(*, unifiedreward_url, unifiedreward_model, unifiedreward_api_key_env, unifiedreward_max_concurrency,
                  reward_timeout, reward_retries, reward_backoff, reward_on_error, reward_max_bytes, **_):
    """UnifiedReward's pointwise score, 1-5, from a server you run (`UnifiedRewardJudge`), through the request
    loop of `openai_api`: deadline, retries, bounded concurrency and --reward-on-error apply alike. Images only."""
    _http_url(unifiedreward_url, "--unifiedreward-url")
    loop = _service_loop(reward_timeout, "--reward-timeout", unifiedreward_max_concurrency,
                         "--unifiedreward-max-concurrency", reward_retries, reward_backoff, reward_on_error,
                         reward_max_bytes)
    if not isinstance(unifiedreward_model, str) or not unifiedreward_model:
        raise ValueError(f"--unifiedreward-model must name the served model, got {_show(unifiedreward_model)}")
    try:
        judge = UnifiedRewardJudge(model=unifiedreward_model, base_url=unifiedreward_url,
                                   api_key_env=unifiedreward_api_key_env)
    except ValueError as err:  # the key's environment variable is unset
        raise ValueError(f"--unifiedreward-api-key-env: {err}") from None
    return _api_scorer("unifiedreward", judge, loop)


# ----------------------------------------------------------------------------- mixtures and dispatch

def parse_spec(spec):
    """'ocr' -> [('ocr', 1.0)]; 'ocr=0.8,pickscore=0.2' -> [('ocr', 0.8), ('pickscore', 0.2)]."""
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"empty reward spec {spec!r}; give a name or name=weight,name=weight")
    out = []
    for part in parts:
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r} in {spec!r}; known rewards: {', '.join(REWARDS)}")
        if name in dict(out):
            raise ValueError(f"reward {name!r} appears twice in {spec!r}")
        try:
            w = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ValueError(f"weight {weight!r} of {name!r} in {spec!r} is not a number") from None
        if not math.isfinite(w):
            raise ValueError(f"weight of {name!r} in {spec!r} must be finite")
        out.append((name, w))
    return out


def _as_scores(out, n, who):
    """A scorer's output -> (score [n] float32, failed [n] bool, extras {key: [n] float32}). Any other shape
    or type (None, strings, a wrong length) is a one-line ValueError naming `who` and what came back."""
    def vector(x, what, kinds="iuf"):
        a = x.detach().cpu() if isinstance(x, torch.Tensor) else x
        if isinstance(a, torch.Tensor):
            a = (a.float() if a.is_floating_point() else a).numpy()  # numpy has no bfloat16
        try:
            a = np.asarray(a)
        except (ValueError, TypeError):  # ragged nesting
            a = np.asarray(None)
        if a.dtype.kind not in kinds:  # strings, None and objects are refused, not parsed: "2" is no score
            kind = "booleans" if "b" in kinds else "numbers"
            raise ValueError(f"{who} returned {what} {_show(x)}; give {n} {kind}, one per sample "
                             f"(list, array or tensor)")
        if a.size != n:
            raise ValueError(f"{who} returned {a.size} {what} for {n} samples: {_show(x)}")
        return torch.from_numpy(a.reshape(n).astype(bool if "b" in kinds else np.float32))

    extras, failed = {}, torch.zeros(n, dtype=torch.bool)
    if isinstance(out, dict):
        out = dict(out)
        if "failed" in out:
            failed = vector(out.pop("failed"), "'failed' values", kinds="biu")
        if "reward" not in out and len(out) != 1:
            raise ValueError(f"{who} returned a dict without a 'reward' entry (keys {sorted(out)}); "
                             f"add 'reward': the score to weight and train on")
        main = out.pop("reward") if "reward" in out else out.popitem()[1]
        extras = {k: vector(v, f"{k!r} values") for k, v in out.items()}
        out = main
    return vector(out, "scores"), failed, extras


def build_reward(spec, *, device="cpu", **options):
    """reward_fn(images, prompts, metadata) -> {component: [B], ..., "reward": [B], "failed": [B] bool}.

    `spec` is a name or "name=weight,...". `options` are dests of `add_arguments`' flags; the ones
    not given take the flags' defaults, and a key no flag declares is refused with the closest name.
    The spec's scorers (and their models) are built now; those only named by a sample's
    `metadata.rm_type` are built the first time one appears.
    """
    known = option_defaults()
    for key in options:
        if key not in known:
            closest = difflib.get_close_matches(key, known, n=1, cutoff=0)[0]
            raise ValueError(f"unknown reward option {key!r}; did you mean {closest!r}? "
                             f"(the options are the dests of rewards.add_arguments)")
    options = {**known, **options}
    default = parse_spec(spec)
    scorers = {}

    def scorer(name):
        if name not in scorers:
            scorers[name] = REWARDS[name](device=device, **options)
        return scorers[name]

    for name, _ in default:
        scorer(name)

    def reward_fn(images, prompts, metadata=None):
        images = to_uint8(images)
        batch = len(images)
        metadata = [m or {} for m in (metadata if metadata is not None else [None] * batch)]
        if not len(prompts) == len(metadata) == batch:
            raise ValueError(f"{batch} images, {len(prompts)} prompts and {len(metadata)} metadata dicts; "
                             f"they must match")
        specs = []
        for i, m in enumerate(metadata):
            try:
                specs.append(parse_spec(m["rm_type"]) if m.get("rm_type") else default)
            except ValueError as err:
                raise ValueError(f"sample {i}, metadata rm_type: {err}") from None
        users = {name: [] for name, _ in default}  # component -> indices of the samples it scores
        for i, s in enumerate(specs):
            for name, _ in s:
                users.setdefault(name, []).append(i)

        out, failed = {}, torch.zeros(batch, dtype=torch.bool)
        for name, idx in users.items():
            component = torch.full((batch,), float("nan"))  # NaN where the component does not apply
            if idx:
                result = scorer(name)(images[idx], [prompts[i] for i in idx], [metadata[i] for i in idx])
                part, part_failed, extras = _as_scores(result, len(idx), f"reward {name!r}")
                # The score must be finite; an extra entry may be NaN ("does not apply to this sample"), not inf.
                checks = [(name, part, ~torch.isfinite(part))] + [(k, v, torch.isinf(v)) for k, v in extras.items()]
                for key, values, bad in checks:
                    bad &= ~part_failed
                    if bad.any():
                        j = int(bad.nonzero()[0])
                        raise NonFiniteReward(f"reward {name!r} ({key}) gave {values[j].item()} for sample {idx[j]}")
                part[part_failed] = float("nan")
                component[idx] = part
                failed[idx] |= part_failed
                for key, values in extras.items():
                    if key in users or key in out or key in ("reward", "failed"):
                        raise ValueError(f"reward {name!r} returned an entry {key!r} that clashes with a "
                                         f"component name")
                    out[key] = torch.full((batch,), float("nan"))
                    out[key][idx] = values
            out[name] = component
        total = torch.zeros(batch)
        for i, s in enumerate(specs):  # weighted sum of the sample's own components
            if not failed[i]:
                total[i] = sum(w * out[name][i] for name, w in s)
        out["reward"], out["failed"] = total, failed
        return out

    reward_fn.spec = default
    return reward_fn


# ----------------------------------------------------------------------------- options (the argparse group "reward")

def add_arguments(parser):
    """Add the group "reward" to an argparse parser: every option `build_reward` takes, with its one default.

    Each help string ends with the default, so `--help` shows it under any formatter. A reward
    module with flags of its own adds them with one line at the end (`geneval.add_arguments(parser)`).
    """
    group = parser.add_argument_group("reward", "options of the scorers named by --reward "
                                                "(keywords of rewards.build_reward)")

    def flag(name, help, **kw):
        group.add_argument(name, help=help + " (default: %(default)s)", **kw)

    # PickScore and HPS
    flag("--pickscore-processor-path", "hub id or local folder of the PickScore processor",
         default="laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
    flag("--pickscore-model-path", "hub id or local folder of the PickScore CLIP model",
         default="yuvalkirstain/PickScore_v1")
    flag("--pickscore-batch-size", "images per PickScore forward, per GPU", type=int, default=8)
    flag("--pickscore-num-frames", "video: evenly spaced frames scored per sample (None or 0: every frame)", type=int,
         default=None)
    flag("--hps-version", "HPSv2 checkpoint version", choices=sorted(HPS_FILES), default="v2.1")
    flag("--hps-checkpoint-path", "HPS checkpoint file (None: the --hps-version file of the hub repo xswu/HPSv2)",
         default=None)
    flag("--hps-model-name", "open_clip architecture of the HPS checkpoint", default="ViT-H-14")
    flag("--hps-batch-size", "images per HPS forward, per GPU", type=int, default=8)
    flag("--hps-num-frames", "video: evenly spaced frames scored per sample (None or 0: every frame)", type=int,
         default=None)
    # ImageReward, HPSv3, CLIPScore, the LAION aesthetic predictor (each: video frames as --pickscore-num-frames)
    flag("--imagereward-model-path", "hub repo id, local folder or ImageReward.pt file (med_config.json beside it)",
         default="THUDM/ImageReward")
    flag("--imagereward-tokenizer-path", "hub id or local folder of ImageReward's BERT tokenizer",
         default="google-bert/bert-base-uncased")
    flag("--imagereward-batch-size", "images per ImageReward forward, per GPU", type=int, default=8)
    flag("--imagereward-num-frames", "video: evenly spaced frames scored per sample (None or 0: every frame)",
         type=int, default=None)
    flag("--hpsv3-checkpoint-path", "HPSv3 weights file (None: HPSv3.safetensors of the hub repo MizzenAI/HPSv3)",
         default=None)
    flag("--hpsv3-base-path", "hub id or local folder of the Qwen2-VL HPSv3 is built on (its config and processor)",
         default="Qwen/Qwen2-VL-7B-Instruct")
    flag("--hpsv3-batch-size", "images per HPSv3 forward, per GPU", type=int, default=8)
    flag("--hpsv3-num-frames", "video: evenly spaced frames scored per sample (None or 0: every frame)", type=int,
         default=None)
    flag("--clipscore-model-path", "hub id or local folder of the CLIP model and processor",
         default="openai/clip-vit-large-patch14")
    flag("--clipscore-batch-size", "images per CLIP forward, per GPU", type=int, default=8)
    flag("--clipscore-num-frames", "video: evenly spaced frames scored per sample (None or 0: every frame)", type=int,
         default=None)
    flag("--aesthetic-clip-path", "hub id or local folder of the aesthetic predictor's CLIP model and processor",
         default="openai/clip-vit-large-patch14")
    flag("--aesthetic-mlp-path", "the predictor's MLP file (None: sac+logos+ava1-l14-linearMSE.pth from its GitHub "
         "repository, cached by torch.hub)", default=None)
    flag("--aesthetic-batch-size", "images per CLIP forward, per GPU", type=int, default=8)
    flag("--aesthetic-num-frames", "video: evenly spaced frames scored per sample (None or 0: every frame)", type=int,
         default=None)
    # UnifiedReward (the openai_api loop with the authors' prompt and reply format)
    flag("--unifiedreward-url", "base URL of the OpenAI-compatible server (vLLM, SGLang) serving UnifiedReward",
         default="http://127.0.0.1:8080/v1")
    flag("--unifiedreward-model", "the model name the server serves it under", default="UnifiedReward")
    flag("--unifiedreward-api-key-env", "name of an environment variable holding the server's API key (None: no key)",
         metavar="NAME", default=None)
    flag("--unifiedreward-max-concurrency", "requests in flight to --unifiedreward-url, per GPU", type=int, default=8)
    # OCR
    flag("--ocr-backend", "OCR engine", choices=sorted(OCR_BACKENDS), default="rapidocr")
    flag("--ocr-workers", "OCR threads, per GPU, each with its own engine on the CPU", type=int, default=2)
    # reward services
    flag("--openai-api-rm-config", "YAML file or base64:<yaml> configuring the openai_api judge", default=None)
    flag("--custom-api-rm-config", "YAML file or base64:<yaml> configuring custom_api (class: pkg.mod.Class "
         "and its keywords)", default=None)
    flag("--rm-url", "URL of your reward server (the 'remote' reward)", default=None)
    flag("--rm-auth-env", "name of an environment variable whose value is sent to --rm-url as the Authorization "
         "header, e.g. 'Bearer <token>'; read at start, never logged or saved", metavar="NAME", default=None)
    flag("--remote-batch-size", "samples per POST to --rm-url, per GPU (0: the whole rollout batch)", type=int,
         default=0)
    flag("--remote-max-concurrency", "POSTs in flight to --rm-url, per GPU", type=int, default=8)
    flag("--reward-retries", "attempts per request to a reward service (1: no retry)", type=int, default=3)
    flag("--reward-timeout", "deadline of one attempt in seconds: connect, send and the whole reply (a config's "
         "timeout_s wins)", type=float, default=60.0)
    flag("--reward-backoff", "seconds before the first retry; doubles each time", type=float, default=1.0)
    flag("--reward-on-error", "after the retries: stop the run, or drop the affected groups from the update",
         choices=["raise", "skip"], default="raise")
    flag("--reward-max-bytes", "largest reply of a reward service in bytes (headers and body as received)", type=int,
         default=16 * 2**20)
    # user code
    flag("--custom-rm-path", "module.function or file.py:function scoring a batch (the 'custom' reward); "
         "RUNS THAT CODE", default=None)
    flag("--custom-rm-args", "opaque string passed to --custom-rm-path", default=None)
    geneval.add_arguments(parser)  # the GenEval reward's own group


def geneval_reward(*, geneval_detector, geneval_detector_path, device, **options):
    """GenEval (geneval.reward) on the detections of --geneval-detector (unset: mask2former; train.py fills shapes
    for its shapes model), a name of GENEVAL_DETECTORS."""
    name = geneval_detector or "mask2former"
    if name not in GENEVAL_DETECTORS:
        raise ValueError(f"--geneval-detector must be one of {', '.join(GENEVAL_DETECTORS)}, got {name!r}")
    detect = GENEVAL_DETECTORS[name](geneval_detector_path, device)
    return geneval.reward(detect=detect, vocabulary=GENEVAL_VOCABULARY.get(name), device=device,
                          geneval_detector=name, **options)


def geneval_rows_check(detector):
    """The check of data.load_prompts for GenEval rows judged by `detector` (None: mask2former): the judge can read
    the row, and every class and colour it names is one the detector reports (else that clause would silently
    fail). Every row of a prompt file is checked when it loads, before any model does."""
    name = detector or "mask2former"
    return lambda metadata: geneval.check_metadata(metadata, vocabulary=GENEVAL_VOCABULARY.get(name), detector=name)


def rows_check(spec, geneval_detector, by_advantage=False):
    """The check of data.load_prompts for the rows of a prompt file trained with reward `spec` (a row's metadata
    rm_type replaces it): a row whose reward has a geneval component must be a GenEval row the judge and
    --geneval-detector can score (geneval_rows_check); by_advantage (--reward-combine advantage, whose weights are
    --reward's): a row's rm_type may only leave components of `spec` out. An unknown rm_type is left to be named
    after the file loads."""
    geneval_check, weights = geneval_rows_check(geneval_detector), dict(parse_spec(spec))

    def check(metadata):
        try:
            row = parse_spec(metadata.get("rm_type") or spec)
        except (AttributeError, ValueError):
            return
        if by_advantage and any(weights.get(name) != w for name, w in row):
            raise ValueError(f"rm_type {metadata['rm_type']!r} is not a part of --reward {spec!r} with its weights, "
                             "which --reward-combine advantage sums the advantages of: fix the row or the flags")
        if "geneval" in dict(row):
            geneval_check(metadata)
    return check


# GenEval's detectors: name -> factory(path, device) -> detect(uint8 images [b, H, W, 3]) -> b lists of detections;
# and the classes and colours each reports.
GENEVAL_DETECTORS = {
    "mask2former": geneval.mask2former_detector,  # photographs (COCO classes); colours from CLIP
    "shapes": lambda path, device: shapes.detect,  # the shapes world: exact, with colours
}
GENEVAL_VOCABULARY = {
    "mask2former": (geneval.OBJECT_NAMES, geneval.COLORS),  # GenEval's 80 COCO classes and 10 colours
    "shapes": (shapes.SHAPES, tuple(shapes.COLORS)),
}


def option_defaults():
    """{dest: default} of every reward option: `add_arguments` on an empty parser, parsing no arguments."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return vars(parser.parse_args([]))


REWARDS = {
    "pickscore": pickscore,
    "hps": hps,
    "ocr": ocr,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "openai_api": openai_api,
    "custom_api": custom_api,
    "remote": remote,
    "custom": custom,
    "geneval": geneval_reward,
    "imagereward": imagereward,
    "hpsv3": hpsv3,
    "clipscore": clipscore,
    "aesthetic": aesthetic,
    "unifiedreward": unifiedreward,
}
