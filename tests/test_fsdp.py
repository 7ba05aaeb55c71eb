"""FSDP2 full fine-tuning under torchrun (2 CPU processes, gloo): it trains, its checkpoints are plain
(they load into an unsharded transformer and optimizer), it resumes exactly, and it is the same algorithm as DDP."""
import json
import math
import os
import sys

import pytest
import torch

import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tests/test_train.py's SMALL run, as a full fine-tune with two optimizer steps per step (the second one off-policy)
# and three micro-steps per optimizer step (one per trained denoising step): gradient accumulation is exercised.
FLAGS = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4", "--train-batch-size", "2",
         "--minibatches", "2", "--num-steps", "4", "--resolution", "32", "--log-images-every", "1",
         "--lora-rank", "0", "--save-every", "1", "--ema-decay", "0.9"]
METRICS = ("reward_mean", "reward_std", "loss", "ratio_mean", "approx_kl", "grad_norm")
# FSDP and DDP differ only in float rounding (the gathered weights sit in other buffers, so CPU kernels block the
# matmuls differently): ratios agree to ~1e-8 and weights to ~3e-7, against a ratio change of ~5e-4 and weight
# updates of ~lr = 1e-3 per step. The loss is a mean of -A * ratio with zero-mean A, so it is compared absolutely.
# approx_kl (~1e-4, the mean squared log-ratio) agrees to 1e-6 of itself on an AMD EPYC, 7e-6 on an Intel Xeon.
SAME = dict(reward_mean=dict(rel=1e-5), reward_std=dict(rel=1e-4), loss=dict(abs=1e-7), ratio_mean=dict(abs=1e-7),
            approx_kl=dict(rel=1e-4, abs=1e-10), grad_norm=dict(rel=1e-5))


def torchrun(out, *flags):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *FLAGS,
           "--out", str(out), *flags]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = forkserver.run(cmd, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def tensors(out, step, name="trainable.safetensors"):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "checkpoints", str(step), name))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    fsdp = torchrun(root / "fsdp", "--steps", "2", "--fsdp", "--eval-every", "2", "--eval-prompts", "prompts/tiny.txt",
                    "--eval-steps", "2")
    resumed = torchrun(root / "resumed", "--steps", "2", "--fsdp", "--resume", str(root / "fsdp" / "checkpoints" / "1"))
    ddp = torchrun(root / "ddp", "--steps", "2")
    return dict(root=root, fsdp=fsdp, resumed=resumed, ddp=ddp)


