"""The GPU path on a CPU: CUDA tensors as torch's fake tensors (shape, dtype and device, no data), CPU tensors real.

`fake_cuda()` runs its block with every CUDA tensor a FakeTensor and every CPU computation real (schedules, seeded
noise, indices, file I/O), and raises where a GPU run would crash or stall:
  - a CPU tensor meets a CUDA tensor in one op (FakeTensorMode raises for most ops; the guard below also for an index
    tensor and the multi-tensor ops, which FakeTensorMode lets through and which copy and wait on a GPU);
  - a CUDA value is read on the host (.item(), .tolist(), bool()): FakeTensorMode has no value to give.
Each test names the bug it would have caught on the code before the fix (resume's copies and optimizer state, the
host syncs of the trained terms).

What fake tensors cannot do: a backward pass (the autograd engine asks the driver for a CUDA context; the stand-in
policy checks the loss and sets gradients instead) and any read of a CUDA value (the one transfer of a step's
statistics, train.host_stats, is checked on real tensors separately), nor Qwen-Image's and Z-Image's encode (diffusers
cuts each prompt's tokens out on the device: it runs on the CPU and the forwards take its rows from the prompt cache).
Files are read for real, as on a GPU machine; what the checkpoint writers would write is recorded instead.
"""
import contextlib
import os

import pytest
import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                          FakeTensorMode, unset_fake_temporarily)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import checkpoints
import eval as evaluation
import losses
import models
import policy as policy_mod
import sde
import train

DEVICE = torch.device("cuda:0")
aten = torch.ops.aten
TRANSFERS = {aten._to_copy.default, aten.copy_.default}  # the ops that may move data between the CPU and the GPU


