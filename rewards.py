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
| `image_similarity`       | cos(sample, source) of CLIP ViT-L/14 image embeddings    | edits; 1 for the source  |
| `clap`                   | cos(text, audio) of LAION-CLAP on the soundtrack (ltx2)  | [-1, 1]                  |
| `unifiedreward`          | UnifiedReward's "Final Score" from your vLLM/SGLang      | [1, 5]                   |
| `ocr`                    | 1 - capped edit distance to the quoted text (Flow-GRPO)  | [0, 1]                   |
| `jpeg_compressibility`   | -(JPEG kB at quality 95) / 500 (DDPO)                    | <= 0                     |
| `jpeg_incompressibility` | +(JPEG kB at quality 95) / 500 (DDPO)                    | >= 0                     |
| `openai_api`             | a vision-language judge's JSON score, one call a sample  | [score_min, score_max]   |
| `custom_api`             | the same loop with your own request/response hooks       | yours                    |
| `remote`                 | a reward server you run, one POST per batch              | yours                    |
| `custom`                 | your function (`--custom-rm-path module.function`)       | yours                    |
| `geneval`                | GenEval verdict from detections (geneval.py)             | [0, 1]; partial <= 1     |
| `soft_tifa`              | GenEval 2's Soft-TIFA: mean / GM of a VLM's P(answer)    | [0, 1]                   |
| `shapes_edit`            | the shapes world's exact edit judge (shapes.judge_edit)  | 0/1, or partial in [0, 1]|
| `shapes_proxy`, `_1`-`_3`| a learned proxy's P(GenEval judge: correct), member k    | [0, 1]                   |

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
- Sound: videos of a model with audio (ltx2) carry their waveforms (`images.audio` [B, channels, samples],
  `images.sample_rate`); `build_reward` takes them before quantising the frames and passes them, as the keywords
  `audio` and `sample_rate`, to the rewards of `HEARING` (`clap`), the others seeing the frames alone. A frame reward
  and `clap` mix as any two components (`--reward pickscore=1,clap=1`).
- Edits: a sample's source images reach every scorer the same way, in its metadata (data.py):
  `metadata["source_images"]` lists their paths and `data.source_images(metadata)` reads them as uint8
  [H, W, 3] arrays. `image_similarity` scores the sample against them, `openai_api` shows the judge the source(s)
  before the edited image, `remote` sends them beside the images, `custom` and `custom_api` hooks read them from
  the metadata.

Reward services (`openai_api`, `custom_api`, `remote`, `unifiedreward`, and `soft_tifa` on a server) are in
reward_services.py: its docstring has their deadlines, retries and secrets, and the `remote` protocol. `custom` (here)
and `custom_api` import and run user code named by a dotted path: only point them at code you trust.

Sections, each read on its own: OCR and JPEG, user code, Soft-TIFA (its three backends; GenEval 2's rules and the
in-process judge are in reward_models.py, the server in reward_services.py), mixtures and the option table; GenEval's
detectors at the end. The neural reward models (PickScore, HPSv2 / v3, ImageReward, CLIPScore, aesthetic) are in
reward_models.py.

