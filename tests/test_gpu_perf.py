"""What a GPU run spends and need not, checked on a CPU: the prompt-embedding cache and the text encoders' offload
(models.prompt_cache), FSDP2's mixed precision and gradient accumulation (distributed.shard_transformer), DDP's
options, the LoRA layers' compute dtype and the OCR threads per rank."""
import contextlib
import json
import os
import unittest.mock

import pytest
import torch

import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every text-to-image family's tiny twin, and the shapes model (trained CLIP encoders)
TEXT_MODELS = ["tiny", "tiny-flux", "tiny-wan", "tiny-qwen-image", "tiny-flux2-klein", "tiny-z-image",
               "tiny-flux-kontext", "shapes"]
PROMPTS = ["a red cube", "two blue spheres on a long wooden table next to a window", "x", "a red cube"]


@pytest.fixture(scope="module")
def pipes():
    return {}


def pipe_of(pipes, name):
    if name not in pipes:
        pipes[name] = models.load_pipeline(name)
    pipe = pipes[name]
    pipe.prompt_cache = None
    return pipe


def count_encodes(monkeypatch):
    """Record the prompts the text encoders see (models._encode_fresh's calls)."""
    seen, fresh = [], models._encode_fresh

    def spy(pipe, prompts, **kw):
        seen.append(list(prompts))
        return fresh(pipe, prompts, **kw)
    monkeypatch.setattr(models, "_encode_fresh", spy)
    return seen


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


# ----------------------------------------------------------------------------- the prompt cache

@pytest.mark.parametrize("name", TEXT_MODELS)
def test_cached_embeddings_equal_fresh_encodes_bit_for_bit(pipes, name, monkeypatch):
    """For every family, with and without CFG's negative: the first encode through the cache is the uncached one, and
    the second comes from the cache alone (the encoders not called) and equals it bit for bit, padding and masks
    of the variable-length families included; another batch of cached prompts agrees to float rounding."""
    pipe = pipe_of(pipes, name)
    fresh = {g: models.encode_prompts(pipe, PROMPTS, guidance_scale=g, negative_prompt="blurry") for g in (1.0, 3.0)}
    models.prompt_cache(pipe, 0.1)
    seen = count_encodes(monkeypatch)
    for _ in range(2):
        for g in (1.0, 3.0):
            assert_same(models.encode_prompts(pipe, PROMPTS, guidance_scale=g, negative_prompt="blurry"), fresh[g])
    assert seen == [PROMPTS, ["blurry"]]  # all four rows, the repeat too, in one batch as uncached; the negative of
    # the first CFG call (its row is the uncached one's: the negative is always encoded alone); then all hits
    cache = pipe.prompt_cache
    assert cache.misses == 4 and cache.hits == 12
    assert all(t.device.type == "cpu" for v in cache.entries.values() for t in v.values())
    subset = models.encode_prompts(pipe, PROMPTS[2:0:-1], guidance_scale=3.0, negative_prompt="blurry")  # reordered
    assert len(seen) == 2
    reference = models._encode_fresh(pipe, PROMPTS[2:0:-1], guidance_scale=3.0, negative_prompt="blurry",
                                     max_sequence_length=models.default_tokens(pipe))
    assert sorted(subset) == sorted(reference)
    for k in subset:
        torch.testing.assert_close(subset[k], reference[k], rtol=0, atol=1e-5)


def test_cache_keys_the_text_length_and_the_negative_prompt(pipes, monkeypatch):
    """Other text tokens or another negative prompt never read rows encoded for different ones."""
    pipe = pipe_of(pipes, "tiny-flux")
    models.prompt_cache(pipe, 0.1)
    seen = count_encodes(monkeypatch)
    models.encode_prompts(pipe, ["a cat"], max_sequence_length=8)
    short = models.encode_prompts(pipe, ["a cat"], max_sequence_length=4)
    assert short["prompt_embeds"].shape[1] == 4 and seen == [["a cat"], ["a cat"]]
    pipe = pipe_of(pipes, "tiny")
    models.prompt_cache(pipe, 0.1)
    seen.clear()
    one = models.encode_prompts(pipe, ["a cat"], guidance_scale=3.0, negative_prompt="blurry")
    two = models.encode_prompts(pipe, ["a cat"], guidance_scale=3.0, negative_prompt="dark")
    assert seen == [["a cat"], ["dark"]]  # the prompt from the cache, the new negative encoded
    assert not torch.equal(one["neg_prompt_embeds"], two["neg_prompt_embeds"])
    assert torch.equal(two["neg_prompt_embeds"][:1], models._encode_fresh(
        pipe, ["x"], guidance_scale=3.0, negative_prompt="dark", max_sequence_length=0)["neg_prompt_embeds"][:1])


