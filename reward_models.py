"""The reward models: scorers built on a neural network of someone's, each a factory of `rewards.REWARDS`.

    pickscore   PickScore (CLIP ViT-H/14 fine-tuned on Pick-a-Pic)       hps        HPSv2 / v2.1 (open_clip ViT-H/14)
    clipscore   cos(text, image) of CLIP ViT-L/14                         aesthetic  LAION's predictor on CLIP ViT-L/14
    image_similarity  cos(sample, source) of CLIP ViT-L/14 image embeddings (edits)
    clap        cos(text, audio) of LAION-CLAP: the soundtrack of a video with sound (ltx2)
    imagereward ImageReward (BLIP + MLP)                                  hpsv3      HPSv3 (Qwen2-VL-7B + reward head)
    Soft-TIFA   GenEval 2's judge: its questions, rules and in-process VLM (the reward itself is rewards.soft_tifa)

Each factory takes its flags (declared in rewards.add_arguments) as keywords, loads its model once by hub id or local
path (offline: one sentence naming the flag), and returns score(images uint8 [B, H, W, 3], prompts, metadata) -> [B];
video [B, F, H, W, 3] is scored on `--<name>-num-frames` evenly spaced frames and averaged. The image helpers shared
with the other scorers (to_uint8, frames, png_base64) live here too. rewards.py holds the registry, the mixtures and
the light scorers (OCR, JPEG, GenEval); reward_services.py the scorers that ask a service.
"""
import base64
import functools
import io
import json
import logging
import math
import os
import re
import warnings

import numpy as np
import torch
from PIL import Image

import data  # an edit's source images (image_similarity): data.source_images(metadata)
import flags
import geneval  # Soft-TIFA's questions for GenEval rows (geneval_vqa)

log = logging.getLogger(__name__)


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


def frame_indices(num_frames_total, num_frames):
    """`num_frames` evenly spaced frame indices (all frames when None or 0 or more than there are)."""
    if not num_frames or num_frames >= num_frames_total:
        return np.arange(num_frames_total)
    return np.linspace(0, num_frames_total - 1, num_frames).round().astype(int)


def sample_frames(images, num_frames):
    """uint8 images [B, H, W, 3] or video [B, F, H, W, 3] -> (frames [B * n, H, W, 3], n): an image is its own
    frame (n = 1); a video gives `num_frames` evenly spaced frames per sample (every frame when None or 0). A
    scorer scores the frames and averages each sample's n scores: `scores.view(B, n).mean(1)`."""
    if images.ndim == 5:
        images = images[:, frame_indices(images.shape[1], num_frames)]
    n = images.shape[1] if images.ndim == 5 else 1
    return images.reshape(-1, *images.shape[-3:]), n


def png_base64(frame):
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def hub_error(name, path, flag, err):
    first_line = str(err).splitlines()[0] if str(err) else ""
    return RuntimeError(f"{name}: cannot load {path!r} ({type(err).__name__}: {first_line}); "
                        f"download it where the hub is reachable and point {flag} at the local copy")


def load_tensors(path, name, flag):
    """The tensors of a checkpoint file a user names: safetensors, or torch.load(weights_only=True), which reads
    tensors, containers and numbers and refuses any other object. A pickle of other objects is refused in one line and
    never unpickled: unpickling runs whatever code the file names."""
    import pickle

    try:
        if path.endswith(".safetensors"):
            import safetensors.torch

            return safetensors.torch.load_file(path)
        with warnings.catch_warnings():  # a pickle protocol above 2 draws a UserWarning before the refusal
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower():  # not a refusal: a damaged or foreign file
            raise hub_error(name, path, flag, err) from None
        raise RuntimeError(f"{name}: {path} is not a file of tensors: torch.load(weights_only=True) refused it, and "
                           f"loading it otherwise would run any code it holds; point {flag} at a file of tensors only "
                           "(a .safetensors file, or a state dict saved by torch.save)") from None
    except Exception as err:
        raise hub_error(name, path, flag, err) from err


# ----------------------------------------------------------------------------- PickScore

