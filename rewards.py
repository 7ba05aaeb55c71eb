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
| `ocr`                    | 1 - capped edit distance to the quoted text (Flow-GRPO)  | [0, 1]                   |
| `jpeg_compressibility`   | -(JPEG kB at quality 95) / 500 (DDPO)                    | <= 0                     |
| `jpeg_incompressibility` | +(JPEG kB at quality 95) / 500 (DDPO)                    | >= 0                     |
| `openai_api`             | a vision-language judge's JSON score, one call a sample  | [score_min, score_max]   |
| `custom_api`             | the same loop with your own request/response hooks       | yours                    |
| `remote`                 | a reward server you run, one POST per batch              | yours                    |
| `custom`                 | your function (`--custom-rm-path module.function`)       | yours                    |
| `geneval`                | GenEval verdict from detections (geneval.py)             | [0, 1]; partial <= 1     |

Conventions shared by every scorer:

- Images are quantised to uint8 by one helper, `to_uint8`: uint8 passes through; float images are
  taken to be in [0, 1], clamped, multiplied by 255 and rounded half-to-even (`torch.round`), the
  same rounding as `models.decode`. Every scorer sees exactly these pixels.
- Each factory loads its model once, when it is called (`build_reward` calls the factories of the
  spec's components at build time, and those of `rm_type` overrides the first time one appears),
  so a reward that is not used downloads and costs nothing.
- A JSONL row's `metadata.rm_type` (a name, or a spec such as "ocr=0.5,pickscore=0.5") replaces
  the global spec for that sample. A component scores all the samples that use it in one batched
  call; where it does not apply, its entry is NaN (log with nanmean). `reward` is always finite: a
  NaN or inf score raises `NonFiniteReward` naming the reward and the sample.
- Model loading that fails (offline, wrong path) raises one sentence naming the flag that points
  at a local copy.

Reward services (`openai_api`, `custom_api`, `remote`) send requests from a thread pool of at most
`max_concurrency` in flight, each bounded by its timeout (`timeout_s` of the config, else
`reward_timeout`, per socket operation as urllib applies it), retried with exponential backoff
(`reward_backoff * 2**attempt` seconds) up to `reward_retries` attempts. HTTP 4xx other than
408/429 is not retried. Once the attempts are spent, `reward_on_error="raise"` raises
`RewardServiceError` naming the service and the sample; `"skip"` marks the sample in `failed`
and gives it reward 0. API keys are read from the environment variable the config names and never
appear in logs or errors.

The `remote` protocol (POST to `--rm-url`, Content-Type application/json):

    request:  {"prompts":  ["a cat", ...],                       # B strings
               "metadata": [{...}, ...],                         # B JSON objects
               "images":   ["<base64 PNG>", ...]}                # B strings; video: B lists of frames
    response: {"scores":   [0.71, ...]}                          # B finite numbers, same order

`custom` and `custom_api` import and run user code named by a dotted path: only point them at
code you trust.

Run `python bench.py --rewards` for the images/s of the offline scorers on this machine.
"""

import base64
import io
import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

import geneval  # light at import: its models load inside geneval.reward
from geneval import geneval_judge  # noqa: F401  (rewards.geneval_judge, as DESIGN.md names it)

log = logging.getLogger(__name__)


class RewardServiceError(RuntimeError):
    """A reward service (API judge, remote server) failed on a sample after all retries."""


class NonFiniteReward(ValueError):
    """A scorer returned NaN or inf; it must never reach the advantages."""


# every keyword `build_reward` accepts (argparse dests in train.py), each defaulted in the factories
OPTIONS = (
    "pickscore_processor_path", "pickscore_model_path", "pickscore_batch_size", "pickscore_num_frames",
    "hps_version", "hps_checkpoint_path", "hps_batch_size", "hps_model_name",
    "ocr_backend", "ocr_workers",
    "openai_api_rm_config", "custom_api_rm_config",
    "rm_url", "remote_batch_size", "remote_max_concurrency",
    "custom_rm_path", "custom_rm_args",
    "reward_retries", "reward_timeout", "reward_backoff", "reward_on_error",
) + geneval.options()  # declared once, in geneval.add_arguments


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
        raise ValueError(f"images must be [B, H, W, 3] or video [B, F, H, W, 3] (channels last), got shape {tuple(images.shape)}")
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


def _png_base64(frame):
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _hub_error(name, path, flag, err):
    return RuntimeError(f"{name}: cannot load {path!r} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                        f"download it where the hub is reachable and point {flag} at the local copy")


# ----------------------------------------------------------------------------- PickScore

def pickscore(*, pickscore_processor_path="laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
              pickscore_model_path="yuvalkirstain/PickScore_v1", pickscore_batch_size=8,
              pickscore_num_frames=None, device="cpu", **_):
    """PickScore (Kirstain et al., Pick-a-Pic, arXiv:2305.01569), scaled as Flow-GRPO does:

        score = exp(logit_scale) * <t / |t|, v / |v|> / 26        (raw logits are about 0-26)

    with t, v the CLIP text and image embeddings. Video: `pickscore_num_frames` evenly spaced
    frames (default every frame) are scored against the prompt and averaged.
    """
    from transformers import AutoProcessor, CLIPModel

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
            pixels = processor(images=[Image.fromarray(f) for f in frames[i:i + pickscore_batch_size]], return_tensors="pt")
            tokens = processor(text=texts[i:i + pickscore_batch_size], padding=True, truncation=True, max_length=77, return_tensors="pt")
            v = features(model.get_image_features(pixel_values=pixels["pixel_values"].to(device)))
            tokens = {k: tokens[k].to(device) for k in ("input_ids", "attention_mask")}
            t = features(model.get_text_features(**tokens))
            scores.append(model.logit_scale.exp() * (t * v).sum(-1) / 26)  # the /26 maps ~0-26 logits to ~0-1
        return torch.cat(scores).float().cpu().view(len(prompts), n).mean(1)  # [B], mean over frames

    return score


# ----------------------------------------------------------------------------- HPSv2

HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}  # files of the hub repo xswu/HPSv2


def hps(*, hps_version="v2.1", hps_checkpoint_path=None, hps_batch_size=8, hps_model_name="ViT-H-14", device="cpu", **_):
    """Human Preference Score v2 / v2.1 (Wu et al., arXiv:2306.09341): an open_clip ViT-H-14 whose
    weights all come from the HPS checkpoint; score = diag(image_features @ text_features.T) with
    both features L2-normalised, i.e. the cosine of each image with its own prompt. Images only.
    `hps_model_name` names the open_clip architecture (tests register a tiny one).
    """
    import open_clip

    if hps_version not in HPS_FILES:
        raise ValueError(f"--hps-version must be one of {sorted(HPS_FILES)}, got {hps_version!r}")
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
            log.warning("hps: %s holds more than tensors (%s); loading it with weights_only=False", path, type(err).__name__)
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
        images = to_uint8(images)
        if images.ndim == 5:
            raise ValueError(f"hps scores images only, got video {tuple(images.shape)}; "
                             f"score frames yourself with --custom-rm-path")
        scores = []
        for i in range(0, len(images), hps_batch_size):
            pixels = torch.stack([preprocess(Image.fromarray(f)) for f in images[i:i + hps_batch_size]]).to(device)
            text = tokenizer(prompts[i:i + hps_batch_size]).to(device)
            with autocast:  # HPSv2 scores under amp on GPU
                out = model(pixels, text)  # features are L2-normalised by open_clip
            scores.append((out["image_features"].float() * out["text_features"].float()).sum(-1))  # diag(I @ T^T)
        return torch.cat(scores).cpu()

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
    engine = RapidOCR(intra_op_num_threads=threads, inter_op_num_threads=1, det_limit_type="max", det_limit_side_len=960)

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


def ocr(*, ocr_backend="rapidocr", ocr_workers=4, **_):
    """OCR reward: read each image with `ocr_backend`, score it with `ocr_score`. Video: mean over
    frames. OCR runs on the CPU in `ocr_workers` threads (the ONNX / Paddle kernels release the
    GIL), each with its own engine, so a batch is read in parallel rather than one image at a time.
    """
    if ocr_backend not in OCR_BACKENDS:
        raise ValueError(f"--ocr-backend must be one of {sorted(OCR_BACKENDS)}, got {ocr_backend!r}")
    workers = max(1, int(ocr_workers))
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
        return torch.tensor([np.mean([ocr_score(t, p) for t in texts[i * f:(i + 1) * f]]) for i, p in enumerate(prompts)],
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


# ----------------------------------------------------------------------------- reward services

def load_config(value, flag):
    """A reward-service config: a YAML file, inline `base64:<base64 of YAML>`, or a dict.

    `prompt_path` is read relative to the config file and becomes `prompt`; an inline config has
    no directory, so it must carry `prompt` itself.
    """
    if value is None:
        raise ValueError(f"this reward needs {flag}: a YAML file or base64:<base64-encoded YAML>")
    import yaml

    folder = None
    if isinstance(value, dict):
        config = dict(value)
    else:
        if value.startswith("base64:"):
            text = base64.b64decode(value[len("base64:"):]).decode("utf-8")
        elif os.path.isfile(value):
            folder = os.path.dirname(os.path.abspath(value))
            text = open(value, encoding="utf-8").read()
        else:
            raise ValueError(f"{flag} {value!r} is neither a file nor base64:<payload>")
        config = yaml.safe_load(text) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{flag} must hold a YAML mapping, got {type(config).__name__}")
    if "prompt_path" in config:
        if "prompt" in config:
            raise ValueError(f"{flag}: give prompt or prompt_path, not both")
        if folder is None:
            raise ValueError(f"{flag}: prompt_path is not allowed in an inline config; put the rubric text under prompt")
        with open(os.path.join(folder, config.pop("prompt_path")), encoding="utf-8") as f:
            config["prompt"] = f.read()
    return config


class BadReply(ValueError):
    """A service answered, but not with what the protocol expects."""


class _HTTPStatus(OSError):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def _retryable(err):
    return not (isinstance(err, _HTTPStatus) and 400 <= err.code < 500 and err.code not in (408, 429))


def post_json(url, body, *, timeout, headers=None):
    """POST `body` as JSON with urllib and return the decoded JSON reply."""
    request = urllib.request.Request(url, data=json.dumps(body, default=str).encode("utf-8"), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as err:
        detail = err.read(300).decode("utf-8", "replace")
        raise _HTTPStatus(err.code, f"HTTP {err.code} {err.reason}: {detail}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise BadReply(f"reply is not JSON: {raw[:200]!r}") from None


def _number(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadReply(f"{what} is not a number: {value!r}")
    return float(value)


def _serve(service, units, prepare, send, *, retries, backoff, max_concurrency, on_error, redact=lambda s: s):
    """Score `units` (lists of sample indices) with at most `max_concurrency` requests in flight.

    prepare(u) builds unit u's request once; send(u, request) returns one float per sample of
    the unit and is retried, `backoff * 2**attempt` seconds apart, up to `retries` attempts.
    Returns (scores [B] float32, failed [B] bool).
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"reward_on_error must be 'raise' or 'skip', got {on_error!r}")
    total = sum(len(u) for u in units)
    scores, failed = torch.zeros(total), torch.zeros(total, dtype=torch.bool)

    def run(u):
        request, error = prepare(u), None
        for attempt in range(max(1, retries)):
            try:
                values = send(u, request)
                if len(values) != len(units[u]):
                    raise BadReply(f"{len(values)} scores for {len(units[u])} samples")
                return values, None
            except Exception as err:
                error = redact(f"{type(err).__name__}: {err}")
                if not _retryable(err) or attempt + 1 >= retries:
                    break
                delay = backoff * 2 ** attempt
                log.warning("%s: sample %s attempt %d/%d failed (%s); retrying in %.2fs",
                            service, _samples(units[u]), attempt + 1, retries, error, delay)
                time.sleep(delay)
        return None, error

    with ThreadPoolExecutor(max(1, int(max_concurrency)), thread_name_prefix=service) as pool:
        results = list(pool.map(run, range(len(units))))
    for unit, (values, error) in zip(units, results):
        if error is None:
            scores[unit] = torch.tensor(values, dtype=torch.float32)
            continue
        message = f"{service}: sample {_samples(unit)} failed after {max(1, retries)} attempt(s): {error}"
        if on_error == "raise":
            raise RewardServiceError(message)
        log.warning("%s; skipped (reward 0, failed=True)", message)
        failed[unit] = True
    return scores, failed


