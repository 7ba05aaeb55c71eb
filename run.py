"""The life of a training run around the algorithm: its folder, resume, rewards awaited, logs, checkpoints, signals.

    run = Run(args, device, on_step=None)   before any model loads: --out checked and locked, the checkpoint to resume
                                    found; on_step(info) is called after each step's line (bench.py times there)
    run.start(policy, held_out, reward_fn)   resume (weights, Adam, copies, RNG, counters) or start; args.json; wandb
    run.lap(), run.lap(phase)       the step's clock: start it, or book the seconds since the last mark to a phase
    run.carry                       {name: JSON value}: the algorithm's state carried from step to step (GARDO's gate
                                    share, its reference's last reset), saved in state.json and resumed with the run
    run.submit(reward_fn, images, prompts, metadata) -> a future: scored in the background while sampling goes on
    run.wait_for_rewards(pending, step) -> Rewards(scores, dropped, skip)
    run.signalled(), run.stop_in_sampling(step), run.stop_in_training(step, snapshot)   a preemption, in each phase
    run.log(step, info, batch, got) metrics.jsonl (and wandb), the step line, the sample grid, the held-out
                                    evaluation (eval.jsonl) when due; skipped steps too
    run.checkpoint_or_stop(step)    save when due or signalled; True ends the run. Stops in one line after
                                    --max-bad-steps skipped steps, or 3 in a row whose gradient was not finite
                                    (nonfinite_stop: their likely cause, the checkpoint of the last finite update)
    run.finish()

A SIGTERM / SIGINT (preemption) stops every rank within seconds, saves the last complete step and exits 0: in the
sampling phase at the next rollout batch, in the wait for rewards at once, in the training phase before the next
forward (the weights back at the step's start). --resume auto then redoes the step exactly. Before the first step
(from train.py's imports on, then from Run's first line while the folder is prepared and the models load) a signal
stops the run in one line, exit 1 (set_up_stop): nothing has trained, nothing is saved. One line per step on rank 0,
with a live bar on a terminal.
"""
import copy
import hashlib
import json
import math
import os
import pickle
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

import checkpoints
import data
import distributed
import diversity
import eval as evaluation
import flags
import models
import rewards
from distributed import RANK, is_main, print0


class Rewards(NamedTuple):
    """The outcome of a step's reward wait: `scores` {name: [per_rank]}, the same names on every rank; `dropped`
    [prompts_per_step] bool, the groups with a sample whose reward service gave up (--reward-on-error skip); `skip` a
    reason to skip the update, or None. (A signal during the wait ends the process there, the last complete step
    saved.)"""
    scores: dict = None
    dropped: torch.Tensor = None
    skip: str = None


def add_arguments(parser):
    """The run's flags: its folder, resume, checkpoints, logs and held-out evaluation; None means the preset."""
    g = parser.add_argument_group("run")
    g.add_argument("--out", default="runs/default", help="run folder: args.json, metrics.jsonl, samples/, checkpoints/")
    g.add_argument("--save-every", type=flags.NONNEG_INT, default=0,
                   help="steps between checkpoints (0: only at the end)")
    g.add_argument("--keep-checkpoints", type=flags.POSITIVE_INT, default=3,
                   help="checkpoints kept in --out/checkpoints")
    g.add_argument("--overwrite", action="store_true",
                   help="start a fresh run in an --out that already holds one, deleting its run files first")
    g.add_argument("--resume", default=None,
                   help="checkpoint folder, run folder, or 'auto' (the newest checkpoint in --out that verifies, if "
                        "any; default: a fresh run). A checkpoint of --out with a later one is refused (the run would "
                        "branch); one of another run folder forks it into a new, empty --out")
    g.add_argument("--eval-every", type=flags.NONNEG_INT, default=None,
                   help="steps between ODE evaluations on --eval-prompts (0: off)")
    g.add_argument("--eval-steps", type=flags.POSITIVE_INT, default=None, help="ODE steps of an evaluation")
    g.add_argument("--eval-guidance-scale", type=flags.POSITIVE, default=None,
                   help="CFG scale of an evaluation (default: --guidance-scale): e.g. rollouts guided at 3 and the "
                        "trained model judged unguided, at 1")
    g.add_argument("--eval-samples-per-prompt", type=flags.POSITIVE_INT, default=None,
                   help="images per held-out prompt, each from its own fixed noise (copy c of prompt j takes noise "
                        "index c N + j, so the first copy is the one-image evaluation): a smaller standard error at "
                        "proportional cost")
    g.add_argument("--log-images-every", type=flags.NONNEG_INT, default=None,
                   help="steps between saved sample grids (0: never)")
    g.add_argument("--max-bad-steps", type=flags.POSITIVE_INT, default=5,
                   help="stop after this many consecutive skipped steps (a non-finite reward or gradient); "
                        "non-finite gradients stop the run after 3 in a row, or this many if fewer, with the checkpoint "
                        "of the last finite update")
    g.add_argument("--fps", type=flags.POSITIVE_INT, default=16,
                   help="video models: frames per second of the saved sample GIFs")
    g.add_argument("--log-to", action="append", default=[], choices=["wandb", "tensorboard"],
                   help="also log the step metrics, the held-out evaluation and the sample grids to Weights & Biases "
                        "or TensorBoard (<out>/tensorboard); repeat for both")
    g.add_argument("--wandb", action="store_true", help="the same as --log-to wandb")
    return g


