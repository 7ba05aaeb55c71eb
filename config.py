"""The flags of train.py, where each value comes from, and the refusals of combinations that cannot work.

    p, args = parse_args(argv)        # every flag; unset ones filled from the presets; args.sources: where from
    per_rank = check_args(p, args, world_size)   # one-line argparse errors before any model loads
    print(report(p, args))            # --print-config: "--lr 0.0003  # recipes/sd3_ocr_grpo.args:12"

A value comes from the first of these that sets it (args.sources and args.json say which):
    1. the command line, or a recipe file (`@recipes/x.args`; flags after it win over it), with its line;
    2. LOSS_PRESETS[model, loss] (below): settings measured for one model and one loss;
    3. the loss's own defaults (losses.LOSSES[loss].defaults, and .hub_defaults on hub models);
    4. the model's preset, in its record (families.MODELS; the full-size models start from the hub preset);
    5. argparse's default, declared beside the code that reads the flag (models.py, policy.py, data.py, rewards.py,
       losses.py, regularizers.py, run.py; the sampling and batching here);
then a few derived values (--lora-alpha from --lora-rank, --train-cfg from --guidance-scale, --kl-floor from
--kl-beta, GARDO's rules off at --kl-beta 0). Flag types and @recipe files: flags.py.
"""
import argparse
import math
import os
import re

import torch

import data
import diversity
import families
import flags
import losses
import models
import policy
import regularizers
import rewards
import run
import sde
from distributed import WORLD, print0
from flags import FRACTION, NONNEG_INT, POSITIVE, POSITIVE_INT, SEED, bounded

DESCRIPTION = "Online RL for flow-matching text-to-image models: Flow-GRPO and its successors."
# Settings measured for one model and one loss: they win over the loss's defaults (losses.LOSSES), which win over
# the model's preset (its families.MODELS record). DiffusionNFT on the shapes world: 6-step rollouts, 3 of their sigmas
# trained per sample (docs/shapes.md: as fast a rise per sample as 10 steps with 3 sigmas, at 83 % of the time per step).
LOSS_PRESETS = {("shapes", "nft"): dict(num_steps=6, timestep_fraction=0.5),
                ("shapes-edit", "nft"): dict(num_steps=6, timestep_fraction=0.5)}


def parse_args(argv=None):
    """The flags (add_arguments); unset flags take --model's preset, then the loss's defaults, then the preset of the
    model and loss together. -> (parser, args); args.sources says where each value came from (`report`)."""
    shown = {name: families.preset(name) for name in ("shapes", "tiny", "sd3", "flux")}  # --help: each one's value
    p = flags.RecipeParser(description=DESCRIPTION, fromfile_prefix_chars="@",
                           formatter_class=flags.preset_help(shown, families.common.HUB))
    add_arguments(p)
    args = p.parse_args(argv)
    sources = p.given()  # dest -> "command line" or "<recipe>:<line>"
    record = families.MODELS[args.model]
    model = f"model preset ({args.model})"
    if args.loss is None:
        args.loss, sources["loss"] = record.preset.get("loss", "grpo"), model
    loss = losses.LOSSES[args.loss]
    if loss.process == "forward" and args.sde is not None:  # flags that would be silently ignored
        p.error(f"--sde chooses the stochastic step of the reverse-process losses; --loss {args.loss} samples with a "
                "deterministic --sampler: drop --sde")
    if args.window_range is not None and args.sde_window not in ("fast", "sparse"):
        p.error("--window-range bounds the drawn steps of --sde-window fast or sparse: use one of them, or drop it")
    loss_defaults = dict(loss.defaults, **(loss.hub_defaults if record.hub else {}))
    if record.guidance_embedded:  # FLUX.1-dev's guidance is a distilled embedding, not CFG: the model's
        loss_defaults.pop("guidance_scale", None)
    layers = [({"timestep_fraction": 1.0}, "default"), (record.preset, model),  # later layers win
              (loss_defaults, f"loss default ({args.loss})"),
              (LOSS_PRESETS.get((args.model, args.loss), {}), f"model and loss preset ({args.model}, {args.loss})")]
    filled = {key: (value, source) for values, source in layers for key, value in values.items()}
    for key, (value, source) in filled.items():  # fill what the command line and recipes left unset
        if getattr(args, key) is None:
            setattr(args, key, value)
            sources[key] = source
    if args.lora_alpha is None:  # a rank given without alpha: scale alpha / rank = 1
        args.lora_alpha, sources["lora_alpha"] = float(args.lora_rank), "derived: --lora-rank"
    if args.train_cfg is None:
        args.train_cfg = args.guidance_scale > 1 and not record.guidance_embedded
        sources["train_cfg"] = "derived: --guidance-scale > 1"
    if args.kl_beta == 0 and (args.gardo_gate or args.gardo_reference):  # e.g. a GARDO recipe + --kl-beta 0 (a full
        print0("warning: --kl-beta 0 leaves no KL term for --gardo-gate / --gardo-reference to shape: both are off")
        args.gardo_gate, args.gardo_reference = None, False  # fine-tune without a snapshot): nothing to gate or renew
        sources["gardo_gate"] = sources["gardo_reference"] = "derived: off at --kl-beta 0"
    if args.kl_floor is None:  # the KL controller only tightens, unless told it may fall
        args.kl_floor, sources["kl_floor"] = args.kl_beta, "derived: --kl-beta"
    if args.kl_beta == 0 and args.kl_reference == "start":  # no KL term: no snapshot to keep
        args.kl_reference, sources["kl_reference"] = "base", "derived: base at --kl-beta 0"
    args.sources = {action.dest: sources.get(action.dest, "default") for action in p._actions
                    if action.dest not in ("help", "sources")}
    return p, args