def test_cache_is_bounded_least_recently_used_first_out(pipes):
    pipe = pipe_of(pipes, "tiny-wan")
    models.prompt_cache(pipe, 1.0)
    row = models._nbytes(next(iter(_filled(pipe, ["p0"]).entries.values())))
    models.prompt_cache(pipe, 3.5 * row / 2**30)  # room for three rows
    cache = _filled(pipe, ["p0", "p1", "p2"])
    models.encode_prompts(pipe, ["p0"])  # p0 used again: p1 is now the oldest
    models.encode_prompts(pipe, ["p3"])
    assert [k[1] for k in cache.entries if k[0] == "prompt"] == ["p2", "p0", "p3"]
    assert cache.bytes == 3 * row <= cache.max_bytes


def _filled(pipe, prompts):
    models.encode_prompts(pipe, prompts)
    return pipe.prompt_cache


def test_cache_steps_aside_for_source_images_and_trained_text_encoders(pipes, monkeypatch):
    """An edit's embeddings depend on its source image (Qwen-Image-Edit's VL encoder reads it; every edit model's
    references are its VAE latents): encoded afresh each time, as are prompts while a text encoder trains."""
    import numpy as np
    pipe = pipe_of(pipes, "tiny-flux-kontext")
    models.prompt_cache(pipe, 0.1)
    seen = count_encodes(monkeypatch)
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    for fill in (0, 255):
        image[:] = fill
        out = models.encode_prompts(pipe, ["make it red"], images=[[image]], resolution=32)
    assert seen == [["make it red"]] * 2 and not pipe.prompt_cache.entries and "ref_latents" in out
    pipe.text_encoder.requires_grad_(True)
    try:
        models.encode_prompts(pipe, ["a cat"])
        models.encode_prompts(pipe, ["a cat"])
    finally:
        pipe.text_encoder.requires_grad_(False)
    assert len(seen) == 4 and not pipe.prompt_cache.entries


def test_offload_encodes_ahead_then_moves_the_encoders_only_for_a_miss(pipes, monkeypatch):
    """--offload-text-encoders: the training and held-out prompts and each CFG setting's negative are encoded ahead,
    the encoders leave the device; a cached prompt then needs no encoder, a new one brings them back for its
    encode and sends them away again."""
    pipe = pipe_of(pipes, "tiny")
    moves = []
    real_to = torch.nn.Module.to

    def to(module, *a, **k):
        if module is pipe.text_encoder:
            moves.append(str(a[0]))
        return real_to(module, *a, **k)
    monkeypatch.setattr(torch.nn.Module, "to", to)
    texts = [f"prompt {i}" for i in range(5)]
    line = models.prompt_cache(pipe, None, offload=True, texts=texts + texts[:2], guidance_scales=(1.0, 4.5),
                               negative_prompt="", batch_size=2)
    assert "5 of 5 prompts" in line and moves == ["cpu"] and pipe.prompt_cache.offloaded_from == torch.device("cpu")
    seen = count_encodes(monkeypatch)
    models.encode_prompts(pipe, texts[3:], guidance_scale=4.5)
    assert seen == [] and moves == ["cpu"]
    models.encode_prompts(pipe, ["a new prompt"])
    assert seen == [["a new prompt"]] and moves == ["cpu", "cpu", "cpu"]  # in for the miss, out again
    with pytest.raises(ValueError, match="--prompt-cache-gb > 0"):
        models.prompt_cache(pipe, 0, offload=True)