Run `python scripts/bench.py --rewards` for the images/s of the offline scorers on this machine.
"""

import argparse
import difflib
import inspect
import io
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

import data  # a sample's source images (edits): data.source_images(metadata)
import distributed
import flags
import geneval  # light at import: its models load inside geneval.reward
import reward_models
import reward_services  # the rewards that ask a service (openai_api, custom_api, remote, unifiedreward)
import services  # the HTTP plumbing of the reward services
import shapes
from geneval import geneval_judge  # noqa: F401  (rewards.geneval_judge: GenEval's rules beside its reward)
from reward_models import to_uint8
from reward_services import OpenAIJudge  # noqa: F401  (rewards.OpenAIJudge: custom_api's default class)
from services import (  # noqa: F401  (rewards.post_json, http_client, BadReply: the names hooks use)
    BadReply, RewardServiceError, _service_loop, http_client, post_json)
from services import redacted  # noqa: F401  (settings as recorded and printed: URLs without their user:password)
from shapes import proxy  # the learned proxy of the shapes world's judge

log = logging.getLogger(__name__)


class NonFiniteReward(ValueError):
    """A scorer returned NaN or inf; it must never reach the advantages."""


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
    workers = flags.integer(ocr_workers, 1, "--ocr-workers")
    # this rank's share of the cores, split between its workers: 8 ranks each sizing by the whole node's count
    # ran 8 x the cores in OCR threads
    threads = max(1, distributed.cpus_per_rank() // workers)
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


# ----------------------------------------------------------------------------- user code

def custom(*, custom_rm_path, custom_rm_args, **_):
    """Your function: `--custom-rm-path module.function` (or file.py:function). Runs user code.

    Called as fn(images uint8 tensor [B, H, W, 3] (or [B, F, H, W, 3]), prompts, metadata,
    custom_rm_args) where `custom_rm_args` is the opaque `--custom-rm-args` string; an edit's
    source images are `data.source_images(metadata[i])` (uint8 [H, W, 3] each). Return B
    scores (list, array or tensor), or a dict of named [B] scores: its "reward" entry (or its only
    entry) is this component's score, an optional bool "failed" entry marks samples to skip, and
    every other entry is reported next to the components under its own name (NaN where it does
    not apply). Anything else (None, strings, the wrong length) is a one-line error naming the flag.
    """
    if not custom_rm_path:
        raise ValueError("reward 'custom' needs --custom-rm-path module.function")
    fn = flags.import_object(custom_rm_path, "--custom-rm-path")
    if not callable(fn):
        raise ValueError(f"--custom-rm-path {custom_rm_path!r} names an object of type {type(fn).__name__}, "
                         "not a function")
    try:  # the four arguments it is called with, checked before the first step rather than at it
        inspect.signature(fn).bind(None, None, None, None)
    except TypeError as e:
        raise ValueError(f"--custom-rm-path {custom_rm_path!r} cannot take (images, prompts, metadata, "
                         f"custom_rm_args): {e}; give it those four parameters") from None
    except ValueError:  # a builtin without a signature: left to its first call
        pass

    def score(images, prompts, metadata):
        out = fn(torch.from_numpy(to_uint8(images)), prompts, metadata, custom_rm_args)
        main, failed, extras = _as_scores(out, len(prompts), f"--custom-rm-path {custom_rm_path}")
        return {"reward": main, "failed": failed, **extras}

    return score


# ----------------------------------------------------------------------------- Soft-TIFA (GenEval 2's judge)

def shapes_answer(question, objects):
    """The true answer to a GenEval 2 question (reward_models.parse_question) about a shapes-world scene, `objects`
    [{"class", "color", "box"}]: a number word for "How many", else "Yes" or "No". "Are there any": one or more;
    "Is the / Are the <shape> <colour>": at least one, and every one of that colour; "<shape> <relation> the <shape>":
    at least one of each, and every pair in the relation by GenEval's rule (geneval.relative_position), as the
    GenEval judge checks a position clause. Raises a one-line ValueError for a question this world cannot answer."""
    parsed = reward_models.parse_question(question)
    relations = {words: name for name, words in reward_models.SOFT_TIFA_RELATIONS.items()}
    relations.update({name: name for name in geneval.RELATIONS})

    def shape(noun):
        for name in shapes.SHAPES:
            if noun in (name, geneval._plural(name)):
                return [o for o in objects if o["class"] == name]
        raise ValueError(f"{noun!r} in {question!r} is no shape of this world ({', '.join(shapes.SHAPES)})")

    if parsed is None or parsed["skill"] == "verb" or ("relation" in parsed and parsed["relation"] not in relations):
        raise ValueError(f"the shapes world cannot answer {question!r}: it reads GenEval 2's count, object, colour and "
                         f"flat-relation questions ({', '.join(relations)})")
    found = shape(parsed["noun"])
    if parsed["skill"] == "count":
        return geneval.NUMBERS[len(found)] if len(found) < len(geneval.NUMBERS) else str(len(found))
    if parsed["skill"] == "object":
        holds = bool(found)
    elif parsed["skill"] == "attribute":
        if parsed["attribute"] not in shapes.COLORS:
            raise ValueError(f"{parsed['attribute']!r} in {question!r} is no colour of this world "
                             f"({', '.join(shapes.COLORS)})")
        holds = bool(found) and all(o["color"] == parsed["attribute"] for o in found)
    else:
        targets, relation = shape(parsed["target"]), relations[parsed["relation"]]
        holds = bool(found) and bool(targets) and all(relation in geneval.relative_position(o["box"], t["box"])
                                                      for o in found for t in targets)
    return "Yes" if holds else "No"


def _soft_tifa_shapes():
    """The exact judge of the shapes world: each question answered from the shapes detector's detections (those any
    GenEval rule keeps: score above 0.3, geneval.kept_detections) by `shapes_answer`; a question's probability is 1
    when that answer is the expected one, else 0. A component the detector cannot name (class UNKNOWN) is no object
    here, where GenEval's judge counts it against exclude clauses."""
    def ask(images, vqa):
        probs = []
        for pairs, detections in zip(vqa, shapes.detect(images)):
            kept = [d for dets in geneval.kept_detections(detections, None).values() for d in dets]
            probs.append(torch.tensor([float(shapes_answer(q, kept).lower() == a.lower()) for q, a in pairs],
                                      dtype=torch.float64))
        return probs, torch.zeros(len(vqa), dtype=torch.bool)

    return ask