class RealCpuGuardedCuda(TorchDispatchMode):
    """Above FakeTensorMode: ops without a CUDA (fake) tensor or device run for real on the CPU; any other op whose
    arguments mix a CPU tensor (not a 0-dim scalar) with a CUDA one, other than a copy between them, raises."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = kwargs.get("device")
        if not any(isinstance(t, FakeTensor) and t.device.type == "cuda" for t in tensors) and \
                (device is None or torch.device(device).type == "cpu"):
            with unset_fake_temporarily():  # CPU work stays real: its values matter (schedules, indices, RNG)
                return func(*args, **kwargs)
        if func not in TRANSFERS and any(t.device.type == "cuda" for t in tensors):
            if cpu := [tuple(t.shape) for t in tensors if t.device.type == "cpu" and t.dim() > 0]:
                raise RuntimeError(f"{func}: CPU tensors {cpu} meet CUDA tensors (a crash or a copy and wait on a GPU)")
        return func(*args, **kwargs)


def real_io(read):
    """A file reader that builds real tensors, as on a GPU machine (torch.load would build fake ones here)."""
    def real(*args, **kwargs):
        with unset_fake_temporarily():
            return read(*args, **kwargs)
    return real


@contextlib.contextmanager
def fake_cuda():
    """Inside: CUDA tensors are fake, CPU ones real, files read for real, and torch.cuda.is_available() is True."""
    import safetensors.torch
    with pytest.MonkeyPatch.context() as mp:
        # No CUDA runtime here: FakeTensorMode then uses a no-op device guard, which slicing and indexing need.
        mp.setattr(FakeTensorMode, "avoid_device_init", property(lambda self: True))
        mp.setattr(torch, "load", real_io(torch.load))
        mp.setattr(safetensors.torch, "load_file", real_io(safetensors.torch.load_file))
        with FakeTensorMode(allow_non_fake_inputs=True), RealCpuGuardedCuda():
            mp.setattr(torch.cuda, "is_available", lambda: True)
            yield DEVICE


def test_the_stand_in_fails_where_a_gpu_would():
    with fake_cuda() as cuda:
        x, on_cpu = torch.zeros(4, 3, device=cuda), torch.ones(4, 3)
        assert torch.tensor([1.0, 2.0]).sum().item() == 3.0  # CPU values are real
        assert (x + torch.tensor(2.0)).device == cuda  # a CPU scalar may meet a CUDA tensor, as on a GPU
        for crash in (lambda: x.lerp_(on_cpu, 0.5), lambda: x[torch.tensor([0, 1])], lambda: x.sum().item(),
                      lambda: torch._foreach_lerp_([x], [on_cpu], 0.5), lambda: bool((x > 0).any())):
            with pytest.raises(Exception):
                crash()


# ----------------------------------------------------------------------------- a policy over a stand-in transformer
class Net(torch.nn.Module):
    def __init__(self, channels, device):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(channels, device=device))
        self.shift = torch.nn.Parameter(torch.zeros(channels, device=device))
        self.proj = torch.nn.Linear(8, channels, device=device)


class StubPolicy(policy_mod.Policy):
    """policy.Policy's own optimizer step, EMA, old copy, swaps and resume, over a per-channel affine velocity (plus
    the prompt embedding) in place of a pipeline: v = x scale + shift + proj(pooled). The reference model is the
    affine map at scale 1, shift 0. step() is Policy.step without its one read of the gradient norm per optimizer
    step (a host sync a GPU run makes on purpose, to skip a non-finite step); backward() checks the loss and leaves
    a gradient of ones (the autograd engine needs a CUDA context, which fake tensors do not have)."""

    def __init__(self, args, device, *, old_copy, sampling_copy=False, channels=4):
        self.args, self.device, self.amp_dtype, self.ddp, self.pipe = args, device, None, None, None
        self.transformer = Net(channels, device)
        self.modules = self.models = {"transformer": self.transformer}
        self.trainable = list(self.transformer.named_parameters())
        self.optimizer = torch.optim.AdamW([q for _, q in self.trainable], lr=1e-2)
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        self.copies = self._copies(args, old_copy, sampling_copy)  # the EMA, the old and sampling copies, GARDO's
        self.optimizer_steps, self.reference_on = 0, False

    def velocity(self, x, sigma, embeds, guidance_scale, *, train=False):
        net, shape = self.transformer, (1, -1) + (1,) * (x.dim() - 2)
        if self.reference_on:
            return x + 0 * net.proj(embeds["pooled"]).view(x.shape[0], -1, *[1] * (x.dim() - 2))
        return x * net.scale.view(shape) + net.shift.view(shape) + net.proj(embeds["pooled"]).view(
            x.shape[0], -1, *[1] * (x.dim() - 2))

    @contextlib.contextmanager
    def frozen(self, name):
        if name == "old" or self.copies["reference"] is not None:  # Policy's own swaps (--gardo-reference's snapshot)
            with super().frozen(name):
                yield
            return
        self.reference_on = True
        try:
            with torch.no_grad():
                yield
        finally:
            self.reference_on = False

    def backward(self, loss):  # the autograd engine asks the CUDA driver for a context: the graph is checked instead
        assert loss.dim() == 0 and loss.device == self.device and loss.requires_grad
        for _, q in self.trainable:
            q.grad = torch.ones_like(q) if q.grad is None else q.grad + 1

    def step(self):
        torch.nn.utils.clip_grad_norm_([q for _, q in self.trainable], self.args.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self._update_ema()
        return "ok", 1.0


def parse(loss="nft", *extra):
    p, args = train.parse_args(["--model", "tiny", "--loss", loss, "--num-steps", "4", "--group-size", "2",
                                "--prompts-per-step", "2", "--sample-batch-size", "2", "--train-batch-size", "1",
                                "--lora-rank", "4", "--ema-decay", "0.9", *extra])
    train.check_args(p, args, 1)
    return args


def assert_beside(policy):
    """Every copy and every Adam state tensor on the weights' device, the copies in float32."""
    for name, copy in policy.copies.items():
        for n, q in policy.trainable if copy is not None else ():
            assert copy[n].device == q.device and copy[n].dtype == torch.float32, (name, n, copy[n].device)
    for state in policy.optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                assert value.device == DEVICE, (key, value.device)


