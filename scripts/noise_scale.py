"""How many samples a GRPO step needs on a model, reward and prompt set: the gradient noise scale.

    python scripts/noise_scale.py                                   # GRPO on train.py's default: the shapes world
    python scripts/noise_scale.py --batches 16 -- --reward jpeg_compressibility   # train.py flags after `--`

McCandlish et al. 2018 (An Empirical Model of Large-Batch Training, arXiv:1812.06162, Sec. 2.2 and
App. A.1): with G the expected gradient and Sigma the covariance of one sample's gradient, a step
on a batch of B samples has E|g_B|^2 = |G|^2 + tr(Sigma) / B, and the simple noise scale

    B_simple = tr(Sigma) / |G|^2                                                 (eq. 2.9)

is the batch size at which a step's noise equals its signal. A step on far fewer samples is mostly
noise, and so is a run made of such steps until its steps add up to about B_simple samples.

Estimated here from n independent batch gradients g_1 .. g_n of B samples each (train.py's rollout,
loss terms and --loss at ratio 1, each batch with its own prompts and noise): for i != j, E[g_i . g_j] = |G|^2,
so

    |G|^2   ~ mean over pairs i < j of g_i . g_j
    tr(Sigma) ~ B (mean_i |g_i|^2 - |G|^2)

and the signal share of one batch's squared gradient, |G|^2 / E|g_B|^2 = 1 / (1 + B_simple / B). GRPO's
samples of a group share their advantages' mean and std, so a "sample" is one sample of a group of the
run's size: B_simple is in samples at that group size. The estimate of |G|^2 is noisy (its standard error
is printed); when it is not clearly above zero, B_simple is reported as a lower bound.
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import losses  # noqa: E402
import models  # noqa: E402
import rewards  # noqa: E402
import sde  # noqa: E402
import train  # noqa: E402
from policy import Policy  # noqa: E402


def noise_scale(grads, batch_size):
    """grads: n >= 2 independent batch gradients (1-D tensors) of batch_size samples each ->
    {"G2": |G|^2 estimate, "G2_se": its standard error, "trace": tr(Sigma) estimate,
    "signal_share": |G|^2 / mean |g|^2, "b_simple": tr(Sigma) / |G|^2 (inf when |G|^2 <= 0)}."""
    if len(grads) < 2:
        raise ValueError(f"noise_scale needs at least 2 batch gradients, got {len(grads)}")
    g = torch.stack([x.double() for x in grads])  # [n, P]
    n = len(g)
    gram = g @ g.T
    g2 = gram[tuple(torch.triu_indices(n, n, offset=1))].mean().item()  # the pairs i < j
    # the pair products share factors; their standard error is taken from n / 2 disjoint pairs
    disjoint = torch.stack([gram[i, i + 1] for i in range(0, n - 1, 2)])
    g2_se = disjoint.std().item() / math.sqrt(len(disjoint)) if len(disjoint) > 1 else float("nan")
    sq = torch.diagonal(gram).mean().item()
    trace = batch_size * (sq - g2)
    return {"G2": g2, "G2_se": g2_se, "trace": trace, "signal_share": g2 / sq,
            "b_simple": trace / g2 if g2 > 0 else math.inf}


def batch_gradient(policy, loss, args, prompts, metadata, reward_fn, sigmas, gen):
    """The gradient of train.py's loss at ratio 1 (its trained steps, terms and loss function, one optimizer step's
    batch) on one freshly sampled batch: args.prompts_per_step prompts and all noise drawn from `gen`,
    args.group_size samples each. Returns (the flattened gradient of the transformer, the batch's mean reward)."""
    ids = torch.randperm(len(prompts), generator=gen)[:args.prompts_per_step].tolist()
    sample_ids, groups = data.rank_samples(ids, group_size=args.group_size, rank=0, world_size=1)
    texts, meta = [prompts[i] for i in sample_ids], [metadata[i] for i in sample_ids]
    sample_guidance, train_guidance = train.guidance_scales(args)
    embeds = models.encode_prompts(policy.pipe, texts, negative_prompt=args.negative_prompt,
                                   guidance_scale=max(sample_guidance, train_guidance),
                                   max_sequence_length=args.max_sequence_length)
    x = models.initial_noise(policy.pipe, len(texts), args.resolution, num_frames=args.num_frames, generator=gen)
    steps = sde.sde_steps(args.num_steps, **train.window_kwargs(args, 0))
    traj, images = models.generate(policy.pipe, x, sigmas, embeds, guidance_scale=sample_guidance, sde_steps=steps,
                                   kind=args.sde, eta=args.eta, generator=gen, flash=args.flash,
                                   flash_ratio=args.flash_ratio, autocast=policy.autocast)
    reward = torch.as_tensor(reward_fn(images, texts, meta)[args.reward_key]).float()
    adv = losses.group_advantages(reward, groups, global_std=args.global_std, clip=args.adv_clip)
    steps_taken = traj["steps"].expand(len(texts), -1)  # [n, K]
    batch = dict(traj, steps=steps_taken, host_steps=steps_taken.cpu())  # the host's copy: Wan 2.2 routes there
    rows = torch.arange(len(texts))
    policy.optimizer.zero_grad(set_to_none=True)
    for x_k, sigma, complete in train.reverse_terms(policy, batch, rows, embeds, adv, sigmas, args, rows):
        value, _ = loss.fn(complete(policy.velocity(x_k, sigma, embeds, train_guidance)), **loss.hyper(vars(args)))
        (value / len(steps)).backward()
    grad = torch.cat([q.grad.flatten() for _, q in policy.trainable if q.grad is not None])
    return grad, reward.mean().item()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=12, help="independent batch gradients (at least 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batches' prompts and noise")
    own = p.parse_args(argv[:cut])
    if own.batches < 2:
        p.error("--batches must be at least 2")
    train_argv = argv[cut + 1:]
    if not any(a == "--loss" or a.startswith("--loss=") for a in train_argv):  # a GRPO step, whatever train.py's default
        train_argv = ["--loss", "grpo", *train_argv]
    train_parser, args = train.parse_args(["--out", os.devnull, *train_argv])
    train.check_args(train_parser, args, 1)  # train.py's own refusals (--group-size 1, sizes that do not divide)
    loss = losses.LOSSES[args.loss]
    if loss.process != "reverse" or args.lora_rank:
        p.error(f"noise_scale measures full fine-tuning (--lora-rank 0) with a reverse-process loss "
                f"({', '.join(k for k, v in losses.LOSSES.items() if v.process == 'reverse')}): the gradient of every "
                "transformer weight at ratio 1")
    torch.manual_seed(args.seed)
    prompts, metadata = data.load_prompts(args.prompts, input_key=args.input_key, metadata_key=args.metadata_key)
    reward_fn = rewards.build_reward(args.reward, device="cpu",
                                     **{name: getattr(args, name) for name in rewards.option_defaults()})
    policy = Policy(args, torch.device("cpu"), old_copy=False)  # full fine-tuning: every transformer weight trains
    sigmas = models.sigmas(policy.pipe, args.num_steps, args.resolution, shift=args.shift)
    batch = args.prompts_per_step * args.group_size
    grads, means = [], []
    for b in range(own.batches):
        grad, mean = batch_gradient(policy, loss, args, prompts, metadata, reward_fn, sigmas, data.seeded(own.seed, b))
        grads.append(grad)
        means.append(mean)
    est = noise_scale(grads, batch)
    bound = est["G2"] - 2 * est["G2_se"] <= 0
    b_simple = est["trace"] / (est["G2"] + 2 * est["G2_se"]) if bound else est["b_simple"]
    print(f"{args.model}, reward {args.reward} ({args.reward_key}), --sde {args.sde} eta {args.eta}, "
          f"{args.num_steps} steps, {own.batches} batches of {args.prompts_per_step} prompts x {args.group_size}")
    print(f"mean reward {sum(means) / len(means):.4f} | |G|^2 {est['G2']:.3e} +- {est['G2_se']:.1e} | "
          f"tr(Sigma) {est['trace']:.3e} | signal share of one batch {est['signal_share']:.4f}")
    print(f"B_simple {'>' if bound else '~'} {b_simple:.0f} samples"
          + (" (|G|^2 is within two standard errors of 0: a lower bound)" if bound else ""))
    return est


if __name__ == "__main__":
    main()
