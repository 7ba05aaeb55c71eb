"""Model families: a file per family, and MODELS, the registry of every `--model` name (bottom).

A family's file holds everything keyed by its models' names: hub id, loader, tiny twin, resolution multiple, source-
image policy, preset, LoRA targets and export, published configs, and the adapter functions that map the family onto
the repository's convention

    x_s = (1 - s) x0 + s eps,    v ~ eps - x0,    Euler step  x + (s' - s) v,    s = 1 is noise,

each saying how (timestep scale, sign of the output, guidance, latent layout, native schedule) and citing the diffusers
0.42 pipeline it was checked against; tests/test_models.py, tests/test_families.py and tests/test_edit_models.py run
each pipeline's own __call__ on the tiny twin and assert our velocity, Euler step and schedule reproduce it. models.py
calls the adapter of a pipeline's record (models.family(pipe)); train.py, sde.py and losses.py never see a family.

Our guidance scale g has one meaning in every family: classifier-free guidance v = v_u + g (v_c - v_u) (Ho & Salimans
2022, eq. 6 with g = 1 + w), off at g = 1, the unconditional and conditional halves run as one batched forward. A family
whose pipeline counts guidance differently (Z-Image: its w = g - 1) converts at the boundary; a guidance-distilled one
takes g through its embedding (FLUX.1-dev, Kontext) or ignores it (a step-distilled FLUX.2 [klein]), as its pipeline.

| name               | what it is                                                                 | file               |
| ------------------ | -------------------------------------------------------------------------- | ------------------ |
| `shapes`           | pretrained here on scenes of coloured shapes: SD3 architecture in pixel    | shapes.py          |
|                    | space at 32 px, weights shipped in weights/                                |                    |
| `shapes-edit`      | its edit model: FLUX.1 Kontext's pipeline in pixel space                   | shapes.py          |
| `sd3`              | `stabilityai/stable-diffusion-3.5-medium` (SD3.5-Large by --model-path)    | sd3.py             |
| `tiny`             | SD3 architecture at toy size, two CLIP encoders (no T5); a CPU at 64 px    | sd3.py             |
| `sd3-random`       | SD3.5-Medium's transformer and VAE at full size, random weights (bench.py) | sd3.py             |
| `flux`             | `black-forest-labs/FLUX.1-dev`                                             | flux.py            |
| `wan`              | `Wan-AI/Wan2.1-T2V-1.3B-Diffusers`, text to video (14B by --model-path)    | wan.py             |
| `wan2.2`           | `Wan-AI/Wan2.2-T2V-A14B-Diffusers`: two 14B experts split at a boundary    | wan.py             |
| `wan2.2-5b`        | `Wan-AI/Wan2.2-TI2V-5B-Diffusers`: one 5B, 16x VAE, a timestep per token  | wan.py             |
| `hunyuan-video-1.5`| `hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v`, text to      | hunyuan_video.py   |
|                    | video (720p by --model-path)                                               |                    |
| `ltx2`             | `Lightricks/LTX-2`: text to video with sound, one 19B audio-video          | ltx2.py            |
|                    | transformer; samples carry their waveforms (ltx2.WithAudio)                |                    |
| `qwen-image`       | `Qwen/Qwen-Image`                                                          | qwen_image.py      |
| `qwen-image-2.1`   | `Qwen/Qwen-Image-2.1`: single-stream, block-causal, Qwen3-VL text, no CFG  | qwen_image21.py    |
| `flux2-klein`      | `black-forest-labs/FLUX.2-klein-base-4B`, also edits (9B, distilled: path) | flux2_klein.py     |
| `z-image`          | `Tongyi-MAI/Z-Image` (`Z-Image-Turbo` by --model-path)                     | z_image.py         |
| `flux-kontext`     | `black-forest-labs/FLUX.1-Kontext-dev`, FLUX.1's editor                    | flux_kontext.py    |
| `qwen-image-edit`  | `Qwen/Qwen-Image-Edit`; `-plus`: `Qwen/Qwen-Image-Edit-2509`, several      | qwen_image_edit.py |
|                    | source images                                                              |                    |
| `tiny-<name>`      | the same pipeline classes at toy width, random weights, seed 0, in code    | its family's       |

Hub models load by id or --model-path (a local folder), and offline fail with one sentence naming the flag. common.py
holds what several families share; PUBLISHED (each family's) the real models' configs, for parameter counts and memory
estimates on the meta device (build_published).

Adding a family: a file here with its loader, tiny twin and adapter functions and, per model name, a dict of Family's
fields; import it at the top and give each name its line in MODELS (tests/test_new_family.py does it with a family
defined in the test).

A family's encode must give a prompt the same rows wherever it is computed: the prompt cache and the prompt store
(--prompt-store) encode each prompt once, keep its rows (a masked family's cut to its own tokens) and assemble later
batches from them, right-padded with zeros and False as common.pad_tokens pads. So encode honours the `tokens` it is
given, returns one batch-first row per prompt, the negative's rows alike for every prompt, and pads masked text on
the right; a batch read back from the store must equal the fresh encode of that batch bit for bit. Every registered
family is held to it by tests/test_prompt_store.py, and to its pipeline's own schedule by tests/test_families.py
(docs/design.md, "A model family").
"""

