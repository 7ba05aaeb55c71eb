"""What a cluster run holds on each GPU and need not, checked on a CPU: a full fine-tune's frozen text encoders in the
run's precision (policy._frozen_in), and FSDP rollouts that gather each block once instead of at every forward
(policy.Policy.gathered, distributed.gathered), under two gloo ranks."""
import json
import math
import os
import sys

import pytest
import torch

import models
import train
from policy import Policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dtypes(module):
    return sorted({str(q.dtype) for q in module.parameters()})


# ----------------------------------------------------------------------------- frozen encoders in the run's precision

def test_a_full_fine_tune_keeps_its_frozen_text_encoders_in_the_autocast_dtype():
    """--lora-rank 0 --mixed-precision bf16: the text encoders bf16 (they were float32, as the transformer), the trained
    transformer and its optimizer's weights float32, the VAE float32; the encoders' bf16 weights are the rounding of
    the float32 load; --mixed-precision no keeps everything float32 (the golden runs)."""
    _, args = train.parse_args(["--model", "tiny", "--lora-rank", "0", "--mixed-precision", "bf16"])
    policy = Policy(args, torch.device("cpu"), old_copy=False)
    pipe = policy.pipe
    assert dtypes(pipe.text_encoder) == dtypes(pipe.text_encoder_2) == ["torch.bfloat16"]
    assert dtypes(pipe.transformer) == dtypes(pipe.vae) == ["torch.float32"]
    assert {q.dtype for _, q in policy.trainable} == {torch.float32}
    assert len(policy.trainable) == len(list(pipe.transformer.parameters()))
    full = models.load_pipeline("tiny")
    for (name, q), (_, ref) in zip(pipe.text_encoder.named_parameters(), full.text_encoder.named_parameters()):
        assert torch.equal(q, ref.to(torch.bfloat16)), name
    for (name, q), (_, ref) in zip(pipe.transformer.named_parameters(), full.transformer.named_parameters()):
        assert torch.equal(q, ref), name
    embeds = models.encode_prompts(pipe, ["a red cube"])
    assert embeds["prompt_embeds"].dtype == torch.bfloat16
    _, args = train.parse_args(["--model", "tiny", "--lora-rank", "0", "--mixed-precision", "no"])
    pipe = Policy(args, torch.device("cpu"), old_copy=False).pipe
    assert {d for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.transformer, pipe.vae) for d in dtypes(m)} == {
        "torch.float32"}


def test_fp16_keeps_the_t5_layers_transformers_keeps_in_float32():
    """fp16 (tiny-flux's T5): every T5 weight fp16 but its `wo` layers (T5EncoderModel._keep_in_fp32_modules, whose
    fp16 outputs overflow), which keep the float32 load's bits, as from_pretrained(torch_dtype=fp16) loads them; the
    embeddings are finite."""
    _, args = train.parse_args(["--model", "tiny-flux", "--lora-rank", "0", "--mixed-precision", "fp16"])
    pipe = Policy(args, torch.device("cpu"), old_copy=False).pipe
    full = models.load_pipeline("tiny-flux")
    t5 = dict(pipe.text_encoder_2.named_parameters())
    kept = [n for n in t5 if "wo" in n.split(".")]
    assert kept and dtypes(pipe.text_encoder) == ["torch.float16"]
    for name, ref in full.text_encoder_2.named_parameters():
        want = ref if name in kept else ref.to(torch.float16)
        assert t5[name].dtype == want.dtype and torch.equal(t5[name], want), name
    embeds = models.encode_prompts(pipe, ["a red cube", "two blue spheres"])
    assert all(v.is_floating_point() and torch.isfinite(v).all() for v in embeds.values())


