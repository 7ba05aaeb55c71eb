"""The trained policy: the pipeline, the weights that train, how they are sharded and stepped, and their copies.

    policy = Policy(args, device, old_copy=..., sampling_copy=...)   load the model; LoRA adapter or every weight;
                                       FSDP2 shards or DDP; compile; AdamW; fp16 loss scaling; the copies (float32):
                                       the evaluation EMA, the loss's old and sampling copies (its Loss record says
                                       which), the KL's reference snapshot (--kl-reference start, --gardo-reference)
    policy.modules, policy.models      {name: module} that train (models.trained_modules), and their training wrappers
    policy.velocity(x, sigma, embeds, guidance_scale, train=False)   a forward (train: through DDP / compile; else the
                                       bare module, compiled with --compile)
    policy.gathered()                  context of a rollout or evaluation: FSDP gathers each block once, not per
                                       forward; --compile: the pipeline's calls run the compiled forward (compiled())
    policy.frozen("old" | "sampling" | "reference") context: a copy's weights, or the KL reference: the base
                                       model (LoRA off), or the snapshot where the run keeps one
    policy.sync_gradients(last)        before a training forward: reduce gradients over ranks after it or not
    policy.backward(loss)              backward (fp16: of the scaled loss)
    policy.step() -> "ok" | "overflow" | "skipped", grad norm      one optimizer step (clip; skip non-finite)
    policy.update_old(decay, name="old"), policy.reset_reference(), policy.ema_weights()
    policy.role(name), policy.step_role(name)   a trained role (the distillation losses' critic, Loss.roles): context
                                       in which a backward trains it, and its own AdamW step; policy.teachers and
                                       policy.frozen("teacher", key): the frozen teachers (--teacher)
    policy.snapshot() / policy.restore(snapshot)   what an optimizer step changes, copied to the CPU and put back (a
                                       preemption between a step's optimizer steps saves the step's start)
    policy.checkpoint(args, step, extra) / policy.resume(path, args)

The algorithm lives in train.py, advantages.py and losses.py; this is what they run it on.
"""
import argparse
import contextlib
import copy
import math

import torch

import checkpoints
import distributed
import flags
import models
from distributed import WORLD, print0