# The stochastic step's flags, read by the rollouts of the reverse-process losses only (the forward-process losses
# sample with --sampler): --print-config marks their values unused there.
SDE_FLAGS = ("--sde", "--eta", "--sde-window", "--window-range", "--flash", "--flash-ratio")


def report(p, args):
    """Every resolved setting with its source, one per line, grouped as --help groups them (--print-config)."""
    unused = SDE_FLAGS if losses.LOSSES[args.loss].process == "forward" else ()
    lines, settings = [], rewards.redacted(vars(args))  # URLs without their user:password
    for group in p._action_groups:
        rows = [(a.option_strings[0], settings[a.dest], args.sources[a.dest]) for a in group._group_actions
                if a.dest in args.sources]
        rows = [(flag, value, f"{source}, unused by --loss {args.loss}" if flag in unused else source)
                for flag, value, source in rows]
        if rows:
            lines.append(f"# {'sampling, batching and the run' if group.title == 'options' else group.title}")
            width = max(len(f"{flag} {value}") for flag, value, _ in rows)
            lines += [f"{f'{flag} {value}':<{width}}  # {source}" for flag, value, source in rows]
    if args.fsdp and WORLD == 1:
        lines.append("# --fsdp: launch it under torchrun --nproc_per_node N > 1 (it shards over the processes)")
    return "\n".join(lines)


def add_arguments(p):
    """Every flag, grouped as the phases of a step: the sampling and batching here, the rest declared where the code
    that reads it is (models.py, policy.py, data.py, rewards.py, losses.py, run.py); flag types and @recipe files in
    flags.py."""
    models.add_arguments(p)  # the model family, its weights and sizes
    policy.add_arguments(p)  # what trains and how: LoRA or full, precision, sharding; AdamW, clipping, the EMA
    data.add_arguments(p)  # the prompt files
    add_sampling_arguments(p)
    # reward
    p.add_argument("--reward", default=None, help='reward spec: a name or weighted mix, e.g. "ocr=0.8,pickscore=0.2"; '
                   "choices: " + ", ".join(rewards.REWARDS))
    p.add_argument("--reward-key", default="reward",
                   help="which reward entry trains (a component name or the weighted total 'reward')")
    rewards.add_arguments(p)  # the reward options, declared and defaulted in rewards.py
    diversity.add_arguments(p)  # --diversity: feature diversity per step and evaluation
    regularizers.add_arguments(p)  # GARDO's rules, for every loss
    losses.add_arguments(p)  # the loss flags, declared in losses.py: --loss takes choices=LOSSES
    # the update's batching
    p.add_argument("--train-batch-size", type=POSITIVE_INT, default=None, help="samples per training forward, per GPU")
    p.add_argument("--minibatches", type=POSITIVE_INT, default=None, help="optimizer steps per pass over the batch")
    p.add_argument("--updates-per-batch", type=POSITIVE_INT, default=1, help="passes over each sampled batch")
    # the run: its length and seed here; its folder, logs, checkpoints and evaluation in run.py
    p.add_argument("--steps", type=POSITIVE_INT, default=None, help="training steps (each: one sampled batch)")
    p.add_argument("--seed", type=SEED, default=0, help="seed; rank r samples with seed-derived noise per step")
    run.add_arguments(p)
    p.add_argument("--print-config", action="store_true",
                   help="print every resolved setting and where it came from (command line, recipe file and line, "
                        "model and loss preset, loss default, model preset, default), then exit before any model loads")