def use_every_copy(policy):
    """The operations of a step that touch the copies: the EMA and old-copy updates, both swaps."""
    for n, q in policy.trainable:
        q.grad = torch.ones_like(q)
    policy.step()  # AdamW and the EMA update
    policy.update_old(0.5)
    with policy.ema_weights():
        pass
    with policy.frozen("old"):
        pass


def write_checkpoint(tmp_path, args, *, optimizer_on_gpu=False, cuda_rng=None):
    """A checkpoint as a GPU run writes it (checkpoints.save, real files): its optimizer.pt, saved from cuda:0,
    tags every tensor with that device when optimizer_on_gpu."""
    args.out = str(tmp_path)
    cpu = StubPolicy(args, torch.device("cpu"), old_copy=True)
    use_every_copy(cpu)
    path = checkpoints.save(args, 1, dict(cpu.trainable), cpu.optimizer.state_dict(), cpu.copies,
                            dict(optimizer_steps=cpu.optimizer_steps))
    if optimizer_on_gpu:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
            torch.save(cpu.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))
    if cuda_rng is not None:
        torch.save({"torch": torch.get_rng_state(), "cuda": cuda_rng}, os.path.join(path, "rng.pt"))
    return path, cpu


def test_resume_puts_the_ema_the_old_copy_and_adam_beside_the_weights(tmp_path):
    """Bug 1: the copies stayed on the CPU, and the first EMA or old-copy update mixed CPU and CUDA tensors."""
    args = parse("nft")
    path, _ = write_checkpoint(tmp_path, args)
    with fake_cuda() as cuda:
        policy = StubPolicy(args, cuda, old_copy=True)
        state = policy.resume(path, args)
        assert state["optimizer_steps"] == policy.optimizer_steps == 1
        use_every_copy(policy)  # the step after a resume: AdamW, the EMA and old-copy updates, the swaps
        assert_beside(policy)


def test_resume_reads_a_gpu_saved_optimizer_onto_the_cpu_first(tmp_path):
    """Bug 2: optimizer.pt saved from cuda:0 was read back onto cuda:0 on every rank (here: no GPU to read it to)."""
    args = parse("nft")
    path, _ = write_checkpoint(tmp_path, args, optimizer_on_gpu=True)
    with fake_cuda() as cuda:
        policy = StubPolicy(args, cuda, old_copy=True)
        policy.resume(path, args)
        assert_beside(policy)


def test_resume_restores_the_cuda_rng_it_saved(tmp_path, monkeypatch):
    args = parse("grpo")
    path, _ = write_checkpoint(tmp_path, args, cuda_rng=torch.arange(16, dtype=torch.uint8))
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state.clone()))
    with fake_cuda() as cuda:
        StubPolicy(args, cuda, old_copy=False).resume(path, args)
    assert len(restored) == 1 and torch.equal(restored[0], torch.arange(16, dtype=torch.uint8))


def test_a_checkpoint_hands_only_cpu_tensors_to_the_file_writers(tmp_path, monkeypatch):
    """checkpoints.write from a run whose weights, EMA, old copy and Adam state are CUDA tensors: every tensor the
    writers receive is on the CPU, the weights and copies in float32. Before the fix optimizer.pt was handed the
    CUDA Adam state (torch.save copied it tensor by tensor and tagged it cuda:0, which resume then had to undo)."""
    import safetensors.torch
    args = parse("nft")
    args.out = str(tmp_path)
    handed = {}

    def recorder(name_of):
        def write(obj, path, *rest, **kwargs):  # fake tensors hold no data: record what would be written
            handed[name_of(path)] = [(t.device, t.dtype) for t in tree_leaves(obj) if torch.is_tensor(t)]
            open(path, "wb").close()
        return write
    monkeypatch.setattr(safetensors.torch, "save_file", recorder(os.path.basename))
    monkeypatch.setattr(checkpoints.torch, "save", recorder(os.path.basename))
    # its one read of the replicas' checksums is a deliberate sync per checkpoint, which fake tensors cannot give
    monkeypatch.setattr(checkpoints.distributed, "check_replicas", lambda trainable, fsdp, device: [0.0])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8))
    with fake_cuda() as cuda:
        policy = StubPolicy(args, cuda, old_copy=True)
        use_every_copy(policy)
        checkpoints.write(args, 1, policy.transformer, policy.trainable, policy.optimizer, policy.copies, cuda,
                          dict(optimizer_steps=policy.optimizer_steps))
    assert sorted(handed) == ["ema.safetensors", "old.safetensors", "optimizer.pt", "rng.pt", "trainable.safetensors"]
    n = len(policy.trainable)
    assert len(handed["optimizer.pt"]) == 3 * n  # step, exp_avg, exp_avg_sq per parameter
    for name, tensors in handed.items():
        assert tensors and all(device.type == "cpu" for device, _ in tensors), (name, tensors)
        if name.endswith(".safetensors"):
            assert len(tensors) == n and all(dtype == torch.float32 for _, dtype in tensors), (name, tensors)