def setup_or_exit(fn, *a, **k):
    """Run a set-up call; its errors (a missing model offline, an unknown reward, a bad config) become one line."""
    try:
        return fn(*a, **k)
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        raise SystemExit(f"error: {e}")


class Run:
    def __init__(self, args, device, on_step=None):
        """Before any model loads: refuse a used or unwritable --out, find the checkpoint to resume (all ranks agree).
        on_step(info) is called after each step's line, its timings logged (bench.py measures between steps)."""
        self.args, self.device, self.on_step = args, device, on_step
        # First: a signal while the folder is prepared and the models load stops the run in one line, not in a
        # KeyboardInterrupt traceback from inside a library (nothing has trained yet). The signal is also kept, so that
        # start() stops the run even where a library swallowed the exit; start() takes both signals over for the
        # steps, finish() gives back the handlers from before these.
        self.signal = None
        self.handlers = {signum: signal.signal(signum, self._interrupted_in_set_up)
                         for signum in (signal.SIGINT, signal.SIGTERM)}
        if is_main:
            check_loggers(args)  # before prepare: --overwrite must not delete a run that then fails to log
        self.resume_from, self.stale = checkpoints.prepare(self.recorded)  # verified, or None; the old run's files
        self.step = self.bad_in_a_row = self.trained = 0  # trained: steps of this process that updated the weights
        self.nonfinite_in_a_row = 0  # consecutive steps whose gradient was not finite (nonfinite_stop)
        self.carry = {}  # train.py's state across steps (JSON values), checkpointed
        self.policy, self.wandb, self.tensorboard, self.ratio_warned = None, None, None, False
        self.pool = ThreadPoolExecutor(max_workers=1)  # scores batch b while batch b + 1 is sampled
        self.bar, self.marks, self.last_skip = None, {}, None

    def _interrupted_in_set_up(self, signum, frame):
        self.signal = signal.Signals(signum).name
        raise SystemExit(set_up_stop(self.signal))

    @property
    def recorded(self):
        """The settings as written (args.json, each checkpoint's state.json) and compared on resume: URLs without their
        user:password (rewards.redacted)."""
        shown = copy.copy(self.args)
        vars(shown).update(rewards.redacted(vars(self.args)))
        return shown

    def lap(self, phase=None):
        """The step's clock: lap() starts it, lap(phase) books the seconds since the last mark to that phase."""
        now = time.time()
        if phase is None:
            self.marks = {"start": now, "last": now}
            self.carry_at_start = copy.deepcopy(self.carry)  # what a stop in the step's training phase saves
        else:
            self.marks[phase], self.marks["last"] = now - self.marks["last"], now

    def start(self, policy, held_out, reward_fn):
        """Resume the policy from the checkpoint found (and the run's counters), or start fresh: write args.json and
        evaluate the model before training on held_out (texts, metadata), as Flow-GRPO evaluates at epoch 0.
        Returns False when a resumed run has nothing left to do."""
        self.policy, self.held_out, self.reward_fn, args = policy, held_out, reward_fn, self.args
        if self.signal is not None:  # a set-up signal whose exit a library caught (a bare except, a __del__)
            raise SystemExit(set_up_stop(self.signal))
        if self.resume_from:
            state = policy.resume(self.resume_from, self.recorded)
            self.step, self.bad_in_a_row = state["step"], state.get("bad_in_a_row", 0)
            self.nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
            self.carry = state.get("carry", {})
            print0(f"resumed from {self.resume_from} at step {self.step}")
            if self.step >= args.steps:
                print0(f"the run is already at step {self.step} of --steps {args.steps}: nothing to train; "
                       "raise --steps to continue it")
                return False
        self.first_step = self.step
        checkpoints.start_run(self.recorded, self.stale)
        fork = self.resume_from and checkpoints.fork_source(self.resume_from, args.out)
        if fork:  # a new --out
            print0(f"forked {fork} at step {self.step} into {args.out}: its files start at step {self.step + 1} "
                   f"(the steps up to {self.step} are in {fork})")
        elif self.resume_from:
            checkpoints.trim_metrics(args.out, self.step)  # a killed run's rows after the checkpoint are redone
        if is_main and (args.wandb or "wandb" in args.log_to):
            import wandb  # optional, heavy: only when asked for
            self.wandb = wandb.init(config=rewards.redacted(vars(args)), dir=args.out, resume="allow")
        if is_main and "tensorboard" in args.log_to:
            from torch.utils.tensorboard import SummaryWriter  # optional: only when asked for
            self.tensorboard = SummaryWriter(os.path.join(args.out, "tensorboard"), purge_step=self.step + 1)
        handlers = {signum: signal.signal(signum, lambda n, frame: setattr(self, "signal", signal.Signals(n).name))
                    for signum in (signal.SIGTERM, signal.SIGINT)}  # preemption: stop within seconds, save, exit 0
        self.handlers = {**handlers, **self.handlers}  # to give back: those from before __init__'s
        self.early_grad_norms = []  # the first 10 logged steps' (warn_divergence)
        # A live bar on rank 0's terminal; none in log files, where the per-step lines already say everything.
        self.bar = tqdm(total=args.steps, initial=self.step, disable=not (is_main and sys.stderr.isatty()),
                        dynamic_ncols=True)
        if args.eval_every and self.step % args.eval_every == 0 and not fork and self.step not in self.evaluated():
            self.evaluate(self.step)  # before training; or a resumed step whose evaluation a stop cut short
        return True

    def evaluated(self):
        """The steps eval.jsonl holds (rank 0's view, shared: every rank must take part in an evaluation or none)."""
        path = os.path.join(self.args.out, "eval.jsonl")
        steps = {row["step"] for row in checkpoints.read_jsonl(path)[0]} if is_main else None
        return distributed.broadcast(steps)

    def submit(self, reward_fn, images, prompts, metadata):
        """Score a rollout batch in the background (departure 5): the next batch is sampled meanwhile."""
        return self.pool.submit(reward_fn, images, prompts, metadata)

    # ------------------------------------------------------------------------- REWARDS
    def wait_for_rewards(self, pending, step):
        """Wait for this rank's reward batches (pending: [(future, the batch's prompts)]) -> Rewards.

        A NaN / inf reward skips the step on every rank; a reward service that failed after its retries
        (--reward-on-error raise) stops every rank with one line naming the service, the step and the prompts;
        when every group lost a sample to a failed service the step is skipped. A SIGTERM / SIGINT during the
        wait saves the last complete step and exits 0 on every rank at once."""
        args, device = self.args, self.device
        self.lap("sampling")
        scores, failed, skip, fatal, interrupted, names = {}, None, None, None, False, []
        try:
            results = []
            for b, (future, prompts) in enumerate(pending):
                result = self._result(future, b, prompts, step)
                if result is None:
                    raise InterruptedError
                results.append(result)
            failed = torch.cat([r.get("failed", torch.zeros(len(r["reward"]), dtype=torch.bool))
                                for r in results]).bool()
            names = {k for r in results for k in r} - {"failed"}  # rm_type overrides may leave one out
        except rewards.NonFiniteReward as e:
            skip = str(e)
        except rewards.RewardServiceError as e:  # after the retries, with --reward-on-error raise
            fatal = (" ".join(str(e).split()) + "; retry later, raise --reward-retries / --reward-timeout, or use "
                     "--reward-on-error skip")  # one line, even when the service sent a multi-line error page
        except (ValueError, TypeError) as e:  # a scorer returned something unusable (wrong length, strings)
            fatal = " ".join(str(e).split())
        except InterruptedError:
            interrupted = True
        if distributed.any_rank(interrupted, device):  # every rank stops waiting, saves and exits together
            self._stop_while_waiting(step)
        if distributed.any_rank(fatal is not None, device):  # every rank stops, not only the one whose reward failed
            self.pool.shutdown(wait=False, cancel_futures=True)  # later batches' requests are not sent
            raise SystemExit(f"error: {fatal or 'the reward failed on another rank'}")
        # A row's rm_type may name components that --reward does not, and a scorer's extra entries (GenEval's tags, a
        # custom scorer's) exist only where it scored: the ranks' names differ. Every rank takes the union, in one
        # order, NaN where it has no value (NaN already means "does not apply"; every statistic is nan-aware), so that
        # train.advantages gathers the same components everywhere. Agreed each step, not fixed at start-up: the extra
        # entries are only known once a scorer has run, and a custom scorer may return other ones per batch.
        names = distributed.union(names)
        if skip is None:
            scores = stacked(results, names)  # each [per_rank]
            trained = scores[args.reward_key][~failed]
            if torch.isinf(trained).any():  # each component is finite (NonFiniteReward): their weighted sum is not
                skip = (f"--reward-key {args.reward_key} is infinite for some samples: the weighted total of --reward "
                        "overflows float32; use smaller weights")
            elif torch.isnan(trained).any():
                skip = f"--reward-key {args.reward_key} is NaN for some samples (an rm_type override without it?)"
        if distributed.any_rank(skip is not None, device):
            return Rewards(skip=skip or "non-finite reward on another rank")
        # Groups with a sample whose reward service gave up are dropped whole (departure 4).
        groups = torch.arange(args.prompts_per_step, device=device).repeat_interleave(args.group_size)  # [samples]
        dropped = torch.zeros(args.prompts_per_step, dtype=torch.bool, device=device)  # [prompts_per_step]
        dropped[groups[distributed.all_gather_cat(failed.to(device))]] = True
        if dropped.all():  # not one reward: an update would only replay Adam's momentum and weight decay
            return Rewards(dropped=dropped, skip=f"every group lost its reward ({args.reward} gave up on every sample)")
        self.lap("reward_wait")  # the wait not hidden behind sampling
        return Rewards(scores=scores, dropped=dropped)

    def _result(self, future, b, prompts, step):
        """One rollout batch's scores, polled so that a signal ends the wait; None when one did."""
        try:
            while self.signal is None:
                try:
                    return future.result(timeout=0.2)
                except TimeoutError:
                    pass
            return None
        except rewards.RewardServiceError as e:  # its "sample i" counts within rollout batch b
            names = list(dict.fromkeys(prompts))
            names = ", ".join(repr(q) for q in names[:3]) + (", ..." if len(names) > 3 else "")
            raise rewards.RewardServiceError(f"step {step + 1}, rank {RANK}, rollout batch {b} "
                                             f"(prompts {names}): {e}") from None

    def signalled(self):
        """Whether a SIGTERM / SIGINT reached any rank (a collective on the host: every rank asks at the same point,
        none waits for its GPU)."""
        return distributed.any_rank_host(self.signal is not None)

    def stop_in_training(self, step, snapshot):
        """A signal arrived in the training phase: back to the state the step started from (the policy's `snapshot`
        after an optimizer step of this step, else the weights as they are, their gradients dropped), save it as
        checkpoint `step` with the run's state from before the step, and exit 0 at once; --resume auto redoes the step
        exactly (departure 1: its rollouts are seeded)."""
        if snapshot is not None:
            self.policy.restore(snapshot)
        self.policy.optimizer.zero_grad(set_to_none=True)
        self.carry = self.carry_at_start  # the step's advantages already moved GARDO's gate share
        self._stop_while_waiting(step, "in the training phase of")

    def stop_in_sampling(self, step):
        """A signal arrived between two rollout batches: save the last complete step and exit 0 at once."""
        self._stop_while_waiting(step, "in the sampling phase of")

    def _stop_while_waiting(self, step, where="while waiting for rewards in", during=None):
        """A signal arrived while waiting: keep the last complete step, redo this one on resume, exit 0 at once.
        during: the step the message names (default step + 1, the one being made)."""
        saved = os.path.isfile(os.path.join(self.args.out, "checkpoints", str(step), "state.json"))
        if not distributed.broadcast(saved):  # rank 0 wrote it: its view decides the collective save for every rank
            self.policy.checkpoint(self.recorded, step, self._state())  # (another node may see the file late, or never)
        during = step + 1 if during is None else during
        print0(f"stopped by {self.signal or 'a signal on another rank'} {where} step {during}; checkpoint {step} "
               f"saved, continue with --resume auto --out {self.args.out}")
        self._exit_now()  # a reward request may still be blocked on the network: do not wait for its thread

    def _exit_now(self):
        """Exit 0 without the interpreter's teardown, the run saved: loggers closed, the process group destroyed,
        output flushed. A thread still alive at teardown (a reward request blocked on the network, a collective's
        worker thread after a peer left) would otherwise hang the exit or abort it: a joinable C++ thread destroyed
        at exit calls std::terminate ("terminate called without an active exception", SIGABRT)."""
        self.bar.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
        self.pool.shutdown(wait=False, cancel_futures=True)
        distributed.finish()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)

    # ------------------------------------------------------------------------- LOG / SAVE
    def _state(self):  # what a checkpoint's state.json carries besides the step
        return dict(bad_in_a_row=self.bad_in_a_row, nonfinite_in_a_row=self.nonfinite_in_a_row, carry=self.carry)

    def log(self, step, info, batch, got):
        """The step's metrics (a row of metrics.jsonl, wandb) and line; a skipped step (info has a skip_reason) is
        logged and counted too. Every --log-images-every steps a grid of the samples (batch["images"]) with their
        prompts, rewards and verdicts (got: the step's Rewards); every --eval-every steps the held-out evaluation."""
        args = self.args
        if "skip_reason" in info:  # skip the update, not the bookkeeping: logged, counted, checkpointed
            self.bad_in_a_row += 1
            self.last_skip = info["skip_reason"]
            info["skipped"] = 1
            if got.dropped is not None:
                info["dropped_groups"] = int(got.dropped.sum())
        else:
            self.bad_in_a_row = 0
        if info.get("skipped_updates"):  # an optimizer step of this step met a non-finite gradient
            self.nonfinite_in_a_row += 1
        elif "updates" in info:  # trained on finite gradients (a step whose rewards were skipped is neither)
            self.nonfinite_in_a_row = 0
        self.trained += info.get("updates", 0) > 0
        info = dict(step=step, **info, bad_in_a_row=self.bad_in_a_row, seconds=time.time() - self.marks["start"],
                    **{f"seconds_{k}": v for k, v in self.marks.items() if k not in ("start", "last")})
        if "updates" in info:
            info["seconds_training"] = time.time() - self.marks["last"]
        if "features" in batch:  # featurized for --gardo-diversity's advantages already: not twice
            info.update(diversity.feature_diversity(batch["features"], batch["prompts"]))
        elif getattr(args, "diversity", "off") != "off" and "images" in batch:  # feature diversity of the groups
            info.update(diversity.measure(batch["images"], batch["prompts"], [], device=self.device, exact=False,
                                          **diversity.options(args)))
        self._append(info)
        if is_main:
            self._show(step, info, batch, got.scores)
        if self.on_step is not None and is_main:
            self.on_step(info)
        if args.eval_every and step % args.eval_every == 0:
            self.evaluate(step)

    def _show(self, step, info, batch, scores):
        """The step's line on rank 0, its sample grid when due, and a warning when the statistics diverge."""
        args = self.args
        if "updates" not in info:
            print0(f"step {step}: skipped ({info['skip_reason']})")
        else:
            self.bar.write(step_line(step, info))
            if args.log_images_every and step % args.log_images_every == 0:  # prompt, reward and verdict per sample
                captions = sample_captions(batch["prompts"], scores, args.reward_key, len(batch["images"]))
                shown = evaluation.select_samples(batch["prompts"], scores[args.reward_key].tolist(), 8)  # several
                paths = evaluation.save_sample_grid(os.path.join(args.out, "samples", f"{step:06d}.png"),
                                                    batch["images"], captions, fps=args.fps, ids=shown)
                if (self.wandb or self.tensorboard) and paths[0].endswith(".png"):
                    self._publish({}, step, image=np.asarray(Image.open(paths[0]).convert("RGB")))
            if len(self.early_grad_norms) < 10 and math.isfinite(info.get("grad_norm", math.nan)):
                self.early_grad_norms.append(info["grad_norm"])
            warn_divergence(info, float(np.median(self.early_grad_norms)) if len(self.early_grad_norms) == 10 else None)

    def evaluate(self, step):
        """Held-out ODE samples, fixed noise, scored into eval.jsonl. Every rank samples and scores its share of the
        held-out images (distributed.share), under the run's autocast as the rollouts, and the scores are gathered in
        image order: image i takes noise i on whichever rank draws it, so the figures are a single process's. With
        --ema-decay the EMA weights are evaluated, as Flow-GRPO does."""
        args, policy, device = self.args, self.policy, self.device
        policy.train(False)
        texts, metadata = (part * args.eval_samples_per_prompt for part in self.held_out)
        mine = distributed.share(len(texts))  # copy c of prompt j is image c N + j, its noise index
        my_texts, my_metadata = [texts[i] for i in mine], [metadata[i] for i in mine]
        with policy.ema_weights(), policy.gathered():  # FSDP: each block gathered once
            images = evaluation.sample_images(policy.pipe, my_texts, resolution=args.resolution,
                                              num_steps=args.eval_steps, guidance_scale=eval_guidance(args),
                                              seed=args.seed, device=device, batch_size=args.sample_batch_size,
                                              negative_prompt=args.negative_prompt, shift=args.shift,
                                              num_frames=args.num_frames, max_sequence_length=args.max_sequence_length,
                                              source_images=[data.source_images(m) for m in my_metadata],
                                              noise_ids=mine, autocast=policy.autocast, stop=self.signalled)
        if images is None:  # preempted: the step is complete, its evaluation is redone on resume (start)
            self._stop_while_waiting(step, "in the held-out evaluation of", during=step)
        result, error = {}, None
        try:
            result = self.reward_fn(images, my_texts, my_metadata)
        except (rewards.RewardServiceError, ValueError, TypeError) as e:  # NonFiniteReward is a ValueError
            error = " ".join(str(e).split())
        if distributed.any_rank(error is not None, device):  # every rank stops, not only the one whose reward failed
            raise SystemExit(f"error: the held-out evaluation at step {step}: "
                             f"{error or 'the reward failed on another rank'}")
        # The same entries on every rank (wait_for_rewards says why), gathered into image order.
        result = {k: distributed.gather_share(v.to(device), len(texts)).cpu()
                  for k, v in stacked([result], distributed.union(result)).items()}
        if "failed" in result:
            result["failed"] = result["failed"] > 0  # back to bool (stacked made it float to gather)
        if diversity.applies(metadata, **diversity.options(args)):  # it compares a prompt's images: all of them
            images = distributed.gather_share(images.to(device), len(texts)).cpu()
        if is_main:
            base_path = os.path.join(args.out, checkpoints.EVAL_BASE)
            fingerprint = eval_fingerprint(args, texts, metadata)  # what the step-0 scores were measured on
            if step == 0:  # the model before training: what every later evaluation's rise is measured against
                torch.save(dict({k: v.detach().cpu() for k, v in result.items() if torch.is_tensor(v)},
                                fingerprint=fingerprint), base_path + ".tmp")
                os.replace(base_path + ".tmp", base_path)  # whole or absent, even if the run is killed here
            base = self.eval_base(base_path, fingerprint) if step > 0 else None
            if base is not None and base["reward"].shape != result["reward"].shape:  # another held-out set
                base = None
            scores = evaluation.means_of(result, base=base)
            scores.update(diversity.measure(images, texts, metadata, device=self.device, **diversity.options(args)))
            evaluation.append_scores(os.path.join(args.out, "eval.jsonl"), step, scores)
            self._publish(scores, step, prefix="eval/")
            self.bar.write(f"eval  {step:5d} | " + evaluation.summary_line(scores))

    @staticmethod
    def eval_base(path, fingerprint=None):
        """The step-0 per-image scores of eval_base.pt, or None (a run folder from before it, a damaged or replaced
        file, or scores of other held-out prompts or evaluation flags than `fingerprint`'s: the evaluation goes on
        without its rise, with a warning)."""
        if not os.path.exists(path):
            return None
        try:
            base = torch.load(path, map_location="cpu", weights_only=True)  # tensors and a string, beside the scores
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
            print0(f"warning: {path} is unreadable ({' '.join(str(e).split())[:200]}); eval.jsonl goes on without "
                   "`rise`")
            return None
        if not (isinstance(base, dict) and torch.is_tensor(base.get("reward"))):
            print0(f"warning: {path} does not hold step-0 reward scores; eval.jsonl goes on without `rise`")
            return None
        saved = base.pop("fingerprint", None)
        if fingerprint is not None and saved is None:  # a file from before the fingerprint: any images, same number
            print0(f"warning: {path} holds no fingerprint of the held-out prompts and evaluation flags it was "
                   "measured on (written before it existed), so its pairing cannot be checked; eval.jsonl goes on "
                   "without `rise` (rerun from step 0 to have it)")
            return None
        if fingerprint is not None and saved != fingerprint:
            print0(f"warning: {path} holds the scores of other held-out prompts or evaluation flags (--eval-prompts, "
                   "--eval-steps, ...) than this run's; eval.jsonl goes on without `rise` (resume with the run's own "
                   "flags to keep it)")
            return None
        return {k: v for k, v in base.items() if torch.is_tensor(v)}

    def _append(self, info):
        self.bar.update(1)
        checkpoints.append_metrics(self.args.out, info)
        self._publish(info, info["step"])

    def _publish(self, values, step, prefix="", image=None):
        """The same numbers (and an image, uint8 [H, W, 3]) to wandb and TensorBoard, when asked for."""
        numbers = {prefix + k: v for k, v in values.items() if isinstance(v, (int, float)) and k != "step"}
        if self.wandb:
            self.wandb.log(dict(numbers, **({prefix + "samples": self.wandb.Image(image)} if image is not None
                                            else {})), step=step)
        if self.tensorboard:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
            if image is not None:
                self.tensorboard.add_image(prefix + "samples", image, step, dataformats="HWC")
            self.tensorboard.flush()

    def warn_ratio(self, deviation, limit, cause):
        """Once per run: the first update's on-policy ratio strays beyond the clip range (departure 2)."""
        if deviation > limit and not self.ratio_warned:
            self.ratio_warned = True
            print0(f"warning: on-policy ratio deviates from 1 by {deviation:.2e}, more than the clip range {limit:g}: "
                   f"the training forward does not match the rollout ({cause}); try --mixed-precision fp16 or no, "
                   "or --train-cfg")

    def checkpoint_or_stop(self, step):
        """Stop on too many bad steps; save when due, at the end or when signalled. True ends the run."""
        args = self.args
        if self.nonfinite_in_a_row >= min(NONFINITE_STEPS, args.max_bad_steps):  # the weights are the last good ones
            self.policy.checkpoint(self.recorded, step, self._state())  # (a skipped step leaves them), kept
            raise SystemExit(nonfinite_stop(args, self.nonfinite_in_a_row, step, self.carry))
        if self.bad_in_a_row >= args.max_bad_steps:
            raise SystemExit(f"error: {self.bad_in_a_row} consecutive steps were skipped (last: {self.last_skip}); "
                             "fix the reward, or lower --lr for non-finite gradients (see --max-bad-steps)")
        stopping = distributed.any_rank(self.signal is not None, self.device)
        if (args.save_every and step % args.save_every == 0) or step == args.steps or stopping:
            self.policy.checkpoint(self.recorded, step, self._state())
        if stopping:
            print0(f"stopped by {self.signal or 'a signal on another rank'} after step {step}; "
                   f"checkpoint saved, continue with --resume auto --out {args.out}")
            if distributed.WORLD > 1:  # preempted under torchrun: every rank saved; leave as after a reward wait
                self._exit_now()
        self.step = step
        return stopping

    def finish(self):
        """The end of the run: loggers closed, the signal handlers and the folder's lock given back (train.main may be
        called again in this process), the process group left."""
        self.bar.close()
        if self.tensorboard:
            self.tensorboard.close()
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        checkpoints.unlock(self.args.out)
        self.pool.shutdown()
        distributed.finish()
        if self.step == self.args.steps > self.first_step and self.trained == 0:  # every step skipped: say so
            raise SystemExit(f"error: none of the {self.step - self.first_step} steps of this run updated the weights "
                             f"(last skip: {self.last_skip}); checkpoint {self.step} holds the weights "
                             "it started from")


