"""Evaluate checkpoints with deterministic (ODE) sampling, and plot a run's curves.

    python eval.py --model tiny --prompts prompts/tiny.txt --reward jpeg_compressibility \
        --checkpoints runs/default/checkpoints/60 --out runs/default/eval
    python eval.py --plot runs/default                      # reward and loss curves -> runs/default/curves.png
    python eval.py --model sd3 --prompts prompts/geneval_test.jsonl --input-key prompt --max-prompts 553 \
        --reward geneval --resolution 512 --guidance-scale 4.5 --checkpoints ...   # GenEval per tag and overall

Every prompt gets the same initial noise in every column (seeded by --seed and the prompt's index), so
the columns of the grid and of the table differ only by the weights. The base model is always the
first column. `--ema` evaluates a checkpoint's EMA weights when it has them.
"""
import argparse
import contextlib
import json
import os

import torch

import data
import geneval
import models
import rewards
import sde


def seeded_noise(pipe, n, resolution, seed):
    """Noise for prompts 0..n-1, each from its own generator: independent of batch size and order."""
    return torch.cat([models.initial_noise(pipe, 1, resolution, generator=torch.Generator().manual_seed(seed * 1_000_003 + i))
                      for i in range(n)])


@torch.no_grad()
def sample_images(pipe, prompts, *, resolution, num_steps, guidance_scale, seed=0, batch_size=8,
                  negative_prompt="", shift=3.0, device="cpu"):
    """ODE samples of `prompts` -> uint8 [N, H, W, 3]."""
    sigmas = sde.sd3_sigmas(num_steps, shift=shift)
    noise = seeded_noise(pipe, len(prompts), resolution, seed)
    out = []
    for i in range(0, len(prompts), batch_size):
        embeds = models.encode_prompts(pipe, prompts[i:i + batch_size], negative_prompt=negative_prompt,
                                       guidance_scale=guidance_scale)
        traj = sde.rollout(lambda x, s: models.velocity(pipe, x, s, embeds, guidance_scale=guidance_scale),
                           noise[i:i + batch_size].to(device), sigmas, sde_steps=[], kind="ode")
        out.append(models.decode(pipe, traj["latents"][:, -1]))
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
    """Copy a train.py checkpoint's trained weights (or their EMA) into a pipeline prepared with the same LoRA rank."""
    from safetensors.torch import load_file
    name = "ema.safetensors" if use_ema and os.path.isfile(os.path.join(path, "ema.safetensors")) else "trainable.safetensors"
    weights = load_file(os.path.join(path, name))
    params = dict(pipe.transformer.named_parameters())
    missing = [k for k in weights if k not in params]
    if missing:
        raise SystemExit(f"error: {path} does not match this model ({len(missing)} unknown tensors, e.g. {missing[0]}); "
                         "evaluate it with the --model it was trained with")
    with torch.no_grad():
        for k, t in weights.items():
            params[k].copy_(t)


def save_grid(path, columns, names, prompts, tables):
    """Rows = prompts, columns = checkpoints; a header with each column's name."""
    from PIL import Image, ImageDraw
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


