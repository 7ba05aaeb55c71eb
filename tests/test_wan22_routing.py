"""Wan 2.2 A14B's two experts (families/wan.py): each sample routed from a sigma held on the host, without reading a
device value, and FSDP2 over both experts under torchrun (2 CPU processes, gloo), where the ranks' micro-batches
reach different experts. The routing rule itself is checked against WanPipeline.__call__ by tests/test_families.py."""
import json
import os
import sys

import pytest
import torch
from torch._guards import detect_fake_mode

import models
from test_fake_cuda import fake_cuda, to_fake_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red cube", "two cats", "a dog"]


def test_wan22_routes_from_a_host_sigma_without_reading_the_device():
    """On fake CUDA tensors, which refuse any read of a device value: the rollout's float sigma and a training
    micro-batch's CPU sigmas on both sides of the boundary (t = 875 is the boundary itself, the high-noise expert's)
    reach each expert with its rows (hooks count them, CFG doubling each); the same sigmas handed over on the device
    need the read the host route avoids, and are refused."""
    pipe = models.load_pipeline("tiny-wan2.2")
    seen = []
    for name in ("transformer", "transformer_2"):
        getattr(pipe, name).register_forward_pre_hook(
            lambda module, args, kwargs, name=name: seen.append((name, kwargs["hidden_states"].shape[0])),
            with_kwargs=True)
    mixed = torch.tensor([0.9, 0.5, 0.875])
    with fake_cuda() as cuda:
        mode = detect_fake_mode()
        for module in models._modules(pipe):
            to_fake_cuda(module, mode)
        embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.5)
        x = models.initial_noise(pipe, 3, 32, num_frames=5, generator=torch.Generator().manual_seed(0)).to(cuda)
        for sigma, expected in [(0.9, [("transformer", 6)]), (0.5, [("transformer_2", 6)]),
                                (mixed, [("transformer", 4), ("transformer_2", 2)])]:
            seen.clear()
            v = models.velocity(pipe, x, sigma, embeds, guidance_scale=4.5)
            assert v.device == cuda and v.shape == x.shape and seen == expected, (sigma, seen)
        with pytest.raises(Exception, match=r"aten\.(nonzero|_local_scalar_dense)"):  # no value to read
            models.velocity(pipe, x, mixed.to(cuda), embeds, guidance_scale=4.5)


@pytest.mark.parametrize("name", ["grpo", "nft"])
def test_wan22_training_forwards_route_without_reading_the_device(name, monkeypatch):
    """train.train_on_batch on fake CUDA tensors with tiny-wan2.2's routed velocity, each micro-batch holding samples
    of both experts: the reverse process's stored steps (1 and 2: sigma 0.9 and 0.75, either side of the boundary)
    and the forward process's drawn sigmas reach the forwards from the host (the rollout's host_steps, renoised's
    s_host), the old copy's and the KL reference's forwards too, so no forward reads the device; both experts run."""
    import losses
    import train
    from test_fake_cuda import StubPolicy, StubRun

    class WanPolicy(StubPolicy):  # its optimizer, copies and checked backward; tiny-wan2.2's forward
        def velocity(self, x, sigma, embeds, guidance_scale, *, train=False):
            v = models.velocity(self.pipe, x, sigma, embeds, guidance_scale=guidance_scale)
            return v + 0 * self.transformer.scale.sum()  # a graph for the stand-in's backward to check
    loss = losses.LOSSES[name]
    p, args = train.parse_args(["--model", "tiny-wan2.2", "--loss", name, "--num-steps", "4", "--group-size", "2",
                                "--prompts-per-step", "2", "--sample-batch-size", "2", "--train-batch-size", "2",
                                "--lora-rank", "4", "--kl-beta", "0.01"])
    train.check_args(p, args, 1)
    monkeypatch.setattr(train, "host_stats", lambda stats: {k: [0.0] * len(v) for k, v in stats.items()})
    pipe = models.load_pipeline("tiny-wan2.2")
    calls = []
    for expert in ("transformer", "transformer_2"):
        getattr(pipe, expert).register_forward_pre_hook(lambda *a, expert=expert: calls.append(expert))
    adv_cpu = torch.tensor([1.0, -1.0, 0.5, -0.5])
    ids = train.trained_ids(loss, adv_cpu, adv_cpu != 0, 2, torch.Generator().manual_seed(0), 2)
    sigmas = models.sigmas(pipe, 4, 32)  # 1, 0.9, 0.75, 0.5, 0
    with fake_cuda() as cuda:
        mode = detect_fake_mode()
        for module in models._modules(pipe):
            to_fake_cuda(module, mode)
        policy = WanPolicy(args, cuda, old_copy=bool(loss.old_copy and loss.old_copy(vars(args))), channels=16)
        policy.pipe = pipe
        embeds = models.encode_prompts(pipe, PROMPTS[:2] * 2)
        latent = (16, 2, 4, 4)  # 32 px, 5 frames
        if loss.process == "forward":
            batch = dict(embeds=embeds, latents=torch.randn(4, 1, *latent, device=cuda))
        else:
            steps = torch.tensor([[1, 2], [2, 1], [1, 2], [2, 1]])  # [n, K]: any micro-batch of 2 mixes the sides
            batch = dict(embeds=embeds, latents=torch.randn(4, 5, *latent, device=cuda), steps=steps.to(cuda),
                         host_steps=steps, log_probs=torch.randn(4, 2, device=cuda),
                         means=torch.randn(4, 2, *latent, device=cuda), stds=torch.rand(4, 2, device=cuda))
        batch.update(prompts=PROMPTS[:2] * 2, images=torch.zeros(4, 5, 32, 32, 3, dtype=torch.uint8))
        adv = dict(adv=adv_cpu.to(cuda), ids=ids, rank_weight=1.0)
        train.train_on_batch(policy, loss, batch, adv, sigmas, args, 0, StubRun())
    assert {"transformer", "transformer_2"} <= set(calls), calls