def add_sampling_arguments(p):
    """The rollout: the schedule, guidance, the stochastic step and which steps train, the batch of groups."""
    p.add_argument("--num-steps", type=bounded(int, 2, 1000), default=None,
                   help="denoising steps of a training rollout (at most the 1000 of the training grid)")
    p.add_argument("--shift", type=bounded(float, 0, 100, low_open=True), default=None,
                   help="static time shift of the sigma schedule (default: the model's own schedule, models.sigmas; "
                        "only for models with a static shift: sd3, wan, z-image)")
    p.add_argument("--max-sequence-length", type=POSITIVE_INT, default=None,
                   help="text tokens per prompt (default: the model family's, see models.py)")
    p.add_argument("--guidance-scale", type=POSITIVE, default=None,
                   help="CFG scale (FLUX: distilled guidance value); --loss nft / awm: 1 on CFG models")
    p.add_argument("--guidance-scale-2", type=POSITIVE, default=None,
                   help="Wan 2.2: the CFG scale of the low-noise expert wherever a forward uses CFG (default: "
                        "--guidance-scale, as WanPipeline's guidance_scale_2)")
    p.add_argument("--audio-guidance-scale", type=POSITIVE, default=None,
                   help="LTX-2: the CFG scale of the soundtrack wherever a forward uses CFG (default: --guidance-scale; "
                        "LTX2Pipeline's audio_guidance_scale, 7 in its __call__)")
    p.add_argument("--negative-prompt", default="", help="negative prompt for CFG")
    p.add_argument("--train-cfg", action=argparse.BooleanOptionalAction, default=None,
                   help="use CFG in the training forward too (default: when sampling uses CFG)")
    p.add_argument("--sde", default=None, choices=["flow", "dance", "cps"],
                   help="stochastic step: Flow-GRPO, DanceGRPO or coefficient-preserving")
    p.add_argument("--eta", type=POSITIVE, default=None, help="noise level of the SDE step")
    p.add_argument("--sde-window", default="all", choices=sde.WINDOWS,
                   help="which steps are stochastic and trained: all, Flow-GRPO-Fast random window, "
                        "MixGRPO sliding window, or FlowDPPO's sparse random steps (one set per step)")
    p.add_argument("--window-size", type=POSITIVE_INT, default=2, help="steps in the fast/mix window")
    p.add_argument("--window-range", type=NONNEG_INT, nargs=2, default=None, metavar=("LO", "HI"),
                   help="--sde-window fast: the window lies in steps LO .. HI - 1 (Flow-GRPO's sde_window_range; "
                        "its start is drawn from LO .. HI - --window-size); sparse: its steps are drawn from them; "
                        "default 0 and --num-steps - 1")
    p.add_argument("--window-stride", type=POSITIVE_INT, default=1, help="steps the mix window slides each time")
    p.add_argument("--iters-per-window", type=POSITIVE_INT, default=25,
                   help="training steps before the mix window slides")
    p.add_argument("--roll-back", action=argparse.BooleanOptionalAction, default=False,
                   help="mix window returns to step 0 after reaching the end")
    p.add_argument("--flash", action=argparse.BooleanOptionalAction, default=False,
                   help="MixGRPO-Flash: second-order solver on a compressed schedule after the window")
    p.add_argument("--flash-ratio", type=FRACTION, default=0.4,
                   help="--flash: the steps after the window are compressed to about this fraction "
                        "(MixGRPO's dpm_post_compress_ratio; sde.flash_grid)")
    p.add_argument("--timestep-fraction", type=FRACTION, default=None,
                   help="fraction of steps trained with --sde-window all; --loss nft: of the schedule's sigmas each "
                        "sample trains at, int(T x fraction); awm: the range its strata cover (default: 1; nft 0.99, "
                        "awm 0.9)")
    p.add_argument("--sampler", default=None, choices=sde.SOLVERS,
                   help="--loss nft / awm: deterministic rollout solver, Euler or DPM-Solver++(2M) (default: dpm2)")
    p.add_argument("--group-size", type=POSITIVE_INT, default=None, help="images per prompt (a group; may span GPUs)")
    p.add_argument("--prompts-per-step", type=POSITIVE_INT, default=None, help="prompts per training step, global")
    p.add_argument("--sample-batch-size", type=POSITIVE_INT, default=None, help="images per rollout forward, per GPU")
    p.add_argument("--same-noise-per-group", action=argparse.BooleanOptionalAction, default=False,
                   help="every image of a prompt's group starts from the same noise x_T (MixGRPO's --init_same_noise; "
                        "Flow-GRPO's same_latent); the SDE noise still differs")


