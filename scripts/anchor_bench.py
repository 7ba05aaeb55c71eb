"""flow_grpo's own step timed on our pipeline: the anchor that scripts/bench.py's figures are compared with.

Launch
------
    scripts/fetch_flow_grpo.sh PATH        # flow_grpo's files into third_party/flow_grpo/ (ignored, never committed)
    python scripts/anchor_bench.py --model tiny --threads 1 -- --num-steps 4          # CPU, train.py's tiny preset
    python scripts/anchor_bench.py --model sd3-random @recipes/sd3_bench.args --json anchor.json \
        --compare sd3_bench.json -- --prompts-per-step 2 --group-size 8 --sample-batch-size 8 --train-batch-size 8
    python scripts/anchor_bench.py --model tiny --impl sde                 # our sde.py in the same loop: no flow_grpo
    python scripts/anchor_bench.py --model tiny --check-logprob -- --mixed-precision no   # its log-probs against ours

The flags are scripts/bench.py's (--model, --steps, --warmup, --reward, --repeats, --peak-tflops, --threads, --json,
train.py's flags after `--` or in @recipe files), so scripts/gpu_bench.sh runs both with one set; then this script's:
--impl, --flow-grpo, --compare and --check-logprob.

What runs
---------
The pipeline is ours, built by policy.Policy from train.py's flags: models.load_pipeline, the frozen base in the
--mixed-precision dtype, a float32 LoRA of --lora-rank on the family's targets (flow_grpo's list). The prompts are
train.py's (data.step_prompt_ids, the same at each step), and so are the resolution, steps, CFG, noise level,
group size, batch sizes, timestep fraction, clip range, KL beta, learning rate and reward. On it, each step runs
flow_grpo's scripts/train_sd3.py, its functions imported from third_party/flow_grpo (commit in its COMMIT file; the
line numbers, of train_sd3.py unless another file is named, are those of ac4c86e8), the rest mirrored line by line:

  SAMPLING    per rollout batch its encode_prompt (L621-627) and pipeline_with_logprob (L637-660), an SDE step with
              log-prob at every one of the --num-steps steps, then the VAE decode
  REWARDS     the bench's reward on the images (L684-696; flow_grpo waits for them before the advantages as well)
  ADVANTAGES  its PerPromptStatTracker (L738-789: one std over the batch with --global-std)
  TRAINING    shuffled and rebatched (L827-841); per batch and trained step j < int(T x --timestep-fraction), the CFG
              forward with its sde_step_with_logprob (compute_log_prob, L180-215), the reference forward with the
              adapter off (L875-878), the clipped ratio loss and the KL (L881-897) and the backward; every
              batches / --minibatches batches, clip_grad_norm_ and an AdamW step (L932-939; accelerate divides the
              loss by the batches x steps it accumulates over, L357-361). With a --timestep-fraction that reaches
              the last step flow_grpo trains it too, ours never (sde.sde_steps): the FLOP ratio shows it

Figures, as bench.py's and with its code (its Recorder hook, count_flops, time_bare): samples/s end to end and per
phase (medians over the measured steps), the FLOPs of the step from every transformer call and VAE decode counted on
one sample of each kind, MFU against --peak-tflops (on a GPU the H200's 989 by default), the bare compute (each kind of
call replayed --repeats times after the run) and the overhead ratio, the peak memory, and |ratio - 1| on the updates
before each step's first optimizer step (on-policy: 0 up to rounding). --compare adds ours over flow_grpo's.

--impl sde puts our sampler behind flow_grpo's four functions (sde.rollout through models.generate, sde.sde_step,
models.encode_prompts, advantages.group_advantages): the same loop, so the plumbing runs and is tested without the
fetched code; its rollout keeps train.py's deterministic last step. --check-logprob scores the transitions of one
rollout of --impl with sde.sde_step and models.velocity on the same inputs and reports the largest difference of the
log-probs (and of the transition means, and of the prompt embeddings with models.encode_prompts). flow_grpo's rollout
feeds each step the state cast to the prompt embeddings' dtype (sd3_pipeline_with_logprob.py L171-172) but keeps the
float32 one, which its training step scores: the first is compared, and the difference at the second (bf16 rounding
of the states, which moves its first update off ratio 1) is reported beside it.

Shims: where flow_grpo's code meets our pipeline (its functions run unchanged)
-----
  1. A pipeline without T5 (`tiny`, models.py departure 1): encode_prompt reads a T5 slot that is a one-token zero
     stand-in, dropped after the call, so the transformer sees the 77 CLIP tokens, as ours does.
  2. The KL reference: train_sd3.py switches peft's PeftModel adapter off (`transformer.module.disable_adapter()`,
     L877); our adapter is diffusers' (add_adapter), switched off by models.reference(pipe).
  3. Autocast: accelerate wraps the prepared transformer's forward in torch.autocast (accelerator.prepare, L559, with
     --mixed-precision); here its calls run inside torch.autocast, so bench.py's hook sees and replays it alike.
  4. The frozen base is in the --mixed-precision dtype (Policy; ours), where train_sd3.py keeps it float32 under
     autocast (L415): the same pipeline for both, as the comparison asks.
diffusers 0.42 needed none (flow_grpo pins 0.33.1): StableDiffusion3Pipeline's check_inputs, encode_prompt (with the
embeddings given), prepare_latents and retrieve_timesteps, and the scheduler's index_for_timestep and sigmas (on the
device), take flow_grpo's calls as they are. Left out: the EMA (the bench recipe has none), the filter of samples whose
advantages are all 0 (L796-817; continuous rewards give none), the statistics it logs (L901-930), wandb and the
evaluation.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import advantages  # noqa: E402
import bench  # noqa: E402  scripts/bench.py: the call recorder, the FLOP counter and the bare timing
import data  # noqa: E402
import distributed  # noqa: E402
import models  # noqa: E402
import rewards  # noqa: E402
import sde  # noqa: E402
import train  # noqa: E402
from policy import Policy  # noqa: E402

FLOW_GRPO = os.path.join(ROOT, "third_party", "flow_grpo")
IMPLS = ("flow_grpo", "sde")
SHIMS = ("1 no-T5 pipelines: a one-token zero T5 stand-in in encode_prompt, its token dropped",
         "2 KL reference: models.reference(pipe) for peft's disable_adapter() (train_sd3.py L877)",
         "3 autocast around the transformer calls, for accelerate's wrapped forward (L559)",
         "4 the frozen base in the --mixed-precision dtype (ours) where train_sd3.py keeps it float32 (L415)")


def parse_args(argv=None):
    """This script's flags, then bench.py's (and through them train.py's), checked against what flow_grpo runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                epilog="the other flags are scripts/bench.py's; train.py flags after `--`")
    p.add_argument("--impl", choices=IMPLS, default="flow_grpo",
                   help="flow_grpo: its functions from --flow-grpo; sde: ours behind the same four signatures")
    p.add_argument("--flow-grpo", default=FLOW_GRPO, help="the folder scripts/fetch_flow_grpo.sh wrote")
    p.add_argument("--compare", default=None, help="scripts/bench.py's JSON of the same flags: ours / flow_grpo")
    p.add_argument("--check-logprob", action="store_true",
                   help="also score one rollout of --impl with sde.py and report the largest log-prob difference")
    own, rest = p.parse_known_args(argv[:split])
    args = bench.parse_args(rest + argv[split:])
    if args.windows or args.losses or args.rewards or args.out:
        p.error("--windows, --losses, --rewards and --out are bench.py's own runs; the anchor times one step: "
                "drop them")
    if own.compare and not os.path.isfile(own.compare):
        p.error(f"--compare {own.compare}: no such file; run scripts/bench.py --json {own.compare} with the same flags")
    vars(args).update(vars(own))
    p_train, targs = train.parse_args(args.train_args + ["--model", args.model, "--reward", args.reward,
                                                         "--steps", str(args.warmup + args.steps)])
    train.check_args(p_train, targs, 1)
    refused = {  # what train_sd3.py does not do, and would not be timed like for like
        "--loss grpo": targs.loss != "grpo", "--sde flow": targs.sde != "flow",
        "--sde-window all": targs.sde_window != "all", "no --flash": targs.flash, "no --compile": targs.compile,
        "no --fsdp": targs.fsdp, "no --gradient-checkpointing": targs.gradient_checkpointing,
        "--mixed-precision bf16 or no": targs.mixed_precision == "fp16",
        "--kl-reference base": targs.kl_reference != "base",
        "no --same-noise-per-group": targs.same_noise_per_group, "--updates-per-batch 1": targs.updates_per_batch != 1,
    }
    wrong = [k for k, bad in refused.items() if bad]
    if wrong:
        p.error(f"flow_grpo's train_sd3.py runs with {', '.join(wrong)}: change those train.py flags")
    return args, targs


# ----------------------------------------------------------------------------- the two implementations
def load_flow_grpo(folder):
    """flow_grpo's functions from the folder scripts/fetch_flow_grpo.sh wrote (imported, not copied here)."""
    commit_file = os.path.join(folder, "COMMIT")
    if not os.path.isfile(commit_file):
        raise SystemExit(f"error: {folder} holds no flow_grpo files: run scripts/fetch_flow_grpo.sh PATH (a flow_grpo "
                         "checkout), or pass --impl sde")
    sys.path.insert(0, os.path.abspath(folder))
    from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
    from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob
    from flow_grpo.diffusers_patch.train_dreambooth_lora_sd3 import encode_prompt
    from flow_grpo.stat_tracking import PerPromptStatTracker
    with open(commit_file) as f:
        commit = f.read().strip()

    def encode(pipe, prompts, tokens):
        """train_sd3.py's compute_text_embeddings (L123-130) with its encode_prompt; shim 1 without T5."""
        encoders = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
        tokenizers = [pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3]
        ids = None
        if pipe.text_encoder_3 is None:  # shim 1
            encoders[2] = NoT5(pipe.transformer.config.joint_attention_dim, pipe.text_encoder.dtype)
            ids = [None, None, torch.zeros(len(prompts), 1, dtype=torch.long)]
        with torch.no_grad():
            embeds, pooled = encode_prompt(encoders, tokenizers, prompts, tokens, text_input_ids_list=ids)
        if ids is not None:
            embeds = embeds[:, :-1]  # the stand-in's token
        device = pipe._execution_device
        return embeds.to(device), pooled.to(device)

    return types.SimpleNamespace(name="flow_grpo", commit=commit, encode=encode,
                                 pipeline_with_logprob=pipeline_with_logprob,
                                 sde_step_with_logprob=sde_step_with_logprob, PerPromptStatTracker=PerPromptStatTracker,
                                 trained=lambda num_steps, fraction: int(num_steps * fraction))  # L345


class NoT5(torch.nn.Module):
    """Shim 1: the T5 slot of a pipeline without T5, one zero token of the transformer's joint width."""

    def __init__(self, width, dtype):
        super().__init__()
        self.width, self._dtype = width, dtype

    @property
    def dtype(self):
        return self._dtype

    @property
    def device(self):
        return torch.device("cpu")

    def forward(self, ids):
        return (torch.zeros(ids.shape[0], ids.shape[1], self.width, dtype=self._dtype, device=ids.device),)


def sde_impl():
    """Ours behind flow_grpo's signatures: the same loop around sde.py, models.py and advantages.py."""

    def encode(pipe, prompts, tokens):
        e = models.encode_prompts(pipe, prompts, max_sequence_length=tokens)
        return e["prompt_embeds"], e["pooled"]

    def pipeline_with_logprob(pipe, *, prompt_embeds, pooled_prompt_embeds, negative_prompt_embeds,
                              negative_pooled_prompt_embeds, num_inference_steps, guidance_scale, height, width,
                              noise_level, output_type="pt"):
        pipe.scheduler.set_timesteps(num_inference_steps, device=pipe._execution_device)  # the step reads them (L658)
        sigmas = models.sigmas(pipe, num_inference_steps, (height, width))
        embeds = dict(prompt_embeds=prompt_embeds, pooled=pooled_prompt_embeds,
                      neg_prompt_embeds=negative_prompt_embeds, neg_pooled=negative_pooled_prompt_embeds)
        x = models.initial_noise(pipe, len(prompt_embeds), (height, width)).to(pipe._execution_device)
        traj, images = models.generate(pipe, x, sigmas, embeds, guidance_scale=guidance_scale,
                                       sde_steps=range(num_inference_steps - 1), kind="flow", eta=noise_level)
        images = images.permute(0, 3, 1, 2).float() / 255  # output_type "pt": [B, 3, H, W] in [0, 1]
        return images, list(traj["latents"].unbind(1)), list(traj["log_probs"].unbind(1))

    def sde_step_with_logprob(scheduler, model_output, timestep, sample, noise_level=0.7, prev_sample=None):
        i = (scheduler.timesteps[None] == timestep[:, None].to(scheduler.timesteps)).float().argmax(1)  # [B]
        sigma, sigma_next = scheduler.sigmas[i], scheduler.sigmas[i + 1]
        out = sde.sde_step(model_output, sample, sigma, sigma_next, kind="flow", eta=noise_level,
                           prev_sample=prev_sample, sigma_max=scheduler.sigmas[1].item())
        std_dev_t = (out.std / (sigma - sigma_next).sqrt()).view(-1, 1, 1, 1)  # flow_grpo returns sde.py's (3)
        return out.prev_sample, out.log_prob, out.mean, std_dev_t

    class GroupAdvantages:
        """PerPromptStatTracker's update / clear by advantages.group_advantages (no clip: the loss clips, L881)."""

        def __init__(self, global_std):
            self.global_std = global_std

        def update(self, prompts, rewards):  # rewards [N, K], equal along K (L740)
            ids = [sorted(set(prompts)).index(q) for q in prompts]
            adv = advantages.group_advantages(torch.as_tensor(rewards[:, 0], dtype=torch.float64), ids,
                                              global_std=self.global_std, clip=math.inf)
            return adv[:, None].expand(-1, rewards.shape[1]).numpy()

        def clear(self):
            pass

    return types.SimpleNamespace(name="sde", commit=None, encode=encode, pipeline_with_logprob=pipeline_with_logprob,
                                 sde_step_with_logprob=sde_step_with_logprob, PerPromptStatTracker=GroupAdvantages,
                                 trained=lambda num_steps, fraction: len(sde.sde_steps(num_steps,
                                                                                       timestep_fraction=fraction)))


# ----------------------------------------------------------------------------- flow_grpo's step
def compute_log_prob(impl, pipe, sample, j, embeds, pooled_embeds, targs):
    """train_sd3.py's compute_log_prob (L180-215): the CFG forward at step j, then its SDE step scoring next_latents."""
    if targs.train_cfg:
        noise_pred = pipe.transformer(
            hidden_states=torch.cat([sample["latents"][:, j]] * 2),
            timestep=torch.cat([sample["timesteps"][:, j]] * 2),
            encoder_hidden_states=embeds, pooled_projections=pooled_embeds, return_dict=False)[0]  # L182-188
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred_uncond = noise_pred_uncond.detach()  # L190: no gradient through the unconditional half
        noise_pred = noise_pred_uncond + targs.guidance_scale * (noise_pred_text - noise_pred_uncond)  # L191-195
    else:
        noise_pred = pipe.transformer(
            hidden_states=sample["latents"][:, j], timestep=sample["timesteps"][:, j],
            encoder_hidden_states=embeds, pooled_projections=pooled_embeds, return_dict=False)[0]  # L197-203
    return impl.sde_step_with_logprob(pipe.scheduler, noise_pred.float(), sample["timesteps"][:, j],
                                      sample["latents"][:, j].float(), prev_sample=sample["next_latents"][:, j].float(),
                                      noise_level=targs.eta)  # L206-213


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Anchor:
    """The pipeline, the trained parameters, flow_grpo's optimizer and the per-step state of the loop."""

    def __init__(self, impl, policy, targs, reward_fn, texts):
        self.impl, self.policy, self.pipe, self.targs = impl, policy, policy.pipe, targs
        self.device, self.reward_fn, self.texts = policy.device, reward_fn, texts
        self.params = [q for _, q in policy.trainable]
        self.optimizer = torch.optim.AdamW(self.params, lr=targs.lr, betas=(0.9, 0.999),
                                           weight_decay=targs.weight_decay, eps=1e-8)  # L465-471, its config/base.py
        self.tokens = targs.max_sequence_length or models.default_tokens(self.pipe)  # 128 on SD3.5: L625
        self.num_train_timesteps = impl.trained(targs.num_steps, targs.timestep_fraction)  # L345; ours never the last
        self.autocast = policy.autocast  # shim 3
        neg, neg_pooled = impl.encode(self.pipe, [""], self.tokens)  # L540
        self.neg = {size: (neg.repeat(size, 1, 1), neg_pooled.repeat(size, 1))  # L542-545
                    for size in (targs.sample_batch_size, targs.train_batch_size)}
        self.pipe.set_progress_bar_config(disable=True)
        self.first_ratio_dev = []  # per step: max |ratio - 1| before its first optimizer step

    def sample(self, step):
        """SAMPLING: this step's prompts (train.py's), a rollout batch at a time -> (samples, images, prompts)."""
        targs, pipe = self.targs, self.pipe
        ids = data.step_prompt_ids(len(self.texts), step, prompts_per_step=targs.prompts_per_step, seed=targs.seed,
                                   shuffle=not targs.no_shuffle)
        ids, _ = data.rank_samples(ids, group_size=targs.group_size, rank=0, world_size=1)
        prompts = [self.texts[i] for i in ids]
        size, samples, images = targs.sample_batch_size, [], []
        pipe.transformer.eval()  # L609
        for b in range(len(prompts) // size):
            batch = prompts[b * size:(b + 1) * size]
            embeds, pooled = self.impl.encode(pipe, batch, self.tokens)  # L621-627
            neg, neg_pooled = self.neg[size]
            with self.autocast(), torch.no_grad():  # L637-638
                image, latents, log_probs = self.impl.pipeline_with_logprob(
                    pipe, prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=neg,
                    negative_pooled_prompt_embeds=neg_pooled, num_inference_steps=targs.num_steps,
                    guidance_scale=targs.guidance_scale, output_type="pt", height=targs.resolution,
                    width=targs.resolution, noise_level=targs.eta)  # L639-651
            latents = torch.stack(latents, dim=1)  # [b, T + 1, C, h, w] (L653-655)
            log_probs = torch.stack(log_probs, dim=1)  # [b, T] (L656)
            timesteps = pipe.scheduler.timesteps.repeat(len(batch), 1)  # [b, T] (L658-660)
            samples.append(dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, timesteps=timesteps,
                                latents=latents[:, :-1], next_latents=latents[:, 1:], log_probs=log_probs))  # L667-681
            images.append((image.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu())
        samples = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}  # [n, ...] (L699-707)
        return samples, torch.cat(images), prompts

    def advantages(self, scores, prompts):
        """ADVANTAGES: per prompt, one std over the batch with --global-std (L738-789) -> [n, K]."""
        rewards = scores.double().cpu().unsqueeze(1).repeat(1, self.num_train_timesteps)  # [n, K] (L740)
        if self.targs.group_size > 1:  # L547-551, L755-761
            tracker = self.impl.PerPromptStatTracker(self.targs.global_std)
            adv = torch.as_tensor(tracker.update(prompts, rewards.numpy()))
            tracker.clear()  # L780
        else:
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # L782
        return adv.to(self.device)  # [n, K] (L785-789)

    def train(self, samples, adv):
        """TRAINING: flow_grpo's loss over the trained steps of shuffled batches, an optimizer step per accumulation."""
        targs, pipe, device = self.targs, self.pipe, self.device
        samples = dict(samples, advantages=adv)
        total = len(adv)
        batches = total // targs.train_batch_size
        accumulate = batches // targs.minibatches  # flow_grpo's gradient_accumulation_steps
        scale = accumulate * self.num_train_timesteps  # accelerate divides each loss by it (L360)
        perm = torch.randperm(total, device=device)  # L829-830
        samples = {k: v[perm] for k, v in samples.items()}
        batched = [{k: v[i * targs.train_batch_size:(i + 1) * targs.train_batch_size] for k, v in samples.items()}
                   for i in range(batches)]  # L833-841
        pipe.transformer.train()  # L844
        dev, stepped = torch.zeros((), device=device), False
        for i, sample in enumerate(batched):
            n = len(sample["prompt_embeds"])
            neg, neg_pooled = self.neg[targs.train_batch_size]
            if targs.train_cfg:  # L852-859
                embeds = torch.cat([neg[:n], sample["prompt_embeds"]])
                pooled_embeds = torch.cat([neg_pooled[:n], sample["pooled_prompt_embeds"]])
            else:
                embeds, pooled_embeds = sample["prompt_embeds"], sample["pooled_prompt_embeds"]  # L861-862
            for j in range(self.num_train_timesteps):  # L864-871
                with self.autocast():  # L873
                    _, log_prob, prev_sample_mean, std_dev_t = compute_log_prob(
                        self.impl, pipe, sample, j, embeds, pooled_embeds, targs)  # L874
                    if targs.kl_beta > 0:  # L875-878
                        with torch.no_grad(), models.reference(pipe):  # shim 2
                            _, _, prev_sample_mean_ref, _ = compute_log_prob(
                                self.impl, pipe, sample, j, embeds, pooled_embeds, targs)
                advantages = torch.clamp(sample["advantages"][:, j], -targs.adv_clip, targs.adv_clip)  # L881-885
                ratio = torch.exp(log_prob - sample["log_probs"][:, j])  # L886
                unclipped_loss = -advantages * ratio  # L887
                clipped_loss = -advantages * torch.clamp(ratio, 1.0 - targs.clip_range, 1.0 + targs.clip_range)
                policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))  # L888-893
                if targs.kl_beta > 0:  # L894-897
                    kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) \
                        / (2 * std_dev_t ** 2)
                    loss = policy_loss + targs.kl_beta * torch.mean(kl_loss)
                else:
                    loss = policy_loss
                if not stepped:  # on-policy until the first optimizer step
                    dev = torch.maximum(dev, (ratio.detach() - 1).abs().max())  # read once, after the loop
                (loss / scale).backward()  # accelerator.backward (L933)
            if (i + 1) % accumulate == 0:  # accelerator.sync_gradients (L934-939)
                torch.nn.utils.clip_grad_norm_(self.params, targs.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad()
                stepped = True
        self.first_ratio_dev.append(dev.item())

    def step(self, step):
        """One step; -> its seconds: total and per phase."""
        sync(self.device)
        t0 = time.perf_counter()
        samples, images, prompts = self.sample(step)
        sync(self.device)
        t1 = time.perf_counter()
        scores = self.reward_fn(images, prompts, [{}] * len(prompts))[self.targs.reward_key]  # [n]
        t2 = time.perf_counter()
        adv = self.advantages(torch.as_tensor(scores, dtype=torch.float64), prompts)
        self.train(samples, adv)
        sync(self.device)
        t3 = time.perf_counter()
        return dict(step=step + 1, seconds=t3 - t0, seconds_sampling=t1 - t0, seconds_reward=t2 - t1,
                    seconds_training=t3 - t2)


# ----------------------------------------------------------------------------- checks and figures
def logprob_agreement(anchor):
    """One rollout batch of the implementation, its transitions scored by sde.sde_step with models.velocity on the
    same inputs: the largest |difference| of the log-probs, of the means, and of the prompt embeddings."""
    targs, pipe, impl = anchor.targs, anchor.pipe, anchor.impl
    size = targs.sample_batch_size
    prompts = anchor.texts[:size]
    embeds, pooled = impl.encode(pipe, prompts, anchor.tokens)
    ours = models.encode_prompts(pipe, prompts, max_sequence_length=anchor.tokens)
    neg, neg_pooled = anchor.neg[size]
    pipe.transformer.eval()
    torch.manual_seed(targs.seed)
    with anchor.autocast(), torch.no_grad():
        _, latents, log_probs = impl.pipeline_with_logprob(
            pipe, prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=neg,
            negative_pooled_prompt_embeds=neg_pooled, num_inference_steps=targs.num_steps,
            guidance_scale=targs.guidance_scale, output_type="pt", height=targs.resolution, width=targs.resolution,
            noise_level=targs.eta)
        sigmas = models.sigmas(pipe, targs.num_steps, targs.resolution)  # [T + 1]
        e = dict(prompt_embeds=embeds, pooled=pooled, neg_prompt_embeds=neg, neg_pooled=neg_pooled)
        lp, stored, mean = 0.0, 0.0, 0.0
        for k, log_prob in enumerate(log_probs):  # flow_grpo: all T steps; sde: the T - 1 before the last
            x_next, diffs = latents[k + 1].float(), []
            # the state its step took, cast back to the first latent's dtype (the prompt embeddings'; its
            # sd3_pipeline_with_logprob.py L171-172), then the float32 one the list keeps, which its training scores
            # (train_sd3.py L673-678)
            for x in (latents[k].to(latents[0].dtype).float(), latents[k].float()):
                v = models.velocity(pipe, x, sigmas[k].item(), e, guidance_scale=targs.guidance_scale)
                out = sde.sde_step(v, x, sigmas[k].item(), sigmas[k + 1].item(), kind="flow", eta=targs.eta,
                                   prev_sample=x_next, sigma_max=sigmas[1].item())
                diffs.append((out.log_prob - log_prob.float()).abs().max().item())
            lp, stored = max(lp, diffs[0]), max(stored, diffs[1])
            t = pipe.scheduler.timesteps[k].expand(len(x))
            theirs = impl.sde_step_with_logprob(pipe.scheduler, v.float(), t, x, prev_sample=x_next,
                                                noise_level=targs.eta)
            mean = max(mean, (out.mean - theirs[2]).abs().max().item())
    schedule = (pipe.scheduler.sigmas.cpu() - sigmas).abs().max().item()
    return dict(logprob_max_abs_diff=lp, logprob_stored_max_abs_diff=stored, mean_max_abs_diff=mean,
                logprob_steps=len(log_probs),
                logprob_scale=max(p.abs().max().item() for p in log_probs), schedule_max_abs_diff=schedule,
                embeds_max_abs_diff=(embeds.float() - ours["prompt_embeds"].float()).abs().max().item(),
                pooled_max_abs_diff=(pooled.float() - ours["pooled"].float()).abs().max().item())


def record_decodes(recorder, vae):
    """Count every VAE decode of the run in `recorder` (flow_grpo decodes through pipe.vae, not models.decode)."""
    decode = vae.decode

    def counted(z, *a, **k):
        if recorder.handle is not None:  # not while count_flops and time_bare replay (models.decode comes here too)
            recorder.count("decode", (z,))
        return decode(z, *a, **k)
    vae.decode = counted


def run(args, targs):
    device = distributed.init()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(targs.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    impl = load_flow_grpo(args.flow_grpo) if args.impl == "flow_grpo" else sde_impl()
    (texts, _), _ = train.load_prompt_sets(targs)
    reward_fn = rewards.build_reward(args.reward, device=device,
                                     **{name: getattr(targs, name) for name in rewards.option_defaults()})
    policy = Policy(targs, device, old_copy=False)
    from diffusers import StableDiffusion3Pipeline
    if not isinstance(policy.pipe, StableDiffusion3Pipeline):
        raise SystemExit(f"error: flow_grpo's train_sd3.py runs a StableDiffusion3Pipeline and --model {args.model} is "
                         f"a {type(policy.pipe).__name__}: use sd3, sd3-random or tiny")
    anchor = Anchor(impl, policy, targs, reward_fn, texts)
    agreement = logprob_agreement(anchor) if args.check_logprob else {}

    recorder = bench.Recorder()  # counts the calls as bench.py does, so both sides' FLOPs come from one counter
    recorder.pipe = anchor.pipe
    recorder.handle = anchor.pipe.transformer.register_forward_pre_hook(recorder.transformer_hook, with_kwargs=True)
    record_decodes(recorder, anchor.pipe.vae)
    total = args.warmup + args.steps
    rows = []
    t = time.time()
    for step in range(total):
        rows.append(anchor.step(step))
        print(f"step {step + 1:5d} | {rows[-1]['seconds']:.2f}s (sampling {rows[-1]['seconds_sampling']:.2f}, "
              f"training {rows[-1]['seconds_training']:.2f}) | first |ratio - 1| {anchor.first_ratio_dev[-1]:.2e}",
              flush=True)
    wall = time.time() - t
    recorder.handle.remove()
    recorder.handle = None
    peak_mib, peak_reserved_mib = bench.peak_memory_mib(device)
    measured = rows[args.warmup:]

    per_step = {sig: entry["count"] / total for sig, entry in recorder.calls.items()}
    flops = bench.count_flops(anchor.pipe, recorder.calls, models)
    bare = bench.time_bare(anchor.pipe, recorder.calls, args.repeats, models)  # after the run: one timing
    flops_step = sum(per_step[s] * flops[s] for s in flops)
    phase_of = {sig: entry["phase"] for sig, entry in recorder.calls.items()}
    pure = {kinds: sum(per_step[s] * bare[s] for s in bare if phase_of[s] in kinds) or math.nan
            for kinds in (("rollout", "decode"), ("train", "reference"))}
    samples = targs.prompts_per_step * targs.group_size
    median = lambda key: statistics.median(r[key] for r in measured)  # noqa: E731
    step_s = median("seconds")
    result = dict(
        impl=impl.name, flow_grpo_commit=impl.commit, shims=list(SHIMS) if impl.name == "flow_grpo" else [],
        model=args.model, device=torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        end_to_end_samples_per_s=samples / step_s, rollout_samples_per_s=samples / median("seconds_sampling"),
        train_samples_per_s=samples / median("seconds_training"),
        seconds=step_s, seconds_sampling=median("seconds_sampling"), seconds_reward=median("seconds_reward"),
        seconds_training=median("seconds_training"), seconds_per_step=[r["seconds"] for r in measured],
        pure_seconds=sum(pure.values()), pure_rollout_seconds=pure[("rollout", "decode")],
        pure_train_seconds=pure[("train", "reference")], overhead_ratio=step_s / sum(pure.values()),
        first_ratio_dev=max(anchor.first_ratio_dev), peak_mem_mib=peak_mib, peak_reserved_mib=peak_reserved_mib,
        tflop_per_step=flops_step / 1e12, achieved_tflops=flops_step / step_s / 1e12,
        calls=[dict(phase=phase_of[s], per_step=per_step[s], seconds=bare[s], tflop=flops[s] / 1e12,
                    autocast=str(recorder.calls[s]["autocast"]), shapes={name: list(shape) for name, shape, _ in s[1]})
               for s in recorder.calls],
        samples_per_step=samples, measured_steps=len(measured), warmup_steps=args.warmup, wall_seconds=wall,
        num_train_timesteps=anchor.num_train_timesteps, train_argv=args.train_args, torch=torch.__version__,
        reward=args.reward, **agreement)
    peak = args.peak_tflops if args.peak_tflops is not None else (989.0 if device.type == "cuda" else None)
    if peak:
        result.update(peak_tflops=peak, mfu=flops_step / step_s / (peak * 1e12))
    if args.compare:
        with open(args.compare) as f:
            result["vs_ours"] = compare(json.load(f), result)
    return result


def compare(ours, anchor):
    """Ours over flow_grpo's: samples/s end to end and per phase, MFU, and the FLOPs of a step (1: the same work)."""
    keys = ["end_to_end_samples_per_s", "rollout_samples_per_s", "train_samples_per_s", "tflop_per_step"]
    keys += ["mfu"] if "mfu" in ours and "mfu" in anchor else []
    return {k: ours[k] / anchor[k] for k in keys}


def report(r):
    commit = " " + r["flow_grpo_commit"][:8] if r["flow_grpo_commit"] else ""
    mfu = f" | MFU {100 * r['mfu']:.1f} % of {r['peak_tflops']:g}" if "mfu" in r else ""
    lines = [
        f"anchor ({r['impl']}{commit}) {r['model']} on {r['device']} | {r['samples_per_step']} samples/step | median "
        f"of {r['measured_steps']} steps after {r['warmup_steps']} warm-up",
        f"  end-to-end {r['end_to_end_samples_per_s']:.3f} samples/s ({r['seconds']:.2f} s/step)",
        f"  rollout    {r['rollout_samples_per_s']:.3f} samples/s ({r['seconds_sampling']:.2f} s; pure "
        f"{r['pure_rollout_seconds']:.2f} s)",
        f"  update     {r['train_samples_per_s']:.3f} samples/s ({r['seconds_training']:.2f} s; pure "
        f"{r['pure_train_seconds']:.2f} s); reward {r['seconds_reward']:.2f} s",
        f"  overhead ratio {r['overhead_ratio']:.3f} | first-update |ratio - 1| {r['first_ratio_dev']:.2e} | "
        f"peak memory {r['peak_mem_mib']:.0f} MiB allocated, {r['peak_reserved_mib']:.0f} MiB reserved | "
        f"{r['tflop_per_step']:.4f} TFLOP/step, {r['achieved_tflops']:.4f} TFLOP/s{mfu}",
    ]
    for c in r["calls"]:
        shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in c["shapes"].items())
        amp = "" if c["autocast"] == "None" else " " + c["autocast"].replace("torch.", "")
        lines.append(f"    {c['phase']:9s} {c['per_step']:6.1f}/step x {1e3 * c['seconds']:8.2f} ms  {c['tflop']:.4f} "
                     f"TFLOP{amp}  [{shapes}]")
    if "logprob_max_abs_diff" in r:
        lines.append(f"  log-probs against sde.py on the same transitions ({r['logprob_steps']} steps, |log-prob| "
                     f"up to {r['logprob_scale']:.3g}): max |diff| {r['logprob_max_abs_diff']:.2e}, at the stored "
                     f"float32 states {r['logprob_stored_max_abs_diff']:.2e}; means {r['mean_max_abs_diff']:.2e}; "
                     f"schedule {r['schedule_max_abs_diff']:.2e}; prompt embeddings {r['embeds_max_abs_diff']:.2e}, "
                     f"pooled {r['pooled_max_abs_diff']:.2e}")
    if "vs_ours" in r:
        lines.append("  ours / anchor: " + ", ".join(f"{k} {v:.3f}x" for k, v in r["vs_ours"].items()))
    print("\n".join(lines), flush=True)


def main(argv=None):
    args, targs = parse_args(argv)
    result = run(args, targs)
    report(result)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    bad = [k for k in ("end_to_end_samples_per_s", "tflop_per_step")
           if not (math.isfinite(result[k]) and result[k] > 0)]
    if bad:
        raise SystemExit(f"error: non-finite or non-positive figures {bad}; see the table above")
    return result


if __name__ == "__main__":
    main()