def test_a_bf16_full_fine_tune_trains_with_finite_losses(tmp_path, monkeypatch):
    """The run's first two steps: finite losses and gradient norms, the prompts encoded by the bf16 encoders."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    train.main(["--model", "tiny", "--lora-rank", "0", "--mixed-precision", "bf16", "--loss", "grpo", "--steps", "2",
                "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4", "--train-batch-size", "4",
                "--num-steps", "4", "--resolution", "32", "--log-images-every", "0", "--out", str(out)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r


# ----------------------------------------------------------------------------- FSDP rollouts: one gather per block

def test_init_binds_the_process_group_to_the_rank_gpu(monkeypatch):
    """On GPUs the process group is made with device_id (NCCL's communicator built at once, on this rank's GPU);
    on CPUs (gloo) without one."""
    import torch.distributed as dist

    import distributed
    made = []
    monkeypatch.setattr(distributed, "WORLD", 2)
    monkeypatch.setattr(distributed, "LOCAL_RANK", 1)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.append((backend, kw.get("device_id"))))
    monkeypatch.setattr(dist, "new_group", lambda **kw: "host group")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert distributed.init() == torch.device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.init() == torch.device("cpu")
    assert made == [("nccl", torch.device("cuda:1")), ("gloo", None)]


def _rollout_worker(out):
    """Under torchrun (2 ranks, gloo): a sharded full fine-tune of the tiny model per --mixed-precision; rollouts with
    and without Policy.gathered, before and after an optimizer step, with the live weights and inside ema_weights;
    FSDP2's all-gathers counted. Each rank writes what the test checks."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.tensor import DTensor

    import distributed
    import sde
    device = distributed.init()
    gathers, real = [], _fsdp_param_group.foreach_all_gather
    _fsdp_param_group.foreach_all_gather = lambda *a, **k: gathers.append(1) or real(*a, **k)
    found = {}
    for precision in ("no", "bf16"):
        _, args = train.parse_args(["--model", "tiny", "--lora-rank", "0", "--resolution", "32", "--fsdp",
                                    "--mixed-precision", precision, "--ema-decay", "0.5"])
        policy = Policy(args, device, old_copy=False)
        pipe, transformer = policy.pipe, policy.modules["transformer"]
        units = sum(isinstance(m, FSDPModule) for m in transformer.modules())
        embeds = models.encode_prompts(pipe, ["a cat", "a dog"], guidance_scale=3.0)
        sigmas = models.sigmas(pipe, 4, 32)

        def rollout(seed=0):
            gen = torch.Generator().manual_seed(10 * seed + distributed.RANK)
            x = models.initial_noise(pipe, 2, 32, generator=gen)
            gathers.clear()
            traj, images = models.generate(pipe, x, sigmas, embeds, guidance_scale=3.0, autocast=policy.autocast,
                                           sde_steps=sde.sde_steps(4), kind="flow", eta=0.7, generator=gen)
            return dict(traj, images=images), len(gathers)

        def shards():  # every parameter the transformer holds is its DTensor shard, the optimizer's own
            held = list(transformer.named_parameters())
            return all(isinstance(q, DTensor) for _, q in held) and all(
                a is b for (_, a), (_, b) in zip(held, policy.trainable)) and len(held) == len(policy.trainable)

        def same(a, b):
            return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        policy.train(False)
        plain, plain_gathers = rollout()
        with policy.gathered():
            kept, kept_gathers = rollout()
            inside = shards()
        f = dict(units=units, plain_gathers=plain_gathers, kept_gathers=kept_gathers, same=same(plain, kept),
                 unsharded_inside=not inside, shards_after=shards())
        policy.train()  # a training step after the rollout: one gather per unit and forward again, then resharded
        x = models.initial_noise(pipe, 2, 32, generator=torch.Generator().manual_seed(5 + distributed.RANK))
        gathers.clear()
        policy.sync_gradients(True)
        v = policy.velocity(x, 0.5, {k: v for k, v in embeds.items() if not k.startswith("neg_")}, 1.0, train=True)
        f.update(train_forward_gathers=len(gathers), shards_after_train_forward=shards())
        policy.backward(v.float().square().mean())
        f["step"] = policy.step()[0]
        policy.train(False)
        with policy.ema_weights():  # the held-out evaluation's weights (run.Run.evaluate)
            ema_plain, _ = rollout(1)
        with policy.ema_weights(), policy.gathered():
            ema_kept, ema_gathers = rollout(1)
        live_plain, _ = rollout(1)
        with policy.gathered():
            live_kept, _ = rollout(1)
        f.update(ema_same=same(ema_plain, ema_kept), ema_gathers=ema_gathers, live_same=same(live_plain, live_kept),
                 ema_differs=not torch.equal(ema_plain["latents"], live_plain["latents"]), shards_at_end=shards())
        found[precision] = f
    with open(os.path.join(out, f"rank{distributed.RANK}.json"), "w") as fh:
        json.dump(found, fh)
    distributed.finish()