SOFT_TIFA_BACKENDS = ("transformers", "openai", "shapes")
SOFT_TIFA_SCORES = ("prompt", "atom")


def soft_tifa(*, soft_tifa_backend, soft_tifa_model, soft_tifa_url, soft_tifa_api_key_env, soft_tifa_score,
              soft_tifa_batch_size, soft_tifa_max_concurrency, soft_tifa_top_logprobs, reward_timeout, reward_retries,
              reward_backoff, reward_on_error, reward_max_bytes, device, **_):
    """GenEval 2's Soft-TIFA (arXiv:2512.16853; reward_models' Soft-TIFA section has the authors' rules) ->
    score(images, prompts, metadata) -> {"reward": the `soft_tifa_score` one of the two below, "soft_tifa_atom": the
    mean of the questions' probabilities (Soft-TIFA AM), "soft_tifa_prompt": their geometric mean (Soft-TIFA GM),
    "failed"}, each [B]. A sample's questions are `metadata["vqa_list"]` (reward_models.check_vqa), asked of:

        transformers  --soft-tifa-model in this process (reward_models.soft_tifa_vlm)
        openai        an OpenAI-compatible server at --soft-tifa-url serving --soft-tifa-model, read from top_logprobs
                      (reward_services.soft_tifa_server; --reward-timeout, --reward-retries, --reward-on-error apply)
        shapes        the shapes world's exact judge (`_soft_tifa_shapes`): each probability 1 or 0

    Images only. A failed sample (openai, --reward-on-error skip) has NaN scores and reward 0.
    """
    if soft_tifa_backend not in SOFT_TIFA_BACKENDS:
        raise ValueError(f"--soft-tifa-backend must be one of {', '.join(SOFT_TIFA_BACKENDS)}, "
                         f"got {soft_tifa_backend!r}")
    if soft_tifa_score not in SOFT_TIFA_SCORES:
        raise ValueError(f"--soft-tifa-score must be one of {', '.join(SOFT_TIFA_SCORES)}, got {soft_tifa_score!r}")
    if soft_tifa_backend == "transformers":
        ask = reward_models.soft_tifa_vlm(soft_tifa_model, device,
                                          flags.integer(soft_tifa_batch_size, 1, "--soft-tifa-batch-size"))
    elif soft_tifa_backend == "openai":
        loop = _service_loop(reward_timeout, "--reward-timeout", soft_tifa_max_concurrency,
                             "--soft-tifa-max-concurrency", reward_retries, reward_backoff, reward_on_error,
                             reward_max_bytes)
        if not isinstance(soft_tifa_model, str) or not soft_tifa_model:
            raise ValueError(f"--soft-tifa-model must name the served model, got {flags.show(soft_tifa_model)}")
        ask = reward_services.soft_tifa_server(url=soft_tifa_url, model=soft_tifa_model,
                                                api_key_env=soft_tifa_api_key_env,
                                                top_logprobs=flags.integer(soft_tifa_top_logprobs, 1,
                                                                           "--soft-tifa-top-logprobs"),
                                                loop=loop)
    else:
        ask = _soft_tifa_shapes()

    def score(images, prompts, metadata):
        images = to_uint8(images)
        if images.ndim != 4:
            raise ValueError(f"soft_tifa scores images only, got frames of shape {images.shape}")
        metadata = metadata or [{}] * len(images)
        vqa = []
        for i, m in enumerate(metadata):
            try:
                vqa.append(reward_models.check_vqa(m))
            except ValueError as err:
                raise ValueError(f"soft_tifa: sample {i} ({prompts[i][:60]!r}): {err}") from None
        probs, failed = ask(images, vqa)
        atom, prompt = torch.tensor([reward_models.soft_tifa_scores(p) if not f else (math.nan, math.nan)
                                     for p, f in zip(probs, failed)], dtype=torch.float64).T
        main = {"atom": atom, "prompt": prompt}[soft_tifa_score]
        return {"reward": main.float(), "soft_tifa_atom": atom.float(), "soft_tifa_prompt": prompt.float(),
                "failed": failed}

    return score