def test_the_copies_update_and_swap_on_the_device():
    with fake_cuda() as cuda:
        policy = StubPolicy(parse("nft"), cuda, old_copy=True)
        use_every_copy(policy)
        assert_beside(policy)


def test_multi_tensor_updates_and_swaps_equal_the_per_tensor_loops_bit_for_bit(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2, 2), (1,), (40,)]
    trainable = [(f"w{i}", torch.randn(s, generator=gen)) for i, s in enumerate(shapes)]
    copy = {n: torch.randn(q.shape, generator=gen) for n, q in trainable}
    expected = {n: c.clone().lerp_(q, 0.1) for (n, q), c in zip(trainable, copy.values())}  # the loop it replaced
    policy_mod._lerp(copy, trainable, 0.1)
    assert all(torch.equal(copy[n], expected[n]) for n in copy)
    monkeypatch.setattr(checkpoints, "SWAP_CHUNK", 10)  # several chunks, one tensor larger than a chunk
    live = {n: q.clone() for n, q in trainable}
    held = {n: c.clone() for n, c in copy.items()}
    with checkpoints.swapped(trainable, copy):
        assert all(torch.equal(q, held[n]) and torch.equal(copy[n], live[n]) for n, q in trainable)
    assert all(torch.equal(q, live[n]) and torch.equal(copy[n], held[n]) for n, q in trainable)


def test_the_steps_statistics_are_fetched_once_with_the_values_item_gives():
    gen = torch.Generator().manual_seed(0)
    values = [torch.rand((), generator=gen) for _ in range(5)] + [torch.rand((), generator=gen).double()]
    stats = {"loss": values[:3], "clipfrac": values[3:], "grad_norm": [0.25, 1.5]}
    got = train.host_stats(stats)
    assert got == {"loss": [v.item() for v in values[:3]], "clipfrac": [v.item() for v in values[3:]],
                   "grad_norm": [0.25, 1.5]}
    assert all(type(v) is float for vs in got.values() for v in vs)


# ----------------------------------------------------------------------------- the SDE step and the trained terms
@pytest.mark.parametrize("kind", ["flow", "dance", "cps", "ode"])
def test_sde_step_samples_and_scores_on_the_device(kind):
    with fake_cuda() as cuda:
        x, v = torch.randn(2, 4, 8, 8, device=cuda), torch.randn(2, 4, 8, 8, device=cuda)
        for sigma, sigma_next in ((0.8, 0.6), (torch.tensor([0.8, 0.7], device=cuda),
                                                torch.tensor([0.6, 0.5], device=cuda))):
            out = sde.sde_step(v, x, sigma, sigma_next, kind=kind, generator=torch.Generator().manual_seed(0),
                               sigma_max=0.95)
            scored = sde.sde_step(v, x, sigma, sigma_next, kind=kind, prev_sample=out.prev_sample, sigma_max=0.95)
            assert out.prev_sample.device == scored.mean.device == scored.std.device == cuda
            if kind != "ode":
                assert scored.log_prob.device == cuda and scored.log_prob.shape == (2,)


