"""Evaluate checkpoints with deterministic (ODE) sampling, and plot a run's curves.

    python eval.py --model tiny --prompts prompts/tiny.txt --reward jpeg_compressibility \
        --checkpoints runs/default/checkpoints/60 --out runs/default/eval
    python eval.py --plot runs/default                      # held-out and training curves -> runs/default/curves.png
    python eval.py --plot runs/a runs/b --out runs/cmp      # several runs on one plot, labelled -> runs/cmp/curves.png
    python eval.py --model sd3 --prompts prompts/geneval_test.jsonl --input-key prompt \
        --reward geneval --checkpoints ...                  # GenEval per tag and overall, at SD3's 512 px and CFG 4.5
    python eval.py --checkpoints runs/default/checkpoints/100       # the shapes world's held-out file, before / after

--model defaults to the model the checkpoints were trained from (their state.json). Unset sampling flags take the
checkpoints' run's, as its held-out evaluation sampled (SAMPLING, from state.json's args; printed), else --model's
preset (its families.MODELS record, as train.py reads it): its resolution, ODE steps (its --eval-steps) and CFG scale;
and where the preset names a held-out file (`eval_prompts`: the shapes worlds), that file, its input key, reward and
detector.
Every prompt of the file is sampled unless --max-prompts.

Every prompt gets the same initial noise in every column (seeded by --seed and the prompt's index), so
the columns of the grid and of the table differ only by the weights. The base model is always the
first column. A checkpoint with EMA weights is scored by its EMA, as train.py's --eval-every and as Flow-GRPO
evaluates; `--no-ema` scores its live weights instead.

What it writes into --out: summary.json; grid.png, the samples before and after side by side (rows: prompts,
columns: base and checkpoints, each captioned with its verdict and score, after the source image for an edit
model; 24 prompts spread over the GenEval tags,
those whose verdict changed first, or every prompt with --grid-all, in pages grid-2.png, ... of at most 2000 px;
videos show their first, middle and last frame, and grid.gif plays them); diversity.png, where the file repeats a
prompt, several images of each of a few such prompts side by side (those that leave a colour free first) for every
column; bars.png, the accuracy per tag of each column. The table it prints has one row per column.
"""
import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import wave

import torch

import checkpoints
import data
import diversity
import families
import flags
import geneval
import models
import rewards


def seeded_noise(pipe, n, resolution, seed, num_frames=None, ids=None):
    """Noise for prompts 0..n-1 (or for the indices `ids`), each from its own generator (seed, index): independent of
    batch size, order and which process draws it."""
    return torch.cat([models.initial_noise(pipe, 1, resolution, num_frames=num_frames, generator=data.seeded(seed, i))
                      for i in (range(n) if ids is None else ids)])


def sample_images(pipe, prompts, *, resolution, num_steps, guidance_scale, seed=0, batch_size=8,
                  negative_prompt="", shift=None, num_frames=None, max_sequence_length=None, device="cpu",
                  source_images=None, noise_ids=None, autocast=contextlib.nullcontext, stop=None):
    """ODE samples of `prompts` on the model's own schedule (models.sigmas) -> uint8 [N, H, W, 3]
    (videos [N, F, H, W, 3]). source_images: per prompt, the images an edit model starts from (data.source_images).
    noise_ids: each prompt's noise index (default 0..N-1; a process sampling a share of a set passes the share's);
    autocast: the forwards' (and decode's) context, as models.generate (train.py: the run's --mixed-precision);
    stop: asked before each batch, True gives up and returns None (train.py: a preemption)."""
    sigmas = models.sigmas(pipe, num_steps, resolution, shift=shift, num_frames=num_frames)
    noise = seeded_noise(pipe, len(prompts), resolution, seed, num_frames, ids=noise_ids)
    out = []
    for i in range(0, len(prompts), batch_size):
        if stop is not None and stop():
            return None
        embeds = models.encode_prompts(pipe, prompts[i:i + batch_size], negative_prompt=negative_prompt,
                                       guidance_scale=guidance_scale, max_sequence_length=max_sequence_length,
                                       images=source_images[i:i + batch_size] if source_images else None,
                                       resolution=resolution)
        out.append(models.generate(pipe, noise[i:i + batch_size].to(device), sigmas, embeds,
                                   guidance_scale=guidance_scale, solver="euler", autocast=autocast)[1])
    return torch.cat(out)


def autocast(device, mixed_precision):
    """The autocast context factory of --mixed-precision ("no": none), as policy.Policy.autocast."""
    dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
    return contextlib.nullcontext if dtype is None else (lambda: torch.autocast(device.type, dtype=dtype))


def means_of(result, base=None):
    """The held-out figures of a reward output (dict of [N] tensors): each entry's mean (nan-aware: rm_type overrides
    leave other components NaN), and beside it its standard error (<key>_se, the sample std / sqrt(n) over the values
    that are not NaN) for error bars. GenEval: the geneval_<tag> means are the per-tag accuracies, geneval_overall is
    their mean (the official number) and geneval_mean_over_images the mean of geneval_correct; geneval_official_overall
    and geneval_official_<tag> the same under GenEval's own rule (geneval.py, departures). With base (the reward
    output of the same prompts and noise from another model): also `rise_of` the two."""
    means = {k: torch.nanmean(v.float()).item() for k, v in result.items() if k != "failed"}
    means.update({f"{k}_se": standard_error(v) for k, v in result.items() if k != "failed"})
    if "geneval_correct" in result:
        overall = geneval.summary_of_scores(result)
        means.update(geneval_overall=overall["overall"], geneval_mean_over_images=overall["mean_over_images"])
        tags = [means[f"geneval_{t}_se"] for t in geneval.TAGS if t in overall]  # overall = the mean of these tags
        means.update(geneval_overall_se=math.sqrt(sum(se * se for se in tags)) / len(tags) if tags else float("nan"),
                     geneval_mean_over_images_se=means["geneval_correct_se"])
    if "geneval_official" in result:  # GenEval's own rule on the same detections, beside the judge's
        official = geneval.summary_of_scores(result, "geneval_official")
        means.update({f"geneval_official_{t}": official[t] for t in geneval.TAGS if t in official},
                     geneval_official_overall=official["overall"])
    if base is not None:
        means.update(rise_of(result, base))
    return means


def rise_of(result, base):
    """{"rise", "rise_se"}: the headline metric (GenEval's overall accuracy, else the reward) of `result` less that
    of `base`, two reward outputs on the same prompts and noise, and the paired standard error of that difference.
    The images pair one to one, so the error is that of the per-image differences: when the two models agree on
    most images it is much smaller than either side's own, and a rise of two of it is unlikely to be noise.
    GenEval: the overall accuracy is the mean over T tags of their accuracies, so its rise is the mean of the
    tags' rises, with standard error sqrt(sum of their squared errors) / T."""
    if "geneval_correct" in result:
        diffs = [result[f"geneval_{t}"].float() - base[f"geneval_{t}"].float() for t in geneval.TAGS
                 if f"geneval_{t}" in result and (~result[f"geneval_{t}"].float().isnan()).any()]
        if not diffs:
            return {"rise": float("nan"), "rise_se": float("nan")}
        rises = [torch.nanmean(d).item() for d in diffs]
        errors = [standard_error(d) for d in diffs]
        return {"rise": sum(rises) / len(rises), "rise_se": math.sqrt(sum(e * e for e in errors)) / len(errors)}
    d = result["reward"].float() - base["reward"].float()
    return {"rise": torch.nanmean(d).item(), "rise_se": standard_error(d)}