def pickscore(*, pickscore_processor_path, pickscore_model_path, pickscore_batch_size, pickscore_num_frames, device,
              **_):
    """PickScore (Kirstain et al., Pick-a-Pic, arXiv:2305.01569), scaled as Flow-GRPO does:

        score = exp(logit_scale) * <t / |t|, v / |v|> / 26        (raw logits are about 0-26)

    with t, v the CLIP text and image embeddings. Video: `pickscore_num_frames` evenly spaced
    frames (default every frame) are scored against the prompt and averaged.
    """
    from transformers import AutoProcessor, CLIPModel

    flags.integer(pickscore_batch_size, 1, "--pickscore-batch-size")
    if pickscore_num_frames is not None:
        flags.integer(pickscore_num_frames, 0, "--pickscore-num-frames")

    try:
        processor = AutoProcessor.from_pretrained(pickscore_processor_path)
    except Exception as err:
        raise hub_error("pickscore", pickscore_processor_path, "--pickscore-processor-path", err) from err
    try:
        model = CLIPModel.from_pretrained(pickscore_model_path).eval().to(device)
    except Exception as err:
        raise hub_error("pickscore", pickscore_model_path, "--pickscore-model-path", err) from err

    def features(out):  # transformers 5 returns a ModelOutput, 4.x a tensor
        out = out if isinstance(out, torch.Tensor) else out.pooler_output
        return out / out.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def score(images, prompts, metadata):
        images = to_uint8(images)
        if images.ndim == 5:  # video: [B, F, H, W, 3] -> [B * n, H, W, 3], prompt repeated per frame
            images = images[:, frame_indices(images.shape[1], pickscore_num_frames)]
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