def _samples(unit):
    return str(unit[0]) if len(unit) == 1 else f"{unit[0]}-{unit[-1]}"


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
    `api_key_env` and is kept out of repr, logs and errors.

    The three methods are the hooks `custom_api` calls: subclass this (or write any class with
    them) and name it under `class` in `--custom-api-rm-config`.
    """

    def __init__(self, *, model, api_key_env=None, base_url="https://api.openai.com/v1", prompt=None,
                 score_min=0.0, score_max=4.0, temperature=0.0, max_tokens=64):
        self._key = None
        if api_key_env:
            self._key = os.environ.get(api_key_env)
            if not self._key:
                raise ValueError(f"the environment variable {api_key_env} (api_key_env) is not set; export the API key in it")
        self.model, self.url = model, base_url.rstrip("/") + "/chat/completions"
        self.prompt = DEFAULT_RUBRIC if prompt is None else prompt
        self.score_min, self.score_max = float(score_min), float(score_max)
        self.temperature, self.max_tokens = temperature, max_tokens

    def __repr__(self):
        return f"{type(self).__name__}(model={self.model!r}, url={self.url!r})"

    def redact(self, text):
        return text.replace(self._key, "***") if self._key else text

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
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        return post_json(self.url, request, timeout=timeout, headers=headers)

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


def _api_scorer(service, client, *, timeout, max_concurrency, reward_retries, reward_backoff, reward_on_error):
    """The request/response loop shared by `openai_api` and `custom_api`: one request per sample."""
    redact = getattr(client, "redact", lambda s: s)

    def score(images, prompts, metadata):
        images = to_uint8(images)
        metadata = metadata or [{}] * len(images)
        scores, failed = _serve(
            service, [[i] for i in range(len(images))],
            prepare=lambda u: client.build_request(images[u], prompts[u], metadata[u]),
            send=lambda u, request: [float(client.parse_response(client.send_request(request, timeout)))],
            retries=reward_retries, backoff=reward_backoff, max_concurrency=max_concurrency,
            on_error=reward_on_error, redact=redact)
        return {"reward": scores, "failed": failed}

    return score


_LOOP_KEYS = ("timeout_s", "max_concurrency")


def openai_api(*, openai_api_rm_config=None, reward_timeout=60.0, reward_retries=3, reward_backoff=1.0,
               reward_on_error="raise", **_):
    """A vision-language judge behind an OpenAI-compatible Chat Completions endpoint (`OpenAIJudge`).

    Config keys: model, api_key_env, base_url, prompt | prompt_path, score_min (0), score_max (4),
    temperature (0), max_tokens (64), timeout_s (reward_timeout), max_concurrency (8).
    """
    config = load_config(openai_api_rm_config, "--openai-api-rm-config")
    known = ("model", "api_key_env", "base_url", "prompt", "score_min", "score_max", "temperature", "max_tokens") + _LOOP_KEYS
    unknown = sorted(set(config) - set(known))
    if unknown or "model" not in config:
        raise ValueError(f"--openai-api-rm-config: unknown keys {unknown} or no model; keys are {sorted(known) + ['prompt_path']}")
    loop = {k: config.pop(k) for k in _LOOP_KEYS if k in config}
    return _api_scorer("openai_api", OpenAIJudge(**config), timeout=float(loop.get("timeout_s", reward_timeout)),
                       max_concurrency=int(loop.get("max_concurrency", 8)), reward_retries=reward_retries,
                       reward_backoff=reward_backoff, reward_on_error=reward_on_error)


def custom_api(*, custom_api_rm_config=None, reward_timeout=60.0, reward_retries=3, reward_backoff=1.0,
               reward_on_error="raise", **_):
    """Your request/response hooks in the `openai_api` loop. Runs user code.

    Config: `class` (dotted path to a class with build_request(image uint8 [H, W, 3], prompt,
    metadata) -> request, send_request(request, timeout) -> response, parse_response(response) ->
    float; default `rewards.OpenAIJudge`), timeout_s, max_concurrency; every other key is passed
    to the class as a keyword. A `redact(text)` method, if present, filters its error messages.
    """
    config = load_config(custom_api_rm_config, "--custom-api-rm-config")
    cls = import_object(config.pop("class", "rewards.OpenAIJudge"), "--custom-api-rm-config class")
    loop = {k: config.pop(k) for k in _LOOP_KEYS if k in config}
    return _api_scorer("custom_api", cls(**config), timeout=float(loop.get("timeout_s", reward_timeout)),
                       max_concurrency=int(loop.get("max_concurrency", 8)), reward_retries=reward_retries,
                       reward_backoff=reward_backoff, reward_on_error=reward_on_error)


def remote(*, rm_url=None, remote_batch_size=0, remote_max_concurrency=8, reward_timeout=60.0, reward_retries=3,
           reward_backoff=1.0, reward_on_error="raise", **_):
    """A reward server you run: the protocol in the module docstring. The batch goes in one POST,
    or in chunks of `remote_batch_size` samples with at most `remote_max_concurrency` in flight."""
    if not rm_url:
        raise ValueError("reward 'remote' needs --rm-url http://host:port/path")

    def send(samples, body):
        reply = post_json(rm_url, body, timeout=reward_timeout)
        if not isinstance(reply, dict) or not isinstance(reply.get("scores"), list):
            raise BadReply(f'expected {{"scores": [...]}}, got {str(reply)[:200]}')
        return [_number(s, "score") for s in reply["scores"]]

    def score(images, prompts, metadata):
        images = to_uint8(images)
        metadata = metadata or [{}] * len(images)
        size = remote_batch_size or len(images)
        units = [list(range(i, min(i + size, len(images)))) for i in range(0, len(images), size)]

        def prepare(u):
            pngs = [_png_base64(images[i]) if images.ndim == 4 else [_png_base64(f) for f in images[i]] for i in units[u]]
            return {"prompts": [prompts[i] for i in units[u]], "metadata": [metadata[i] for i in units[u]], "images": pngs}

        scores, failed = _serve("remote", units, prepare, lambda u, body: send(units[u], body),
                                retries=reward_retries, backoff=reward_backoff,
                                max_concurrency=remote_max_concurrency, on_error=reward_on_error)
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


def custom(*, custom_rm_path=None, custom_rm_args="", **_):
    """Your function: `--custom-rm-path module.function` (or file.py:function). Runs user code.

    Called as fn(images uint8 tensor [B, H, W, 3] (or [B, F, H, W, 3]), prompts, metadata,
    custom_rm_args) where `custom_rm_args` is the opaque `--custom-rm-args` string. Return B
    scores (list, array or tensor), or a dict of named [B] scores: its "reward" entry (or its only
    entry) is this component's score, an optional bool "failed" entry marks samples to skip, and
    every other entry is reported next to the components under its own name.
    """
    if not custom_rm_path:
        raise ValueError("reward 'custom' needs --custom-rm-path module.function")
    fn = import_object(custom_rm_path, "--custom-rm-path")
    return lambda images, prompts, metadata: fn(torch.from_numpy(to_uint8(images)), prompts, metadata, custom_rm_args)


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


def _as_scores(out, n, name):
    """A scorer's output -> (score [n] float32, failed [n] bool, extras {key: [n] float32})."""
    def vector(x, what):
        x = torch.as_tensor(np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x, dtype=np.float64))
        if x.numel() != n:
            raise ValueError(f"reward {name!r} returned {x.numel()} {what} for {n} samples")
        return x.reshape(n).float()

    extras, failed = {}, torch.zeros(n, dtype=torch.bool)
    if isinstance(out, dict):
        out = dict(out)
        if "failed" in out:
            failed = torch.as_tensor(np.asarray(out.pop("failed"), dtype=bool)).reshape(n)
        if "reward" not in out and len(out) != 1:
            raise ValueError(f"reward {name!r} returned a dict without a 'reward' entry (keys {sorted(out)}); "
                             f"add 'reward': the score to weight and train on")
        main = out.pop("reward") if "reward" in out else out.popitem()[1]
        extras = {k: vector(v, f"{k!r} values") for k, v in out.items()}
        out = main
    return vector(out, "scores"), failed, extras