def standard_error(values):
    """Standard error of the mean of a [N] tensor's values that are not NaN; NaN below two values."""
    x = values.float().flatten()
    x = x[~x.isnan()]
    return (x.std() / math.sqrt(len(x))).item() if len(x) > 1 else float("nan")


def load_weights(pipe, path, *, use_ema=False):
    """Copy a train.py checkpoint's trained weights (use_ema: their EMA, where it has one) into a pipeline prepared
    with the same LoRA rank (models.add_lora; a full fine-tune's checkpoint holds every weight). -> the file read."""
    try:
        return checkpoints.load_weights(path, dict(models.named_parameters(models.trained_modules(pipe))),
                                        use_ema=use_ema, complete=False)
    except SystemExit as e:  # its advice names train.py's flags: eval.py takes the LoRA rank from the checkpoint
        message = str(e.code)
        for advice in TRAIN_ADVICE:
            message = message.replace(advice, "evaluate it with the --model it was trained with (or without --model: "
                                              "eval.py reads the model and the LoRA rank from its state.json)")
        raise SystemExit(message) from None


TRAIN_ADVICE = ("use the flags it was saved with (--model, --lora-rank)",  # checkpoints.load_weights' refusals
                "use the --model and --lora-rank it was trained with")


def captioned_row(images, captions, *, min_side=128):
    """uint8 [m, H, W, 3] -> one PIL image: the samples side by side, each with its caption (lines: prompt,
    score, verdict) wrapped under it. Images smaller than min_side are enlarged (nearest neighbour, whole
    multiples) so that a 32 px sample and its caption stay readable."""
    import textwrap
    from PIL import Image, ImageDraw, ImageFont
    h, w = images.shape[1:3]
    scale = max(1, -(-min_side // min(h, w)))  # ceil
    tile_h, tile_w = h * scale, w * scale
    font = ImageFont.load_default(size=max(12, min(16, tile_w // 10)))
    chars = max(8, int(tile_w / (0.55 * font.size)))  # characters per caption line
    wrapped = ["\n".join(line for part in str(c).split("\n") for line in textwrap.wrap(part, chars) or [""])
               for c in captions]
    line_h = font.size + 3
    cap = 4 + line_h * max(text.count("\n") + 1 for text in wrapped)
    grid = Image.new("RGB", (tile_w * len(images), tile_h + cap), "white")
    draw = ImageDraw.Draw(grid)
    for i, img in enumerate(images):
        grid.paste(Image.fromarray(img).resize((tile_w, tile_h), Image.NEAREST), (i * tile_w, 0))
        draw.multiline_text((i * tile_w + 3, tile_h + 2), wrapped[i], fill="black", font=font, spacing=3)
    return grid


def select_samples(prompts, scores, n=8):
    """Indices of up to n of a step's samples (prompts[i], scores[i] its reward) that show what the step learns from:
    several distinct prompts, each by its worst and its best sample (the contrast a group-relative advantage sees),
    prompts with a spread of rewards (a failure beside a success) before saturated ones, of which the failing come
    first; then more samples of the same prompts while n allows. In the order of the prompts' first sample, each
    prompt's worst first."""
    values = [-math.inf if math.isnan(float(s)) else float(s) for s in scores]  # a sample without reward: the worst
    groups = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    ranked = {p: sorted(ids, key=lambda i: values[i]) for p, ids in groups.items()}  # worst first
    spread = [p for p, ids in ranked.items() if values[ids[0]] != values[ids[-1]]]
    saturated = sorted((p for p in ranked if p not in spread), key=lambda p: values[ranked[p][0]])
    order = [p for p in ranked if p in (spread + saturated)[:max(1, n // 2)]]
    prefs = {p: ranked[p][:1] + ranked[p][1:][-1:] + ranked[p][1:-1] for p in order}  # worst, best, the others
    chosen = [prefs[p][r] for r in range(max(map(len, prefs.values()), default=0)) for p in order if r < len(prefs[p])]
    chosen = set(chosen[:n])  # round after round: every prompt's worst, then every prompt's best, ...
    return [i for p in order for i in ranked[p] if i in chosen]


def save_sample_grid(path, images, captions, n=8, fps=16, ids=None):
    """Up to n training samples with their captions (train.py's samples/): images as one PNG row;
    videos [N, F, H, W, 3] as one animated GIF per caption's first line, the prompt (<path stem>_<k>.gif,
    that prompt's samples side by side, at fps frames per second). Videos with sound (ltx2: `images.audio`)
    also write each sample's soundtrack, <path stem>_<k>_<j>.wav for the j-th of the GIF's row, and where a
    codec is at hand the sample with its sound as <path stem>_<k>_<j>.mp4 (save_sound). `ids` picks the samples
    (e.g. select_samples'); by default the first n. Returns the paths written."""
    if ids is not None:
        images, captions = images[list(ids)], [captions[i] for i in ids]
    audio = getattr(images[:n], "audio", None)  # [n, channels, samples] beside videos with sound
    rate = getattr(images, "sample_rate", None)
    images = images[:n].numpy()
    captions = captions[:len(images)]
    if images.ndim == 4:
        captioned_row(images, captions).save(path)
        return [path]
    paths = []
    prompts = [str(c).split("\n")[0] for c in captions]
    for k, prompt in enumerate(dict.fromkeys(prompts)):
        ids = [i for i in range(len(images)) if prompts[i] == prompt]
        frames = [captioned_row(images[ids, f], [captions[i] for i in ids]) for f in range(images.shape[1])]
        paths.append(os.path.splitext(path)[0] + f"_{k}.gif")
        frames[0].save(paths[-1], save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
        for j, i in enumerate(ids if audio is not None else []):
            paths += save_sound(os.path.splitext(path)[0] + f"_{k}_{j}", images[i], audio[i], rate, fps)
    return paths


def save_sound(stem, frames, audio, sample_rate, fps):
    """One video's soundtrack, audio float [channels, samples] in [-1, 1], as <stem>.wav (16-bit PCM, stdlib wave),
    and frames uint8 [F, H, W, 3] with it as <stem>.mp4 (H.264, AAC) where a codec is at hand: PyAV through
    diffusers.utils.encode_video (the LTX-2 pipeline's own exporter), else an ffmpeg binary on PATH; neither: the
    WAV alone. Returns the paths written."""
    pcm = (torch.as_tensor(audio).float().clamp(-1, 1) * 32767).round().to(torch.int16)  # [C, T]
    with wave.open(stem + ".wav", "wb") as f:
        f.setnchannels(pcm.shape[0])
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(pcm.T.contiguous().numpy().astype("<i2").tobytes())  # interleaved frames of samples
    paths = [stem + ".wav"]
    try:
        import av  # noqa: F401  (diffusers' encode_video needs it)
        from diffusers.utils import encode_video
        encode_video(torch.as_tensor(frames), fps=fps, output_path=stem + ".mp4",
                     audio=torch.as_tensor(audio).float(), audio_sample_rate=int(sample_rate))
        return paths + [stem + ".mp4"]
    except ImportError:
        pass
    if shutil.which("ffmpeg") is None:
        return paths
    height, width = frames.shape[1:3]
    command = ["ffmpeg", "-y", "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}",
               "-r", str(fps), "-i", "-", "-i", stem + ".wav", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-c:a", "aac",
               "-shortest", stem + ".mp4"]
    subprocess.run(command, input=frames.tobytes(), check=True, capture_output=True)
    return paths + [stem + ".mp4"]


def summary_line(scores):
    """One readable line of `means_of`'s figures: for GenEval the official overall accuracy with the per-tag ones,
    then the trained reward; otherwise every entry."""
    rise = f" | rise {scores['rise']:+.4f} +- {scores['rise_se']:.4f}" if "rise" in scores else ""
    if "geneval_overall" not in scores:
        return " | ".join(f"{k} {v:+.4f}" for k, v in scores.items() if not k.endswith("_se") and k != "rise") + rise
    tags = ", ".join(f"{tag} {scores[f'geneval_{tag}']:.2f}" for tag in geneval.TAGS
                     if math.isfinite(scores.get(f"geneval_{tag}", float("nan"))))
    official = scores.get("geneval_official_overall", scores["geneval_overall"])
    official = f" | GenEval's rule {official:.3f}" if official != scores["geneval_overall"] else ""
    return f"accuracy {scores['geneval_overall']:.3f} ({tags}){official} | reward {scores['reward']:+.4f}" + rise


def append_scores(path, step, scores):
    """One line of eval.jsonl: the step and the mean of every reward entry."""
    with open(path, "a") as f:
        f.write(checkpoints.json_line({"step": step, **scores}))


# ----------------------------------------------------------------------------- before / after
TAG_NAMES = {"single_object": "single", "two_object": "two_obj", "counting": "counting", "colors": "colors",
             "position": "position", "color_attr": "attr"}  # table headers


def short_names(paths):
    """Column names of checkpoint folders: 'step 40' for <run>/checkpoints/40 when every one comes from the same
    run, '<run> step 40' when they come from several, the folder's name otherwise."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    steps = [p[-1] if len(p) >= 3 and p[-2] == "checkpoints" else None for p in parts]
    runs = {p[-3] for p, s in zip(parts, steps) if s is not None}
    return [f"step {s}" if s is not None and len(runs) == 1 else f"{p[-3]} step {s}" if s is not None else p[-1]
            for p, s in zip(parts, steps)]


def verdicts(result):
    """(caption, ok) of each image of a reward output: 'correct 0.83' (ok True) or 'wrong 0.50' (False) under
    GenEval, the official verdict and the trained score; 'reward +0.123' (None) otherwise."""
    scores = result["reward"].float().tolist()
    if "geneval_correct" not in result:
        return [(f"reward {s:+.3f}", None) for s in scores]
    correct = (result["geneval_correct"].float() > 0.5).tolist()
    return [(f"{'correct' if ok else 'wrong'} {s:.2f}", ok) for s, ok in zip(scores, correct)]


def select_rows(results, tags, rows):
    """Prompts (indices) for the before/after grid: `rows` of them spread evenly over the tags (GenEval's; one group
    without), in each tag first those whose verdict changed in some checkpoint against the base (results[0]), then
    those whose score changed most; within those, file order."""
    n = len(tags)
    scores = torch.stack([r["reward"].float() for r in results])  # [columns, N]
    change = (scores[1:] - scores[0]).abs().amax(0) if len(results) > 1 else torch.zeros(n)  # [N]
    changed = torch.zeros(n, dtype=torch.bool)
    if "geneval_correct" in results[0]:
        correct = torch.stack([r["geneval_correct"].float() > 0.5 for r in results])  # [columns, N]
        changed = (correct[1:] != correct[0]).any(0) if len(results) > 1 else changed
    groups = {}
    for i, tag in enumerate(tags):
        groups.setdefault(tag, []).append(i)
    quota = -(-rows // len(groups))  # ceil: rows spread evenly over the tags
    chosen = []
    for ids in groups.values():
        chosen += sorted(ids, key=lambda i: (not changed[i], -change[i].item(), i))[:quota]
    return chosen[:rows]


def stills(video):
    """uint8 [N, F, H, W, 3] -> [N, 3, H, W, 3]: the first, middle and last frame of each video."""
    f = video.shape[1]
    return video[:, [0, f // 2, f - 1]]


def compare_pages(columns, names, prompts, notes, captions, *, key="", max_height=2000, max_width=1600, min_side=128):
    """The before/after grid as pages (PIL images) of at most max_height x max_width pixels (at least one row each):
    rows = prompts (with a note under each, e.g. its tag), columns = `names` (base first; a name may have more
    lines, e.g. its accuracy), each cell the images of `columns[c][r]` (uint8 [k, H, W, 3]: one image, or k frames
    side by side) over its caption strip; captions[c][r] = (text, ok), ok True / False tints the strip green / red.
    `key` (what the captions say) heads the prompts. Where the columns are few, a page holds several blocks of rows
    side by side (read down, then across). Images smaller than min_side are enlarged (nearest neighbour, whole
    multiples) so that a 32 px sample can be seen."""
    import textwrap
    from PIL import Image, ImageDraw, ImageFont
    k, h, w = columns[0].shape[1:4]
    scale = max(1, -(-min_side // min(h, w)))  # ceil
    tile_h, tile_w, gap = h * scale, w * scale, 4
    cell_w = k * tile_w + (k - 1) * gap
    font = ImageFont.load_default(size=14)
    line_h, side, margin = 17, 220, 16
    chars, cell_chars = int(side / (0.55 * font.size)), max(8, int(cell_w / (0.55 * font.size)))
    heads = ["\n".join(textwrap.fill(line, cell_chars) for line in name.split("\n")) for name in names]
    key = textwrap.fill(key, chars)
    head = 8 + line_h * max(text.count("\n") + 1 for text in heads + [key + "\npage"])
    cap_h = line_h + 6
    row_h = tile_h + cap_h + gap
    block_w = side + len(columns) * (cell_w + gap)
    per_block = max(1, (max_height - head) // row_h)
    per_page = per_block * max(1, (max_width + margin) // (block_w + margin))
    tints = {True: ((222, 245, 222), (0, 110, 0)), False: ((250, 224, 224), (170, 0, 0)),
             None: ((236, 236, 236), (0, 0, 0))}  # (strip, text)
    pages, count = [], -(-len(prompts) // per_page)
    for start in range(0, len(prompts), per_page):
        rows = list(range(start, min(start + per_page, len(prompts))))
        blocks = -(-len(rows) // per_block)
        tall = -(-len(rows) // blocks)  # rows per block, spread evenly
        page = Image.new("RGB", (blocks * block_w + (blocks - 1) * margin, head + tall * row_h), "white")
        draw = ImageDraw.Draw(page)
        draw.multiline_text((4, 4), key + (f"\npage {start // per_page + 1} of {count}" if count > 1 else ""),
                            fill="gray", font=font, spacing=3)
        for b in range(blocks):
            x0 = b * (block_w + margin)
            for c, text in enumerate(heads):
                draw.multiline_text((x0 + side + c * (cell_w + gap) + 3, 4), text, fill="black", font=font, spacing=3)
            for y, r in enumerate(rows[b * tall:(b + 1) * tall]):
                top = head + y * row_h
                lines = textwrap.wrap(prompts[r], chars) or [""]
                room = max(1, tile_h // line_h - 1)  # lines of the prompt that fit beside the images, with the note
                if len(lines) > room:
                    lines = lines[:room - 1] + [lines[room - 1][:chars - 3] + "..."]
                draw.multiline_text((x0 + 4, top + 2), "\n".join(lines), fill="black", font=font, spacing=3)
                draw.text((x0 + 4, top + 2 + len(lines) * line_h), notes[r], fill="gray", font=font)
                for c, cells in enumerate(columns):
                    left = x0 + side + c * (cell_w + gap)
                    for j, img in enumerate(cells[r]):
                        tile = Image.fromarray(img).resize((tile_w, tile_h), Image.NEAREST)
                        page.paste(tile, (left + j * (tile_w + gap), top))
                    text, ok = captions[c][r]
                    strip, ink = tints[ok]
                    draw.rectangle((left, top + tile_h, left + cell_w - 1, top + tile_h + cap_h - 1), fill=strip)
                    draw.text((left + 4, top + tile_h + 3), text, fill=ink, font=font)
        pages.append(page)
    return pages


def source_column(sources, size):
    """The grid's first column for an edit model: each row's first source image (sources: per row, the list of
    data.source_images) at the samples' size, uint8 [N, H, W, 3]; nearest neighbour, as the grid enlarges its tiles;
    black where a row has none."""
    import numpy as np
    from PIL import Image
    h, w = size
    cells = np.zeros((len(sources), h, w, 3), dtype=np.uint8)
    for i, images in enumerate(sources):
        if images:
            cells[i] = np.asarray(Image.fromarray(images[0]).resize((w, h), Image.NEAREST))
    return cells


def diversity_groups(prompts, metadata, *, rows=6, per=8):
    """The diversity panel's rows: prompts the file repeats (each repeat on its own noise), those that leave an
    object's colour free first (a GenEval include clause without "color"), at most `rows`, taken in turn from each
    tag in order of first appearance -> per row the indices of its first k images, k the fewest repeats of the rows
    chosen (at most `per`); [] when no prompt repeats."""
    groups = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    repeated = [g for g in groups.values() if len(g) > 1]

    def free_colour(g):
        meta = metadata[g[0]]
        return isinstance(meta, dict) and any(isinstance(c, dict) and c.get("color") is None
                                              for c in meta.get("include") or ())
    repeated = [g for g in repeated if free_colour(g)] or repeated
    by_tag = {}
    for g in repeated:
        meta = metadata[g[0]]
        by_tag.setdefault(meta.get("tag", "") if isinstance(meta, dict) else "", []).append(g)
    chosen = []
    while len(chosen) < rows and any(by_tag.values()):
        for tag_groups in by_tag.values():
            if tag_groups and len(chosen) < rows:
                chosen.append(tag_groups.pop(0))
    k = min([per] + [len(g) for g in chosen])
    return [g[:k] for g in chosen]


def save_diversity_panel(path, panel, columns, results, tables, labels, prompts, tags):
    """diversity.png: per row a prompt's first k images (diversity_groups), one cell per column (base, then the
    checkpoints), the same noise in every column; each column headed by its free-colour diversity where the shapes
    world measures it, each cell captioned with how many of its images are right (or their mean reward)."""
    cells = [torch.stack([torch.as_tensor(c)[g] for g in panel]).numpy() for c in columns]  # [rows, k, H, W, 3]
    heads = [label + (f"\ncolour diversity {t['diversity_color']:.3f}" if "diversity_color" in t else "")
             for label, t in zip(labels, tables)]
    captions = []
    for result in results:
        if "geneval_correct" in result:
            right = result["geneval_correct"].float() > 0.5
            captions.append([(f"{int(right[g].sum())} of {len(g)} right", None) for g in panel])
        else:
            captions.append([(f"reward {result['reward'][g].float().mean():+.3f}", None) for g in panel])
    k = len(panel[0])
    page = compare_pages(cells, heads, [prompts[g[0]] for g in panel], [tags[g[0]] for g in panel], captions,
                         key=f"each cell: {k} images of the prompt, each on its own noise, the same noise in every "
                             "column; colour diversity: the entropy of the colours prompts leave free (docs/shapes.md)")[0]
    page.save(path)
    return path


def page_paths(folder, stem, n, ext):
    """<stem>.<ext>, <stem>-2.<ext>, ...: the first page keeps the plain name."""
    return [os.path.join(folder, f"{stem}.{ext}" if i == 0 else f"{stem}-{i + 1}.{ext}") for i in range(n)]


def save_compare_grid(folder, columns, names, prompts, notes, captions, *, key="", max_height=2000, fps=16):
    """Write the before/after grid (see compare_pages) into folder: grid.png, grid-2.png, ... for images [N, H, W, 3];
    for videos [N, F, H, W, 3] the same pages with the first, middle and last frame of each video, and each page
    as an animated GIF (grid.gif, ...) at fps frames per second; videos with sound (ltx2) also each cell's soundtrack,
    grid_<column>_<row>.wav (save_sound). Returns the paths written."""
    sounds = [(getattr(c, "audio", None), getattr(c, "sample_rate", None)) for c in columns]
    columns = [c.numpy() if isinstance(c, torch.Tensor) else c for c in columns]
    video = columns[0].ndim == 5
    still = [stills(c) if video else c[:, None] for c in columns]  # [N, k, H, W, 3]
    pages = compare_pages(still, names, prompts, notes, captions, max_height=max_height,
                          key=key + ("; the frames: first, middle, last" if video else ""))
    for name in os.listdir(folder):  # the pages of an earlier, longer grid in the same folder would read as ours
        if re.fullmatch(r"grid(-\d+)?\.(png|gif)|grid_\d+_\d+\.(wav|mp4)", name):
            os.remove(os.path.join(folder, name))
    paths = page_paths(folder, "grid", len(pages), "png")
    for page, path in zip(pages, paths):
        page.save(path)
    if video:
        frames = [compare_pages([c[:, f, None] for c in columns], names, prompts, notes, captions, key=key,
                                max_height=max_height) for f in range(columns[0].shape[1])]  # [F][pages]
        for p, path in enumerate(page_paths(folder, "grid", len(frames[0]), "gif")):  # one frame a cell: fewer pages
            frames[0][p].save(path, save_all=True, append_images=[f[p] for f in frames[1:]],
                              duration=round(1000 / fps), loop=0)
            paths.append(path)
    for j, (audio, rate) in enumerate(sounds):
        for i in range(len(audio) if audio is not None and video else 0):
            paths += save_sound(os.path.join(folder, f"grid_{j}_{i}"), columns[j][i], audio[i], rate, fps)
    return paths


def table_keys(tables):
    """[(short name, key)] of the summary's table and bars: GenEval's overall accuracy, the accuracy of each tag
    that has prompts and the mean reward; otherwise the reward and each other entry that has a value (an edit kind
    with no prompts among those scored has none) and is not the reward again."""
    if "geneval_overall" not in tables[0]:
        return [("reward", "reward")] + [(k, k) for k in tables[0] if k not in ("reward", "rise")
                                         and not k.endswith("_se") and any(t.get(k) != t.get("reward") for t in tables)
                                         and any(is_number(t.get(k)) and math.isfinite(t[k]) for t in tables)]
    tags = [t for t in geneval.TAGS if any(math.isfinite(table.get(f"geneval_{t}", math.nan)) for table in tables)]
    return [("accuracy", "geneval_overall")] + [(TAG_NAMES[t], f"geneval_{t}") for t in tags] + [("reward", "reward")]


def save_bars(path, names, tables, title=None):
    """Grouped bars, one group per tag (or reward entry), one bar per column (base first), with standard errors."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = table_keys(tables)
    width = 0.8 / len(tables)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(groups) * len(tables) + 2), 3.8))
    for c, (name, table) in enumerate(zip(names, tables)):
        xs = [g + (c - (len(tables) - 1) / 2) * width for g in range(len(groups))]
        values = [table.get(key, math.nan) for _, key in groups]
        errors = [table.get(f"{key}_se", math.nan) for _, key in groups]
        ax.bar(xs, values, width, yerr=[0 if math.isnan(e) else e for e in errors], capsize=2, label=name,
               color=f"C{c}")
    ax.set_xticks(range(len(groups)), [label for label, _ in groups])
    if "geneval_overall" in tables[0]:  # overall | the tags | the mean trained score
        for x in (0.5, len(groups) - 1.5):
            ax.axvline(x, color="gray", lw=0.8, ls=":")
        ax.set_ylabel("GenEval accuracy (reward: mean score)")
    ax.set_title((title + "\n" if title else "") + "bars: one standard error", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_table(names, tables):
    """Lines of an aligned table, one row per column (base first): GenEval's overall accuracy with its standard
    error, the tag accuracies and the mean reward; every reward entry otherwise."""
    keys = table_keys(tables)

    def cell(table, key):
        value, se = table.get(key, math.nan), table.get(f"{key}_se", math.nan)
        text = f"{value:.3f}" if key.startswith("geneval_") else f"{value:+.4f}"
        return text + (f" +- {se:.3f}" if key == "geneval_overall" and math.isfinite(se) else "")

    rows = [[name] + [cell(t, key) for _, key in keys] for name, t in zip(names, tables)]
    header = ["checkpoint"] + [label for label, _ in keys]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(r, widths))).rstrip()
             for r in [header] + rows]
    return lines


# ----------------------------------------------------------------------------- curves of runs (--plot)
MOVING = (("grad_norm", "gradient norm"), ("kl", "KL to the base (kl)"), ("approx_kl", "approx. KL to the old policy"),
          ("clipfrac", "clip fraction"), ("masked_fraction", "FlowDPPO masked fraction"), ("ratio_mean", "ratio mean"),
          ("loss", "loss"), ("zero_adv_fraction", "share of zero-advantage samples"),
          ("diversity_features", "feature diversity within groups (--diversity)"))  # metrics.jsonl, as they move


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def step_rows(path, numeric):
    """{step: row} of a run's jsonl file (the last row of a step wins, as a resumed run redoes it), and how many
    lines were skipped: torn lines, and rows whose step or whose values at keys where numeric(key) holds are not
    numbers (or null)."""
    rows, bad = checkpoints.read_jsonl(path)
    kept = {}
    for row in rows:
        if (not isinstance(row, dict) or not is_number(row.get("step"))
                or any(numeric(k) and not (v is None or is_number(v)) for k, v in row.items())):
            bad += 1
            continue
        kept[row["step"]] = row
    return dict(sorted(kept.items())), bad


def run_label(run_dir, run_dirs):
    """The folder's name (with its parent's where two runs share a name) and, from args.json, loss and seed."""
    parts = os.path.normpath(run_dir).split(os.sep)
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    label = os.sep.join(parts[-2:]) if names.count(parts[-1]) > 1 else parts[-1]
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            flags = json.load(f)["args"]
        return f"{label} ({flags['loss']}, seed {flags['seed']})"
    except (OSError, ValueError, KeyError, TypeError):
        return label


def read_run(run_dir, run_dirs):
    """A run folder's label, eval.jsonl and metrics.jsonl rows (completed steps), one warning line per damaged file."""
    if not os.path.isdir(run_dir):
        raise SystemExit(f"error: {run_dir} is not a folder: --plot takes run folders written by train.py --out")
    files = {}
    for name, numeric in (("eval.jsonl", lambda k: True),
                          ("metrics.jsonl", lambda k: k in ("reward_mean", *dict(MOVING)) or k.startswith("reward/"))):
        path = os.path.join(run_dir, name)
        files[name], bad = step_rows(path, numeric)
        if bad:
            print(f"warning: {path}: skipped {bad} line(s) that are torn or hold something other than numbers")
    metrics = [r for r in files["metrics.jsonl"].values() if not r.get("skipped")]
    return {"label": run_label(run_dir, run_dirs), "eval": list(files["eval.jsonl"].values()), "metrics": metrics}


def series(rows, key):
    """(steps, values, standard errors) of key in rows, absent and null as NaN; None when no row has a number."""
    if not any(is_number(r.get(key)) for r in rows):
        return None
    def value(r, k):
        return r[k] if is_number(r.get(k)) else math.nan
    return [r["step"] for r in rows], [value(r, key) for r in rows], [value(r, f"{key}_se") for r in rows]


def running_mean(values, window):
    """Trailing mean over up to `window` values (fewer at the start), NaN values left out."""
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i + 1 - window):i + 1] if not math.isnan(v)]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def is_constant(values, tol=1e-6):
    """True when every finite value lies within tol x max(1, |largest|) of the others (a loss of 1e-8 or a ratio of
    1 on every step, constant by construction): nothing to see in a panel."""
    finite = [v for v in values if math.isfinite(v)]
    return not finite or max(finite) - min(finite) <= tol * max(1.0, max(abs(v) for v in finite))