class Policy:
    role_optimizers, role_steps, teachers = {}, {}, {}  # no roles (replaced per instance where a loss has them)

    def __init__(self, args, device, *, old_copy, sampling_copy=False, roles=()):
        """args: train.py's flags; old_copy: whether the loss keeps an old copy of the weights (Loss.old_copy);
        sampling_copy: whether its rollouts run a copy of their own (Loss.sampling_copy); roles: the trained roles
        beside the policy (Loss.roles: ("critic",) for the distribution-matching losses)."""
        amp_dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.mixed_precision]
        load_dtype = amp_dtype if (amp_dtype and args.lora_rank > 0) else torch.float32  # LoRA: frozen base in half
        self.pipe = pipe = models.load_pipeline(args.model, args.model_path, dtype=load_dtype, device=device)
        pipe.edit_vl_input = getattr(args, "edit_vl_input", "diffusers")  # qwen_image_edit.encode reads it
        pipe.prompt_store_dir = getattr(args, "prompt_store", None)  # models.prompt_cache builds or opens it there
        # VAE weights in float32, as Flow-GRPO keeps them; the decode still runs under the rollout's fp16 autocast
        # (models.generate), so its convolutions compute in fp16: float32 activations there are not yet guaranteed.
        if load_dtype == torch.float16:
            pipe.vae.to(torch.float32)
        self.modules = modules = models.trained_modules(pipe)  # {"transformer": ...}, or a family's experts
        # A full fine-tune loads in float32 for the weights it trains, but the modules that never train only run
        # forwards: under mixed precision they sit in its dtype whatever the rank, as a LoRA run loads them (the
        # frozen T5-XXL of SD3.5: 9.5 GB per GPU in bf16 instead of 19 GB), their prompts encoded in the precision a
        # LoRA run encodes them in. The trained modules stay float32 (the master weights) and the VAE as it loaded.
        if amp_dtype is not None:
            _frozen_in(pipe, modules, amp_dtype)
        models.attention_backend(pipe, getattr(args, "attention_backend", "native"),  # --attention-backend, tried
                                 dtype=amp_dtype or torch.float32)  # in the forwards' dtype
        models.add_lora(pipe, args.lora_rank, args.lora_alpha)  # the adapter (float32) trains, or all weights (rank 0)
        trainable = [(n, q) for n, q in models.named_parameters(modules) if q.requires_grad]
        which = "LoRA r%d" % args.lora_rank if args.lora_rank else "full"
        if len(modules) > 1:
            which += " of " + " and ".join(modules)
        print0(f"model {args.model}: {sum(q.numel() for _, q in models.named_parameters(modules)) / 1e6:.2f} M "
               f"params, {sum(q.numel() for _, q in trainable) / 1e6:.3f} M trained ({which})")
        for module in modules.values():
            if args.gradient_checkpointing:
                module.enable_gradient_checkpointing()
            if args.fsdp:  # the module itself becomes sharded, so rollouts and evaluations run through FSDP too
                distributed.shard_transformer(module, device, param_dtype=amp_dtype)  # bf16 gathers, fp32 grads
        if args.fsdp:
            trainable = [(n, q) for n, q in models.named_parameters(modules) if q.requires_grad]  # same names, shards
        self.trainable = trainable  # [(name, parameter)]
        self.optimizer = torch.optim.AdamW([q for _, q in trainable], lr=args.lr, weight_decay=args.weight_decay)
        # Several modules (experts a micro-batch may not reach), or a record that says DDP may not wrap its module
        # (ddp: called several times a forward, or layers some batches do not reach), are averaged over ranks at the
        # optimizer step (distributed.average_gradients): DDP refuses a parameter that takes no part in a backward, or
        # takes part twice.
        self.ddp = None
        if WORLD > 1 and not args.fsdp and len(modules) == 1 and models.family(pipe).ddp:
            # broadcast_buffers=False: the transformers' buffers are fixed tables (positions, RoPE frequencies), built
            # alike on every rank and never updated, so rank 0's copy need not be broadcast before every forward.
            # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets instead of beside them, one
            # gradient-sized copy less (10 GB for SD3.5-M's full fine-tune in float32); safe as nothing here
            # replaces or detaches a .grad (zero_grad(set_to_none), clipping and unscaling work in place or anew).
            (module,) = modules.values()
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
                gradient_as_bucket_view=True)
        elif WORLD > 1 and not args.fsdp:  # no DDP: the replicas start alike, as DDP would make them
            distributed.broadcast_parameters([q for _, q in trainable])
        wrapped = {name: self.ddp or module for name, module in modules.items()}  # what the training forward calls
        # --compile, after everything that changes what a forward runs (--attention-backend, the adapter, FSDP's
        # shards, gradient checkpointing): torch.compile traces at the first call, so it sees the modules as they are
        # now. The training forward compiles its wrapper (DDP: dynamo's DDPOptimizer splits the graph at the gradient
        # buckets); the forwards without gradients (rollout, old / sampling copy, reference, evaluation) compile the
        # bare module's forward, never DDP's (Policy.compiled).
        self.models = {name: torch.compile(m) if args.compile else m for name, m in wrapped.items()}
        self.forwards = _compiled_forwards(modules) if args.compile and not args.fsdp else []
        # fp16 (as Flow-GRPO's configs, through accelerate) needs loss scaling: the tiny gradients of mean-reduced
        # log-probs underflow its range (26 % of the gradient norm lost on the tiny model). Off: each call a no-op.
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        self.amp_dtype, self.device, self.args = amp_dtype, device, args
        self.copies = self._copies(args, old_copy, sampling_copy)
        self.role_optimizers = self._roles(args, roles)  # {name: AdamW of the role's weights in copies[name]}
        self.teachers = self._teachers(args) if getattr(args, "teacher", None) else {}
        self.optimizer_steps = 0  # all of the run's, for the EMA warm-up and the old copy's decay
        if args.updates_per_batch * args.minibatches > 1 and (args.fsdp or self.trained_bytes() > SNAPSHOT_BYTES):
            why = "sharded weights" if args.fsdp else f"more than {SNAPSHOT_BYTES >> 30} GB of trained weights"
            print0(f"note: a preemption (SIGTERM) in the training phase after a step's first optimizer step finishes "
                   f"the step before it saves ({why}: no copy of the step's start is kept), which a launcher that "
                   "kills after 30 s may cut short; --minibatches 1 --updates-per-batch 1 let every signal stop at "
                   "once")

    def _copy(self):  # float32, sharded like the trained weights under FSDP
        return {n: q.detach().float().clone() for n, q in self.trainable}

    def _copies(self, args, old_copy, sampling_copy):
        """The copies of the trained weights the run keeps, each a copy of them now (checkpoints.COPIES): the
        evaluation EMA, the loss's old copy, its sampling copy, the KL's reference snapshot (--kl-reference start, or
        GARDO's, G L636-641: a copy of the trained LoRA, renewed on its schedule)."""
        snapshot = getattr(args, "gardo_reference", False) or getattr(args, "kl_reference", "base") == "start"
        return {"ema": self._copy() if args.ema_decay > 0 else None, "old": self._copy() if old_copy else None,
                "sampling": self._copy() if sampling_copy else None, "reference": self._copy() if snapshot else None}

    def _roles(self, args, roles):
        """The trained roles (docs/design.md, "A role"), each a float32 copy of the trained weights that trains on its
        own: a second set of adapter weights on the same base where --lora-rank > 0 (TDM and DMDR train the fake score
        as a LoRA, train_tdm_demo.py L779-780, train_sitxl_refl_deepspeed.py L462-469), a full copy at rank 0 (DMD2's
        fake_unet, sd_guidance.py L50-58). It starts from the policy's weights, the base model's at the start: the
        fake score starts as the teacher. Its AdamW: --critic-lr, DMD2's betas (0.9, 0.999) and --weight-decay
        (train_sd.py L191-201). Kept in `copies` so that checkpoints and resume cover it as the other copies."""
        optimizers = {}
        for name in roles:
            self.copies[name] = {n: t.requires_grad_() for n, t in self._copy().items()}
            optimizers[name] = torch.optim.AdamW(list(self.copies[name].values()), lr=args.critic_lr,
                                                 weight_decay=args.weight_decay)
        self.role_steps = {name: 0 for name in roles}
        return optimizers

    def _teachers(self, args):
        """{key: frozen weights}: --teacher base (the base model: None under LoRA, the adapter switched off; a float32
        copy of the starting weights at rank 0) or a checkpoint folder's trainable.safetensors (this project's), one or
        several keyed by a prompt row's field (--teacher KEY=PATH ... --teacher-field FIELD)."""
        teachers = {}
        for spec in args.teacher:
            key, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
            if path == "base":
                teachers[key] = None if args.lora_rank > 0 else self._copy()
            else:
                weights = checkpoints._read_weights(path, [n for n, _ in self.trainable], "--teacher")
                teachers[key] = {n: weights[n].to(q.device, torch.float32) for n, q in self.trainable}
        return teachers

    # ------------------------------------------------------------------------- forwards
    def train(self, mode=True):
        """The trained modules in training (or, False, evaluation) mode, through their wrappers."""
        for model in self.models.values():
            model.train(mode)

    def autocast(self):
        """The forwards' autocast (--mixed-precision); the SDE step and log-probs stay float32."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def velocity(self, x, sigma, embeds, guidance_scale, *, train=False):
        """The velocity at (x, sigma) under autocast; train=True runs the training wrapper (DDP, compile), else the
        bare modules (--compile: their compiled forwards, Policy.compiled)."""
        with self.autocast(), contextlib.nullcontext() if train else self.compiled():
            return models.velocity(self.pipe, x, sigma, embeds, guidance_scale=guidance_scale,
                                   modules=self.models if train else None)

    @contextlib.contextmanager
    def compiled(self):
        """Inside, with --compile (not --fsdp), the bare trained modules run their compiled forwards: every call of
        them, the pipeline's own as models.generate makes, goes through torch.compile. Outside, `forward` is the
        class's again (or what it was), so that the training wrapper (torch.compile of the module or of DDP) traces
        the module itself and no call enters two compiled regions. The module's hooks (scripts/bench.py's recorder)
        run around the compiled forward, eager. Re-entrant; without --compile, nothing."""
        held = [(module, module.__dict__.get("forward")) for module, _ in self.forwards]
        for module, forward in self.forwards:
            module.forward = forward  # an instance attribute, found before the class's forward by nn.Module.__call__
        try:
            yield
        finally:
            for module, before in held:
                if before is None:
                    del module.forward
                else:
                    module.forward = before

    @contextlib.contextmanager
    def gathered(self):
        """Context for a rollout or a held-out evaluation (forwards without gradients): under --fsdp each block's
        weights are all-gathered at its first forward and kept until the exit, then resharded for training
        (distributed.gathered): one all-gather per block per rollout batch instead of one per forward. Enter it inside
        frozen() and ema_weights(), whose exchanges of the weights it must see. With --compile the forwards inside run
        compiled (Policy.compiled). Without --fsdp or --compile: nothing."""
        with distributed.gathered(*self.modules.values()) if self.args.fsdp else contextlib.nullcontext(), \
                self.compiled():
            yield

    @contextlib.contextmanager
    def frozen(self, name, key=""):
        """Inside, the transformer runs a frozen model, without gradients: "old" or "sampling", that copy of the
        weights (exchanged in place, checkpoints.swapped), or "reference", the KL anchor: the base model (the LoRA
        adapter off), or the snapshot where the run keeps one (exchanged in place as the old copy); a role ("critic")
        as it is now; "teacher", teacher `key` (the base model, or a checkpoint's weights exchanged in place)."""
        if name == "teacher":
            snapshot = self.teachers[key]
        else:
            snapshot = self.copies[name] if name in ("old", "sampling", *self.role_optimizers) \
                else self.copies.get("reference")
        with torch.no_grad(), (checkpoints.swapped(self.trainable, snapshot) if snapshot is not None
                               else models.reference(self.pipe)):
            yield

    @contextlib.contextmanager
    def role(self, name):
        """Inside, the trained parameters hold role `name`'s weights (exchanged in place) and a backward inside fills
        its gradients: on exit they move to the role's own tensors and the parameters' gradients are cleared, so the
        policy's update never sees them. Forwards inside run the bare modules (policy.velocity, train=False)."""
        weights = self.copies[name]
        with checkpoints.swapped(self.trainable, weights):
            try:
                yield
            finally:
                for n, q in self.trainable:
                    weights[n].grad = None if q.grad is None else q.grad.detach().float()
                    q.grad = None

    def step_role(self, name):
        """One optimizer step of role `name` on its gradients (averaged over the ranks), clipped to --max-grad-norm;
        skipped where not finite. Returns (status, grad norm)."""
        weights = list(self.copies[name].values())
        if WORLD > 1:
            distributed.average_gradients(weights)
        grad_norm = torch.nn.utils.clip_grad_norm_(weights, self.args.max_grad_norm).item()
        status = "ok" if math.isfinite(grad_norm) else "skipped"
        if status == "ok":
            self.role_optimizers[name].step()
            self.role_steps[name] += 1
        self.role_optimizers[name].zero_grad(set_to_none=True)
        return status, grad_norm

    # ------------------------------------------------------------------------- the update
    def sync_gradients(self, last):
        """Before each training forward: whether its backward reduces the gradients over the ranks, True for the last
        micro-step of an optimizer step only; before it they are summed locally (DDP's no_sync, which must hold the
        forward too). FSDP reduce-scatters after every micro-step (distributed.gradient_sync: memory)."""
        if self.args.fsdp:
            for module in self.modules.values():
                distributed.gradient_sync(module, last, every=getattr(self.args, "fsdp_reduce", "micro-step") ==
                                          "micro-step")
        elif self.ddp is not None:
            self.ddp.require_backward_grad_sync = last

    def backward(self, loss):
        """Backpropagate (fp16: the scaled loss)."""
        self.scaler.scale(loss).backward()

    def step(self):
        """One optimizer step on the accumulated gradients, clipped to --max-grad-norm. A non-finite gradient (NaN
        loss, log-prob or reward) skips it, weights and Adam state untouched: "overflow" when the fp16 loss scale
        overflowed (the scaler lowers it; not a bad step, and counted in the run's optimizer steps as the references
        count it: train_nft_sd3.py L992-1035, train_sd3_awm.py L1373-1413), else "skipped". Returns (status, gradient
        norm)."""
        if WORLD > 1 and self.ddp is None and not self.args.fsdp:  # reduced here, not by DDP (see __init__)
            distributed.average_gradients([q for _, q in self.trainable])
        self.scaler.unscale_(self.optimizer)  # fp16: the loss-scaled gradients back to their size (else a no-op)
        grad_norm = torch.nn.utils.clip_grad_norm_([q for _, q in self.trainable], self.args.max_grad_norm)
        if self.args.fsdp:  # the norm over all shards, as a DTensor: a plain tensor, the same on every rank
            grad_norm = grad_norm.full_tensor()
        grad_norm = grad_norm.item()
        if not math.isfinite(grad_norm):
            status = "overflow" if self.scaler.get_scale() > 1 else "skipped"
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            if status == "overflow":  # counted, as DiffusionNFT and AWM count every step (global_step, their EMA)
                self.optimizer_steps += 1
                self._update_ema()
            return status, grad_norm
        for group in self.optimizer.param_groups:  # the schedule's rate for this step (a function of the count alone,
            group["lr"] = self.lr()  # so a resumed run continues it exactly)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self._update_ema()
        return "ok", grad_norm

    def lr(self):
        """The learning rate of the next optimizer step under --lr-schedule: --lr throughout (constant), or from --lr
        at the first step to --lr-final x --lr at the run's last (--steps x its optimizer steps per step), along a
        line or a half cosine (Loshchilov & Hutter 2017, SGDR eq. 5, without restarts)."""
        args = self.args
        schedule = getattr(args, "lr_schedule", "constant")
        if schedule == "constant":
            return args.lr
        total = args.steps * args.updates_per_batch * args.minibatches
        progress = min(self.optimizer_steps / max(total - 1, 1), 1.0)
        shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return args.lr * (args.lr_final + (1 - args.lr_final) * shape)

    def _update_ema(self):
        """The evaluation EMA, on flow_grpo/ema.py's schedule: due after optimizer steps n with (n + 1) % --ema-every
        == 0, decay min((1 + n) / (10 + n), --ema-decay), applied --ema-repeat times (train.py departure 6)."""
        ema, n, args = self.copies["ema"], self.optimizer_steps, self.args
        if ema is not None and (n + 1) % args.ema_every == 0:
            decay = min((1 + n) / (10 + n), args.ema_decay) ** args.ema_repeat
            _lerp(ema, self.trainable, 1 - decay)

    def update_old(self, decay, name="old"):
        """copy <- decay copy + (1 - decay) current (decay 0 copies exactly), for the "old" or the "sampling" copy."""
        _lerp(self.copies[name], self.trainable, 1 - decay)

    def reset_reference(self):
        """GARDO's reference snapshot <- the current weights, exactly (G L790-792)."""
        _lerp(self.copies["reference"], self.trainable, 1.0)  # lerp at weight 1 is `end` itself (torch.lerp)

    def ema_weights(self):
        """Context: the trained weights hold their EMA (what is evaluated and exported), if the run keeps one."""
        return checkpoints.ema_weights(dict(self.trainable), self.copies["ema"])

    def snapshot(self):
        """What an optimizer step changes, copied to the CPU: the trained weights, Adam's state, the EMA, the loss scale
        and the step count, and the trained roles' weights, AdamW state and step counts. A step with several optimizer
        steps (or a role's before the policy's) takes one first, so that a preemption after the first can still save the
        state the step started from (run.stop_in_training). None where it would not fit its use: a sharded run, or more
        than SNAPSHOT_BYTES of trained weights (said at start-up)."""
        if self.args.fsdp or self.trained_bytes() > SNAPSHOT_BYTES:
            return None
        cpu = lambda tensors: [t.detach().to("cpu", copy=True) for t in tensors]  # noqa: E731
        state = self.optimizer.state_dict()
        return dict(weights=cpu(q for _, q in self.trainable), optimizer=dict(
                    state={k: {n: v.to("cpu", copy=True) if torch.is_tensor(v) else v for n, v in s.items()}
                           for k, s in state["state"].items()}, param_groups=copy.deepcopy(state["param_groups"])),
                    ema={n: t.to("cpu", copy=True) for n, t in self.copies["ema"].items()}
                    if self.copies["ema"] is not None else None,
                    scaler=self.scaler.state_dict(), optimizer_steps=self.optimizer_steps,
                    roles={name: (cpu(self.copies[name].values()), copy.deepcopy(checkpoints._on_cpu(o.state_dict())),
                                  self.role_steps[name]) for name, o in self.role_optimizers.items()})

    def restore(self, snapshot):
        """Back to a `snapshot`, exactly (the gradients accumulated since are the caller's to drop)."""
        with torch.no_grad():
            for (_, q), saved in zip(self.trainable, snapshot["weights"]):
                q.copy_(saved)
            for n, saved in (snapshot["ema"] or {}).items():
                self.copies["ema"][n].copy_(saved)
        self.optimizer.load_state_dict(snapshot["optimizer"])
        for name, (saved, optimizer, steps) in snapshot.get("roles", {}).items():  # the trained roles, as they were
            with torch.no_grad():
                for t, value in zip(self.copies[name].values(), saved):
                    t.copy_(value)
            self.role_optimizers[name].load_state_dict(optimizer)
            self.role_steps[name] = steps
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(snapshot["scaler"])
        self.optimizer_steps = snapshot["optimizer_steps"]

    def trained_bytes(self):
        return sum(q.numel() * q.element_size() for _, q in self.trainable)

    # ------------------------------------------------------------------------- checkpoints
    def checkpoint(self, args, step, extra):
        """Write checkpoint `step` (every rank calls; rank 0 writes). LoRA runs also export the adapter in diffusers'
        format (lora/), the EMA where there is one."""
        checkpoints.write(args, step, self._fsdp_module(), self.trainable, self.optimizer, self.copies, self.device,
                          dict(extra, optimizer_steps=self.optimizer_steps, grad_scaler=self.scaler.state_dict(),
                               role_steps=self.role_steps),
                          role_optimizers={k: o.state_dict() for k, o in self.role_optimizers.items()},
                          export=(lambda folder: models.save_lora(self.pipe, folder)) if args.lora_rank > 0 else None)

    def resume(self, path, args):
        """Restore weights, Adam, the copies this run keeps and the RNG from a checkpoint -> its state.json."""
        state, saved = checkpoints.load(path, args, self.trainable, self.optimizer,
                                        fsdp_model=self._fsdp_module() if args.fsdp else None)
        self.optimizer_steps = state.get("optimizer_steps", 0)
        if state.get("grad_scaler") and self.scaler.is_enabled():  # fp16: the loss scale continues where it was
            self.scaler.load_state_dict(state["grad_scaler"])
        for name in self.copies:  # the EMA, the old policy and the reference snapshot continue where they were (if
            if name in self.role_optimizers:  # a role: into its own tensors, which its optimizer holds
                checkpoints.load_role(path, name, self.copies[name], self.role_optimizers[name], saved)
                self.role_steps[name] = state.get("role_steps", {}).get(name, 0)
            elif self.copies[name] is not None and name in saved:  # this run keeps them); load put them beside the
                self.copies[name] = saved[name]  # weights, in float32
        if self.copies["reference"] is not None and "reference" not in saved:  # from a run without one: a snapshot
            self.reset_reference()  # of the weights it resumes from
        return state


    def _fsdp_module(self):
        """The sharded modules as one, whose parameter names are the trained ones' (models.named_parameters): the
        module itself, or a ModuleDict of a family's experts ("transformer_2.blocks.0...")."""
        return next(iter(self.modules.values())) if len(self.modules) == 1 else torch.nn.ModuleDict(self.modules)


def _frozen_in(pipe, trained, dtype):
    """Every module of the pipeline but the trained ones and the VAE, cast to `dtype` in place, keeping in float32 the
    layers its class keeps there when transformers loads it in that dtype (`_keep_in_fp32_modules` under fp16, as
    T5's `wo`, whose fp16 outputs overflow; `_keep_in_fp32_modules_strict` under fp16 and bf16): the frozen modules as
    a half-precision load gives them, from a float32 load's bits. A no-op for what already loaded in `dtype`."""
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module) or name == "vae" or any(module is m for m in trained.values()):
            continue
        keep = set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            keep |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
        kept = [(q, q.data) for n, q in module.named_parameters() if keep & set(n.split("."))]
        module.to(dtype)
        for q, data in kept:  # the float32 tensors themselves, not a round trip through dtype
            q.data = data