def batch_for(loss, args, policy, n=4, channels=4, side=8):
    """What train.sample hands train_on_batch, built on the device as it builds it (latents, log-probs, means, steps,
    embeddings on the GPU; images and the prompt mask of Qwen-Image and Z-Image on the CPU)."""
    d, T = policy.device, args.num_steps
    batch = dict(prompts=[f"p{i}" for i in range(n)], images=torch.zeros(n, 64, 64, 3, dtype=torch.uint8),
                 embeds={"prompt_embeds": torch.randn(n, 7, 8, device=d), "pooled": torch.randn(n, 8, device=d),
                         "prompt_mask": torch.arange(7) < torch.tensor([[3], [7], [5], [2]])})  # on the CPU
    if loss.process == "forward":
        batch["latents"] = torch.randn(n, 1, channels, side, side, device=d)
        return batch
    steps = torch.tensor(sde.sde_steps(T, **train.window_kwargs(args, 0)))  # [K]
    batch.update(latents=torch.randn(n, T + 1, channels, side, side, device=d),
                 log_probs=torch.randn(n, len(steps), device=d), means=torch.randn(n, len(steps), channels, side, side,
                                                                                    device=d),
                 stds=torch.rand(n, len(steps), device=d), steps=steps.expand(n, -1).to(d))
    return batch


class StubRun:
    carry = None  # train.py's state across steps (GARDO's)

    def warn_ratio(self, deviation, limit, cause):
        pass

    def signalled(self):  # no preemption
        return False


@pytest.mark.parametrize("name", [n for n, loss in losses.LOSSES.items() if "kl_beta" in loss.reads()])  # a KL term
def test_every_loss_trains_on_the_device_without_reading_it_back(name, monkeypatch):
    """Each trained term through its registry function, with the KL to the reference and the old copy where the loss
    keeps one, two passes (the off-policy branch; AWM's frozen statistics): train.train_on_batch with the tensors
    train.sample builds. Before the fix every statistic was read back with .item() (a host sync per value and term)
    and CPU sample indices indexed the GPU tensors."""
    loss = losses.LOSSES[name]
    extra = ["--kl-beta", "0.01", "--updates-per-batch", "2"] + (
        ["--step-loss-weight", "wan"] if loss.process == "reverse" else []) + (
        ["--train-timesteps", "2"] if "train_timesteps" in loss.reads() else []) + (
        ["--train-batch-size", "2"] if loss.unit != "sample" else [])  # whole pairs / groups
    args = parse(name, *extra)
    fetched = []

    def host_stats(stats):  # the step's one transfer: its values have no data here, every one a 0-dim value
        assert all(not torch.is_tensor(v) or v.dim() == 0 for values in stats.values() for v in values)
        fetched.append(sorted(stats))
        return {k: [0.0] * len(values) for k, values in stats.items()}
    monkeypatch.setattr(train, "host_stats", host_stats, raising=False)
    rewards, groups = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])  # a saturated second group
    adv_cpu = loss.advantages(rewards, groups, global_std=False, clip=5.0)  # the loss's own rule (pairs: +-1 and 0)
    ids = train.trained_ids(loss, adv_cpu, adv_cpu != 0, 4 // args.train_batch_size, torch.Generator().manual_seed(0),
                            args.group_size)
    sigmas = sde.sd3_sigmas(args.num_steps)
    with fake_cuda() as cuda:
        policy = StubPolicy(args, cuda, old_copy=bool(loss.old_copy and loss.old_copy(vars(args))),
                            sampling_copy=bool(loss.sampling_copy and loss.sampling_copy(vars(args))))
        batch = batch_for(loss, args, policy)
        adv = dict(adv=adv_cpu.to(cuda), ids=ids, rank_weight=1.0)
        info = train.train_on_batch(policy, loss, batch, adv, sigmas, args, 0, StubRun())
        assert info["updates"] == 2 and policy.optimizer_steps == 2
        assert_beside(policy)
    assert fetched and "loss" in fetched[0] and "kl" in fetched[0]