def test_fsdp_run_trains_on_policy_and_evaluates_on_all_ranks(runs):
    rows = runs["fsdp"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert not r.get("skipped"), r
        assert all(math.isfinite(r[k]) for k in METRICS), r
        assert abs(r["first_ratio_dev"]) < 1e-4  # the sharded training forward reproduces the rollout's log-probs
        assert abs(r["ratio_mean"] - 1) > 1e-7  # the second minibatch ran after an update: the weights moved
        assert r["grad_norm"] > 0
    evals = [json.loads(line) for line in open(runs["root"] / "fsdp" / "eval.jsonl")]
    # ODE evals ran before training and after step 2 (every rank sampled)
    assert [e["step"] for e in evals] == [0, 2] and all(-1 < e["reward"] < 0 for e in evals)


def test_checkpoint_loads_into_a_plain_transformer_and_optimizer(runs):
    import models
    out = runs["root"] / "fsdp"
    weights = tensors(out, 2)
    pipe = models.load_pipeline("tiny")
    transformer = pipe.transformer
    params = dict(transformer.named_parameters())
    assert list(weights) and set(weights) == set(params)  # full tensors, the names of an unsharded run
    assert all(weights[n].shape == params[n].shape for n in params)
    assert any(not torch.equal(weights[n], params[n].detach()) for n in params)  # trained, not the initial weights
    full = dict(transformer.state_dict(), **weights)  # the buffers (fixed positional table) are not trained
    transformer.load_state_dict(full, strict=True)
    assert all(torch.equal(params[n].detach(), weights[n]) for n in params)
    # The rank checksum is the full model's: the sum over both ranks' shards equals the one over the saved tensors.
    state = json.load(open(out / "checkpoints" / "2" / "state.json"))
    sums = state["rank_checksums"]
    expected = sum(t.double().sum().item() + t.double().abs().sum().item() for t in weights.values())
    assert len(sums) == 2 and sums[0] == sums[1] and sums[0] == pytest.approx(expected, rel=1e-9)
    # optimizer.pt is optimizer.state_dict() of an unsharded AdamW over the parameters in their order.
    optimizer = torch.optim.AdamW(list(params.values()), lr=1e-3)
    optimizer.load_state_dict(torch.load(out / "checkpoints" / "2" / "optimizer.pt", weights_only=True))
    adam = optimizer.state_dict()["state"]
    assert len(adam) == len(params)
    for i, p in enumerate(params.values()):
        assert adam[i]["exp_avg"].shape == p.shape and float(adam[i]["step"]) == 4  # 2 steps x 2 minibatches
    ema = tensors(out, 2, "ema.safetensors")
    assert set(ema) == set(params) and all(ema[n].shape == params[n].shape for n in params)


def test_resume_under_fsdp_matches_the_uninterrupted_run(runs):
    (full,), (resumed,) = [r for r in runs["fsdp"] if r["step"] == 2], runs["resumed"]
    assert resumed["step"] == 2
    for key in METRICS:
        assert resumed[key] == pytest.approx(full[key], rel=1e-4, abs=1e-9), key
    root = runs["root"]
    for name in ("trainable.safetensors", "ema.safetensors"):  # weights, and the EMA resharded from the file
        a, b = tensors(root / "fsdp", 2, name), tensors(root / "resumed", 2, name)
        assert all(torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-7) for n in a), name
    opt_a = torch.load(root / "fsdp" / "checkpoints" / "2" / "optimizer.pt", weights_only=True)["state"]
    opt_b = torch.load(root / "resumed" / "checkpoints" / "2" / "optimizer.pt", weights_only=True)["state"]
    assert all(torch.allclose(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"], rtol=1e-4, atol=1e-12) for i in opt_a)


def test_fsdp_and_ddp_are_the_same_algorithm(runs):
    assert [r["step"] for r in runs["ddp"]] == [1, 2]
    for f, d in zip(runs["fsdp"], runs["ddp"]):
        for key, tol in SAME.items():
            assert f[key] == pytest.approx(d[key], **tol), (key, f["step"])
    root = runs["root"]
    for name in ("trainable.safetensors", "ema.safetensors"):  # after 4 Adam steps of ~1e-3 each
        a, b = tensors(root / "fsdp", 2, name), tensors(root / "ddp", 2, name)
        assert set(a) == set(b)
        assert max((a[n] - b[n]).abs().max().item() for n in a) < 1e-5, name


def test_fsdp_with_lora_is_refused_in_one_line():
    proc = forkserver.run([sys.executable, "train.py", "--fsdp", "--lora-rank", "4", "--steps", "1"], cwd=ROOT,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--fsdp" in proc.stderr.strip().splitlines()[-1] and "--lora-rank 0" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("name,attributes", [
    ("tiny", ["transformer_blocks"]), ("tiny-flux", ["transformer_blocks", "single_transformer_blocks"]),
    ("tiny-wan", ["blocks"]), ("tiny-qwen-image", ["transformer_blocks"]),
    ("tiny-flux2-klein", ["transformer_blocks", "single_transformer_blocks"]),
    ("tiny-z-image", ["noise_refiner", "context_refiner", "layers"])])
def test_every_family_is_sharded_block_by_block(name, attributes):
    """FSDP's all-gather units are the transformer blocks, whatever attribute a family keeps them in."""
    import distributed
    import models
    transformer = models.load_pipeline(name).transformer
    expected = [block for attribute in attributes for block in getattr(transformer, attribute)]
    assert distributed.transformer_blocks(transformer) == expected and expected