def check_args(p, args, world_size):
    """Refuse flag combinations that cannot work, before any model is loaded. -> samples per process."""
    _check_finite(p, args)
    per_rank = _check_batches(p, args, world_size)
    _check_roles(p, args)
    _check_model(p, args, world_size)
    _check_loss(p, args, per_rank)
    _check_reward(p, args)
    return per_rank


def _check_roles(p, args):
    """The distillation losses' roles (policy.Policy._roles, _teachers): their flags only where a loss reads them, a
    teacher that exists, the teachers' keys with --teacher-field, no --fsdp with a trained role (its weights are not
    sharded yet)."""
    loss = losses.LOSSES[args.loss]
    _check_loss_flags(p, args, loss)  # first: a flag no distillation loss reads (--kl-beta) is named as such
    for dest, needs in (("teacher", loss.terms), ("teacher_field", loss.terms), ("critic_lr", loss.roles),
                        ("critic_updates", loss.roles)):
        if not needs and _given(args, dest):
            p.error(f"--{dest.replace('_', '-')} is read by the distillation losses with "
                    f"{'a teacher' if dest.startswith('teacher') else 'a critic'}, not by --loss {args.loss}: drop it")
    if not loss.terms:
        return
    if "tdm_weight" in loss.reads() and not 0 < args.tdm_weight < 1:  # both rewards keep a share (losses.tdm_r1_loss)
        p.error(f"--tdm-weight {args.tdm_weight}: must lie strictly between 0 and 1 (the guidance reward's share, 1 - "
                "it the surrogate's)")
    keyed = [spec.partition("=")[0] for spec in args.teacher if "=" in spec]
    if len(args.teacher) > 1 and (len(keyed) != len(args.teacher) or not args.teacher_field):
        p.error("several --teacher need a key each and --teacher-field: --teacher KEY=PATH ... --teacher-field FIELD")
    if args.teacher_field and len(args.teacher) > 1 and len(set(keyed)) != len(keyed):
        p.error(f"--teacher keys must differ, got {', '.join(keyed)}")
    for spec in args.teacher:
        path = spec.partition("=")[2] if "=" in spec else spec
        if path != "base" and not os.path.isfile(os.path.join(path, "trainable.safetensors")):
            p.error(f"--teacher {spec}: {path} is not a checkpoint folder (no trainable.safetensors there): give a "
                    "run's checkpoints/<step> folder, or base")
    if loss.roles and args.fsdp:
        p.error(f"--fsdp with --loss {args.loss}: its trained critic is not sharded yet; train without --fsdp")


def _check_finite(p, args):
    """Every number a flag holds is finite, those typed a plain float too: NaN fails every comparison and takes
    whichever branch a test leaves it (--crd-temperature nan ran the T = 0 centring, --gardo-kl-thres nan never
    renewed the reference), and within float32's range, where the losses compute (--crd-temperature 1e300: inf)."""
    for action in p._actions:
        value = getattr(args, action.dest, None)
        if any(isinstance(v, float) and not abs(v) <= flags.FLOAT32_MAX
               for v in (value if isinstance(value, (list, tuple)) else (value,))):
            p.error(f"{action.option_strings[0]} {value}: must be a finite number that float32 holds (at most "
                    f"{flags.FLOAT32_MAX:.3g})")