# ----------------------------------------------------------------------------- mixtures and dispatch

MAX_WEIGHT = 1e6  # the largest |weight| of a --reward component


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
        if not math.isfinite(w) or abs(w) > MAX_WEIGHT:  # a larger one overflows the float32 total: inf for all
            raise ValueError(f"weight {weight.strip()} of {name!r} in {spec!r} must be a finite number within "
                             f"+-{MAX_WEIGHT:g}; weights are relative: scale them down")
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
            raise ValueError(f"{who} returned {what} {flags.show(x)}; give {n} {kind}, one per sample "
                             f"(list, array or tensor)")
        if a.size != n:
            raise ValueError(f"{who} returned {a.size} {what} for {n} samples: {flags.show(x)}")
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


def _score_part(fn, name, images, prompts, metadata, idx, sound=(None, None)):
    """Component `name` scored by `fn` on the samples idx -> (scores [n], failed [n] bool, extras {key: [n]}), each
    checked: a score must be finite (NaN where it failed), an extra entry may be NaN (does not apply), never inf.
    sound: the batch's (waveforms [B, channels, samples], sample rate), given to the components of HEARING (clap)."""
    kwargs = {}
    if name in HEARING:
        if sound[0] is None:
            raise ValueError(f"reward {name!r} scores the samples' sound and these samples have none; sample with a "
                             f"model that makes audio (--model ltx2) or drop {name!r} from --reward")
        kwargs = dict(audio=sound[0][idx], sample_rate=sound[1])
    try:
        result = fn(images[idx], [prompts[i] for i in idx], [metadata[i] for i in idx], **kwargs)
    except SystemExit as err:  # would end the run in silence, with no checkpoint (exit 0 for sys.exit(0))
        if isinstance(err.code, str):  # an exit with its own message: not silent
            raise
        raise ValueError(f"reward {name!r} called sys.exit({err.code!r}) while scoring; return scores, or "
                         "raise an exception to stop the run") from None
    part, part_failed, extras = _as_scores(result, len(idx), f"reward {name!r}")
    checks = [(name, part, ~torch.isfinite(part))] + [(k, v, torch.isinf(v)) for k, v in extras.items()]
    for key, values, bad in checks:
        bad &= ~part_failed
        if bad.any():
            j = int(bad.nonzero()[0])
            raise NonFiniteReward(f"reward {name!r} ({key}) gave {values[j].item()} for sample {idx[j]}")
    part[part_failed] = float("nan")
    return part, part_failed, extras


def _row_scorer(scorer, name):
    """scorer(name) for a component that a row's rm_type may name, built the first time it is asked for: one that
    cannot be built (a model missing offline, a package not installed) is one ValueError line, which the run turns into
    its `error:` line."""
    try:
        return scorer(name)
    except (RuntimeError, OSError, ImportError) as err:
        raise ValueError(f"a prompt row's rm_type names reward {name!r}: {' '.join(str(err).split())}") from None