def set_up_stop(name):
    """The line of a SIGINT (Ctrl-C) or SIGTERM before the first step, while the folder is prepared and the prompts,
    rewards and models load."""
    what = "interrupted (Ctrl-C)" if name == "SIGINT" else f"stopped by {name}"
    return (f"error: {what} during start-up, before the first step: nothing was trained; rerun the same command to "
            "start (or continue) the run")


NONFINITE_STEPS = 3  # consecutive steps with a non-finite gradient that stop the run (or --max-bad-steps, if fewer)


def nonfinite_stop(args, count, step, carry):
    """The line that stops a run whose gradient was not finite in `count` consecutive steps up to `step`: none of them
    moved the weights (policy.step skips such an update), and what follows would not either. It names the settings
    that make a gradient overflow, the learning rate always, the KL controller's weight and fp16 where the run has
    them, and the checkpoint saved with the last good weights."""
    causes = [f"a learning rate too high for these weights (--lr {args.lr:g}: lower it)"]
    if getattr(args, "kl_target", 0) > 0:  # the adaptive KL weight (regularizers) may have run away
        weight = carry.get("kl_beta", args.kl_beta)
        causes.append(f"the KL controller's weight, now {weight:.3g} (lower --kl-rate {args.kl_rate:g})")
    if args.mixed_precision == "fp16":
        causes.append("fp16 overflow in the forward (use --mixed-precision bf16)")
    last = getattr(args, "steps", None)  # a run at its last step would resume to nothing: --steps must grow too
    more = f" and a --steps above {last} (the run is at its last)" if last is not None and step >= last else ""
    return (f"error: the gradient was not finite in {count} consecutive steps (steps {step - count + 1}-{step}), so "
            f"none of them trained; likely cause: {'; or '.join(causes)}. Checkpoint {step} holds the weights as the "
            f"last finite update left them: continue with --resume auto --out {args.out} after the change{more}")