# ----------------------------------------------------------------------------- FSDP2 over both experts
# Each rank's sigmas per micro-step of the first optimizer step (floats: the rollout's kind; CPU tensors: a training
# micro-batch's). Micro-step 0 sends rank 0 to the high-noise expert alone and rank 1 to the low-noise one alone; then
# one rank's micro-batch holds both sides while the other's holds one. The second optimizer step reaches only the
# high-noise expert, on both ranks.
SPLIT = {0: [torch.tensor([0.95, 0.9]), torch.tensor([0.9, 0.5]), 0.3],
         1: [torch.tensor([0.5, 0.3]), 0.6, torch.tensor([0.99, 0.2])]}
HIGH_ONLY = {0: [0.9], 1: [torch.tensor([0.95, 0.88])]}


def _noise(pipe, k, rank):
    return models.initial_noise(pipe, 2, 32, num_frames=5, generator=torch.Generator().manual_seed(10 * k + rank))


def _fsdp_worker(out):
    """Under torchrun (2 ranks, gloo): tiny-wan2.2 fully fine-tuned with both experts sharded through Policy; a rollout
    across the boundary with and without Policy.gathered; two optimizer steps of SPLIT's and HIGH_ONLY's micro-steps.
    Rank 0 writes the first step's gradient (full tensors) and what the test checks."""
    import distributed
    import sde
    import train
    from policy import Policy
    from torch.distributed.tensor import DTensor
    device = distributed.init()
    _, args = train.parse_args(["--model", "tiny-wan2.2", "--lora-rank", "0", "--fsdp", "--resolution", "32"])
    policy = Policy(args, device, old_copy=False)
    pipe, rank = policy.pipe, distributed.RANK
    embeds = models.encode_prompts(pipe, PROMPTS[:2])
    sigmas = models.sigmas(pipe, 4, 32)  # 1, 0.9, 0.75, 0.5, 0: two steps of each expert
    policy.train(False)

    def rollout():
        gen = torch.Generator().manual_seed(rank)
        return models.generate(pipe, _noise(pipe, 9, rank), sigmas, embeds, sde_steps=sde.sde_steps(4), kind="flow",
                               eta=0.7, generator=gen)[0]["latents"]
    plain = rollout()
    experts, held = (pipe.transformer, pipe.transformer_2), []

    def note(module, args, output):  # after each forward: which experts' first blocks hold gathered (plain) weights
        held.append([not isinstance(next(e.blocks[0].parameters()), DTensor) for e in experts])
    hooks = [e.register_forward_hook(note) for e in experts]
    with policy.gathered():
        kept = rollout()
    for hook in hooks:
        hook.remove()
    policy.train()

    def optimizer_step(micro):
        for k, sigma in enumerate(micro):
            policy.sync_gradients(last=k == len(micro) - 1)
            v = policy.velocity(_noise(pipe, k, rank), sigma, embeds, 1.0, train=True)
            policy.backward(v.float().square().mean())
        grads = {n: None if q.grad is None else q.grad.full_tensor() for n, q in policy.trainable}
        return grads, policy.step()[0]

    def weights():
        return {n: q.full_tensor() for n, q in policy.trainable}
    start = weights()
    grads, first = optimizer_step(SPLIT[rank])
    after_first = weights()
    _, second = optimizer_step(HIGH_ONLY[rank])
    after_second = weights()

    def same(a, b, expert):
        return all(torch.equal(a[n], b[n]) for n in a if n.split(".")[0] == expert)
    found = dict(rollout_same=torch.equal(plain, kept), held=held, steps=[first, second],
                 checksums=distributed.check_replicas(policy.trainable, True, device),
                 moved_first=[not same(start, after_first, e) for e in ("transformer", "transformer_2")],
                 moved_second=[not same(after_first, after_second, e) for e in ("transformer", "transformer_2")])
    if distributed.is_main:
        torch.save(grads, os.path.join(out, "grads.pt"))
        with open(os.path.join(out, "found.json"), "w") as f:
            json.dump(found, f)
    distributed.finish()