def curve_panels(runs):
    """[(title, kind, {label: (steps, values, errors)})] of the runs' curves, in order: the held-out metrics of
    eval.jsonl (GenEval: overall accuracy, each tag, the reward), kind "held_out", with standard errors; the training
    reward (and GenEval accuracy) of metrics.jsonl, kind "smoothed"; then each figure of MOVING that moves in some
    run, kind "raw"."""
    held_out = [r for run in runs for r in run["eval"]]
    if any("geneval_overall" in r for r in held_out):
        keys = ([("geneval_overall", "held-out accuracy (GenEval overall)")]
                + [(f"geneval_{t}", f"held-out accuracy: {t}") for t in geneval.TAGS]
                + [("reward", "held-out reward"), ("diversity_color", "held-out colour diversity (free colours)"),
                   ("diversity_position", "held-out position spread (free positions)")])
    else:  # the reward entries, but not a component that is the reward itself
        others = dict.fromkeys(k for r in held_out for k in r if k not in ("step", "reward", "rise")
                               and not k.endswith("_se"))
        keys = [("reward", "held-out reward")] + [(k, f"held-out {k}") for k in others
                                                  if any(r.get(k) != r.get("reward") for r in held_out)]
    panels = []
    for kind, rows, keys in (("held_out", "eval", keys),
                             ("smoothed", "metrics", [("reward_mean", "training reward"),
                                                      ("reward/geneval_correct_mean", "training accuracy (GenEval)")]),
                             ("raw", "metrics", MOVING)):
        for key, title in keys:
            curves = {run["label"]: s for run in runs if (s := series(run[rows], key)) is not None}
            if not curves:
                continue
            if kind == "raw" and is_constant([v for _, values, _ in curves.values() for v in values]):
                continue
            panels.append((title, kind, curves))
    return panels