import dataclasses
from typing import Callable, Optional

from distributed import print0
from families import (common, flux, flux2_klein, flux_kontext, hunyuan_video, ltx2, qwen_image, qwen_image21,
                      qwen_image_edit, sd3, shapes, wan, z_image)


@dataclasses.dataclass(frozen=True)
class Family:
    """One `--model` name: how to build it, what it fills in, and its family's adapter. A hub model and its tiny twin
    share the adapter and differ in load, hub_id, hub, multiple and preset. models.load_pipeline(name) writes the name to
    pipe.model_name, and models.family(pipe) returns this record from it."""
    name: str  # the family whose adapter it uses (its pipeline's), as messages and tests name it
    load: Callable  # (model_path, dtype, device) -> the diffusers pipeline (model_path: an id or folder, or None)
    multiple: int  # image sides are multiples of this (VAE down-sampling x patch), checked before a model loads
    preset: dict  # the flags --model fills in where the command line is silent (families.preset)
    tokens: int  # the reference text length, encode_prompts' default (capped by the tokenizer's context)
    shape: Callable  # (pipe, height, width, num_frames) -> the per-sample shape of the latent sde.rollout sees
    noise: Callable  # (pipe, batch, height, width, num_frames, generator) -> x at s = 1, float32, as the pipeline draws
    encode: Callable  # (pipe, prompts, negative_prompt, guidance_scale, tokens[, images, size]) -> embeds, batch first
    velocity: Callable  # (pipe, modules, x, sigma [B] float32, embeds, guidance_scale) -> v ~ eps - x0; modules:
    # {name: callable} of the trained modules (or their training wrappers), the ones of `trained`
    decode: Callable  # (pipe, latents) -> uint8 images [B, H, W, 3] on the CPU (videos [B, F, H, W, 3])
    sigmas: Callable  # (pipe, num_steps, height, width, shift) -> the pipeline's schedule, float32 [N + 1], 1 -> 0
    lora_targets: tuple  # module-name suffixes models.add_lora adapts by default
    hub_id: Optional[str] = None  # the hub id --model-path defaults to; None: built in code
    hub: bool = False  # a full-size model (from a hub, or sd3-random): the losses' hub defaults apply (train.py)
    tokenizer: str = "tokenizer"  # the pipeline attribute whose context caps tokens (None there: no such text, 0)
    unused: Callable = common.no_unused  # transformer -> layers whose output is discarded: left out of training
    save_lora: Callable = common.save_lora  # (pipe, modules, folder) -> the adapters written as the loader reads them
    trained: tuple = ("transformer",)  # the pipeline attributes that train (models.trained_modules), in this order
    ddp: bool = True  # DDP may wrap the module: every trained parameter takes part in every backward, once. False
    # (a module called twice a forward, or with layers some batches do not reach): gradients averaged at the optimizer
    # step instead (policy.py), as DDP refuses both
    video: bool = False  # samples are videos [B, F, H, W, 3]; --num-frames applies
    temporal: int = 0  # video: its VAE's temporal compression, a video being temporal k + 1 frames (checked before the
    # model loads; the family's shape checks the loaded VAE's)
    sound: bool = False  # the videos carry their soundtrack (`.audio`), which rewards that hear score (clap)
    source_images: Optional[str] = None  # edits: "optional" or "required" (encode takes images, size); None: text
    max_sources: Optional[int] = None  # edits: the most source images one prompt may bring (None: any number)
    guidance_embedded: bool = False  # the guidance scale enters through an embedding, not CFG (FLUX.1-dev, Kontext)
    edit_vl_input: bool = False  # --edit-vl-input applies (Qwen-Image-Edit's VL encoder)
    preset_notes: Optional[dict] = None  # flag -> where the preset's value comes from (--print-config); a hub preset
    # without one: common.HUB_NOTES