# ----------------------------------------------------------------------------- a real tiny pipeline
def to_fake_cuda(module, mode):
    """Every parameter and buffer of `module` -> a fake CUDA tensor of the same values' shape and dtype."""
    for m in module.modules():
        for k, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[k] = torch.nn.Parameter(mode.from_tensor(p.detach()).to(DEVICE), p.requires_grad)
        for k, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[k] = mode.from_tensor(b).to(DEVICE)


@pytest.mark.parametrize("name", ["tiny", "tiny-flux"])
def test_tiny_models_roll_out_evaluate_and_hand_cpu_images_to_the_reward(name):
    """The tiny SD3 and FLUX.1 pipelines on the device: prompt encoding, a training rollout (SDE steps; CFG or the
    guidance embedding) and the held-out ODE sampling of eval.py, whose uint8 images reach the reward on the CPU."""
    pipe = models.load_pipeline(name)  # real weights, made fake below
    with fake_cuda() as cuda:
        mode = detect_fake_mode()
        for module in models._modules(pipe):
            to_fake_cuda(module, mode)
        embeds = models.encode_prompts(pipe, ["a red cube", "two cats"], guidance_scale=4.5)
        assert all(v.device == cuda for v in embeds.values())
        sigmas = models.sigmas(pipe, 3, 64)
        x = models.initial_noise(pipe, 2, 64, generator=torch.Generator().manual_seed(0)).to(cuda)
        traj, images = models.generate(pipe, x, sigmas, embeds, guidance_scale=4.5, sde_steps=sde.sde_steps(3),
                                       kind="flow", eta=0.7, generator=torch.Generator().manual_seed(1))
        assert traj["latents"].device == traj["log_probs"].device == cuda
        assert images.device.type == "cpu" and images.dtype == torch.uint8 and images.shape == (2, 64, 64, 3)
        held_out = evaluation.sample_images(pipe, ["a red cube"] * 3, resolution=64, num_steps=2, guidance_scale=4.5,
                                            device=cuda, batch_size=2)
        assert held_out.device.type == "cpu" and held_out.dtype == torch.uint8 and held_out.shape == (3, 64, 64, 3)


@pytest.mark.parametrize("name, resolution, frames", [("tiny-wan", 32, 5), ("tiny-flux2-klein", 64, None)])
def test_the_other_families_encode_and_run_their_transformer_on_the_device(name, resolution, frames):
    """Wan 2.1 and FLUX.2 [klein] through models.encode_prompts and models.velocity (the rollout's and the training
    forward's call), CFG on."""
    pipe = models.load_pipeline(name)
    with fake_cuda() as cuda:
        mode = detect_fake_mode()
        for module in models._modules(pipe):
            to_fake_cuda(module, mode)
        embeds = models.encode_prompts(pipe, ["a red cube", "two cats"], guidance_scale=4.5)
        size = dict(num_frames=frames) if frames else {}
        x = models.initial_noise(pipe, 2, resolution, generator=torch.Generator().manual_seed(0), **size).to(cuda)
        v = models.velocity(pipe, x, torch.full((2,), 0.5, device=cuda), embeds, guidance_scale=4.5)
        assert v.device == cuda and v.shape == x.shape


# Two transformers read the device inside diffusers 0.42, once a forward, which no family code here can avoid: marked
# strict, so that a diffusers that stops doing it fails the mark and the families join the others.
DIFFUSERS_SYNC = {
    "tiny-hunyuan-video-1.5": "HunyuanVideo15Transformer3DModel.forward branches on torch.all(image_embeds == 0) "
                              "(transformer_hunyuan_video15.py L701-702)",
    "tiny-qwen-image-2.1": "QwenImage21Transformer2DModel.forward expands img_mask by repeat_interleave of its values "
                           "and indexes the device with it (transformer_qwenimage21.py L927-938)"}