def build_reward(spec, *, device="cpu", **options):
    """reward_fn(images, prompts, metadata) -> {component: [B], ..., "reward": [B], "failed": [B] bool}.

    `spec` is a name or "name=weight,...". `options` are dests of `add_arguments`' flags; the ones
    not given take the flags' defaults, and a key no flag declares is refused with the closest name.
    The spec's scorers (and their models) are built now; those only named by a sample's
    `metadata.rm_type` are built the first time one appears (_row_scorer), or now by `reward_fn.build_rows(metadata)`.
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

    def build_rows(metadata):
        """Build now the scorers that the rows' rm_type name (so that a model missing offline fails at start-up)."""
        for row_spec in {m["rm_type"] for m in metadata if (m or {}).get("rm_type")}:
            for name, _ in parse_spec(row_spec):
                _row_scorer(scorer, name)

    def reward_fn(images, prompts, metadata=None):
        sound = getattr(images, "audio", None), getattr(images, "sample_rate", None)  # videos with sound (ltx2)
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
                part, part_failed, extras = _score_part(_row_scorer(scorer, name), name, images, prompts, metadata, idx,
                                                        sound)
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

    reward_fn.spec, reward_fn.build_rows = default, build_rows
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
    flag("--hps-version", "HPSv2 checkpoint version", choices=sorted(reward_models.HPS_FILES), default="v2.1")
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
    flag("--clap-model-path", "hub id or local folder of the CLAP model and processor (clap: text-audio cosine)",
         default="laion/clap-htsat-unfused")
    flag("--clap-batch-size", "soundtracks per CLAP forward, per GPU", type=int, default=8)
    flag("--image-similarity-model-path", "hub id or local folder of the CLIP model and processor comparing an edit "
         "with its source (image_similarity)", default="openai/clip-vit-large-patch14")
    flag("--image-similarity-batch-size", "images per CLIP forward, per GPU", type=int, default=8)
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
    # Soft-TIFA (GenEval 2's judge)
    flag("--soft-tifa-backend", "who answers the questions: transformers (--soft-tifa-model in this process), openai "
         "(the OpenAI-compatible server at --soft-tifa-url, e.g. vLLM) or shapes (the shapes world's exact judge)",
         choices=SOFT_TIFA_BACKENDS, default="transformers")
    flag("--soft-tifa-model", "the judge: hub id or local folder (transformers), or the name the server serves it "
         "under (openai)", default=reward_models.SOFT_TIFA_MODEL)
    flag("--soft-tifa-score", "the trained reward: prompt (the geometric mean of the questions' probabilities, "
         "Soft-TIFA GM) or atom (their mean, Soft-TIFA AM); both are reported", choices=SOFT_TIFA_SCORES,
         default="prompt")
    flag("--soft-tifa-batch-size", "questions per forward of the in-process judge, per GPU", type=int, default=8)
    flag("--soft-tifa-url", "base URL of the OpenAI-compatible server (openai backend)",
         default="http://127.0.0.1:8000/v1")
    flag("--soft-tifa-api-key-env", "name of an environment variable holding the server's API key (None: no key)",
         metavar="NAME", default=None)
    flag("--soft-tifa-max-concurrency", "questions in flight to --soft-tifa-url, per GPU", type=int, default=16)
    flag("--soft-tifa-top-logprobs", "log-probabilities the server lists for the answer token (vLLM allows 20 unless "
         "started with a larger --max-logprobs); an answer below them counts 0", type=int, default=20)
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
    flag("--reward-backoff", f"seconds before the first retry; doubles each time, to at most "
         f"{services.MAX_BACKOFF:g}", type=flags.bounded(float, 0, services.MAX_BACKOFF), default=1.0)
    flag("--reward-on-error", "after the retries: stop the run, or drop the affected groups from the update",
         choices=["raise", "skip"], default="raise")
    flag("--reward-max-bytes", "largest reply of a reward service in bytes (headers and body as received)", type=int,
         default=16 * 2**20)
    # user code
    flag("--custom-rm-path", "module.function or file.py:function scoring a batch (the 'custom' reward); "
         "RUNS THAT CODE", default=None)
    flag("--custom-rm-args", "opaque string passed to --custom-rm-path", default=None)
    geneval.add_arguments(parser)  # the GenEval reward's own group
    shapes.edit.add_arguments(parser)  # the shapes world's edit reward
    proxy.add_arguments(parser)  # the learned proxy of the shapes world's judge