def test_fsdp_rollouts_gather_each_block_once_and_sample_the_same_bits(tmp_path):
    """Two gloo ranks, FSDP2 in float32 and bf16: a 4-step rollout under CFG all-gathers each unit (the blocks and the
    root) once inside Policy.gathered, against once per forward without it, and its samples, log-probs, means and
    images are the same bits; inside, the units hold their gathered weights, and after it every parameter is its
    DTensor shard again (the optimizer's own object), a training forward gathers per forward and reshards, and the
    optimizer steps. The evaluation's EMA weights, entered before the gathering, are what it samples; a later
    rollout samples the live weights (no stale gathered copy)."""
    import forkserver
    forkserver.two_ranks("test_cluster_memory.py", "rollout", tmp_path)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for precision, f in found.items():
            units = f["units"]
            assert units == 3, f  # the tiny transformer's two joint blocks and its root
            assert f["plain_gathers"] == 4 * units and f["kept_gathers"] == units, (rank, precision, f)
            assert f["ema_gathers"] == units and f["train_forward_gathers"] == units, (rank, precision, f)
            assert f["same"] and f["ema_same"] and f["live_same"] and f["ema_differs"], (rank, precision, f)
            assert f["unsharded_inside"] and f["shards_after"] and f["shards_after_train_forward"], (rank, f)
            assert f["shards_at_end"] and f["step"] == "ok", (rank, precision, f)


if __name__ == "__main__":  # the FSDP rollout worker, under torchrun
    _rollout_worker(sys.argv[2])


def test_the_attention_backend_is_chosen_explicitly_and_recorded(tmp_path, capsys):
    """--attention-backend sets diffusers' backend on every trained module (here the math SDPA kernel on Wan's
    processors, which dispatch), args.json records it, and a backend whose package is missing is refused in one line
    naming the flag."""
    import json

    import models

    pipe = models.load_pipeline("tiny-wan2.2")
    models.attention_backend(pipe, "_native_math")
    for module in models.trained_modules(pipe).values():
        backends = {str(getattr(m.processor, "_attention_backend", None)) for m in module.modules()
                    if hasattr(m, "processor")}
        assert backends == {"AttentionBackendName._NATIVE_MATH"}, backends
    with pytest.raises(RuntimeError, match="--attention-backend flash: .*flash-attn"):
        models.attention_backend(pipe, "flash")
    out = tmp_path / "run"
    train.main(["--model", "tiny-wan", "--attention-backend", "_native_math", "--steps", "1", "--num-steps", "2",
                "--prompts-per-step", "1", "--group-size", "2", "--sample-batch-size", "2", "--train-batch-size", "2",
                "--log-images-every", "0", "--out", str(out)])
    assert json.load(open(out / "args.json"))["args"]["attention_backend"] == "_native_math"