def _given(args, dest):
    """Whether the command line or a recipe set the flag (not a preset, a loss default, a default or a derivation)."""
    source = getattr(args, "sources", {}).get(dest, "default")
    return source == "command line" or re.fullmatch(r".+:\d+", source) is not None  # "<recipe>:<line>"


def _check_batches(p, args, world_size):
    """The step's samples over processes, rollout batches and micro-batches -> samples per process."""
    if args.group_size < 2:  # every loss here is group-relative
        p.error(f"--group-size {args.group_size}: each sample would be its own group mean, so every advantage is 0 and "
                "nothing trains; use --group-size 2 or more")
    samples = args.prompts_per_step * args.group_size  # global samples per step
    if samples % world_size:
        p.error(f"--prompts-per-step x --group-size = {samples} is not divisible by the {world_size} processes")
    per_rank = samples // world_size
    if per_rank % args.sample_batch_size:
        p.error(f"{per_rank} samples per GPU are not divisible by --sample-batch-size {args.sample_batch_size}")
    if per_rank % (args.train_batch_size * args.minibatches):
        p.error(f"{per_rank} samples per GPU are not divisible by --train-batch-size x --minibatches = "
                f"{args.train_batch_size * args.minibatches}")
    return per_rank


def _check_model(p, args, world_size):
    """Guidance, precision and sharding, sizes, the KL's anchor, the optimizer, the run folder."""
    if args.train_cfg and args.guidance_scale <= 1:
        p.error("--train-cfg needs CFG at sampling: set --guidance-scale > 1 or drop --train-cfg")
    if args.train_cfg and families.MODELS[args.model].guidance_embedded:
        p.error("FLUX.1-dev uses a guidance embedding, not CFG: drop --train-cfg")
    # fp16 needs a loss scale whose overflow check agrees across the shards of every rank (FSDP1's ShardedGradScaler);
    # policy.py's GradScaler sees its own shard only. bf16 needs no scale, and Flow-GRPO's FSDP configs use it
    # (config/grpo.py pickscore_qwenimage, counting_qwenimage_edit: mixed_precision "bf16"); the SD3.5 recipes keep
    # the fp16 of its LoRA runs (config/base.py), so a full fine-tune from them adds --mixed-precision bf16.
    if args.fsdp and args.mixed_precision == "fp16":
        p.error("--mixed-precision fp16 needs loss scaling, which is not wired for --fsdp: add --mixed-precision bf16 "
                "after the recipe")
    # --print-config reads a recipe before its launch, in one process: printed, with a note on the launch (report)
    if args.fsdp and (args.lora_rank > 0 or (world_size == 1 and not args.print_config)):
        p.error("--fsdp shards a full fine-tune over processes: use it with --lora-rank 0 under torchrun "
                "--nproc_per_node N > 1 (LoRA runs use DDP)")
    if _given(args, "fsdp_reduce") and not args.fsdp:
        p.error(f"--fsdp-reduce {args.fsdp_reduce} says when --fsdp reduce-scatters its gradients, and --fsdp is off: "
                "add --fsdp (a full fine-tune under torchrun), or drop --fsdp-reduce")
    if problem := families.guidance_mismatch(args.model, args.guidance_scale_2, args.audio_guidance_scale):
        p.error(problem)
    families.settle(p, args)  # the frame rule before the model loads; the guidance's sources, LTX-2's soundtrack
    # Several experts under FSDP: an optimizer step's last micro-step may not reach every expert that an earlier one
    # did, and only its backward would reduce-scatter the gradients accumulated until then (families/wan.py _routes).
    experts = families.MODELS[args.model].trained
    if args.fsdp and getattr(args, "fsdp_reduce", None) == "optimizer-step" and len(experts) > 1:
        p.error(f"--fsdp-reduce optimizer-step reduces at the last micro-step, which may not reach every one of "
                f"{args.model}'s {' and '.join(experts)}: use --fsdp-reduce micro-step")
    if args.kl_beta > 0 and args.lora_rank == 0 and not args.gardo_reference and args.kl_reference == "base":
        p.error("--kl-beta > 0 with --lora-rank 0 has no base model to anchor the KL (it is the LoRA adapter off): add "
                "--kl-reference start (a snapshot of the starting weights), or set --lora-rank > 0 or --kl-beta 0")
    if args.kl_target > 0 and not args.kl_beta:
        p.error("--kl-target adapts the weight of a KL term: give its starting weight with --kl-beta > 0")
    # Flags that would be silently ignored, where the command line or a recipe set them (as --sampling-decay below).
    if _given(args, "kl_rate") and not args.kl_target:
        p.error("--kl-rate is the step of the KL weight's controller toward --kl-target, which is off: give "
                "--kl-target > 0, or drop --kl-rate")
    if _given(args, "kl_floor") and not args.kl_target:
        p.error("--kl-floor bounds the KL weight's controller, which is off: give --kl-target > 0, or drop --kl-floor")
    if args.kl_target > 0 and not args.kl_rate * losses.KL_ERROR < 1:  # 10: 0 after one step; 1e30: inf, NaN
        p.error(f"--kl-rate {args.kl_rate:g}: the KL weight's factor per step, 1 +- {losses.KL_ERROR:g} x rate, must "
                f"stay within (0, 2]: use a rate below {1 / losses.KL_ERROR:g} (Ziegler et al.: 0.1)")
    if args.kl_target > 0 and args.kl_floor > args.kl_beta:
        p.error(f"--kl-floor {args.kl_floor:g} is above the starting weight --kl-beta {args.kl_beta:g}: the weight "
                f"would jump to the floor at the first step; give --kl-floor <= --kl-beta")
    if (_given(args, "gardo_reset_freq") or _given(args, "gardo_kl_thres")) and not args.gardo_reference and \
            not getattr(args, "sources", {}).get("gardo_reference", "").startswith("derived"):  # not off by --kl-beta 0
        p.error("--gardo-reset-freq / --gardo-kl-thres say when GARDO's reference is renewed: add "
                "--gardo-reference, or drop them")
    if _given(args, "lr_final") and getattr(args, "lr_schedule", "constant") == "constant":
        p.error("--lr-final is where --lr-schedule linear / cosine ends; the schedule is constant: add "
                "--lr-schedule cosine (or linear), or drop --lr-final")
    if args.kl_reference == "start" and args.gardo_reference:
        p.error("--kl-reference start and --gardo-reference are two snapshots as the KL's anchor, one never renewed, "
                "one renewed on GARDO's schedule: pick one")
    if args.gardo_reset_freq < 1 or args.gardo_kl_thres < 0:
        p.error(f"--gardo-reset-freq {args.gardo_reset_freq} / --gardo-kl-thres {args.gardo_kl_thres:g}: a number of "
                "steps >= 1 and a KL >= 0")
    if args.lr >= 1:  # Adam moves every weight by about lr a step: the first update overflows the weights
        p.error(f"--lr {args.lr:g}: Adam moves each weight by about --lr per step; use a rate below 1 (the recipes "
                "train LoRA at 1e-4 to 3e-4)")
    if args.lora_rank > 0 and args.lora_alpha <= 0:
        p.error("--lora-alpha must be > 0 with a LoRA adapter (its scale is alpha / rank)")
    multiple = models.MODELS[args.model].multiple
    sides = args.resolution if isinstance(args.resolution, tuple) else (args.resolution,)
    if multiple and any(side % multiple for side in sides):
        p.error(f"--resolution {args.resolution} must be a multiple of {multiple} for --model {args.model} "
                "(VAE down-sampling x transformer patch)")
    if args.prompt_store and os.path.exists(args.prompt_store) and not os.path.isdir(args.prompt_store):
        p.error(f"--prompt-store {args.prompt_store} is not a folder: give a folder on the node's local disk for the "
                "prompt store")  # found before the model loads and the prompts are encoded
    if args.prompt_store and os.path.realpath(args.prompt_store) == os.path.realpath(args.out):
        p.error(f"--prompt-store {args.prompt_store} is the run folder (--out), whose files are the run's: give the "
                f"store a folder of its own, such as {os.path.join(args.out, 'prompt_store')}")
    if args.offload_text_encoders and args.prompt_cache_gb is not None and args.prompt_cache_gb <= 0:
        p.error("--offload-text-encoders reads every prompt from the prompt cache: give --prompt-cache-gb > 0 (or "
                "leave it unset)")  # models.prompt_cache refused it too, but after the model had loaded
    if args.overwrite and args.resume:
        p.error("--overwrite starts the run over and --resume continues it: give one of them")