def plot_run(run_dir, out=None):
    """Reward and loss curves of a run's metrics.jsonl -> PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} not found: --plot takes a run folder written by train.py --out")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    rows = [r for r in rows if not r.get("skipped")]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].plot(steps, [r["reward_mean"] for r in rows], label="reward_mean")
    for key in sorted({k for r in rows for k in r if k.startswith("reward/")}):
        axes[0].plot(steps, [r.get(key, float("nan")) for r in rows], label=key, alpha=0.7)
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=7)
    axes[1].plot(steps, [r.get("loss", float("nan")) for r in rows], label="loss")
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--plot", metavar="RUN_DIR", help="only plot the curves of a run folder")
    p.add_argument("--model", default="tiny", choices=list(models.MODELS))
    p.add_argument("--model-path", default=None, help="hub id or local folder of the base pipeline")
    p.add_argument("--checkpoints", nargs="*", default=[], help="train.py checkpoint folders (<run>/checkpoints/<step>)")
    p.add_argument("--ema", action="store_true", help="use the checkpoints' EMA weights where saved")
    p.add_argument("--prompts", default="prompts/tiny.txt", help="held-out prompts (.txt or .jsonl)")
    p.add_argument("--input-key", default="input", help="JSONL key of the prompt (GenEval files: prompt)")
    p.add_argument("--metadata-key", default="metadata", help="JSONL key of the metadata; '' takes the whole row")
    p.add_argument("--max-prompts", type=int, default=16, help="first N prompts of the file")
    p.add_argument("--reward", default="jpeg_compressibility", help="reward spec, as train.py --reward")
    p.add_argument("--resolution", type=int, default=64, help="image side in pixels")
    p.add_argument("--eval-steps", type=int, default=40, help="ODE steps")
    p.add_argument("--guidance-scale", type=float, default=1.0, help="CFG scale")
    p.add_argument("--batch-size", type=int, default=8, help="images per forward")
    p.add_argument("--seed", type=int, default=0, help="noise seed (per prompt)")
    p.add_argument("--out", default="runs/eval", help="folder for summary.json and grid.png")
    geneval.add_arguments(p)
    args = p.parse_args(argv)
    if args.plot:
        return plot_run(args.plot)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prompts, metadata = data.load_prompts(args.prompts, input_key=args.input_key, metadata_key=args.metadata_key)
    prompts, metadata = prompts[:args.max_prompts], metadata[:args.max_prompts]
    reward_fn = rewards.build_reward(args.reward, device=device, **{k: getattr(args, k) for k in geneval.options()})
    pipe = models.load_pipeline(args.model, args.model_path, device=device)
    ranks = set()
    for ckpt in args.checkpoints:
        state_path = os.path.join(ckpt, "state.json")
        if not os.path.isfile(state_path):
            raise SystemExit(f"error: {ckpt} is not a complete checkpoint (no state.json); pass <run>/checkpoints/<step>")
        state = json.load(open(state_path))
        ranks.add((state["lora_rank"], state.get("lora_alpha", state["lora_rank"])))
    if len(ranks) > 1:
        raise SystemExit("error: the checkpoints use different LoRA ranks; evaluate them in separate calls")
    rank, alpha = ranks.pop() if ranks else (0, 0)
    models.add_lora(pipe, rank, alpha)
    base = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()} if rank == 0 and args.checkpoints else None

    kw = dict(resolution=args.resolution, num_steps=args.eval_steps, guidance_scale=args.guidance_scale,
              seed=args.seed, batch_size=args.batch_size, device=device)
    names, columns, tables = ["base"], [], []
    with models.reference(pipe) if rank else contextlib.nullcontext():
        columns.append(sample_images(pipe, prompts, **kw))
    tables.append(score(reward_fn, columns[0], prompts, metadata))
    for ckpt in args.checkpoints:
        if base is not None:
            pipe.transformer.load_state_dict(base)
        load_weights(pipe, ckpt, use_ema=args.ema)
        names.append(ckpt.rstrip("/"))
        columns.append(sample_images(pipe, prompts, **kw))
        tables.append(score(reward_fn, columns[-1], prompts, metadata))

    os.makedirs(args.out, exist_ok=True)
    keys = sorted({k for t in tables for k in t})
    print(f"{'checkpoint':<40}" + "".join(f"{k:>24}" for k in keys))
    for name, table in zip(names, tables):
        print(f"{name[-40:]:<40}" + "".join(f"{table.get(k, float('nan')):>24.5f}" for k in keys))
    summary = {"prompts": args.prompts, "num_prompts": len(prompts), "eval_steps": args.eval_steps,
               "results": {name: table for name, table in zip(names, tables)}}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    save_grid(os.path.join(args.out, "grid.png"), columns, names, prompts, tables)
    print(f"wrote {args.out}/summary.json and {args.out}/grid.png")
    return summary


if __name__ == "__main__":
    main()