NEWEST = [("tiny-wan2.2", 32, 5), ("tiny-wan2.2-5b", 32, 9), ("tiny-hunyuan-video-1.5", 32, 5),
          ("tiny-qwen-image-2.1", 64, None), ("tiny-ltx2", 64, 9)]


@pytest.mark.parametrize("name, resolution, frames", [
    pytest.param(*case, marks=pytest.mark.xfail(strict=True, reason=DIFFUSERS_SYNC[case[0]], raises=(
        DataDependentOutputException, DynamicOutputShapeException)) if case[0] in DIFFUSERS_SYNC else ())
    for case in NEWEST])
def test_the_newest_families_roll_out_on_the_device(name, resolution, frames):
    """Wan 2.2 (both experts: the rollout crosses the boundary), its TI2V-5B, HunyuanVideo 1.5, Qwen-Image 2.1 and
    LTX-2 (video and sound) on the device, CFG on where the family guides: the prompts from the cache, the training
    forward's velocity at a sigma the caller holds on the host, and a rollout of SDE steps whose frames reach the
    reward on the CPU. Fake tensors refuse any read of a device value, so a host sync in any forward fails here. The
    encodes run on the CPU first, as in the test below: HunyuanVideo's and Qwen-Image 2.1's read their masks inside
    diffusers, once a prompt (then cached)."""
    pipe = models.load_pipeline(name)
    guidance = 1.0 if name == "tiny-qwen-image-2.1" else 4.5  # 2.1 samples without CFG (its preset)
    prompts = ["a red cube", "two cats"]
    models.prompt_cache(pipe, 1)
    models.encode_prompts(pipe, prompts, guidance_scale=guidance)
    size = dict(num_frames=frames) if frames else {}
    sigmas = models.sigmas(pipe, 3, resolution, **size)
    x_cpu = models.initial_noise(pipe, 2, resolution, generator=torch.Generator().manual_seed(0), **size)
    with fake_cuda() as cuda:
        mode = detect_fake_mode()
        for module in models._modules(pipe):
            to_fake_cuda(module, mode)
        embeds = models.encode_prompts(pipe, prompts, guidance_scale=guidance)  # from the cache
        assert pipe.prompt_cache.hits == 2
        x = x_cpu.to(cuda)
        v = models.velocity(pipe, x, torch.full((2,), 0.5), embeds, guidance_scale=guidance)
        assert v.device == cuda and v.shape == x.shape
        rollout = dict(sde_steps=sde.sde_steps(3), kind="flow", eta=0.7, generator=torch.Generator().manual_seed(1))
        if name == "tiny-ltx2":  # its decode wraps the frames in WithAudio, a subclass no fake tensor can become:
            with torch.no_grad():  # the rollout alone here (the decode: tests/test_ltx2.py)
                traj = sde.rollout(lambda x_, s_: models.velocity(pipe, x_, s_, embeds, guidance_scale=guidance),
                                   x, sigmas, **rollout)
        else:
            traj, videos = models.generate(pipe, x, sigmas, embeds, guidance_scale=guidance, **rollout)
            assert videos.device.type == "cpu" and videos.dtype == torch.uint8
            assert videos.shape[0] == 2 and videos.shape[-3:] == (resolution, resolution, 3)
        assert traj["latents"].device == traj["log_probs"].device == cuda