def _check_loss(p, args, per_rank):
    """What the chosen loss can train: its SDE, units, copies, sigmas, windows."""
    loss = losses.LOSSES[args.loss]
    if loss.process == "reverse" and args.sde not in loss.sde_kinds:
        p.error(f"--loss {args.loss} needs a Gaussian transition log-prob, which --sde {args.sde} does not have "
                f"(cps scores -mean(delta^2)): use --sde {' or '.join(loss.sde_kinds)}")
    if args.edit_vl_input != "diffusers" and not models.MODELS[args.model].edit_vl_input:
        p.error(f"--edit-vl-input {args.edit_vl_input} changes what Qwen-Image-Edit's VL encoder sees; --model "
                f"{args.model} has no such input: drop the flag or use --model qwen-image-edit")
    if args.eval_every and not args.eval_prompts:
        p.error("--eval-every needs --eval-prompts (a held-out prompt file)")
    _check_loss_flags(p, args, loss)
    if loss.reference and loss.reference(vars(args)) and args.lora_rank == 0:
        p.error(f"--loss {args.loss} compares with the base model, which is the LoRA adapter disabled: set "
                "--lora-rank > 0, or point the loss's reference at the old copy (its flags: --help)")
    width = unit_width(loss, args)  # a pair or group must sit on one process, whole in each micro-batch
    if loss.unit != "sample" and (per_rank % args.group_size or args.train_batch_size % width):
        p.error(f"--loss {args.loss} trains whole {loss.unit}s of one group's samples: make the {per_rank} samples per "
                f"process a multiple of --group-size {args.group_size} and --train-batch-size a multiple of {width}")
    if _given(args, "ref_update_every") and "copy" not in (args.old_decay, args.sampling_decay):
        p.error(f"--ref-update-every says how often --old-decay copy copies the trained weights; --loss {args.loss}"
                f"{' --old-decay ' + args.old_decay if args.old_decay else ''} keeps no such copy: drop it")
    if args.sampling_decay is not None and not (loss.sampling_copy and loss.sampling_copy(vars(args))):
        p.error(f"--sampling-decay schedules the rollouts' own copy, which --loss {args.loss} does not keep: drop it")
    if loss.advantages is not losses.group_advantages and args.reward_combine == "advantage":
        p.error(f"--loss {args.loss} turns the rewards into its own sample weights: drop --reward-combine advantage")
    if loss.process == "forward":
        if args.sde_window != "all" or args.flash or args.step_loss_weight != "none":
            p.error(f"--sde-window / --flash / --step-loss-weight concern the SDE steps of the reverse-process losses; "
                    f"--loss {args.loss} samples with a deterministic --sampler and trains at re-noised samples: drop "
                    "them")
        try:  # the training sigmas must fit the schedule (one-line errors naming the flags)
            n_trained(loss, None, args)
        except ValueError as e:
            p.error(str(e))
    else:
        if args.sampler is not None or args.old_decay is not None:
            p.error(f"--sampler and --old-decay belong to --loss nft / awm; --loss {args.loss} samples with --sde")
        if args.eta <= 0:
            p.error("--eta must be > 0 for training: with no noise the step is an ODE and has no log-prob")
    # Raises a one-line ValueError naming the window flag when the window does not fit the schedule.
    try:
        sde.sde_steps(args.num_steps, **window_kwargs(args, 0))
    except ValueError as e:
        p.error(str(e))