def _compiled_forwards(modules):
    """[(module, torch.compile of its forward)] for the forwards without gradients (Policy.compiled).

    Nothing is baked in: dynamo's graphs take the parameters as inputs (torch 2.14's inline_inbuilt_nn_modules), so the
    in-place exchanges of the weights (checkpoints.swapped: the old, sampling and reference copies, the EMA) reach the
    next call as they are, and it guards on the Python state a forward branches on (peft's adapter switch that
    models.reference flips, the requires_grad flags it sets, train / eval mode, autocast, grad mode): each such state
    compiles once, then each call finds its graph. dynamic left at None (automatic): the first call compiles for its
    shapes, and a second batch size (a micro-batch smaller than the rollout's, or a different one of a later step as
    samples without an advantage are dropped; an evaluation's last batch) recompiles once with the batch dimension
    symbolic, after which every size shares that graph. dynamic=False would compile once per batch size, up to
    dynamo's recompile limit (8 per module) and then run eager; dynamic=True would make the image dimensions symbolic
    too, for slower kernels. The limit counts the training forward's graphs too: its compile, of the module or of
    DDP, ends in the same forward, its graphs told apart by grad mode. The compiles per phase are counted in
    tests/test_cluster_memory.py::test_the_compiled_training_forward_reproduces_the_rollouts_log_probs."""
    return [(module, torch.compile(module.forward)) for module in modules.values()]