EVAL_FLAGS = ("model", "resolution", "eval_steps", "guidance_scale", "seed", "negative_prompt", "shift", "num_frames",
              "max_sequence_length", "reward", "audio_guidance_scale", "guidance_scale_2")  # what the held-out images
# and their scores depend on (LTX-2's soundtrack and Wan 2.2's second expert have scales of their own; not where the
# weights were read from: --model-path may move between machines)


def eval_guidance(args):
    """The CFG scale the held-out images are sampled at: --eval-guidance-scale, else the rollouts' --guidance-scale."""
    scale = getattr(args, "eval_guidance_scale", None)
    return args.guidance_scale if scale is None else scale


def eval_fingerprint(args, texts, metadata):
    """A digest of what a held-out evaluation measures (the prompts and their metadata, in order, and EVAL_FLAGS, with
    guidance_scale the scale its images are sampled at): eval_base.pt's step-0 scores pair with a later evaluation
    only when both digests agree."""
    what = dict(texts=list(texts), metadata=list(metadata), **{k: getattr(args, k, None) for k in EVAL_FLAGS})
    what["guidance_scale"] = eval_guidance(args)
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def check_loggers(args):
    """--log-to's libraries and folder, in one line each, before the run folder is touched."""
    if args.wandb or "wandb" in args.log_to:
        try:
            import wandb  # noqa: F401  (imported again where it is used, in start)
        except ImportError:
            raise SystemExit("error: --log-to wandb needs the wandb package: pip install wandb, or drop --log-to "
                             "wandb (--log-to tensorboard needs only tensorboard)") from None
    if "tensorboard" in args.log_to:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise SystemExit("error: --log-to tensorboard needs the tensorboard package: pip install tensorboard, or "
                             "drop --log-to tensorboard") from None
        folder = os.path.join(args.out, "tensorboard")
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise SystemExit(f"error: {folder} is a file, where --log-to tensorboard writes its event folder; move "
                             "it away or drop --log-to tensorboard")