def _reference_grads():
    """The first optimizer step's gradient unsharded, in one process: both ranks' micro-steps, each loss halved (FSDP
    averages over the ranks), names as Policy's (models.named_parameters)."""
    pipe = models.load_pipeline("tiny-wan2.2")
    modules = models.trained_modules(pipe)
    for module in modules.values():
        module.requires_grad_(True)
    embeds = models.encode_prompts(pipe, PROMPTS[:2])
    for rank, micro in SPLIT.items():
        for k, sigma in enumerate(micro):
            (models.velocity(pipe, _noise(pipe, k, rank), sigma, embeds).float().square().mean() / 2).backward()
    return {n: q.grad for n, q in models.named_parameters(modules)}


def test_fsdp_shards_both_experts_where_the_ranks_reach_different_ones(tmp_path):
    """--fsdp with Wan 2.2's two experts: a micro-step where rank 0 reaches only the high-noise expert and rank 1 only
    the low-noise one completes (each rank also runs the expert it lacks on a zero-weight row, so their all-gathers and
    reduce-scatters pair; a hang is cut by the timeout), and the sharded gradient of the optimizer step is the
    unsharded one of both ranks' micro-steps to float rounding. A rollout across the boundary samples the same bits
    with each expert gathered once as with a gather per forward, and holds one expert gathered at a time. An
    optimizer step no rank's micro-batch took to the low-noise expert leaves it unchanged (no gradient: AdamW skips
    it, no momentum step), and the replicas agree."""
    import forkserver
    forkserver.two_ranks("test_wan22_routing.py", "fsdp", tmp_path)
    found = json.loads((tmp_path / "found.json").read_text())
    assert found["rollout_same"] and found["steps"] == ["ok", "ok"], found
    assert found["held"] == [[True, False]] * 2 + [[False, True]] * 2, found  # one expert gathered at a time
    assert len(found["checksums"]) == 2 and found["checksums"][0] == found["checksums"][1], found
    assert found["moved_first"] == [True, True] and found["moved_second"] == [True, False], found
    grads, reference = torch.load(tmp_path / "grads.pt"), _reference_grads()
    assert set(grads) == set(reference) and {n.split(".")[0] for n in grads} == {"transformer", "transformer_2"}
    for n in reference:
        torch.testing.assert_close(grads[n], reference[n], rtol=1e-4, atol=1e-7, msg=n)