def hps_preprocess(image, side, mean, std):
    """HPSv2's evaluation transform of a PIL image -> float [3, side, side]: the longest side resized (bicubic) to
    `side` keeping the aspect ratio, then zero-padded (black) to a square, centred (the odd pixel right / below),
    ToTensor, normalised by mean and std. HPSv2 builds it so (hpsv2/src/open_clip/factory.py L368-375 passes
    resize_longest_max=True; transform.py L26-49 ResizeMaxSize, L140-153), as do flow_grpo, MixGRPO and
    DanceGRPO; open_clip's default (shortest side, centre crop) would score another part of a non-square image."""
    import torchvision.transforms.functional as TF

    width, height = image.size
    scale = side / max(width, height)
    new_h, new_w = round(height * scale), round(width * scale)
    if (new_h, new_w) != (height, width):
        image = TF.resize(image, [new_h, new_w], interpolation=TF.InterpolationMode.BICUBIC)
    pad_h, pad_w = side - new_h, side - new_w
    image = TF.pad(image, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    return TF.normalize(TF.to_tensor(image.convert("RGB")), mean, std)


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
    flags.integer(hps_batch_size, 1, "--hps-batch-size")
    if hps_num_frames is not None:
        flags.integer(hps_num_frames, 0, "--hps-num-frames")
    path = hps_checkpoint_path
    if path is None:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download("xswu/HPSv2", HPS_FILES[hps_version])
        except Exception as err:
            raise hub_error("hps", f"xswu/HPSv2/{HPS_FILES[hps_version]}", "--hps-checkpoint-path", err) from err
    state = load_tensors(path, "hps", "--hps-checkpoint-path")
    state = state.get("state_dict", state)
    state = {k.removeprefix("module."): v for k, v in state.items()}  # checkpoints saved from DDP
    # the architecture only (pretrained=None): the HPS checkpoint overwrites every weight, so no base CLIP download
    model = open_clip.create_model(hps_model_name, pretrained=None, output_dict=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing:
        raise RuntimeError(f"hps: {path} does not fit open_clip {hps_model_name} (missing {missing[:3]}...); "
                           f"point --hps-checkpoint-path at an HPS_v2(.1)_compressed.pt file")
    if unexpected:
        log.warning("hps: ignoring %d unexpected checkpoint entries, e.g. %s", len(unexpected), unexpected[:3])
    model = model.eval().to(device)
    size = model.visual.image_size
    side = size if isinstance(size, int) else size[0]  # HPS's ViT-H-14 is square, 224
    config = model.visual.preprocess_cfg  # open_clip's mean and std of the architecture (OpenAI's for ViT-H-14)
    preprocess = functools.partial(hps_preprocess, side=side, mean=config["mean"], std=config["std"])
    tokenizer = open_clip.get_tokenizer(hps_model_name)
    autocast = torch.autocast("cuda") if str(device).startswith("cuda") else torch.autocast("cpu", enabled=False)

    @torch.no_grad()
    def score(images, prompts, metadata):
        frames, n = sample_frames(to_uint8(images), hps_num_frames)
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
        raise hub_error(name, path, flag, err) from err
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
    batch_size = flags.integer(clipscore_batch_size, 1, "--clipscore-batch-size")
    if clipscore_num_frames is not None:
        flags.integer(clipscore_num_frames, 0, "--clipscore-num-frames")
    processor, model = _clip(clipscore_model_path, "--clipscore-model-path", "clipscore", device)

    @torch.no_grad()
    def score(images, prompts, metadata):
        frames, n = sample_frames(to_uint8(images), clipscore_num_frames)
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


def image_similarity(*, image_similarity_model_path, image_similarity_batch_size, device, **_):
    """How close an edit stays to its source: the cosine of CLIP ViT-L/14's image embeddings of sample and source,

        score = <v(sample) / |v(sample)|, v(source) / |v(source)|>      in [-1, 1]; 1 for the source itself

    Flow-GRPO's `image_similarity` reward (yifan123/flow_grpo flow_grpo/rewards.py image_similarity_score and
    multi_score L443-444, clip_scorer.py ClipScorer.image_similarity L56-69), which its counting-edit configs add to
    GenEval (config/grpo.py L686 counting_flux_kontext 0.5 / 0.5, L818 and L860 the Qwen-Image-Edit ones 0.2 / 0.8).
    The source is each sample's (data.source_images(metadata)) resized to the sample's size, as the authors compare
    with `ref_image.resize((resolution, resolution))`; both go through CLIPProcessor (shortest side to 224 bicubic,
    centre crop, CLIP mean/std), as `clipscore`. A sample with several sources scores the mean of its cosines (the
    authors' edits have one); a sample without one is refused. Images only, not video.
    """
    batch_size = flags.integer(image_similarity_batch_size, 1, "--image-similarity-batch-size")
    processor, model = _clip(image_similarity_model_path, "--image-similarity-model-path", "image_similarity", device)

    def embed(pils):
        out = []
        for i in range(0, len(pils), batch_size):
            pixels = processor(images=pils[i:i + batch_size], return_tensors="pt")["pixel_values"]
            out.append(_unit(model.get_image_features(pixel_values=pixels.to(device))).float().cpu())
        return torch.cat(out)

    @torch.no_grad()
    def score(images, prompts, metadata):
        images = to_uint8(images)
        if images.ndim != 4:
            raise ValueError(f"image_similarity scores images [B, H, W, 3], got shape {images.shape}")
        metadata = metadata if metadata is not None else [{}] * len(images)
        refs, owner = [], []
        for i, image in enumerate(images):
            sources = data.source_images(metadata[i])
            if not sources:
                raise ValueError(f"image_similarity compares each sample with its source image, and sample {i} "
                                 f"({prompts[i]!r}) has none: give its prompt row an 'image', or drop "
                                 "image_similarity from --reward")
            height, width = image.shape[:2]
            for source in sources:  # to the sample's size, as the authors' 512 px ref_image
                ref = Image.fromarray(np.ascontiguousarray(source))
                refs.append(ref if ref.size == (width, height) else ref.resize((width, height)))
                owner.append(i)
        v = embed([Image.fromarray(image) for image in images])
        cos = (v[owner] * embed(refs)).sum(-1)  # cos(sample, each of its sources)
        owner = torch.tensor(owner)
        total = torch.zeros(len(images)).index_add_(0, owner, cos)
        return total / torch.bincount(owner, minlength=len(images)).float()  # [B], mean over a sample's sources

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
    batch_size = flags.integer(aesthetic_batch_size, 1, "--aesthetic-batch-size")
    if aesthetic_num_frames is not None:
        flags.integer(aesthetic_num_frames, 0, "--aesthetic-num-frames")
    processor, model = _clip(aesthetic_clip_path, "--aesthetic-clip-path", "aesthetic", device)
    source = aesthetic_mlp_path or AESTHETIC_URL
    try:  # the published file holds CUDA tensors: map_location is needed on a machine without a GPU
        if aesthetic_mlp_path:
            state = load_tensors(aesthetic_mlp_path, "aesthetic", "--aesthetic-mlp-path")
        else:
            state = torch.hub.load_state_dict_from_url(AESTHETIC_URL, map_location="cpu", weights_only=True)
    except Exception as err:
        raise hub_error("aesthetic", source, "--aesthetic-mlp-path", err) from err
    state = {k.removeprefix("layers."): v for k, v in state.items()}
    width = model.config.projection_dim
    mlp = _load_state(_laion_mlp(width), state, f"aesthetic: {source}", "--aesthetic-mlp-path (its input must be "
                     f"the {width}-wide embedding of --aesthetic-clip-path)").eval().to(device)

    @torch.no_grad()
    def score(images, prompts, metadata):
        frames, n = sample_frames(to_uint8(images), aesthetic_num_frames)
        scores = []
        for i in range(0, len(frames), batch_size):
            pixels = processor(images=[Image.fromarray(f) for f in frames[i:i + batch_size]], return_tensors="pt")
            v = _unit(model.get_image_features(pixel_values=pixels["pixel_values"].to(device)))
            scores.append(mlp(v.float())[:, 0])
        return torch.cat(scores).cpu().view(len(images), n).mean(1)  # [B], mean over frames

    return score


# ----------------------------------------------------------------------------- CLAP (sound)

def mono_at(audio, sample_rate, rate):
    """Waveforms [B, channels, samples] (or [B, samples]) at sample_rate -> float32 numpy [B, samples'] at `rate`: the
    channels averaged, then resampled by linear interpolation (no anti-aliasing filter: it is meant for raising a
    vocoder's 16 or 24 kHz to CLAP's 48 kHz, where nothing folds back)."""
    wave = torch.as_tensor(audio).float()
    wave = wave.mean(1) if wave.ndim == 3 else wave  # [B, samples]
    if sample_rate != rate:
        length = max(1, round(wave.shape[-1] * rate / sample_rate))
        wave = torch.nn.functional.interpolate(wave[:, None], size=length, mode="linear", align_corners=False)[:, 0]
    return wave.cpu().numpy()


def clap(*, clap_model_path, clap_batch_size, device, **_):
    """CLAP's text-audio score: the cosine of its text and audio embeddings (LAION-CLAP, Wu et al. 2023,
    arXiv:2211.06687: the similarity its contrastive loss is built on, without the temperature),

        score = <t / |t|, a / |a|>      in [-1, 1]

    with transformers' ClapModel and ClapProcessor from one hub id or folder (laion/clap-htsat-unfused by default;
    laion/larger_clap_general by --clap-model-path). It hears the sample's soundtrack: build_reward hands the rewards
    of rewards.HEARING the batch's waveforms (`audio` [B, channels, samples] in [-1, 1] and `sample_rate`, which a sound
    model's videos carry: families/ltx2.py, WithAudio), made mono and resampled to the processor's rate (mono_at),
    then the processor's own features (48 kHz mel spectrogram, repeat-padded to its 10 s). The frames are not used.
    """
    batch_size = flags.integer(clap_batch_size, 1, "--clap-batch-size")
    from transformers import ClapModel, ClapProcessor

    try:
        processor = ClapProcessor.from_pretrained(clap_model_path)
        model = ClapModel.from_pretrained(clap_model_path).eval().to(device)
    except Exception as err:
        raise hub_error("clap", clap_model_path, "--clap-model-path", err) from err
    rate = processor.feature_extractor.sampling_rate

    @torch.no_grad()
    def score(images, prompts, metadata, *, audio, sample_rate):
        waves = mono_at(audio, sample_rate, rate)
        scores = []
        for i in range(0, len(prompts), batch_size):
            sound = processor.feature_extractor(list(waves[i:i + batch_size]), sampling_rate=rate, return_tensors="pt")
            tokens = processor.tokenizer(prompts[i:i + batch_size], padding=True, truncation=True, return_tensors="pt")
            a = _unit(model.get_audio_features(**{k: v.to(device) for k, v in sound.items()}))
            t = _unit(model.get_text_features(**{k: tokens[k].to(device) for k in ("input_ids", "attention_mask")}))
            scores.append((t * a).sum(-1))  # cos(text, audio)
        return torch.cat(scores).float().cpu()

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


def _imagereward_towers(vision_state, text_config):
    """ImageReward's BLIP towers, sized from its checkpoint (the ViT) and med_config.json (the BERT) -> (vision, text,
    image side)."""
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

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
    return vision, text, side


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
    from transformers import AutoTokenizer

    batch_size = flags.integer(imagereward_batch_size, 1, "--imagereward-batch-size")
    if imagereward_num_frames is not None:
        flags.integer(imagereward_num_frames, 0, "--imagereward-num-frames")
    flag = "--imagereward-model-path"
    try:
        weights, med_config = _imagereward_files(imagereward_model_path)
        with open(med_config) as f:
            text_config = json.load(f)
    except Exception as err:
        raise hub_error("imagereward", imagereward_model_path, flag, err) from err
    state = load_tensors(weights, "imagereward", flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(imagereward_tokenizer_path)
    except Exception as err:
        raise hub_error("imagereward", imagereward_tokenizer_path, "--imagereward-tokenizer-path", err) from err
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})  # BLIP init_tokenizer
    try:
        vision_state, text_state, head_state, ignored = imagereward_state(state)
    except KeyError as err:
        raise RuntimeError(f"imagereward: {weights} holds {err}, not a key of ImageReward.pt; check {flag}") from None
    if ignored:
        log.warning("imagereward: ignoring %d entries of %s that the score does not use, e.g. %s", len(ignored),
                    weights, ignored[:3])

    vision, text, side = _imagereward_towers(vision_state, text_config)
    head = _laion_mlp(text.config.hidden_size)
    for module, part, what in ((vision, vision_state, "its ViT"), (text, text_state, "its BERT (med_config.json)"),
                               (head, head_state, "its MLP")):
        _load_state(module, part, f"imagereward: {weights} ({what})", flag)
    vision, text, head = (m.eval().to(device) for m in (vision, text, head))
    preprocess = T.Compose([T.Resize(side, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(side),
                            T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])

    @torch.no_grad()
    def score(images, prompts, metadata):
        frames, n = sample_frames(to_uint8(images), imagereward_num_frames)
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
    visual tokens). Positions are 1-D (0, 1, 2, ... over the valid tokens), not Qwen2-VL's 3-D M-RoPE, as the authors'
    Qwen2VLRewardModelBT.forward (qwen2vl_trainer.py, MizzenAI/HPSv3 d232ff8) passes its language model no
    image_grid_thw: get_rope_index falls back to the attention mask's running count. Weights: the whole model from
    `hpsv3_checkpoint_path` (the hub file MizzenAI/HPSv3/HPSv3.safetensors by default, read by `hpsv3_state`);
    config and processor from `hpsv3_base_path`. bfloat16 on a GPU (as the authors), float32 on the CPU. Video:
    `hpsv3_num_frames` evenly spaced frames (default every frame), averaged."""
    from transformers import AutoConfig, AutoProcessor, Qwen2VLModel
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    batch_size = flags.integer(hpsv3_batch_size, 1, "--hpsv3-batch-size")
    if hpsv3_num_frames is not None:
        flags.integer(hpsv3_num_frames, 0, "--hpsv3-num-frames")
    try:
        processor = AutoProcessor.from_pretrained(hpsv3_base_path, padding_side="right")
        config = AutoConfig.from_pretrained(hpsv3_base_path)
    except Exception as err:
        raise hub_error("hpsv3", hpsv3_base_path, "--hpsv3-base-path", err) from err
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
        raise hub_error("hpsv3", path or "MizzenAI/HPSv3/HPSv3.safetensors", "--hpsv3-checkpoint-path", err) from err
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
        frames, n = sample_frames(to_uint8(images), hpsv3_num_frames)
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


# ----------------------------------------------------------------------------- Soft-TIFA (GenEval 2's judge)
# GenEval 2 (Kamath et al., arXiv:2512.16853) scores a prompt by asking a VQA model one question per atom of the prompt
# (an object, its count, an attribute, a relation) and reading, from the first generated token's distribution, the
# probability of the right answer. Facts from the authors' code and data (facebookresearch/GenEval2 a6e82d2:
# evaluation.py = "ge2 L..", README.md section "Evaluation", geneval2_data.jsonl); rewards.soft_tifa is the reward.

SOFT_TIFA_MODEL = "Qwen/Qwen3-VL-8B-Instruct"  # the judge (ge2 L16-27)
SOFT_TIFA_SUFFIX = " Answer in one word."  # appended to every question (ge2 L142)
SOFT_TIFA_YES = ("Yes", "yes", " yes", " Yes")  # the answers whose probabilities make P(yes) (ge2 L140-141)
SOFT_TIFA_NUMBERS = geneval.NUMBERS[1:]  # "one" .. "ten": the count answers, each also read as a digit (ge2 L30-52)
SOFT_TIFA_SKILLS = ("object", "count", "attribute", "position", "verb")  # geneval2_data.jsonl's skills
SOFT_TIFA_FORMAT = ('"vqa_list": [["How many cats are in the image?", "one"], ["Are there any cats in the image?", '
                    '"Yes"]] (GenEval 2\'s geneval2_data.jsonl rows, read with --input-key prompt --metadata-key \'\'; '
                    'a GenEval row gets them from reward_models.geneval_vqa(metadata))')
# GenEval's relations in GenEval 2's words: left and right as GenEval 2 asks them; GenEval 2 has no flat "above" and
# "below" (its vertical relations, "on top of" and "under", imply contact), so these keep GenEval's words.
SOFT_TIFA_RELATIONS = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}


def soft_tifa_answers(question, answer):
    """The answer texts whose probabilities, as the first token of the reply, add up to the question's score (ge2
    L135-141): a question that starts with "How many" takes its number word (one to ten), capitalised or not, with
    or without a leading space, and its digits ("four", "Four", " four", " Four", "4", " 4"); every other question
    takes P(yes): "Yes", "yes", " yes", " Yes", whatever its expected answer (GenEval 2 expects "Yes" throughout, and
    an answer other than "Yes" is refused here rather than scored as if it were). Raises a one-line ValueError."""
    if not isinstance(question, str) or not question.strip() or not isinstance(answer, str):
        raise ValueError(f"a question and its answer must be two strings, got {flags.show([question, answer])}")
    if not question.startswith("How many"):
        if answer != "Yes":
            raise ValueError(f"the answer to {question!r} must be 'Yes' (Soft-TIFA scores P(yes) for every question "
                             f"but a 'How many' one), got {answer!r}; ask the question whose answer is yes")
        return SOFT_TIFA_YES
    if answer.lower() not in SOFT_TIFA_NUMBERS:
        raise ValueError(f"the answer to {question!r} must be a number word from one to ten, as GenEval 2's, got "
                         f"{answer!r}")
    word, digits = answer.lower(), str(SOFT_TIFA_NUMBERS.index(answer.lower()) + 1)
    return (word, word.capitalize(), " " + word, " " + word.capitalize(), digits, " " + digits)


def check_vqa(metadata):
    """A row's GenEval 2 questions -> [(question, answer), ...]; a one-line ValueError naming the fix unless
    `metadata["vqa_list"]` is a non-empty list of [question, answer] pairs that `soft_tifa_answers` accepts, and
    `skills`, where present, one of SOFT_TIFA_SKILLS per question (GenEval 2's per-skill analysis reads it)."""
    vqa = metadata.get("vqa_list") if isinstance(metadata, dict) else None
    if not isinstance(vqa, list) or not vqa:
        has = "none" if vqa is None else flags.show(vqa)
        raise ValueError(f"Soft-TIFA needs the row's questions, one per atom, under 'vqa_list'; this row has {has}: "
                         f"give it {SOFT_TIFA_FORMAT}")
    pairs = []
    for k, pair in enumerate(vqa):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise ValueError(f"vqa_list item {k} must be a [question, answer] pair, got {flags.show(pair)}")
        try:
            soft_tifa_answers(*pair)
        except ValueError as err:
            raise ValueError(f"vqa_list item {k}: {err}") from None
        pairs.append((pair[0], pair[1]))
    skills = metadata.get("skills")
    if skills is not None and (not isinstance(skills, list) or len(skills) != len(vqa)
                               or any(s not in SOFT_TIFA_SKILLS for s in skills)):
        raise ValueError(f"'skills' must list one of {', '.join(SOFT_TIFA_SKILLS)} per question of vqa_list "
                         f"({len(vqa)}), got {flags.show(skills)}; or leave it out")
    return pairs


def soft_tifa_scores(probs):
    """Soft-TIFA of one prompt from its questions' probabilities p [n] (README "Evaluation"; ge2 L143-146, L186-190):

        atom   = mean(p)                    Soft-TIFA AM, the atom-level estimate
        prompt = exp(mean(log p))           Soft-TIFA GM (scipy.stats.gmean), the prompt-level estimate; 0 if a p is 0

    The prompt score is the geometric mean, not the product prod(p) = prompt ** n, the probability that every atom
    holds were they independent: the authors' code reports the geometric mean, which does not shrink with the number
    of questions. Both are in [0, 1]; a p outside [0, 1] (beyond float rounding) raises.
    """
    p = torch.as_tensor(probs, dtype=torch.float64).flatten()
    if not len(p) or not ((p >= -1e-6) & (p <= 1 + 1e-6)).all():
        raise ValueError(f"Soft-TIFA needs one probability in [0, 1] per question, got {p.tolist()}")
    p = p.clamp(0, 1)
    return p.mean().item(), torch.exp(torch.log(p).mean()).item()  # log 0 = -inf: a zero makes the GM 0


def geneval_vqa(metadata):
    """GenEval 2's questions for a GenEval row (its include clauses; exclude clauses add nothing: the count question
    asks for the exact number) -> {"vqa_list", "skills", "atom_count"}, in GenEval 2's templates and order
    (geneval2_data.jsonl): per object, in the prompt's order (a relation's subject before its target),

        count      "How many {plural} are in the image?"            -> its number word (also for one)
        attribute  "Is the {noun} {colour}?" / "Are the {plural} {colour}?"           -> "Yes"
        object     "Are there any {plural} in the image?"          -> "Yes"
        position   "Is the {noun} {relation} the {target}?" / "Are the {plural} ..."   -> "Yes" (target plural when
                   its count is above one; relation in GenEval 2's words, SOFT_TIFA_RELATIONS)

    atom_count does not count the count questions of single objects (GenEval 2's README: "a" is asked, not counted).
    """
    geneval.check_metadata(metadata)
    include = metadata["include"]
    if any(clause["count"] > len(SOFT_TIFA_NUMBERS) for clause in include):
        raise ValueError(f"GenEval 2's count answers go up to {SOFT_TIFA_NUMBERS[-1]}; this row asks for more: "
                         f"{include}")
    order = sorted(range(len(include)), key=lambda i: "position" not in include[i])  # subjects first, else as listed

    def noun(clause):
        return clause["class"] if clause["count"] == 1 else geneval._plural(clause["class"])

    vqa, skills = [], []
    for i in order:
        clause = include[i]
        plural, be = geneval._plural(clause["class"]), "Is" if clause["count"] == 1 else "Are"
        vqa.append([f"How many {plural} are in the image?", SOFT_TIFA_NUMBERS[clause["count"] - 1]])
        skills.append("count")
        if "color" in clause:
            vqa.append([f"{be} the {noun(clause)} {clause['color']}?", "Yes"])
            skills.append("attribute")
        vqa.append([f"Are there any {plural} in the image?", "Yes"])
        skills.append("object")
        if "position" in clause:
            relation, target = clause["position"]
            vqa.append([f"{be} the {noun(clause)} {SOFT_TIFA_RELATIONS[relation]} the {noun(include[target])}?",
                        "Yes"])
            skills.append("position")
    singles = sum(s == "count" and a == "one" for s, (_, a) in zip(skills, vqa))
    return {"vqa_list": vqa, "skills": skills, "atom_count": len(vqa) - singles}


_RELATION_WORDS = "|".join(sorted({*SOFT_TIFA_RELATIONS, *SOFT_TIFA_RELATIONS.values(), "in front of", "behind",
                                   "under", "on top of"}, key=len, reverse=True))
_QUESTIONS = (  # GenEval 2's templates (geneval_vqa), most specific first
    ("count", r"How many (?P<noun>.+) are in the image\?"),
    ("object", r"Are there any (?P<noun>.+) in the image\?"),
    ("position", rf"(?:Is|Are) the (?P<noun>.+?) (?P<relation>{_RELATION_WORDS}) the (?P<target>.+)\?"),
    ("verb", r"(?:Is|Are) the (?P<noun>.+?) (?P<relation>playing with|chasing|jumping over) the (?P<target>.+)\?"),
    ("attribute", r"(?:Is|Are) the (?P<noun>.+) (?P<attribute>\S+)\?"),
)


def parse_question(question):
    """A question in one of GenEval 2's templates -> {"skill", "noun", and "attribute" or "relation" and "target"}
    (nouns as written, singular or plural); None for any other question."""
    for skill, pattern in _QUESTIONS:
        found = re.fullmatch(pattern, question)
        if found:
            return {"skill": skill, **found.groupdict()}
    return None


def soft_tifa_vlm(path, device, batch_size):
    """The in-process Soft-TIFA judge: a transformers vision-language model (AutoModelForImageTextToText, e.g.
    Qwen3-VL-8B-Instruct as the authors) -> ask(images uint8 [B, H, W, 3], B lists of (question, answer)) -> (B
    tensors of the questions' probabilities, failed [B] bool, all False).

    As ge2 L55-100: one user turn holding the image, then the question and SOFT_TIFA_SUFFIX, through the model's chat
    template with the generation prompt; the next token's distribution is the softmax of the model's logits over the
    whole vocabulary, in float32 (what generate(max_new_tokens=1, do_sample=False, output_scores=True) gives there),
    and a question's probability is the sum over the token ids of its `soft_tifa_answers`. No renormalisation against
    "No": a judge that answers something else entirely scores low. Departure: only answers that are one token count.
    The authors take the first token of each (ge2 L92), so with Qwen3's tokenizer " 4" (a space, then the digit) adds
    the probability of a bare space and "10" that of "1"; here both are left out, which is also what a server's
    top_logprobs can give (rewards.soft_tifa's openai backend). Questions are batched `batch_size` at a time, padded
    on the left; bfloat16 on a GPU (the authors' dtype "auto"), float32 on the CPU.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    try:
        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval().to(device)
    except Exception as err:
        raise hub_error("soft_tifa", path, "--soft-tifa-model", err) from err
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"  # the next token follows the last position of every row

    @functools.lru_cache(maxsize=None)
    def token_ids(answers):
        ids = {tuple(tokenizer.encode(a, add_special_tokens=False)) for a in answers}
        single = sorted({i[0] for i in ids if len(i) == 1})
        if not single:
            raise ValueError(f"soft_tifa: the tokenizer of --soft-tifa-model {path} has no single token for any of "
                             f"{list(answers)}, so the answer cannot be read from the first token; use a model "
                             f"whose vocabulary holds them (Qwen3-VL's does)")
        return single

    token_ids(SOFT_TIFA_YES)  # a tokenizer without "Yes" fails now, not at the first batch

    @torch.no_grad()
    def ask(images, vqa):
        jobs = [(i, q, a) for i, pairs in enumerate(vqa) for q, a in pairs]
        probs = []
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start:start + batch_size]
            messages = [[{"role": "user", "content": [{"type": "image"},
                                                      {"type": "text", "text": q + SOFT_TIFA_SUFFIX}]}]
                        for _, q, _ in chunk]
            text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            batch = processor(text=text, images=[Image.fromarray(images[i]) for i, _, _ in chunk], padding=True,
                              return_tensors="pt").to(device)
            batch["pixel_values"] = batch["pixel_values"].to(dtype)
            logits = model(**batch, logits_to_keep=1).logits[:, -1].float()  # [b, vocab], the first reply token
            p = logits.softmax(-1)
            probs += [row[token_ids(soft_tifa_answers(q, a))].sum().item() for row, (_, q, a) in zip(p, chunk)]
        counts = [len(pairs) for pairs in vqa]
        return list(torch.tensor(probs, dtype=torch.float64).split(counts)), torch.zeros(len(vqa), dtype=torch.bool)

    return ask