def test_offload_stops_ahead_when_the_cache_is_full(pipes):
    pipe = pipe_of(pipes, "tiny-wan")
    row = models._nbytes(next(iter(_filled_new(pipe, ["p"]).entries.values())))
    line = models.prompt_cache(pipe, 5.5 * row / 2**30, offload=True, texts=[f"p{i}" for i in range(9)],
                               batch_size=2)
    assert "4 of 9 prompts" in line  # two batches in; a third would evict the first
    assert len(pipe.prompt_cache.entries) == 5  # and the negative's entry (empty without CFG)


def _filled_new(pipe, prompts):
    models.prompt_cache(pipe, 1.0)
    return _filled(pipe, prompts)


def _run(tmp_path, name, *flags):
    import train as train_module
    out = str(tmp_path / name)
    train_module.main(["--model", "tiny", "--prompts", str(tmp_path / "p.txt"), "--prompts-per-step", "1",
                       "--group-size", "4", "--sample-batch-size", "4", "--train-batch-size", "4", "--num-steps", "3",
                       "--resolution", "32", "--log-images-every", "0", "--steps", "2", "--loss", "grpo",
                       "--guidance-scale", "3", "--eval-every", "1", "--eval-prompts", str(tmp_path / "e.txt"),
                       "--eval-steps", "2", "--out", out, *flags])
    logged = {}
    for path in ("metrics.jsonl", "eval.jsonl"):
        with open(os.path.join(out, path)) as f:
            logged[path] = [{k: v for k, v in json.loads(line).items() if isinstance(v, float) and "time" not in k
                             and not k.endswith("_s") and "second" not in k} for line in f if line.strip()]
    return logged