@pytest.mark.parametrize("name", ["tiny-qwen-image", "tiny-z-image"])
def test_qwen_image_and_z_image_roll_out_from_cached_prompts_without_reading_the_device(name):
    """Qwen-Image and Z-Image with prompts of their own lengths, CFG on: the embeddings come from the prompt cache
    (models._assemble puts them on the device, their masks on the CPU), then the transformer forward and a rollout.
    Before the fix each forward read the prompt mask on the device (Qwen-Image's mask.all(), Z-Image's e[mask] per
    prompt): a sync per call, which fake tensors refuse. The encode itself reads its masks on the device inside
    diffusers (once per prompt, then cached), so it runs here on the CPU, before the weights become fake."""
    pipe = models.load_pipeline(name)
    prompts = ["a red cube", "two cats on a long wooden bench at dusk"]
    models.prompt_cache(pipe, 1)
    real = models.encode_prompts(pipe, prompts, guidance_scale=4.5)
    assert not real["prompt_mask"].all() and real["prompt_mask"].device.type == "cpu"
    x_cpu = models.initial_noise(pipe, 2, 64, generator=torch.Generator().manual_seed(0))
    with fake_cuda() as cuda:
        mode = detect_fake_mode()
        for module in models._modules(pipe):
            to_fake_cuda(module, mode)
        embeds = models.encode_prompts(pipe, prompts, guidance_scale=4.5)  # from the cache
        assert pipe.prompt_cache.hits == 2 and embeds["prompt_embeds"].device == cuda
        assert torch.equal(embeds["prompt_mask"], real["prompt_mask"])  # real values, on the CPU
        x = x_cpu.to(cuda)
        v = models.velocity(pipe, x, torch.full((2,), 0.5, device=cuda), embeds, guidance_scale=4.5)
        assert v.device == cuda and v.shape == x.shape
        traj, images = models.generate(pipe, x, models.sigmas(pipe, 2, 64), embeds, guidance_scale=4.5,
                                       sde_steps=sde.sde_steps(2), kind="flow", eta=0.7,
                                       generator=torch.Generator().manual_seed(1))
        assert traj["latents"].device == traj["log_probs"].device == cuda
        assert images.device.type == "cpu" and images.dtype == torch.uint8 and images.shape == (2, 64, 64, 3)


GARDO = ["--kl-beta", "0.01", "--reward", "jpeg_compressibility=1,jpeg_incompressibility=0", "--reward-key",
         "jpeg_compressibility", "--gardo-gate", "jpeg_incompressibility", "--gardo-reference"]


@pytest.mark.parametrize("name", ["grpo", "nft"])
def test_the_gardo_reference_resumes_renews_and_gates_on_the_device(name, tmp_path, monkeypatch):
    """GARDO's reference snapshot (a third copy of the weights) read from a checkpoint lands beside the weights, as the
    EMA and the old copy must (bug 1 above), and a step then renews it and swaps it in there; the gated KL
    (the advantage phase's kl_gate on the device) is taken without reading the device back."""
    args = parse(name, *GARDO)
    loss = losses.LOSSES[name]
    path, cpu = write_checkpoint(tmp_path, args)
    assert os.path.isfile(os.path.join(path, "reference.safetensors")) and cpu.copies["reference"] is not None
    monkeypatch.setattr(train, "host_stats", lambda stats: {k: [0.0] * len(v) for k, v in stats.items()})
    rewards, groups = torch.tensor([1.0, 0.0, 0.25, 0.5]), torch.tensor([0, 0, 1, 1])
    adv_cpu = loss.advantages(rewards, groups, global_std=False, clip=5.0)
    ids = train.trained_ids(loss, adv_cpu, torch.ones(4, dtype=torch.bool), 4 // args.train_batch_size,
                            torch.Generator().manual_seed(0), args.group_size)
    run = StubRun()
    run.carry = {"last_reset": 0, "max_kl": 1.0}  # a KL above --gardo-kl-thres since the last renewal
    with fake_cuda() as cuda:
        policy = StubPolicy(args, cuda, old_copy=bool(loss.old_copy and loss.old_copy(vars(args))),
                            sampling_copy=bool(loss.sampling_copy and loss.sampling_copy(vars(args))))
        policy.resume(path, args)
        assert_beside(policy)
        batch = batch_for(loss, args, policy)
        gate = torch.tensor([True, False, False, True], device=cuda)
        info = train.train_on_batch(policy, loss, batch, dict(adv=adv_cpu.to(cuda), ids=ids, rank_weight=1.0,
                                                              kl_gate=gate),
                                    sde.sd3_sigmas(args.num_steps), args, 1, run)
        assert info["gardo_reset"] == 1 and run.carry["last_reset"] == 1
        assert_beside(policy)