def step_line(step, info):
    """One greppable line per step: the reward, GenEval's accuracy, and what moves (the gradient norm, KL terms, the
    share of samples without an advantage); the ratio and its clip only where a batch is trained off-policy."""
    line = f"step {step:5d} | reward {info['reward_mean']:+.4f} +- {info['reward_std']:.4f}"
    if "reward/geneval_correct_mean" in info:  # GenEval: the share of samples officially correct
        line += f" | accuracy {info['reward/geneval_correct_mean']:.3f}"
    line += f" | grad {info.get('grad_norm', float('nan')):.2e}"
    for key in ("kl", "ema_kl"):
        if key in info:
            line += f" | {key} {info[key]:.2e}"
    line += f" | zero-adv {info['zero_adv_fraction']:.2f}"
    if info.get("off_policy_ratio_mean") is not None:  # updates after the first of a batch
        line += f" | ratio {info['off_policy_ratio_mean']:.5f} | clipfrac {info['off_policy_clipfrac']:.3f}"
    return line + f" | {info['seconds']:.1f}s"


def warn_divergence(info, early_grad_norm=None):
    """One actionable line when the statistics say the policy is running away (FlowDPPO's debug checklist), and for
    any loss when the gradient norm has grown to 10x early_grad_norm (the median of the run's first 10 steps): the
    forward-process losses have no ratio to watch, and their runs collapse after such a rise (docs/shapes.md)."""
    if info.get("clipfrac", 0) > 0.8:
        print0(f"warning: clipfrac {info['clipfrac']:.2f} ~ 1: the policy moves too far per step; "
               "lower --lr or raise --clip-range")
    if info.get("masked_fraction", 0) > 0.8:
        print0(f"warning: FlowDPPO masked_fraction {info['masked_fraction']:.2f} ~ 1: most terms are masked; "
               "raise --kl-mask-threshold or lower --lr")
    if abs(info.get("ratio_mean", 1) - 1) > 0.5:
        print0(f"warning: ratio mean {info['ratio_mean']:.3f} far from 1; lower --lr")
    if early_grad_norm and info.get("grad_norm", 0) > 10 * early_grad_norm:
        print0(f"warning: gradient norm {info['grad_norm']:.3g} is {info['grad_norm'] / early_grad_norm:.0f}x its "
               f"first steps' ({early_grad_norm:.3g}): the policy is running away; lower --lr or add --kl-beta")


