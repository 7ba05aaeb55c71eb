"""Pretrain the `shapes-edit` model: conditional flow matching on rendered edit pairs of the shapes world.

    python scripts/pretrain_shapes_edit.py   # writes weights/shapes_edit.safetensors (2 CPU threads)
    python scripts/pretrain_shapes_edit.py --steps 200 --out /tmp/edit.safetensors  # a quick look

Each step draws a batch of edit tasks (shapes.edit_example: the four kinds equally often), renders their source and
target scenes, noises the target along the rectified-flow path and regresses the velocity given the instruction
and the source (SD3, Esser et al. 2024, eq. 1-3 with the rectified-flow choice; s from the logit-normal
distribution, m = 0, s = 1, Sec. 3.1): x_s = (1 - s) x0 + s eps, target eps - x0, on the packed target latent
alone. The source enters as Kontext's reference tokens, through models.encode_prompts(images=...) and
models.velocity, the calls the RL code samples with, so the reference handling cannot drift between pretraining
and RL. The transformer and both CLIP text encoders (all but their token tables, families.shapes.trained_state) train
jointly; the saved weights are an exponential moving average of the trained ones.

The run is a pure function of --seed and the thread count: rendering uses one NumPy generator, noise and
timesteps one torch generator, and torch runs on --threads threads.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # waiting threads sleep: same bits, less CPU on a shared machine

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import families  # noqa: E402
import flags  # noqa: E402
import models  # noqa: E402
import shapes  # noqa: E402


def batch(rng, size):
    """A batch of edit tasks: (instructions, per task its source [uint8 [H, W, 3]], targets float [B, 3, H, W] in
    [-1, 1])."""
    prompts, sources, targets = [], [], []
    for _ in range(size):
        row, source, target = shapes.edit_example(rng, size=shapes.RESOLUTION)
        prompts.append(row["prompt"])
        sources.append([source])
        targets.append(target)
    x = torch.from_numpy(np.stack(targets)).permute(0, 3, 1, 2).float() / 127.5 - 1  # [B, 3, H, W]
    return prompts, sources, x


def pack(pipe, images):
    """Images [B, 3, H, W] in [-1, 1] -> the packed latent the Kontext pipeline samples, [B, (H/4)(W/4), 48]."""
    z = pipe.vae.encode(images).latents  # [B, 12, H/2, W/2], space-to-depth
    return pipe._pack_latents(z, len(z), z.shape[1], z.shape[2], z.shape[3])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=flags.POSITIVE_INT, default=4000, help="optimizer steps")
    p.add_argument("--batch-size", type=flags.POSITIVE_INT, default=48, help="edit tasks per step")
    p.add_argument("--lr", type=flags.bounded(float, 0, 1, low_open=True), default=1e-3, help="peak Adam learning rate")
    p.add_argument("--warmup", type=flags.NONNEG_INT, default=200,
                   help="steps of linear learning-rate warm-up (0: none)")
    p.add_argument("--decay-fraction", type=flags.bounded(float, 0, 1), default=0.3,
                   help="final fraction of steps with linear decay to 0")
    p.add_argument("--ema", type=flags.bounded(float, 0, 1, high_open=True), default=0.999,
                   help="EMA decay of the saved weights")
    p.add_argument("--max-grad-norm", type=flags.POSITIVE, default=1.0, help="gradient clipping norm")
    p.add_argument("--seed", type=flags.SEED, default=0, help="seed of the initial weights, the tasks and the noise")
    p.add_argument("--threads", type=flags.POSITIVE_INT, default=2,
                   help="torch threads (the weights depend on it in the last bits)")
    p.add_argument("--out", default=shapes.EDIT_WEIGHTS, help="safetensors file written at the end")
    p.add_argument("--log-every", type=flags.POSITIVE_INT, default=100, help="steps between log lines")
    p.add_argument("--save-every", type=flags.NONNEG_INT, default=0,
                   help="steps between extra EMA snapshots <out>-<step>.safetensors (0: none)")
    args = p.parse_args(argv)
    if problem := flags.unwritable(args.out, "shapes_edit.safetensors"):  # refused now, not after the training
        p.error(f"--out {args.out} {problem}")

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    pipe = families.shapes.build_edit(seed=args.seed)
    params = families.shapes.trainable_parameters(pipe)  # transformer and text encoders; the token tables stay seeded
    opt = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.99))
    ema = [q.detach().clone() for q in params]
    print(f"shapes-edit pretraining: {sum(q.numel() for q in params) / 1e6:.2f} M parameters "
          f"(transformer {sum(q.numel() for q in pipe.transformer.parameters()) / 1e6:.2f} M), "
          f"{args.steps} steps x {args.batch_size} edits, {args.threads} threads", flush=True)

    def lr_at(step):
        decay_start = args.steps * (1 - args.decay_fraction)
        warm = min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0
        tail = 1.0 if step < decay_start else max(0.0, (args.steps - step) / (args.steps - decay_start))
        return args.lr * warm * tail

    start_wall, start_cpu, window = time.time(), time.process_time(), []
    for step in range(args.steps):
        prompts, sources, images = batch(rng, args.batch_size)
        x0 = pack(pipe, images)  # [B, 64, 48]
        s = torch.sigmoid(torch.randn(args.batch_size, generator=gen))  # logit-normal(0, 1), SD3 Sec. 3.1
        eps = torch.randn(x0.shape, generator=gen)
        x_s = (1 - s.view(-1, 1, 1)) * x0 + s.view(-1, 1, 1) * eps  # rectified-flow path, the target alone
        embeds = models.encode_prompts(pipe, prompts, images=sources, resolution=shapes.RESOLUTION)  # references
        embeds["prompt_embeds"], embeds["pooled"], _ = pipe.encode_prompt(  # the text again, with gradients
            prompts, prompt_2=None, device="cpu", max_sequence_length=models.default_tokens(pipe))
        v = models.velocity(pipe, x_s, s, embeds)
        loss = torch.nn.functional.mse_loss(v, eps - x0)  # velocity target eps - x0
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))  # EMA warm-up, as scripts/pretrain_shapes.py
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