# name -> component -> (class, config) of the published models (each family's PUBLISHED); Qwen-Image-Edit (2509, 2511)
# publishes Qwen-Image's components
PUBLISHED = {**sd3.PUBLISHED, **wan.PUBLISHED, **qwen_image.PUBLISHED, **flux2_klein.PUBLISHED, **z_image.PUBLISHED,
             **flux_kontext.PUBLISHED, "qwen-image-edit": qwen_image.PUBLISHED["qwen-image"],
             **hunyuan_video.PUBLISHED, **qwen_image21.PUBLISHED, **ltx2.PUBLISHED}


def guidance_mismatch(name, guidance_scale_2=None, audio_guidance_scale=None):
    """The line refusing a CFG scale for what model `name` lacks (a second expert, a soundtrack), or None: train.py's
    and eval.py's --guidance-scale-2 and --audio-guidance-scale."""
    if guidance_scale_2 is not None and "transformer_2" not in MODELS[name].trained:
        return f"--guidance-scale-2 is the CFG scale of a second expert, and {name} has none: drop it"
    if audio_guidance_scale is not None and not MODELS[name].sound:
        return f"--audio-guidance-scale guides a soundtrack, and {name} makes none: drop it"
    return None


def frames_mismatch(name, num_frames):
    """The line refusing a --num-frames that model `name` cannot make by its record (frames on an image model, a count
    off its VAE's temporal rule), or None: train.py's and eval.py's, before the model loads (the token bound needs the
    loaded transformer: the family's shape, at pipe.forward_samples)."""
    record = MODELS[name]
    if num_frames is not None and not record.video and num_frames != 1:
        return (f"--num-frames {num_frames}: {name} makes images; drop the flag or pick a video model (wan, "
                "hunyuan-video-1.5, ltx2, ...)")
    if num_frames is not None and record.video:
        try:
            common.video_frames(name, num_frames, None, record.temporal, 1, float("inf"))
        except ValueError as e:
            return str(e)
    return None


def forward_samples(name, forwards, audio_guidance_scale=None):
    """The most samples one forward of model `name` holds, over `forwards`, (samples, guidance scale) pairs: the
    families run CFG's two halves in one batch (twice the samples) where the scale is above 1, LTX-2 where its
    soundtrack's is too (families/ltx2.py guidance), and none where the guidance is embedded (FLUX.1-dev). The video
    families' token bound shares the memory among them (common.sample_tokens); train.py and eval.py set it as
    pipe.forward_samples."""
    record = MODELS[name]
    audio = audio_guidance_scale if record.sound and audio_guidance_scale is not None else 1

    def cfg(scale):
        return not record.guidance_embedded and (scale > 1 or audio > 1)
    return max(n * (2 if cfg(scale) else 1) for n, scale in forwards)


def settle(p, args):
    """What --model settles in train.py's flags (config.check_args), before the model loads: the frame count's rule
    (frames_mismatch), and the guidance (settle_guidance)."""
    if problem := frames_mismatch(args.model, args.num_frames):
        p.error(problem)
    settle_guidance(p, args)