def test_fsdp_trains_both_experts_checkpoints_and_resumes(tmp_path):
    """train.py --fsdp on tiny-wan2.2 under torchrun, DiffusionNFT (each rank draws its own training sigmas, so the
    ranks' micro-batches reach different experts, the old copy's forwards too): it trains, the checkpoint holds both
    experts' full tensors under their prefixed names with the replicas agreeing, and a run resumed from step 1 ends
    where the uninterrupted one does."""
    import forkserver
    from safetensors.torch import load_file
    flags = ["--model", "tiny-wan2.2", "--lora-rank", "0", "--fsdp", "--loss", "nft", "--num-steps", "4",
             "--group-size", "2", "--prompts-per-step", "2", "--sample-batch-size", "1", "--train-batch-size", "1",
             "--steps", "2", "--log-images-every", "0", "--save-every", "1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    for out, extra in ((tmp_path / "full", []),
                       (tmp_path / "resumed", ["--resume", str(tmp_path / "full" / "checkpoints" / "1")])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *flags,
               "--out", str(out), *extra]
        proc = forkserver.run(cmd, cwd=ROOT, env=env, timeout=300)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    full, resumed = (load_file(tmp_path / run / "checkpoints" / "2" / "trainable.safetensors")
                     for run in ("full", "resumed"))
    start = dict(models.named_parameters(models.trained_modules(models.load_pipeline("tiny-wan2.2"))))
    assert {n: t.shape for n, t in full.items()} == {n: q.shape for n, q in start.items()}  # "transformer_2." names
    for expert in ("transformer", "transformer_2"):  # each trained: some tensor moved from the start
        assert any(not torch.equal(full[n], q.detach()) for n, q in start.items() if n.split(".")[0] == expert), expert
    state = json.load(open(tmp_path / "full" / "checkpoints" / "2" / "state.json"))
    assert len(state["rank_checksums"]) == 2 and len(set(state["rank_checksums"])) == 1
    for n in full:
        torch.testing.assert_close(resumed[n], full[n], rtol=1e-5, atol=1e-7, msg=n)


if __name__ == "__main__":  # the FSDP worker, under torchrun
    _fsdp_worker(sys.argv[2])


@pytest.mark.parametrize("g, g2", [(4.0, 0.5), (4.0, 1.0), (1.0, 3.0)])
def test_wan22_guidance_matches_the_pipeline_at_every_step(g, g2, monkeypatch):
    """WanPipeline.__call__ runs CFG where guidance_scale > 1 and guides the low-noise expert by guidance_scale_2
    whatever its value (below 1 too: v_u + g_2 (v_c - v_u)); at guidance_scale 1 neither expert is guided. Four
    steps of __call__ (t = 999 and 900 on the high-noise expert, 750 and 500 on the low-noise one): the velocity it
    hands UniPC at each step is models.velocity's at the same latents and sigma."""
    pipe = models.load_pipeline("tiny-wan2.2")
    seen = []  # (velocity, latents) of each step, as __call__ hands them to its scheduler
    step = pipe.scheduler.step
    monkeypatch.setattr(pipe.scheduler, "step", lambda v, t, x, **kw: seen.append((v, x)) or step(v, t, x, **kw))
    x = models.initial_noise(pipe, 2, 64, num_frames=5, generator=torch.Generator().manual_seed(4))
    pipe(prompt=PROMPTS[:2], negative_prompt="", num_inference_steps=4, guidance_scale=g, guidance_scale_2=g2,
         height=64, width=64, num_frames=5, latents=x.clone(), max_sequence_length=models.default_tokens(pipe),
         output_type="latent")
    pipe.guidance_scale_2 = g2  # --guidance-scale-2 (train.py and eval.py set it so)
    embeds = models.encode_prompts(pipe, PROMPTS[:2], guidance_scale=g)
    sigmas = models.sigmas(pipe, 4, 64)
    assert [int(1000 * s) for s in sigmas[:4].tolist()] == [999, 900, 750, 500]  # the last two on transformer_2
    with torch.no_grad():
        for (expected, latents), s in zip(seen, sigmas[:4].tolist()):
            ours = models.velocity(pipe, latents, s, embeds, guidance_scale=g)
            torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=1e-5)
        unguided = models.velocity(pipe, seen[2][1], sigmas[2].item(), embeds)
    assert len(seen) == 4 and ((seen[2][0] - unguided).abs().max() > 1e-3) == (g > 1 and g2 != 1.0)
