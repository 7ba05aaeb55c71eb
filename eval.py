"""Evaluate checkpoints with deterministic (ODE) sampling, and plot a run's curves.

    python eval.py --model tiny --prompts prompts/tiny.txt --reward jpeg_compressibility \
        --checkpoints runs/default/checkpoints/60 --out runs/default/eval
    python eval.py --plot runs/default                      # reward and loss curves -> runs/default/curves.png
    python eval.py --model sd3 --prompts prompts/geneval_test.jsonl --input-key prompt --max-prompts 553 \
        --reward geneval --resolution 512 --guidance-scale 4.5 --checkpoints ...   # GenEval per tag and overall

Every prompt gets the same initial noise in every column (seeded by --seed and the prompt's index), so
the columns of the grid and of the table differ only by the weights. The base model is always the
first column. A checkpoint with EMA weights is scored by its EMA, as train.py's --eval-every and as Flow-GRPO
evaluates; `--no-ema` scores its live weights instead.
"""
import argparse
import contextlib
import json
import math
import os

import torch

import checkpoints
import data
import geneval
import models
import rewards


def seeded_noise(pipe, n, resolution, seed, num_frames=None):
    """Noise for prompts 0..n-1, each from its own generator (seed, index): independent of batch size and order."""
    return torch.cat([models.initial_noise(pipe, 1, resolution, num_frames=num_frames, generator=data.seeded(seed, i))
                      for i in range(n)])


def sample_images(pipe, prompts, *, resolution, num_steps, guidance_scale, seed=0, batch_size=8,
                  negative_prompt="", shift=None, num_frames=None, max_sequence_length=None, device="cpu"):
    """ODE samples of `prompts` on the model's own schedule (models.sigmas) -> uint8 [N, H, W, 3]
    (videos [N, F, H, W, 3])."""
    sigmas = models.sigmas(pipe, num_steps, resolution, shift=shift)
    noise = seeded_noise(pipe, len(prompts), resolution, seed, num_frames)
    out = []
    for i in range(0, len(prompts), batch_size):
        embeds = models.encode_prompts(pipe, prompts[i:i + batch_size], negative_prompt=negative_prompt,
                                       guidance_scale=guidance_scale, max_sequence_length=max_sequence_length)
        out.append(models.generate(pipe, noise[i:i + batch_size].to(device), sigmas, embeds,
                                   guidance_scale=guidance_scale, solver="euler")[1])
    return torch.cat(out)


def score(reward_fn, images, prompts, metadata):
    """Mean of every reward entry (nan-aware: rm_type overrides leave other components NaN).

    GenEval: the geneval_<tag> means are the per-tag accuracies; geneval_overall is their mean
    (the official number) and geneval_mean_over_images the mean of geneval_correct.
    """
    result = reward_fn(images, prompts, metadata)
    means = {k: torch.nanmean(v.float()).item() for k, v in result.items() if k != "failed"}
    if "geneval_correct" in result:
        overall = geneval.summary_of_scores(result)
        means.update(geneval_overall=overall["overall"], geneval_mean_over_images=overall["mean_over_images"])
    return means


def load_weights(pipe, path, *, use_ema=False):
    """Copy a train.py checkpoint's trained weights (use_ema: their EMA, where it has one) into a pipeline prepared
    with the same LoRA rank (models.add_lora; a full fine-tune's checkpoint holds every weight). -> the file read."""
    return checkpoints.load_weights(path, dict(pipe.transformer.named_parameters()), use_ema=use_ema, complete=False)


def save_grid(path, columns, names, prompts, tables):
    """Rows = prompts, columns = checkpoints; a header with each column's name. Videos show their first frame."""
    from PIL import Image, ImageDraw
    columns = [c[:, 0] if c.ndim == 5 else c for c in columns]  # [N, F, H, W, 3] -> [N, H, W, 3]
    n, h, w = columns[0].shape[:3]
    head, side = 16, 160
    grid = Image.new("RGB", (side + w * len(columns), head + h * n), "white")
    draw = ImageDraw.Draw(grid)
    for c, (imgs, name) in enumerate(zip(columns, names)):
        draw.text((side + c * w + 2, 2), f"{name[-18:]}", fill="black")
        for r in range(n):
            grid.paste(Image.fromarray(imgs[r].numpy()), (side + c * w, head + r * h))
    for r, prompt in enumerate(prompts):
        draw.text((2, head + r * h + 2), prompt[:24], fill="black")
    grid.save(path)


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


def save_sample_grid(path, images, captions, n=8, fps=16):
    """Up to n training samples with their captions (train.py's samples/): images as one PNG row;
    videos [N, F, H, W, 3] as one animated GIF per caption's first line, the prompt (<path stem>_<k>.gif,
    that prompt's samples side by side, at fps frames per second). Returns the paths written."""
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
    return paths


def summary_line(scores):
    """One readable line of `score`'s means: for GenEval the official overall accuracy with the per-tag ones,
    then the trained reward; otherwise every entry."""
    if "geneval_overall" not in scores:
        return " | ".join(f"{k} {v:+.4f}" for k, v in scores.items())
    tags = ", ".join(f"{tag} {scores[f'geneval_{tag}']:.2f}" for tag in geneval.TAGS
                     if math.isfinite(scores.get(f"geneval_{tag}", float("nan"))))
    return f"accuracy {scores['geneval_overall']:.3f} ({tags}) | reward {scores['reward']:+.4f}"


def append_scores(path, step, scores):
    """One line of eval.jsonl: the step and the mean of every reward entry."""
    with open(path, "a") as f:
        f.write(checkpoints.json_line({"step": step, **scores}))