def plot_runs(run_dirs, out=None):
    """The curves of one or more run folders (curve_panels; one colour per run, labelled) -> one PNG: by default
    curves.png in the run folder (of the first run when several)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    runs = [read_run(d, run_dirs) for d in run_dirs]
    panels = curve_panels(runs)
    if not panels:
        raise SystemExit(f"error: {', '.join(run_dirs)}: no completed step or evaluation to plot yet "
                         "(train.py writes metrics.jsonl after each step and eval.jsonl with --eval-every)")
    flag, out = ("--out", out) if out else ("--plot", os.path.join(run_dirs[0], "curves.png"))
    check_output(os.path.dirname(os.path.abspath(out)), [os.path.basename(out)], flag)  # before the figure is drawn
    colours = {run["label"]: f"C{i}" for i, run in enumerate(runs)}
    longest = max(len(run["metrics"]) for run in runs)
    window = max(1, round(longest / 10))
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.1 * rows + 0.5), squeeze=False)
    for ax, (title, kind, curves) in zip(axes.flat, panels):
        for label, (steps, values, errors) in curves.items():
            colour = colours[label]
            if kind == "held_out":
                known = any(math.isfinite(e) for e in errors)  # eval.jsonl of older runs has no standard errors
                ax.errorbar(steps, values, yerr=[e if math.isfinite(e) else 0 for e in errors] if known else None,
                            color=colour, marker="o", ms=3, capsize=3, lw=1.5)
            elif kind == "smoothed":
                ax.plot(steps, values, color=colour, alpha=0.25, lw=0.8, marker=".", ms=3)
                ax.plot(steps, running_mean(values, window), color=colour, lw=1.8)
            else:
                ax.plot(steps, values, color=colour, lw=1.2, marker=".", ms=3)
        scores = [v for _, values, _ in curves.values() for v in values if math.isfinite(v)]
        if scores and not math.isfinite(max(scores) - min(scores)):  # 1e308 beside -1e308: matplotlib's ticks overflow
            plt.close(fig)
            raise SystemExit(f"error: {', '.join(run_dirs)}: {title} spans {min(scores):.3g} to {max(scores):.3g}, "
                             "more than a float holds, and cannot be drawn: check the run's metrics.jsonl and "
                             "eval.jsonl for that figure")
        if kind == "held_out" and all(0 <= v <= 1 for v in scores):  # accuracies: a change of 0.003 fills no panel
            lo, hi = ax.get_ylim()
            if hi - lo < 0.1:
                ax.set_ylim((lo + hi) / 2 - 0.05, (lo + hi) / 2 + 0.05)
        with_bars = kind == "held_out" and any(math.isfinite(e) for _, _, es in curves.values() for e in es)
        ax.set_title(title + ("\n(bars: one standard error)" if with_bars and title == panels[0][0] else "")
                     + (f"\n(running mean of {window} steps; faint: each step)" if kind == "smoothed"
                        and window > 1 else ""), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colours[run["label"]], lw=2) for run in runs]
    fig.legend(handles, [run["label"] for run in runs], loc="upper center", ncol=min(3, len(runs)), fontsize=9,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight() * (1 + (len(runs) - 1) // 3)))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"wrote {out}")
    return out


OUTPUTS = ("summary.json", "grid.png", "grid.gif", "grid.mp4", "bars.png", "diversity.png")  # what --out receives


def check_output(folder, names, flag):
    """Refuse in one line, before any sampling, a results folder this process cannot write, or one where a file of
    `names` is a folder: a file is created and removed in it (or, while it does not exist, in the nearest folder above
    it that does, which the results' folders will be made in), as train.py checks its run folder (checkpoints.prepare).
    A trial write, not the permission bits: those do not bind root, a read-only mount does."""
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isdir(path) or (os.path.lexists(path) and not os.path.isfile(path)):
            raise SystemExit(f"error: {flag}: {path} is a folder (or not a regular file), and eval.py writes a file "
                             f"there; move it away or pick another {flag}")
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    probe = os.path.join(existing, f".write-test-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"error: {flag}: cannot write in {existing} ({e.strerror or e}); pick a writable folder") \
            from None


def trained_model(paths):
    """The --model the checkpoints were trained from (their state.json; unreadable ones are refused later), or None."""
    names = set()
    for path in paths:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            with open(os.path.join(path, "state.json")) as f:
                names.add(json.load(f)["model"])
    if len(names) > 1:
        raise SystemExit(f"error: the checkpoints come from different models ({', '.join(sorted(names))}): evaluate "
                         "them in separate calls")
    return names.pop() if names else None


# eval.py's sampling flags, each as the run's held-out evaluation set it (run_value)
SAMPLING = ("resolution", "eval_steps", "guidance_scale", "guidance_scale_2", "audio_guidance_scale", "num_frames",
            "shift", "max_sequence_length")


def run_value(saved, key):
    """A sampling flag's value in a run's args (state.json): its own, but the CFG scale its held-out images were
    sampled at (run.eval_guidance: --eval-guidance-scale where given)."""
    if key == "guidance_scale" and saved.get("eval_guidance_scale") is not None:
        return saved["eval_guidance_scale"]
    return saved.get(key)


def fill_from_run(args):
    """Unset sampling flags from the run the checkpoints come from (state.json's args), so that a checkpoint is
    sampled as its run evaluated it; one line says what was taken. Checkpoints of runs that sampled differently are
    refused in one line, naming the flag to pass."""
    runs = []  # (checkpoint, its run's args); an unreadable state.json is refused later (lora_shape)
    for path in args.checkpoints:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            with open(os.path.join(path, "state.json")) as f:
                saved = json.load(f)["args"]
            if isinstance(saved, dict):
                runs.append((path, saved))
    taken = {}
    for key in SAMPLING:
        if getattr(args, key) is not None or not runs:
            continue
        if len(values := {json.dumps(run_value(saved, key)) for _, saved in runs}) > 1:
            raise SystemExit(f"error: the checkpoints' runs sampled at different {key} ({', '.join(sorted(values))}): "
                             f"pass --{key.replace('_', '-')}, or evaluate them in separate calls")
        if (value := run_value(runs[0][1], key)) is not None:
            setattr(args, key, value)
            taken[key] = value
    if taken:
        print(f"sampling as {runs[0][0]}'s run evaluated: " + ", ".join(f"{k} {v}" for k, v in taken.items()))


def fill_from_preset(args):
    """Unset flags from --model's preset, as train.py fills its own: the sampling always; the prompt file, its key,
    reward and detector only where the preset names a held-out file (a hub preset's training prompts are not one)."""
    defaults = families.preset(args.model)
    fill = dict(resolution=defaults["resolution"], eval_steps=defaults["eval_steps"],
                guidance_scale=defaults["guidance_scale"], prompts="prompts/tiny.txt", input_key="input",
                reward="jpeg_compressibility")
    if "eval_prompts" in defaults:
        fill.update(prompts=defaults["eval_prompts"], input_key=defaults["input_key"], reward=defaults["reward"],
                    geneval_detector=defaults.get("geneval_detector"))
    if args.guidance_scale is None:  # LTX-2's soundtrack scale goes with the preset's video scale (settle_guidance)
        fill.update(audio_guidance_scale=defaults.get("audio_guidance_scale"))
    for key, value in fill.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def parse_args(argv=None):
    """eval.py's flags (--help groups them), the reward's and the diversity's -> (parser, args)."""
    shown = {name: families.preset(name) for name in ("shapes", "tiny", "sd3", "flux")}  # --help: each one's value
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=flags.preset_help(
        shown, ("resolution", "eval_steps", "guidance_scale")))
    p.add_argument("--plot", nargs="+", metavar="RUN_DIR",
                   help="only plot the curves of one or more run folders (labelled, one colour each)")
    p.add_argument("--model", default=None, choices=list(models.MODELS),
                   help="default: the model the --checkpoints were trained from (their state.json), else tiny")
    p.add_argument("--model-path", default=None, help="hub id or local folder of the base pipeline")
    p.add_argument("--checkpoints", nargs="*", default=[],
                   help="train.py checkpoint folders (<run>/checkpoints/<step>)")
    p.add_argument("--ema", action=argparse.BooleanOptionalAction, default=True,
                   help="score a checkpoint's EMA weights where it has them (as train.py evaluates and exports)")
    p.add_argument("--prompts", default=None,
                   help="held-out prompts (.txt or .jsonl; default: the preset's held-out file, else prompts/tiny.txt)")
    p.add_argument("--input-key", default=None, help="JSONL key of the prompt (GenEval files: prompt; default: the "
                   "preset's for its held-out file, else input)")
    p.add_argument("--metadata-key", default="metadata", help="JSONL key of the metadata; '' takes the whole row")
    p.add_argument("--max-prompts", type=flags.POSITIVE_INT, default=None, help="first N prompts of the file "
                   "(default: all)")
    p.add_argument("--reward", default=None, help="reward spec, as train.py --reward (default: the preset's for its "
                   "held-out file, else jpeg_compressibility)")
    p.add_argument("--resolution", type=flags.POSITIVE_INT, default=None,
                   help="image side in pixels")
    # the types of train.py's flags: a value it refuses (NaN, 0, a negative guidance) is refused here, before any model
    p.add_argument("--num-frames", type=flags.POSITIVE_INT, default=None, help="video models (wan): frames per sample")
    p.add_argument("--shift", type=flags.bounded(float, 0, 100, low_open=True), default=None,
                   help="static schedule shift (default: the model's own)")
    p.add_argument("--max-sequence-length", type=flags.POSITIVE_INT, default=None,
                   help="text tokens (default: the family's)")
    p.add_argument("--eval-steps", type=flags.POSITIVE_INT, default=None, help="ODE steps")
    p.add_argument("--guidance-scale", type=flags.POSITIVE, default=None, help="CFG scale (1 or less: no CFG)")
    p.add_argument("--guidance-scale-2", type=flags.POSITIVE, default=None,
                   help="Wan 2.2: the low-noise expert's CFG scale, as train.py's (default: --guidance-scale)")
    p.add_argument("--audio-guidance-scale", type=flags.POSITIVE, default=None,
                   help="LTX-2: the soundtrack's CFG scale, as train.py's (default: --guidance-scale)")
    p.add_argument("--batch-size", type=flags.POSITIVE_INT, default=8, help="images per forward")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"],
                   help="autocast dtype of the forwards and the decode: the training run's, to score what it sampled")
    p.add_argument("--seed", type=flags.SEED, default=0, help="noise seed (per prompt)")
    p.add_argument("--out", default=None, help="folder for summary.json, grid.png (pages grid-2.png, ...) and "
                   "bars.png (default: runs/eval); with --plot, for curves.png (default: the first run's folder)")
    p.add_argument("--grid-rows", type=flags.POSITIVE_INT, default=24,
                   help="prompts in the before/after grid, spread evenly over "
                   "the GenEval tags, those whose verdict changed first")
    p.add_argument("--grid-all", action="store_true", help="every prompt in the grid, in pages of at most 2000 px")
    p.add_argument("--fps", type=flags.POSITIVE_INT, default=16,
                   help="video models: frames per second of the grid's GIFs")
    rewards.add_arguments(p)
    diversity.add_arguments(p)
    return p, p.parse_args(argv)


def lora_shape(paths):
    """The checkpoints, each checked complete and trusted before any model loads -> their (LoRA rank, alpha)."""
    ranks = set()  # the checkpoints are checked before any model loads
    for ckpt in paths:
        if not os.path.isfile(os.path.join(ckpt, "state.json")):
            raise SystemExit(f"error: {ckpt} is not a complete checkpoint (no state.json); "
                             "pass <run>/checkpoints/<step>")
        if (problem := checkpoints.verify(ckpt)) is not None:
            raise SystemExit(f"error: checkpoint {ckpt} cannot be trusted: {problem}; evaluate another step of the run")
        with open(os.path.join(ckpt, "state.json")) as f:
            state = json.load(f)
        ranks.add((state["lora_rank"], state.get("lora_alpha", state["lora_rank"])))
    if len(ranks) > 1:
        raise SystemExit("error: the checkpoints use different LoRA ranks; evaluate them in separate calls")
    return ranks.pop() if ranks else (0, 0)


def evaluate(pipe, reward_fn, prompts, metadata, args, device, rank):
    """The base model's and each checkpoint's samples on the same prompts and noise, and their scores -> (names,
    columns uint8 [N, ...], reward outputs, {checkpoint: "ema" | "live"}, the sampling keywords)."""
    base = None  # a full fine-tune's checkpoints replace every weight: keep the base to restore between them
    if rank == 0 and args.checkpoints:
        base = {k: v.detach().clone() for k, v in models.named_parameters(models.trained_modules(pipe))}

    kw = dict(resolution=args.resolution, num_steps=args.eval_steps, guidance_scale=args.guidance_scale,
              seed=args.seed, batch_size=args.batch_size, device=device, shift=args.shift,
              num_frames=args.num_frames, max_sequence_length=args.max_sequence_length,
              source_images=[data.source_images(m) for m in metadata],  # edit models: what each prompt edits
              autocast=autocast(device, args.mixed_precision))
    names, columns, results, weights = ["base"], [], [], {}
    with models.reference(pipe) if rank else contextlib.nullcontext():
        columns.append(sample_images(pipe, prompts, **kw))
    results.append(reward_fn(columns[0], prompts, metadata))
    for ckpt in args.checkpoints:
        if base is not None:
            with torch.no_grad():
                for name, param in models.named_parameters(models.trained_modules(pipe)):
                    param.copy_(base[name])
        file = load_weights(pipe, ckpt, use_ema=args.ema)
        names.append(ckpt.rstrip("/"))
        weights[names[-1]] = "ema" if file == "ema.safetensors" else "live"
        columns.append(sample_images(pipe, prompts, **kw))
        results.append(reward_fn(columns[-1], prompts, metadata))

    return names, columns, results, weights, kw


def write_outputs(names, columns, results, weights, kw, prompts, metadata, args, device):
    """summary.json, the before / after grid (pages), the diversity panel and the bars in --out -> the summary."""
    os.makedirs(args.out, exist_ok=True)
    tables = [means_of(r, base=None if i == 0 else results[0]) for i, r in enumerate(results)]
    for table, images in zip(tables, columns):  # within each prompt's images: free colours, positions, features
        table.update(diversity.measure(images, prompts, metadata, device=device, **diversity.options(args)))
    labels = ["base"] + [f"{s} ({weights[n]})" for s, n in zip(short_names(names[1:]), names[1:])]
    print("\n".join(summary_table(labels, tables)))
    summary = {"prompts": args.prompts, "num_prompts": len(prompts), "eval_steps": args.eval_steps,
               "sampling": {key: getattr(args, key) for key in SAMPLING},
               "results": {name: table for name, table in zip(names, tables)}, "weights": weights}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    # Before / after: the same prompts and noise in every column; a readable selection unless --grid-all.
    tags = [m.get("tag", "") if isinstance(m, dict) else "" for m in metadata]
    rows = list(range(len(prompts))) if args.grid_all else select_rows(results, tags, args.grid_rows)
    captions = [verdicts(r) for r in results]
    if "geneval_overall" in tables[0]:
        heads = [f"{label}\naccuracy {t['geneval_overall']:.3f}" for label, t in zip(labels, tables)]
        key = f"under each sample: GenEval's verdict and the reward; accuracy: all {len(prompts)} prompts"
    else:
        heads = [f"{label}\nreward {t['reward']:+.4f}" for label, t in zip(labels, tables)]
        key = f"under each sample: its reward; under each name: the mean over all {len(prompts)} prompts"
    cells, captions = [c[rows] for c in columns], [[c[i] for i in rows] for c in captions]
    sources = [kw["source_images"][i] for i in rows]  # read once, for the sampling
    if columns[0].ndim == 4 and any(sources):  # an edit model: what each edit started from comes first
        cells, heads = [source_column(sources, columns[0].shape[1:3])] + cells, ["source"] + heads
        captions = [[(f"{len(s)} sources, the first" if len(s) > 1 else "", None) for s in sources]] + captions
    paths = save_compare_grid(args.out, cells, heads, [prompts[i] for i in rows],
                              [f"{tags[i]} #{i}".strip() for i in rows], captions, key=key, fps=args.fps)
    if columns[0].ndim == 4 and not any(kw["source_images"]) and (panel := diversity_groups(prompts, metadata)):
        # several images of one prompt (an edit model's repeats edit other sources: not one prompt's spread)
        paths.append(save_diversity_panel(os.path.join(args.out, "diversity.png"), panel, columns, results, tables,
                                          labels, prompts, tags))
    paths.append(save_bars(os.path.join(args.out, "bars.png"), labels, tables,
                           title=f"{args.prompts}: {len(prompts)} prompts, the same noise in every column"))
    print(f"wrote {os.path.join(args.out, 'summary.json')}, " + ", ".join(paths))
    return summary


def main(argv=None):
    p, args = parse_args(argv)
    args.model = args.model or trained_model(args.checkpoints) or "tiny"
    if not args.plot:
        fill_from_run(args)
    fill_from_preset(args)
    if problem := (families.guidance_mismatch(args.model, args.guidance_scale_2, args.audio_guidance_scale)
                   or families.frames_mismatch(args.model, args.num_frames)):  # before any model loads
        p.error(problem)
    if args.out is not None:  # a file where the results' folder goes: found now, not after the sampling
        existing = os.path.abspath(args.out)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            p.error(f"--out {args.out}: {existing} is a file; --out names the folder the results are written in: "
                    "pick a folder")
    if args.plot:
        return plot_runs(args.plot, out=os.path.join(args.out, "curves.png") if args.out else None)
    args.out = args.out or "runs/eval"

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        prompts, metadata = data.load_prompts(args.prompts, input_key=args.input_key, metadata_key=args.metadata_key,
                                              check=rewards.rows_check(args.reward, args.geneval_detector,
                                                                       model=args.model,
                                                                       sound=families.MODELS[args.model].sound))
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    prompts, metadata = prompts[:args.max_prompts], metadata[:args.max_prompts]
    check_output(args.out, OUTPUTS, "--out")  # now, not after the sampling
    rank, alpha = lora_shape(args.checkpoints)
    try:  # an unknown reward, a bad option or config, a model missing offline: one line naming the flag
        options = {k: getattr(args, k) for k in rewards.option_defaults()}  # the reward group's flags
        reward_fn = rewards.build_reward(args.reward, device=device, **options)
        reward_fn.build_rows(metadata)  # the rows' rm_type rewards too: a model missing offline fails now
        diversity.featurizer(args.diversity, args.diversity_path, device)
        pipe = models.load_pipeline(args.model, args.model_path, device=device)
        pipe.guidance_scale_2, pipe.guidance_scale_audio = args.guidance_scale_2, args.audio_guidance_scale
        batch = min(args.batch_size, len(prompts))  # the most samples one forward holds: the video token bound's
        pipe.forward_samples = families.forward_samples(args.model, [(batch, args.guidance_scale)],
                                                        args.audio_guidance_scale)
        models.latent_shape(pipe, args.resolution, num_frames=args.num_frames)  # a size the model cannot take
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        raise SystemExit(f"error: {e}")
    models.add_lora(pipe, rank, alpha)
    return write_outputs(*evaluate(pipe, reward_fn, prompts, metadata, args, device, rank), prompts, metadata, args,
                         device)


if __name__ == "__main__":
    main()