def build_reward(spec, *, device="cpu", **options):
    """reward_fn(images, prompts, metadata) -> {component: [B], ..., "reward": [B], "failed": [B] bool}.

    `spec` is a name or "name=weight,...". `options` are train.py's argparse dests (see OPTIONS);
    unset ones keep the factories' defaults. The spec's scorers (and their models) are built now;
    those only named by a sample's `metadata.rm_type` are built the first time one appears.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown reward options {unknown}; known: {', '.join(OPTIONS)}")
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
            raise ValueError(f"{batch} images, {len(prompts)} prompts and {len(metadata)} metadata dicts; they must match")
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
                part, part_failed, extras = _as_scores(
                    scorer(name)(images[idx], [prompts[i] for i in idx], [metadata[i] for i in idx]), len(idx), name)
                for key, values in [(name, part)] + list(extras.items()):
                    # extra entries may be NaN where they do not apply (GenEval's per-tag accuracies), never inf
                    bad = (~torch.isfinite(values) if key == name else values.isinf()) & ~part_failed
                    if bad.any():
                        j = int(bad.nonzero()[0])
                        raise NonFiniteReward(f"reward {name!r} ({key}) gave {values[j].item()} for sample {idx[j]}")
                part[part_failed] = float("nan")
                component[idx] = part
                failed[idx] |= part_failed
                for key, values in extras.items():
                    if key in users or key in out or key in ("reward", "failed"):
                        raise ValueError(f"reward {name!r} returned an entry {key!r} that clashes with a component name")
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


def geneval_reward(*, device="cpu", **options):
    """GenEval (geneval.reward); options left unset take the defaults of geneval.add_arguments."""
    return geneval.reward(device=device, **{**geneval.defaults(), **options})


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
}