def test_a_run_with_the_cache_logs_what_one_without_does(tmp_path, monkeypatch):
    """The tiny model under CFG with held-out evaluations, 2 steps: with the cache, and with the encoders offloaded
    after encoding ahead, the losses, rewards and held-out figures are those of the uncached run bit for bit, and each
    prompt is encoded once (its batches here are the uncached ones: module notes in models.py); offloaded, nothing is
    encoded after the start."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "p.txt").write_text("a red apple\n")
    (tmp_path / "e.txt").write_text("a white cat\na green tree\n")
    seen = count_encodes(monkeypatch)
    plain = _run(tmp_path, "plain")
    assert sum(map(len, seen)) == 2 * 1 + 3 * 2  # steps x prompts + evaluations x held-out prompts
    assert len(plain["metrics.jsonl"]) == 2 and len(plain["eval.jsonl"]) == 3 and "loss" in plain["metrics.jsonl"][0]
    seen.clear()
    assert _run(tmp_path, "cached", "--prompt-cache-gb", "0.01") == plain
    assert seen == [["a white cat", "a green tree"], ["a red apple"]]  # at their first use (evaluation 0 first)
    seen.clear()
    assert _run(tmp_path, "offloaded", "--offload-text-encoders") == plain
    assert seen == [["a red apple"], ["a white cat", "a green tree"]]  # ahead, with the CFG negative


# ----------------------------------------------------------------------------- LoRA under autocast, OCR threads

def test_lora_layers_take_their_input_in_the_autocast_dtype_for_the_same_bits():
    """A LoRA run in bf16 (half-precision base, float32 adapter): peft's float32 copy of each LoRA layer's input is
    skipped under autocast, and the velocity and the adapter's gradients are bit for bit those with it."""
    pipe = models.load_pipeline("tiny", dtype=torch.bfloat16)
    params = models.add_lora(pipe, 4, 4.0)
    layer = pipe.transformer._lora_layers[0]
    seen = []
    layer.lora_A["default"].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    embeds = models.encode_prompts(pipe, ["a cat", "a dog"])
    x = torch.randn(2, *models.latent_shape(pipe, 32), generator=torch.Generator().manual_seed(0))
    for p in params:
        p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))  # lora_B starts at 0: make it count
    def with_peft_cast(*a):  # models.velocity without its _lora_input context: peft's float32 copy stays
        with unittest.mock.patch.object(models, "_lora_input", lambda *_: contextlib.nullcontext()):
            return models.velocity(*a)

    out = {}
    for name, fn in (("peft", with_peft_cast), ("fixed", models.velocity)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            v = fn(pipe, x, 0.5, embeds)
        v.float().square().mean().backward()
        out[name] = (v.detach(), [p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    assert seen[0] == torch.float32 and seen[-1] == torch.bfloat16  # peft's cast, then none
    assert 2 * len(pipe.transformer._lora_layers) == len(params)  # every adapted layer (its lora_A and lora_B)
    assert layer.cast_input_dtype_enabled  # peft's default, restored after the call
    assert torch.equal(out["peft"][0], out["fixed"][0])
    assert all(torch.equal(a, b) for a, b in zip(out["peft"][1], out["fixed"][1]))
    assert out["fixed"][1][0].abs().sum() > 0
    with torch.no_grad():  # without autocast the cast is needed (a bf16 input, a float32 adapter) and stays
        assert models.velocity(pipe, x.bfloat16(), 0.5, embeds).dtype == torch.bfloat16


def test_ocr_threads_are_this_rank_share_of_the_cores(monkeypatch):
    """8 ranks on a 64-core node with 2 OCR workers each: 4 threads per engine (64 / 8 / 2), not 32."""
    import rewards
    sized = []
    monkeypatch.setitem(rewards.OCR_BACKENDS, "rapidocr", lambda threads: sized.append(threads) or (lambda f: ""))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    rewards.ocr(ocr_backend="rapidocr", ocr_workers=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    rewards.ocr(ocr_backend="rapidocr", ocr_workers=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")
    rewards.ocr(ocr_backend="rapidocr", ocr_workers=2)
    assert sized == [4, 32, 1]


# ----------------------------------------------------------------------------- FSDP2: mixed precision, accumulation

def _fsdp_worker(out):
    """Under torchrun (2 ranks, gloo): a sharded tiny transformer per --mixed-precision, three accumulated micro-steps
    through Policy; rank 0 writes what the test checks."""
    import distributed
    import train
    from policy import Policy
    device = distributed.init()
    found = {}
    for precision in ("no", "bf16", "ddp", "once"):
        fsdp = {"ddp": [], "once": ["--fsdp", "--mixed-precision", "no", "--fsdp-reduce", "optimizer-step"]}.get(
            precision, ["--fsdp", "--mixed-precision", precision])
        _, args = train.parse_args(["--model", "tiny", "--lora-rank", "0", "--resolution", "32", *fsdp])
        policy = Policy(args, device, old_copy=False)
        pipe, block = policy.pipe, policy.modules["transformer"].transformer_blocks[0]  # SD3's joint blocks
        gathered = []
        block.register_forward_pre_hook(lambda m, a: gathered.append(next(m.parameters()).dtype))
        embeds = models.encode_prompts(pipe, ["a cat", "a dog"])
        synced = []
        for k in range(3):  # micro-steps of one optimizer step
            seed = torch.Generator().manual_seed(10 * k + distributed.RANK)  # as _reference_grads draws it
            x = torch.randn(2, *models.latent_shape(pipe, 32), generator=seed)
            policy.sync_gradients(k == 2)
            policy.backward(policy.velocity(x, 0.5, embeds, 1.0, train=True).float().square().mean())
            synced.append(all(q.grad is not None and q.grad.to_local().shape == q.to_local().shape
                              for _, q in policy.trainable) if fsdp else None)
        if precision == "ddp":  # replicated: each rank holds the all-reduced mean
            found["ddp"] = dict(broadcast_buffers=policy.ddp.broadcast_buffers, synced=synced,
                                bucket_view=policy.ddp.gradient_as_bucket_view)
            if distributed.is_main:
                torch.save({n: q.grad for n, q in policy.trainable}, os.path.join(out, "grads_ddp.pt"))
            continue
        state = block._get_fsdp_state()._fsdp_param_group.mp_policy
        grads = {n: q.grad.full_tensor() for n, q in policy.trainable}
        found[precision] = dict(param_dtype=str(state.param_dtype), reduce_dtype=str(state.reduce_dtype),
                                cast_inputs=state.cast_forward_inputs, gathered=str(gathered[0]), synced=synced,
                                shards=sorted({str(q.dtype) for _, q in policy.trainable}),
                                grad_dtypes=sorted({str(g.dtype) for g in grads.values()}))
        if distributed.is_main:
            torch.save(grads, os.path.join(out, f"grads_{precision}.pt"))
    if distributed.is_main:
        with open(os.path.join(out, "found.json"), "w") as f:
            json.dump(found, f)
    distributed.finish()


def _reference_grads(autocast):
    """The gradient the two ranks' micro-steps give together, unsharded, in one process (FSDP averages over ranks)."""
    pipe = models.load_pipeline("tiny")
    transformer = pipe.transformer.requires_grad_(True)
    embeds = models.encode_prompts(pipe, ["a cat", "a dog"])
    for rank in range(2):
        for k in range(3):
            x = torch.randn(2, *models.latent_shape(pipe, 32), generator=torch.Generator().manual_seed(10 * k + rank))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                v = models.velocity(pipe, x, 0.5, embeds)
            (v.float().square().mean() / 2).backward()
    return {n: q.grad for n, q in transformer.named_parameters()}


def test_fsdp_mixed_precision_and_accumulation_and_ddp_options(tmp_path):
    """FSDP2's MixedPrecisionPolicy: bf16 runs gather and compute bf16 weights, fp32 ones float32; gradients are
    reduced in float32 into float32 shards, and forward inputs are left to autocast. Every micro-step leaves its
    reduce-scattered shard of the gradient (no full unsharded gradient kept until the last one), or with --fsdp-reduce
    optimizer-step only the last one does (one reduce-scatter per optimizer step, the same gradient). The float32 path
    gives the unsharded gradient to float rounding, bf16 to bf16 rounding; so does DDP, built without buffer
    broadcasts and with its gradients as views of its buckets."""
    import forkserver
    forkserver.two_ranks("test_gpu_perf.py", "fsdp", tmp_path)
    found = json.loads((tmp_path / "found.json").read_text())
    fp32, bf16 = found["no"], found["bf16"]
    assert (fp32["param_dtype"], fp32["reduce_dtype"], fp32["gathered"]) == ("None", "torch.float32", "torch.float32")
    assert (bf16["param_dtype"], bf16["reduce_dtype"], bf16["gathered"]) == (
        "torch.bfloat16", "torch.float32", "torch.bfloat16")
    for f in (fp32, bf16):
        assert f["cast_inputs"] is False and f["shards"] == f["grad_dtypes"] == ["torch.float32"]
        assert f["synced"] == [True, True, True]  # a sharded gradient after the first micro-step already
    assert found["once"]["synced"] == [False, False, True]  # --fsdp-reduce optimizer-step: one reduce-scatter, last
    reference = _reference_grads(autocast=False)
    for path in ("grads_no.pt", "grads_ddp.pt", "grads_once.pt"):  # FSDP in float32 (reduced each micro-step, or
        # once), and DDP with its options (below)
        grads = torch.load(tmp_path / path)
        assert set(grads) == set(reference)
        for n in reference:
            torch.testing.assert_close(grads[n], reference[n], rtol=1e-4, atol=1e-7)
    # DDP: rank 0's fixed buffers are not broadcast before each forward; gradients live in the all-reduce buckets
    assert found["ddp"]["broadcast_buffers"] is False and found["ddp"]["bucket_view"] is True
    grads, reference = torch.load(tmp_path / "grads_bf16.pt"), _reference_grads(autocast=True)
    flat = torch.cat([grads[n].flatten() for n in reference])
    expected = torch.cat([reference[n].flatten() for n in reference])
    assert torch.nn.functional.cosine_similarity(flat, expected, dim=0) > 0.999
    assert not torch.equal(flat, torch.cat([g.flatten() for g in _reference_grads(autocast=False).values()]))


if __name__ == "__main__":  # the FSDP worker, under torchrun
    import sys
    _fsdp_worker(sys.argv[2])