SNAPSHOT_BYTES = 4 << 30  # trained weights up to this are copied to the CPU at the start of a multi-update step


def _lerp(copy, trainable, weight):
    """copy <- copy + weight (current - copy), for every trained tensor in one multi-tensor op (torch._foreach_lerp_:
    a few kernel launches where a loop would launch one per tensor, the same arithmetic as lerp_); FSDP: on the
    local shards."""
    with torch.no_grad():
        torch._foreach_lerp_([distributed.local(copy[name]) for name, _ in trainable],
                             [distributed.local(param.detach()).float() for _, param in trainable], weight)


def add_arguments(parser):
    """The flags of what trains and how, declared once; None means the model's preset (train.py)."""
    g = parser.add_argument_group("policy and optimizer")
    g.add_argument("--lora-rank", type=flags.NONNEG_INT, default=None, help="LoRA rank; 0 trains the full transformer")
    g.add_argument("--lora-alpha", type=flags.NONNEG, default=None,
                   help="LoRA alpha (scale = alpha / rank; default: the preset's, else the rank)")
    g.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16"],
                   help="autocast dtype of model forwards; the SDE step and log-probs are always float32")
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute transformer activations in the backward pass (less memory, ~30%% more compute)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the trained transformer(s) in every phase: the training forward (through DDP "
                        "where it wraps them) and, on the bare module, the rollout, the old / sampling copy, the KL "
                        "reference and the held-out evaluation. Under --fsdp only the training forward: the rollout's "
                        "one gather per block (Policy.gathered) works through FSDP2's hooks, which are not checked "
                        "under compile, so the forwards without gradients stay eager. The first step pays the "
                        "compiles: one per phase, one more where a second batch size makes the batch dimension "
                        "dynamic")
    g.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=False,
                   help="full fine-tune (--lora-rank 0) under torchrun: shard weights, gradients and Adam state over "
                        "the processes (FSDP2) instead of replicating them (DDP)")
    g.add_argument("--fsdp-reduce", default="micro-step", choices=["micro-step", "optimizer-step"],
                   help="--fsdp: reduce-scatter the gradients after every micro-step (the least memory) or once per "
                        "optimizer step (the least traffic, the unsharded float32 gradients kept until then: 4 bytes "
                        "a parameter, e.g. 9 GB for SD3.5-M)")
    g.add_argument("--lr", type=flags.POSITIVE, default=None, help="AdamW learning rate")
    g.add_argument("--lr-schedule", default="constant", choices=["constant", "linear", "cosine"],
                   help="learning rate over the run: constant, or from --lr down to --lr-final x --lr at --steps")
    g.add_argument("--lr-final", type=flags.bounded(float, 0, 1), default=0.1,
                   help="--lr-schedule linear / cosine: the last step's learning rate as a fraction of --lr")
    g.add_argument("--weight-decay", type=flags.NONNEG, default=1e-4, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=flags.POSITIVE, default=1.0, help="gradient clipping norm")
    g.add_argument("--ema-decay", type=flags.bounded(float, 0, 1, high_open=True), default=None,
                   help="EMA of the trained weights (0: off), warmed up as flow_grpo/ema.py: the decay after n "
                        "optimizer steps is min((1 + n) / (10 + n), this). Evaluation (--eval-every) and the "
                        "exported lora/ use the EMA; trainable.safetensors keeps the live weights to resume from")
    g.add_argument("--ema-every", type=flags.POSITIVE_INT, default=1,
                   help="update the EMA after optimizer steps n with (n + 1) %% this == 0, as flow_grpo/ema.py")
    g.add_argument("--critic-lr", type=flags.POSITIVE, default=None,
                   help="the critic's (fake score's) AdamW learning rate (default: the loss's, its authors')")
    g.add_argument("--critic-updates", type=flags.POSITIVE_INT, default=None,
                   help="critic optimizer steps per policy optimizer step (the two-time-scale rule; default: the "
                        "loss's: Flow-Factory's ttur_fake_updates 5)")
    g.add_argument("--teacher", action="append", default=None, metavar="[KEY=]base|PATH",
                   help="the frozen teacher of the distillation losses: base (the base model; default) or a checkpoint "
                        "folder of this project (its trainable.safetensors, e.g. a LoRA run's); repeated as KEY=PATH "
                        "with --teacher-field, one teacher per value of that prompt field")
    g.add_argument("--teacher-field", default=None,
                   help="--teacher KEY=PATH ...: the prompt rows' metadata field whose value picks a sample's teacher")
    g.add_argument("--ema-repeat", type=flags.POSITIVE_INT, default=1,
                   help="apply the decay this many times per update: Flow-GRPO steps its EMA after every micro-batch, "
                        "so each due update repeats once per accumulated micro-batch (2 in its 32-GPU configs, 4 in "
                        "GRPO-Guard's 16-GPU ones)")
    return g