def _check_loss_flags(p, args, loss):
    """A loss's own flag (one that some losses' functions or schedules name, losses.Loss.reads) set by the command line
    or a recipe for a loss that does not read it: refused, naming the losses that do. --adv-clip is every loss's (the
    advantages' clip)."""
    group = next(g for g in p._action_groups if g.title == "loss")  # losses.add_arguments' flags
    reads = loss.reads()
    for action in group._group_actions:
        owners = [name for name, other in losses.LOSSES.items() if action.dest in other.reads()]
        if owners and action.dest != "adv_clip" and action.dest not in reads and _given(args, action.dest):
            p.error(f"{action.option_strings[0]} is read by --loss {' / '.join(owners)}, not by --loss {args.loss}: "
                    "drop it")


def _check_reward(p, args):
    """The reward spec, its trained key, GARDO's auxiliary rewards and diversity features."""
    if args.gardo_diversity and args.diversity == "off":
        p.error("--gardo-diversity scales advantages by image-feature distances: choose the features with "
                "--diversity dinov2, clip or pixels")
    if args.diversity == "pixels" and args.diversity_path:
        p.error("--diversity pixels reads the images themselves, no model: drop --diversity-path")
    try:
        components = [name for name, _ in rewards.parse_spec(args.reward)]  # unknown names fail here, before any model
    except ValueError as e:
        p.error(str(e))
    if args.reward_key != "reward" and args.reward_key not in components and "custom" not in components:
        p.error(f"--reward-key {args.reward_key!r} is not a component of --reward {args.reward!r}")
    hearing = [name for name in components if name in rewards.HEARING]
    if hearing and not families.MODELS[args.model].sound:
        p.error(f"--reward {hearing[0]} scores the samples' sound, which --model {args.model} does not make: train a "
                "model with sound (--model ltx2), or score its frames")
    spec = rewards.parse_spec(args.reward)
    if args.reward_key == "reward" and args.reward_combine == "score" and not any(w for _, w in spec):
        p.error(f"--reward {args.reward!r} weighs every component 0: the trained total is 0 for every sample and "
                "nothing trains; give a component a weight, or train one alone with --reward-key NAME")
    # What trains: the --reward-key component, or every weighted one (the total, or --reward-combine advantage).
    trained = {args.reward_key} if args.reward_key != "reward" else \
        {name for name, w in spec if w or args.reward_combine == "advantage"}
    for name in args.gardo_gate or []:  # scored beside the trained reward, never trained on
        if name not in components or name in trained:
            p.error(f"--gardo-gate {name}: name components of --reward {args.reward!r} other than the trained ones "
                    f"({', '.join(sorted(trained))}), scored and weighted 0, e.g. --reward "
                    "ocr=1,aesthetic=0,imagereward=0 --reward-key ocr --gardo-gate aesthetic,imagereward")
    if args.reward_combine == "advantage" and args.reward_key != "reward":
        p.error("--reward-combine advantage trains on every component of --reward: drop --reward-key")
    if args.reward_combine == "advantage" and not sum(w for _, w in rewards.parse_spec(args.reward)) > 0:
        p.error(f"--reward-combine advantage divides the weights of --reward {args.reward!r} by their sum (MixGRPO), "
                "which must be positive: give a positive weight")