def geneval_reward(*, geneval_detector, geneval_detector_path, device, **options):
    """GenEval (geneval.reward) on the detections of --geneval-detector (unset: mask2former; train.py fills shapes
    for its shapes model), a name of GENEVAL_DETECTORS."""
    name = geneval_detector or "mask2former"
    if name not in GENEVAL_DETECTORS:
        raise ValueError(f"--geneval-detector must be one of {', '.join(GENEVAL_DETECTORS)}, got {name!r}")
    detect = GENEVAL_DETECTORS[name](geneval_detector_path, device)
    return geneval.reward(detect=detect, vocabulary=GENEVAL_VOCABULARY.get(name), device=device,
                          geneval_detector=name, **options,
                          counting_threshold=GENEVAL_COUNTING_THRESHOLD.get(name, geneval.COUNTING_THRESHOLD))


def geneval_rows_check(detector):
    """The check of data.load_prompts for GenEval rows judged by `detector` (None: mask2former): the judge can read
    the row, and every class and colour it names is one the detector reports (else that clause would silently
    fail). Every row of a prompt file is checked when it loads, before any model does."""
    name = detector or "mask2former"
    return lambda metadata: geneval.check_metadata(metadata, vocabulary=GENEVAL_VOCABULARY.get(name), detector=name)


def rows_check(spec, geneval_detector, by_advantage=False, *, model=None, sound=True):
    """The check of data.load_prompts for the rows of a prompt file trained with reward `spec` (a row's metadata
    rm_type replaces it): a row whose reward has a geneval component must be a GenEval row the judge and
    --geneval-detector can score (geneval_rows_check), one with image_similarity must name a source image, one with
    soft_tifa must carry its questions (reward_models.check_vqa), one with a reward of HEARING needs a `model` that
    makes sound (sound=False: it makes none, as config.py refuses for --reward);
    by_advantage (--reward-combine advantage, whose weights are
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
        if any(name.startswith("shapes_proxy") for name in dict(row)):  # the proxy reads GenEval rows of this world
            geneval_rows_check("shapes")(metadata)
        if "shapes_edit" in dict(row):
            shapes.edit_row_check(metadata)
        if "soft_tifa" in dict(row):
            reward_models.check_vqa(metadata)
        if not sound and (hearing := [name for name, _ in row if name in HEARING]):
            named = f"rm_type {metadata['rm_type']!r}" if metadata.get("rm_type") else f"--reward {spec!r}"
            raise ValueError(f"{named}: reward {hearing[0]} scores the samples' sound, which "
                             f"--model {model} does not make: train a model with sound (--model ltx2), or score its "
                             "frames")
        if "image_similarity" in dict(row) and not metadata.get(data.SOURCE_KEY):
            raise ValueError("reward image_similarity compares each sample with its source image, and this row has "
                             "none: give it an 'image', or drop image_similarity from --reward")
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
GENEVAL_COUNTING_THRESHOLD = {  # the score above which a counting prompt's detection counts (geneval.py, departures)
    "mask2former": geneval.COUNTING_THRESHOLD,  # GenEval's 0.9, for a detector scored on photographs
    "shapes": shapes.COUNTING_THRESHOLD,  # 0.3: the shapes detector's scores are template fits, not confidences
}


def option_defaults():
    """{dest: default} of every reward option: `add_arguments` on an empty parser, parsing no arguments."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return vars(parser.parse_args([]))


HEARING = ("clap",)  # the rewards that score the samples' sound (given as audio=, sample_rate=: _score_part); a
# model that makes none is refused (config.py)
REWARDS = {
    "pickscore": reward_models.pickscore,
    "hps": reward_models.hps,
    "ocr": ocr,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "openai_api": reward_services.openai_api,
    "custom_api": reward_services.custom_api,
    "remote": reward_services.remote,
    "custom": custom,
    "geneval": geneval_reward,
    "shapes_edit": shapes.edit_reward,
    "shapes_proxy": proxy.member_reward(0),  # one name per member of --shapes-proxy-path's ensemble, so that
    "shapes_proxy_1": proxy.member_reward(1),  # members can be told apart in a --reward mix (one trained, the
    "shapes_proxy_2": proxy.member_reward(2),  # others watched by --gardo-gate)
    "shapes_proxy_3": proxy.member_reward(3),
    "imagereward": reward_models.imagereward,
    "hpsv3": reward_models.hpsv3,
    "clipscore": reward_models.clipscore,
    "image_similarity": reward_models.image_similarity,
    "aesthetic": reward_models.aesthetic,
    "clap": reward_models.clap,
    "unifiedreward": reward_services.unifiedreward,
    "soft_tifa": soft_tifa,
}