def check_rm_types(path, prompts, metadata):
    """Every row's metadata.rm_type must name known rewards: a typo fails now, not at the step that draws it."""
    for i, meta in enumerate(metadata):
        if meta.get("rm_type"):
            try:
                rewards.parse_spec(meta["rm_type"])
            except ValueError as e:
                raise SystemExit(f"error: {path}, prompt {i + 1} ({prompts[i][:40]!r}): metadata rm_type: {e}")


def check_sources(path, model, metadata):
    """Source images (data.py) need a model that edits, and the Qwen-Image-Edit models need one on every row; the rows
    of one file bring the same number (none on one row and one on another fails inside a batched step): said in one
    line before a model loads."""
    have = sum(data.SOURCE_KEY in m for m in metadata)
    record = models.MODELS[model]
    takes = record.source_images
    if have and takes is None:
        editors = [name for name, f in models.MODELS.items() if f.source_images]
        raise SystemExit(f"error: {path}: {have} of {len(metadata)} rows name source images, but --model {model} "
                         f"generates from text alone; edit with {', '.join(editors)}, or drop the "
                         "rows' 'image' field")
    if takes == "required" and have < len(metadata):
        raise SystemExit(f"error: {path}: --model {model} edits source images and {len(metadata) - have} of "
                         f"{len(metadata)} rows have none; give every row one under 'image' (data.py)")
    if 0 < have < len(metadata):  # a batch of rows with and without sources fails inside the model's step
        raise SystemExit(f"error: {path}: {have} of {len(metadata)} rows name source images and the others none; "
                         f"--model {model} batches prompts that bring the same number: give every row one under "
                         "'image', or train the edits and the text-to-image prompts in separate runs")
    counts = {len(m[data.SOURCE_KEY]) for m in metadata if data.SOURCE_KEY in m}  # the pipelines batch these rows
    if record.max_sources == 1 and counts - {1}:
        raise SystemExit(f"error: {path}: --model {model} edits one source image per prompt and some rows name "
                         f"{max(counts)}; give each row one under 'image', or edit several with "
                         "qwen-image-edit-plus or flux2-klein")
    if len(counts) > 1:
        raise SystemExit(f"error: {path}: rows name {' or '.join(map(str, sorted(counts)))} source images; --model "
                         f"{model} batches prompts that bring the same number: give every row as many")


def stacked(results, names):
    """Reward outputs (a list of dicts of [b] tensors) -> {name: [sum of b] float}, NaN where an output lacks it."""
    return {k: torch.cat([r[k].float() if k in r else torch.full((len(r["reward"]),), float("nan")) for r in results])
            for k in names}


def sample_captions(prompts, scores, reward_key, n):
    """Captions of the first n samples: the prompt, the trained reward and, for GenEval, the official verdict."""
    captions = []
    for i in range(n):
        line = f"{reward_key} {scores[reward_key][i].item():.3f}"
        if "geneval_correct" in scores:
            line += " | " + ("correct" if scores["geneval_correct"][i] > 0.5 else "wrong")
        captions.append(f"{prompts[i]}\n{line}")
    return captions


def mean_stats(stats):
    """{name: [values]} of a step's micro-steps -> {name: mean}."""
    return {k: float(np.mean(v)) for k, v in stats.items()}