def plot_run(run_dir, out=None):
    """Reward and loss curves of a run's metrics.jsonl -> PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} not found: --plot takes a run folder written by train.py --out")
    rows, torn = checkpoints.read_jsonl(path)
    if torn:
        print(f"warning: {path}: skipped {torn} line(s) that are not JSON (a run killed mid-write)")
    rows = [r for r in rows if isinstance(r, dict) and not r.get("skipped") and "reward_mean" in r]
    if not rows:
        raise SystemExit(f"error: {path} has no completed step to plot yet")
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    def series(key):  # null (a NaN when written) and absent both plot as gaps
        return [float("nan") if r.get(key) is None else r[key] for r in rows]
    axes[0].plot(steps, series("reward_mean"), label="reward_mean")
    for key in sorted({k for r in rows for k in r if k.startswith("reward/")}):
        axes[0].plot(steps, series(key), label=key, alpha=0.7)
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=7)
    axes[1].plot(steps, series("loss"), label="loss")
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--plot", metavar="RUN_DIR", help="only plot the curves of a run folder")
    p.add_argument("--model", default="tiny", choices=list(models.MODELS))
    p.add_argument("--model-path", default=None, help="hub id or local folder of the base pipeline")
    p.add_argument("--checkpoints", nargs="*", default=[],
                   help="train.py checkpoint folders (<run>/checkpoints/<step>)")
    p.add_argument("--ema", action=argparse.BooleanOptionalAction, default=True,
                   help="score a checkpoint's EMA weights where it has them (as train.py evaluates and exports)")
    p.add_argument("--prompts", default="prompts/tiny.txt", help="held-out prompts (.txt or .jsonl)")
    p.add_argument("--input-key", default="input", help="JSONL key of the prompt (GenEval files: prompt)")
    p.add_argument("--metadata-key", default="metadata", help="JSONL key of the metadata; '' takes the whole row")
    p.add_argument("--max-prompts", type=int, default=16, help="first N prompts of the file")
    p.add_argument("--reward", default="jpeg_compressibility", help="reward spec, as train.py --reward")
    p.add_argument("--resolution", type=int, default=64, help="image side in pixels")
    p.add_argument("--num-frames", type=int, default=None, help="video models (wan): frames per sample")
    p.add_argument("--shift", type=float, default=None, help="static schedule shift (default: the model's own)")
    p.add_argument("--max-sequence-length", type=int, default=None, help="text tokens (default: the family's)")
    p.add_argument("--eval-steps", type=int, default=40, help="ODE steps")
    p.add_argument("--guidance-scale", type=float, default=1.0, help="CFG scale")
    p.add_argument("--batch-size", type=int, default=8, help="images per forward")
    p.add_argument("--seed", type=int, default=0, help="noise seed (per prompt)")
    p.add_argument("--out", default="runs/eval", help="folder for summary.json and grid.png")
    rewards.add_arguments(p)
    args = p.parse_args(argv)
    if args.plot:
        return plot_run(args.plot)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        prompts, metadata = data.load_prompts(args.prompts, input_key=args.input_key, metadata_key=args.metadata_key,
                                              check=rewards.rows_check(args.reward, args.geneval_detector))
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    prompts, metadata = prompts[:args.max_prompts], metadata[:args.max_prompts]
    ranks = set()  # the checkpoints are checked before any model loads
    for ckpt in args.checkpoints:
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
    rank, alpha = ranks.pop() if ranks else (0, 0)
    try:  # an unknown reward, a bad option or config, a model missing offline: one line naming the flag
        options = {k: getattr(args, k) for k in rewards.option_defaults()}  # the reward group's flags
        reward_fn = rewards.build_reward(args.reward, device=device, **options)
        pipe = models.load_pipeline(args.model, args.model_path, device=device)
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        raise SystemExit(f"error: {e}")
    models.add_lora(pipe, rank, alpha)
    base = None  # a full fine-tune's checkpoints replace every weight: keep the base to restore between them
    if rank == 0 and args.checkpoints:
        base = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}

    kw = dict(resolution=args.resolution, num_steps=args.eval_steps, guidance_scale=args.guidance_scale,
              seed=args.seed, batch_size=args.batch_size, device=device, shift=args.shift,
              num_frames=args.num_frames, max_sequence_length=args.max_sequence_length)
    names, columns, tables, weights = ["base"], [], [], {}
    with models.reference(pipe) if rank else contextlib.nullcontext():
        columns.append(sample_images(pipe, prompts, **kw))
    tables.append(score(reward_fn, columns[0], prompts, metadata))
    for ckpt in args.checkpoints:
        if base is not None:
            pipe.transformer.load_state_dict(base)
        file = load_weights(pipe, ckpt, use_ema=args.ema)
        names.append(ckpt.rstrip("/"))
        weights[names[-1]] = "ema" if file == "ema.safetensors" else "live"
        columns.append(sample_images(pipe, prompts, **kw))
        tables.append(score(reward_fn, columns[-1], prompts, metadata))

    os.makedirs(args.out, exist_ok=True)
    keys = sorted({k for t in tables for k in t})
    print(f"{'checkpoint':<40}" + "".join(f"{k:>24}" for k in keys))
    for name, table in zip(names, tables):
        print(f"{name[-40:]:<40}" + "".join(f"{table.get(k, float('nan')):>24.5f}" for k in keys))
    summary = {"prompts": args.prompts, "num_prompts": len(prompts), "eval_steps": args.eval_steps,
               "results": {name: table for name, table in zip(names, tables)}, "weights": weights}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    save_grid(os.path.join(args.out, "grid.png"), columns, names, prompts, tables)
    print(f"wrote {args.out}/summary.json and {args.out}/grid.png")
    return summary


if __name__ == "__main__":
    main()