def window_kwargs(args, step, draw=()):
    """sde.sde_steps' arguments at `step`; `draw` (rank, rollout batch) picks the batch's own fast window."""
    return dict(window=args.sde_window, iteration=step, timestep_fraction=args.timestep_fraction,
                window_size=args.window_size, window_range=args.window_range, stride=args.window_stride,
                iters_per_window=args.iters_per_window, roll_back=args.roll_back, seed=(args.seed, *draw))


def guidance_scales(args):
    """(sampling, training forward) guidance: the training forward drops CFG unless --train-cfg (FLUX.1-dev's
    embedded guidance is part of the model, always)."""
    embedded = families.MODELS[args.model].guidance_embedded
    return args.guidance_scale, args.guidance_scale if (args.train_cfg or embedded) else 1.0


def forward_samples(args, reference):
    """The most samples one forward of the run holds (families.forward_samples): a rollout batch at the sampling
    scale, a held-out one at the evaluation's, a micro-batch at the training forward's and at the reference's scale
    `reference` (train.reference_guidance). The video families' token bound divides the memory by it."""
    sample, train = guidance_scales(args)
    forwards = [(args.sample_batch_size, sample), (args.train_batch_size, train), (args.train_batch_size, reference)]
    if args.eval_every:
        forwards.append((args.sample_batch_size, run.eval_guidance(args)))
    return families.forward_samples(args.model, forwards, args.audio_guidance_scale)


def unit_width(loss, args):
    """Samples per unit of loss.unit: 1, a pair's 2, or a group's --group-size."""
    return {"sample": 1, "pair": 2, "group": args.group_size}[loss.unit]


def n_trained(loss, batch, args):
    """Loss terms per sample: its trained steps K (reverse process) or training sigmas (forward)."""
    if loss.process == "reverse":
        return batch["steps"].shape[1]
    return loss.times(1, torch.Generator(), **vars(args)).shape[1]
