"""Pretrain the `shapes` model: conditional flow matching on rendered scenes of coloured shapes.

    python scripts/pretrain_shapes.py --replace-shipped  # reproduces weights/shapes.safetensors (2 CPU threads)
    python scripts/pretrain_shapes.py --steps 300 --out /tmp/shapes.safetensors  # a quick look

Each step renders a batch of scenes for captions drawn from GenEval's six templates over this world
(shapes.prompt_rows, all tags equally often, then a uniform prompt of the tag), noises them along
the rectified-flow path and regresses the velocity (SD3, Esser et al. 2024, eq. 1-3 with the
rectified-flow choice): x_s = (1 - s) x0 + s eps, target eps - x0, s from the logit-normal
distribution (SD3 Sec. 3.1, m = 0, s = 1). The transformer and both CLIP text encoders (all but
their token tables, see families.shapes.trained_state) train jointly; 10 % of captions are dropped to "" so
that classifier-free guidance works (Ho & Salimans 2022). The prediction goes through
models.velocity, the same call the RL code samples with, so the timestep convention (SD3 takes
t = 1000 s) cannot drift. The saved weights are an exponential moving average of the trained ones.

The run is a pure function of --seed and the thread count: rendering uses one NumPy generator,
noise and timesteps one torch generator, and torch runs on --threads threads (matmul reductions
split differently on another count, which changes the last bits of the weights).
"""
import argparse
import os
import sys
import time

# Waiting threads sleep instead of spinning: on a shared machine spinning burns about three times the
# CPU per step, and the results are bit-for-bit the same (they depend on the thread count only).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import families  # noqa: E402
import flags  # noqa: E402
import models  # noqa: E402
import shapes  # noqa: E402


def batch(rng, size, *, tags, dropout):
    """A batch of (captions, images float [B, 3, H, W] in [-1, 1]); dropped captions are ""."""
    rows = {tag: shapes.prompt_rows(tag) for tag in tags}
    captions, images = [], []
    for _ in range(size):
        tag = tags[rng.integers(len(tags))]
        row = rows[tag][rng.integers(len(rows[tag]))]
        images.append(shapes.render(row["metadata"], shapes.RESOLUTION, rng))
        captions.append("" if rng.random() < dropout else row["prompt"])
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1  # [B, 3, H, W]
    return captions, x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=flags.POSITIVE_INT, default=7000, help="optimizer steps")
    p.add_argument("--batch-size", type=flags.POSITIVE_INT, default=64, help="scenes per step")
    p.add_argument("--lr", type=flags.bounded(float, 0, 1, low_open=True), default=1e-3, help="peak Adam learning rate")
    p.add_argument("--warmup", type=flags.NONNEG_INT, default=200,
                   help="steps of linear learning-rate warm-up (0: none)")
    p.add_argument("--decay-fraction", type=flags.bounded(float, 0, 1), default=0.3,
                   help="final fraction of steps with linear decay to 0")
    p.add_argument("--ema", type=flags.bounded(float, 0, 1, high_open=True), default=0.999,
                   help="EMA decay of the saved weights")
    p.add_argument("--caption-dropout", type=flags.bounded(float, 0, 1), default=0.1,
                   help="fraction of captions replaced by '' (for CFG)")
    p.add_argument("--max-grad-norm", type=flags.POSITIVE, default=1.0, help="gradient clipping norm")
    p.add_argument("--seed", type=flags.SEED, default=0, help="seed of the initial weights, the scenes and the noise")
    p.add_argument("--threads", type=flags.POSITIVE_INT, default=2,
                   help="torch threads (the weights depend on it in the last bits)")
    p.add_argument("--out", default=shapes.WEIGHTS, help="safetensors file written at the end")
    p.add_argument("--replace-shipped", action="store_true",
                   help=f"allow --out to be the shipped {shapes.WEIGHTS}, the model every `python train.py` trains")
    p.add_argument("--log-every", type=flags.POSITIVE_INT, default=100, help="steps between log lines")
    p.add_argument("--save-every", type=flags.NONNEG_INT, default=0,
                   help="steps between extra EMA snapshots <out>-<step>.safetensors (0: none)")
    args = p.parse_args(argv)
    if problem := flags.unwritable(args.out, "shapes.safetensors"):  # refused now, not after the training
        p.error(f"--out {args.out} {problem}")
    shipped = {os.path.realpath(flags.shipped(shapes.WEIGHTS)), os.path.realpath(os.path.join(ROOT, shapes.WEIGHTS))}
    if os.path.realpath(args.out) in shipped and os.path.exists(args.out) and not args.replace_shipped:
        p.error(f"--out {args.out} is the shipped shapes model, which every `python train.py` trains from; write "
                "elsewhere (--out /tmp/shapes.safetensors), or add --replace-shipped to reproduce it")

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    pipe = families.shapes.build(seed=args.seed)
    params = families.shapes.trainable_parameters(pipe)  # transformer and text encoders; the token tables stay seeded
    opt = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.99))
    ema = [q.detach().clone() for q in params]
    print(f"shapes pretraining: {sum(q.numel() for q in params) / 1e6:.2f} M parameters "
          f"(transformer {sum(q.numel() for q in pipe.transformer.parameters()) / 1e6:.2f} M), "
          f"{args.steps} steps x {args.batch_size} scenes, {args.threads} threads", flush=True)

    def lr_at(step):
        decay_start = args.steps * (1 - args.decay_fraction)
        warm = min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0
        tail = 1.0 if step < decay_start else max(0.0, (args.steps - step) / (args.steps - decay_start))
        return args.lr * warm * tail

    start_wall, start_cpu, window = time.time(), time.process_time(), []
    for step in range(args.steps):
        captions, x0 = batch(rng, args.batch_size, tags=shapes.TAGS, dropout=args.caption_dropout)
        s = torch.sigmoid(torch.randn(args.batch_size, generator=gen))  # logit-normal(0, 1), SD3 Sec. 3.1
        eps = torch.randn(x0.shape, generator=gen)
        x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps  # rectified-flow path
        embeds, _, pooled, _ = pipe.encode_prompt(captions, prompt_2=None, prompt_3=None, device="cpu",
                                                  do_classifier_free_guidance=False, max_sequence_length=0)
        v = models.velocity(pipe, x_s, s, {"prompt_embeds": embeds, "pooled": pooled})
        loss = torch.nn.functional.mse_loss(v, eps - x0)  # velocity target eps - x0
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))  # EMA warm-up, as DiffusionNFT's eval EMA
        with torch.no_grad():
            for e, q in zip(ema, params):
                e.lerp_(q, 1 - decay)
        window.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            wall, cpu = time.time() - start_wall, time.process_time() - start_cpu
            print(f"step {step + 1:6d}  loss {np.mean(window):.4f}  lr {lr_at(step):.2e}  "
                  f"{wall / (step + 1):.3f} s/step wall  {cpu / (step + 1):.3f} s/step cpu  "
                  f"eta {(args.steps - step - 1) * wall / (step + 1) / 60:.1f} min", flush=True)
            window = []

        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            families.shapes.save_ema(pipe, params, ema, f"{os.path.splitext(args.out)[0]}-{step + 1}.safetensors")

    families.shapes.save_ema(pipe, params, ema, args.out)
    wall, cpu = time.time() - start_wall, time.process_time() - start_cpu
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB) after {wall / 60:.1f} min wall, "
          f"{cpu / 60:.1f} min cpu", flush=True)


if __name__ == "__main__":
    main()