def settle_guidance(p, args):
    """train.py's guidance flags against --model (config.check_args): --print-config's source of a preset's scale names
    where the value comes from (the pipeline's default, or Flow-GRPO's setting); LTX-2's soundtrack scale from its
    preset (LTX2Pipeline's 7) holds only beside the preset's video scale in forwards that all run CFG, and otherwise
    follows --guidance-scale, as before; what cannot run as asked is refused in one line (p.error)."""
    record, sources = MODELS[args.model], getattr(args, "sources", {})
    preset = f"model preset ({args.model})"
    notes = record.preset_notes or {k: note for k, note in common.HUB_NOTES.items()
                                    if record.hub and record.preset.get(k) == common.HUB[k]}
    for key, note in notes.items():
        if sources.get(key) == preset and record.preset.get(key) == getattr(args, key):
            sources[key] = f"{preset}: {note}"
    if not record.sound:
        return
    if sources.get("audio_guidance_scale", "").startswith(preset) and \
            not (sources.get("guidance_scale", "").startswith(preset) and args.train_cfg):
        args.audio_guidance_scale = None  # the soundtrack follows the video's scale (a loss's 1: no CFG)
        sources["audio_guidance_scale"] = "derived: --guidance-scale's (the preset's 7 goes with its 3 and --train-cfg)"
    audio = args.audio_guidance_scale
    if audio is not None and audio > 1 and args.guidance_scale > 1 and not args.train_cfg:
        p.error(f"--audio-guidance-scale {audio:g} keeps CFG on {args.model}'s soundtrack in every forward (LTX2Pipeline "
                "runs CFG where either scale is above 1), the training forward too, which --no-train-cfg runs without "
                "CFG: drop --no-train-cfg, or give --audio-guidance-scale 1")
    if audio is None or audio <= 1:
        return
    # the held-out evaluations' scale: LTX2Pipeline(guidance_scale=1, audio_guidance_scale=7) guides the sound alone
    held_out = getattr(args, "eval_guidance_scale", None) if getattr(args, "eval_every", None) else None
    if audio > 1 >= args.guidance_scale and getattr(args, "prompt_store", None):
        p.error(f"--audio-guidance-scale {audio:g} at --guidance-scale {args.guidance_scale:g} runs CFG on the "
                "soundtrack alone, whose negative prompt the prompt store serves only at --guidance-scale > 1: drop "
                "--prompt-store")
    if held_out is not None and held_out <= 1 and getattr(args, "prompt_store", None):
        p.error(f"--eval-guidance-scale {held_out:g} with --audio-guidance-scale {audio:g} runs CFG on the held-out "
                "soundtracks alone, whose negative prompt the prompt store serves only at a scale above 1: drop "
                "--prompt-store, or give --eval-guidance-scale above 1")
    if held_out is not None and held_out <= 1:
        print0(f"warning: --eval-guidance-scale {held_out:g} samples the held-out videos' picture without CFG and "
               f"their soundtrack at --audio-guidance-scale {audio:g}, as LTX2Pipeline guides it (CFG where either "
               "scale is above 1); eval.py --guidance-scale 1 --audio-guidance-scale 1 scores a checkpoint without any")


def build_published(name, component, device="meta"):
    """One component of a PUBLISHED model with random (or, on "meta", no) weights."""
    return common.build_published(*PUBLISHED[name][component], device)


# The registry: `--model` takes these names (models.add_arguments), in this order.
MODELS = {
    "tiny": Family(**sd3.TINY),
    "shapes": Family(**shapes.SHAPES),
    "tiny-flux": Family(**flux.TINY),
    "sd3": Family(**sd3.SD3),
    "sd3-random": Family(**sd3.RANDOM),
    "flux": Family(**flux.FLUX),
    "wan": Family(**wan.WAN),
    "tiny-wan": Family(**wan.TINY),
    "wan2.2": Family(**wan.WAN22),
    "tiny-wan2.2": Family(**wan.TINY22),
    "wan2.2-5b": Family(**wan.WAN22_5B),
    "tiny-wan2.2-5b": Family(**wan.TINY22_5B),
    "hunyuan-video-1.5": Family(**hunyuan_video.HUNYUAN_VIDEO),
    "tiny-hunyuan-video-1.5": Family(**hunyuan_video.TINY),
    "ltx2": Family(**ltx2.LTX2),
    "tiny-ltx2": Family(**ltx2.TINY),
    "qwen-image": Family(**qwen_image.QWEN_IMAGE),
    "tiny-qwen-image": Family(**qwen_image.TINY),
    "qwen-image-2.1": Family(**qwen_image21.QWEN_IMAGE21),
    "tiny-qwen-image-2.1": Family(**qwen_image21.TINY),
    "flux2-klein": Family(**flux2_klein.KLEIN),
    "tiny-flux2-klein": Family(**flux2_klein.TINY),
    "z-image": Family(**z_image.Z_IMAGE),
    "tiny-z-image": Family(**z_image.TINY),
    "flux-kontext": Family(**flux_kontext.KONTEXT),
    "tiny-flux-kontext": Family(**flux_kontext.TINY),
    "qwen-image-edit": Family(**qwen_image_edit.EDIT),
    "tiny-qwen-image-edit": Family(**qwen_image_edit.TINY),
    "qwen-image-edit-plus": Family(**qwen_image_edit.PLUS),
    "tiny-qwen-image-edit-plus": Family(**qwen_image_edit.TINY_PLUS),
    "shapes-edit": Family(**shapes.SHAPES_EDIT),
}
def preset(model):
    """The defaults --model fills in where the command line is silent: a copy of its record's preset."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    return dict(MODELS[model].preset)