def test_the_compiled_training_forward_reproduces_the_rollouts_log_probs(tmp_path, monkeypatch):
    """--compile (inductor on the CPU) compiles every phase: the training forward, and on the bare module the rollout's
    and the KL reference's (--kl-beta on a LoRA run: the adapter off). With micro-batches of 2 where the rollout batches
    are 4, the first update's ratio stays within 1e-4 of 1, the hub recipes' clip range, and the losses and gradient
    norms are the eager run's to float rounding. Dynamo compiles each phase (grad mode x train mode) in the first step
    and nothing after it. After the run the compiled forwards give the eager module's velocity with other weights
    exchanged in place (the old copy's way) and with the adapter off, without a recompile: no stale graph. (The three
    compiles: about a minute with inductor's on-disk cache warm, two to three minutes cold on 2 cores.)"""
    from torch._dynamo import callback_handler
    from torch._dynamo.callback import CallbackTrigger

    flags = ["--model", "tiny", "--lora-rank", "4", "--kl-beta", "0.04", "--steps", "3", "--num-steps", "4",
             "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4", "--train-batch-size", "2",
             "--resolution", "32", "--log-images-every", "0"]
    made, steps, compiles = [], [], []

    class Kept(Policy):  # the run's policy, kept to probe its compiled forwards afterwards
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)
    monkeypatch.setattr(train, "Policy", Kept)

    def on_compile(info):  # which phase dynamo compiles a frame for: the steps done, grad mode, train / eval mode
        if info.callback_trigger == CallbackTrigger.DYNAMO:
            compiles.append((len(steps), torch.is_grad_enabled(), made[-1].modules["transformer"].training))
    callback_handler.register_start_callback(on_compile)
    rows = {}
    try:
        for name, extra in (("eager", []), ("compiled", ["--compile"])):
            steps.clear()
            train.main(flags + extra + ["--out", str(tmp_path / name)], on_step=lambda info: steps.append(info))
            rows[name] = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
            if name == "eager":
                assert compiles == []
        policy = made[-1]
        assert [m.__dict__.get("forward") for m in policy.modules.values()] == [None]  # the class's, outside
        ran = len(compiles)
        found = _compiled_against_eager(policy)
    finally:
        callback_handler.remove_start_callback(on_compile)
    assert len(rows["compiled"]) == len(rows["eager"]) == 3
    # The on-policy GRPO loss is mean(-A ratio) with group-centred A of order 1 and ratio 1: a cancellation whose value
    # (~1e-7) is the summation's rounding, so the gradient is what must agree. Each Adam step amplifies the compiled
    # kernels' other rounding about a hundredfold (its first updates are near sign(g), and the components with g ~ 0
    # flip): on AMD EPYC with AVX-512 the grad norms differ by 3e-7, 8e-4 and 7e-2 at steps 1, 2 and 3, so the two
    # runs are held tight over their first two steps and only to the same scale at the third.
    for step, (compiled, eager) in enumerate(zip(rows["compiled"], rows["eager"]), start=1):
        assert compiled["first_ratio_dev"] < 1e-4
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-2, abs=2e-6)
        assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-3 if step <= 2 else 0.2), step
    # rollout (no grad, eval mode), reference (no grad, train mode), training (grad): one compile each, all in the
    # first step (a training-only compile makes one); the exchange and the adapter switch after the run, none
    assert sorted(compiles[:ran]) == [(0, False, False), (0, False, True), (0, True, True)], compiles
    assert len(compiles) == ran, compiles[ran:]
    for name, (compiled, eager, other) in found.items():
        assert torch.allclose(compiled, eager, atol=1e-5), (name, (compiled - eager).abs().max())
        assert (compiled - other).abs().max() > 1e-3, name  # what a stale graph would have returned


def _compiled_against_eager(policy):
    """The run's compiled forwards against the eager module, in the rollout's shapes and mode with the trained weights
    exchanged for others (policy.frozen("old")), and in the reference's (train mode, a micro-batch of 2, adapter off):
    {name: (compiled, eager, what the weights before the exchange / with the adapter give)}."""
    pipe, args = policy.pipe, policy.args
    sample_guidance, train_guidance = train.guidance_scales(args)
    embeds = models.encode_prompts(pipe, ["a red cube", "a blue ball"] * 2, guidance_scale=max(sample_guidance,
                                   train_guidance), max_sequence_length=args.max_sequence_length)
    x = models.initial_noise(pipe, 4, 32, generator=torch.Generator().manual_seed(3))
    sigma = torch.full((4,), 0.6)
    gen = torch.Generator().manual_seed(4)
    policy.copies["old"] = {n: q.detach() + 0.1 * torch.randn(q.shape, generator=gen) for n, q in policy.trainable}
    found = {}
    policy.train(False)
    with torch.no_grad():
        live = policy.velocity(x, sigma, embeds, sample_guidance)
        with policy.frozen("old"):
            found["exchanged"] = (policy.velocity(x, sigma, embeds, sample_guidance),
                                  models.velocity(pipe, x, sigma, embeds, guidance_scale=sample_guidance), live)
    policy.train(True)
    sub = {k: v[:2] for k, v in embeds.items()}
    with torch.no_grad():
        live = models.velocity(pipe, x[:2], sigma[:2], sub, guidance_scale=train_guidance)
    with policy.frozen("reference"):
        found["adapter off"] = (policy.velocity(x[:2], sigma[:2], sub, train_guidance),
                                models.velocity(pipe, x[:2], sigma[:2], sub, guidance_scale=train_guidance), live)
    policy.copies["old"] = None
    return found
