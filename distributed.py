"""Ranks, collectives and FSDP2 sharding: the multi-process plumbing of train.py, free of any algorithm.

    RANK, WORLD, LOCAL_RANK, LOCAL_WORLD, is_main   from torchrun's environment (0, 1, 0, 1, True without torchrun)
    init() -> device                     process group (NCCL on GPUs, gloo on CPUs) and this rank's device
    print0(...)                          print on rank 0 only
    cpus_per_rank()                      this rank's share of the node's CPU cores (CPU-side thread pools)
    all_gather_cat(t)                    [n, ...] on every rank -> [WORLD * n, ...] in rank order
    any_rank(flag, device)               True everywhere when True anywhere (lockstep skips and stops)
    any_rank_host(flag)                  the same over gloo on the host, without waiting for the GPU (signals)
    any_rank_each(flags)                 any_rank_host of each flag of a list, in one all-reduce (experts reached)
    union(names)                         the sorted union of every rank's names (the same collectives everywhere)
    share(n), gather_share(t, n)         this rank's share of n items; the shares' [n, ...] back in item order
    broadcast(obj)                       rank 0's value of a small object, on every rank
    barrier(), finish()
    shard_transformer(transformer, device, param_dtype=None)      FSDP2, one unit per transformer block
    sharded(module)                                               whether FSDP2 shards it
    gathered(*transformers)                                       FSDP2 context: each unit gathered once, kept
    gradient_sync(transformer, last, every)                       FSDP2: reduce-scatter after each (or the last) micro-step
    average_gradients(params)                                     the mean gradient over ranks, None counted as 0
    broadcast_parameters(params)                                  rank 0's values everywhere, as DDP starts
    check_replicas(trainable, fsdp, device) -> [checksum per rank]
    fsdp_full_state(model, optimizer, trainable, copies)          shards -> rank 0's full tensors
    fsdp_load(model, optimizer, trainable, weights, optim_state)  rank 0's full tensors -> shards
    shard_like(tensors, trainable)                                full tensors -> this rank's shards, on its device
    local(t)                                                      a DTensor's local shard (a plain tensor: itself)

Every function here is called on every rank (the collectives need all of them); the script also runs
without torchrun, where each of them reduces to the single-process case.
"""
import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist

RANK, WORLD, LOCAL_RANK = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
LOCAL_WORLD = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # the ranks of this node (torchrun)
is_main = RANK == 0


_HOST = []  # a gloo group beside NCCL's, for flags agreed on the host without waiting for the GPU (any_rank_host)


def init():
    """Join the process group (under torchrun) and return this rank's device."""
    device = torch.device(f"cuda:{LOCAL_RANK}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if WORLD > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # device_id binds the group to this rank's GPU: NCCL builds its communicator at once, on that GPU, rather than
        # at the first collective on whichever device is current then, and barrier() need not guess the device.
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
        _HOST[:] = [dist.new_group(backend="gloo") if backend == "nccl" else None]  # None: the default group is gloo
    return device


def cpus_per_rank():
    """The CPU cores this process may use without oversubscribing its node: those it may run on (its affinity, a
    container's limit) shared by the node's ranks (torchrun's LOCAL_WORLD_SIZE), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def finish():
    if WORLD > 1 and dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs):
    """print on rank 0 only. A reader that went away (`train.py --print-config | head`) ends the printing, not the
    program: the stream goes to /dev/null from then on, quietly (the run's own files keep every line)."""
    if not is_main:
        return
    try:
        print(*args, **kwargs, flush=True)
    except BrokenPipeError:
        stream = kwargs.get("file") or sys.stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())  # the interpreter's last flush must not fail again


def barrier():
    if WORLD > 1:
        dist.barrier()


def broadcast(obj):
    """Rank 0's value of a small picklable object, on every rank."""
    if WORLD == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_cat(t):
    """Concatenate a per-rank tensor [n, ...] over ranks in rank order -> [WORLD * n, ...]."""
    if WORLD == 1:
        return t
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def any_rank(flag, device):
    """True on every rank when flag is True on any rank (keeps ranks in lockstep on skips and stops)."""
    if WORLD == 1:
        return bool(flag)
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def any_rank_host(flag):
    """any_rank of a flag the host holds (a signal), reduced over gloo on the CPU: no wait for the GPU's queued work,
    so the training loop can ask before every forward."""
    if WORLD == 1:
        return bool(flag)
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_HOST[0] if _HOST else None)
    return bool(t.item())


def any_rank_each(flags):
    """[any_rank_host(f) for f in flags] in one all-reduce on the host: which of a family's experts any rank's
    micro-batch reaches (families/wan.py), so that every rank calls those under FSDP."""
    if WORLD == 1:
        return [bool(f) for f in flags]
    t = torch.tensor([float(f) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_HOST[0] if _HOST else None)
    return [bool(f) for f in t.tolist()]


def union(names):
    """The sorted union of every rank's names (strings), on every rank: what each rank then gathers one by one is the
    same list in the same order, whatever each happened to hold (a collective per name that one rank lacks would
    pair with another call on the others: NCCL hangs or mixes data)."""
    mine = sorted(set(names))
    if WORLD == 1:
        return mine
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    return sorted(set().union(*everyone))


def share(n):
    """This rank's share of n items (the held-out images): items rank, rank + WORLD, ..., padded to ceil(n / WORLD)
    by repeating its last (item 0 where it has none), so that every rank runs as many forwards (FSDP gathers in
    each) and gathers as many rows. Strided, so that a file sorted by kind spreads each kind over the ranks.
    -> [indices]"""
    size = -(-n // WORLD)
    mine = list(range(RANK, n, WORLD))
    return mine + [mine[-1] if mine else 0] * (size - len(mine))


def gather_share(t, n):
    """Every rank's [ceil(n / WORLD), ...] rows of its share(n) -> [n, ...] in item order, on every rank (the
    padding dropped)."""
    size = -(-n // WORLD)
    rows = all_gather_cat(t)  # [WORLD * size, ...]: rank r's k-th row is item r + k WORLD
    return rows[[(i % WORLD) * size + i // WORLD for i in range(n)]]


def transformer_blocks(transformer):
    """The transformer's blocks, in module order: the classes diffusers marks as never to be split
    (`_no_split_modules`: SD3's joint blocks, FLUX's double- and single-stream blocks, Wan's, Qwen-Image's,
    Z-Image's), whatever attribute holds them."""
    block_types = set(getattr(transformer, "_no_split_modules", None) or ())
    blocks = [m for m in transformer.modules() if type(m).__name__ in block_types]
    if not blocks:
        raise ValueError(f"--fsdp: {type(transformer).__name__} names no transformer block class (_no_split_modules)")
    return blocks


def shard_transformer(transformer, device, *, param_dtype=None):
    """FSDP2, in place: each transformer block is one all-gather unit; the root holds embeddings and output layers.

    Every forward all-gathers, so every rank must call the transformer the same number of times.

    param_dtype: the dtype the weights are gathered and computed in (--mixed-precision bf16), None for float32. The
    shards (what the optimizer steps, the EMA and the old copy mix) stay float32. Gradients are reduce-scattered in
    float32 (reduce_dtype), as torchtitan and the FSDP2 docs recommend: a bf16 sum over ranks keeps 8 bits of
    mantissa, and the small per-sample log-prob gradients of these losses would lose their low bits in it.
    Without it, every forward all-gathered float32 weights to cast them to bf16 under autocast: twice the traffic
    and twice the memory of the gathered block. The forward inputs are not cast (cast_forward_inputs=False):
    autocast already runs each op in the run's precision, and FSDP's cast would round the float32 timesteps and
    rotary tables that the pipelines keep in float32 (SD3's t = 1000 s to bf16's steps of 4).

    Gradient accumulation reduce-scatters after every micro-step (gradient_sync): without that sync each rank
    keeps the full unsharded gradients until the last micro-step, in float32 (FSDP upcasts them to reduce_dtype to
    accumulate), 48 GB per GPU for FLUX.1's 12 B weights; synced, it holds its float32 shard (6 GB on 8 GPUs). The
    price is one reduce-scatter per micro-step instead of per optimizer step, overlapped with the backward.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (WORLD,))
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in transformer_blocks(transformer):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    # The root reshards after each forward too: by default, after a no_grad forward (rollout, eval) it keeps its
    # gathered weights registered in place of its shards until the next backward. This way, outside a forward,
    # named_parameters() are always the shards the optimizer holds. Costs one extra gather of the small root.
    fully_shard(transformer, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy)


def sharded(module):
    """Whether FSDP2 shards `module` (or the module a torch.compile wrapper holds)."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(getattr(module, "_orig_mod", module), FSDPModule)


@contextlib.contextmanager
def gathered(*transformers):
    """FSDP2, for forwards without gradients (a rollout, an evaluation): inside, each unit (block, root) all-gathers
    its weights at its first forward and keeps them, so a rollout of N forwards gathers each block once instead of N
    times; on exit every unit reshards and resharding after each forward is restored, so that the training forwards
    that follow hold one block at a time and named_parameters() are the shards again.

    The price is the whole transformer gathered at once (in the MixedPrecisionPolicy's dtype: 2 bytes a parameter
    under bf16) for the rollout, instead of the block in use and the prefetched one. Of several transformers (Wan
    2.2's experts, which a rollout calls one after the other as sigma falls) one is held at a time: a forward of one
    first reshards the others, which gather again if called later, so a rollout holds one 14B expert (28 GB), not
    both. The gathered weights are those of the first forward: enter it inside any exchange of the weights
    (policy.Policy.frozen, ema_weights), never around one. A checkpoint inside is safe: FSDP2 reshards before a
    state_dict, and the next forward gathers again."""
    from torch.distributed.fsdp import FSDPModule
    units = {t: [m for m in t.modules() if isinstance(m, FSDPModule)] for t in transformers}
    held = [None]

    def release_the_others(module, args):
        if held[0] is not module:
            for other in transformers:
                if other is not module:
                    for unit in units[other]:
                        unit.reshard()
            held[0] = module
    hooks = [t.register_forward_pre_hook(release_the_others, prepend=True) for t in transformers
             if len(transformers) > 1]
    for t in transformers:
        t.set_reshard_after_forward(False)  # every unit below it too
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for t in transformers:
            for unit in units[t]:
                unit.reshard()
            t.set_reshard_after_forward(True)  # as shard_transformer built them (the root: True on purpose)


def gradient_sync(transformer, last, every=True):
    """Before a training forward under FSDP: every micro-step reduce-scatters its gradients into the float32 shards
    (every, the default: shard_transformer says why), or only the last one of an optimizer step (every=False: one
    reduce-scatter per optimizer step, the unsharded float32 gradients kept until then: 4 bytes a parameter)."""
    transformer.set_requires_gradient_sync(last or every)


def average_gradients(params):
    """Each parameter's gradient <- its mean over the ranks, as DDP's all-reduce makes it, in one flat all-reduce. A
    parameter without a gradient counts as zeros on that rank, and keeps none where no rank has one (an expert no
    micro-batch reached: the optimizer skips it, as in one process). Several trained modules (a family's experts) are
    reduced here rather than by DDP, which refuses a module that takes no part in a backward."""
    if WORLD == 1:
        return
    grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
    present = torch.tensor([float(q.grad is not None) for q in params], device=grads[0].device)
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [present])
    dist.all_reduce(flat)
    *pieces, present = flat.split([g.numel() for g in grads] + [len(params)])
    for q, piece, seen in zip(params, pieces, present.tolist()):
        q.grad = (piece / WORLD).view_as(q).to(q.dtype) if seen else None


def broadcast_parameters(params):
    """Rank 0's values of `params` on every rank, as DDP's construction makes them (a LoRA adapter is drawn from each
    rank's own seed)."""
    if WORLD == 1:
        return
    with torch.no_grad():
        for q in params:
            dist.broadcast(q.data, src=0)


def check_replicas(trainable, fsdp, device):
    """Checksums of the trained weights, one per rank; raises when DDP replicas disagree (a desync caught early).

    Under FSDP the shards are disjoint: their checksums are summed into the full model's, the same on every rank."""
    local = [q.detach().to_local() if fsdp else q.detach() for _, q in trainable]
    checksum = torch.stack([t.double().sum() + t.double().abs().sum() for t in local]).sum()
    if fsdp:
        dist.all_reduce(checksum)
    sums = all_gather_cat(checksum.reshape(1).to(device)).tolist()
    if max(sums) != min(sums):
        raise SystemExit(f"error: the {WORLD} replicas hold different weights (checksums {sums}); not saving")
    return sums


def fsdp_full_state(model, optimizer, trainable, copies):
    """Gather the shards into the checkpoint format of an unsharded run. Collective: every rank calls it; rank 0
    receives (weights by parameter name, optimizer.state_dict() keyed by position, copies: {name: full tensors or
    None}), the others empties."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0's CPU only
    names = [n for n, _ in trainable]
    full = get_model_state_dict(model, options=options)
    weights = {n: full[n] for n in names} if is_main else {}  # parameters only, no buffers: as without FSDP
    osd = get_optimizer_state_dict(model, optimizer, options=options)  # keyed by parameter name
    position = {n: i for i, n in enumerate(names)}  # the optimizer was built over trainable, in this order
    optim_state = {}
    if is_main:
        optim_state = {"state": {position[n]: s for n, s in osd["state"].items()},
                       "param_groups": [dict(g, params=[position[n] for n in g["params"]])
                                        for g in osd["param_groups"]]}
    copies_full = {}
    for name, tensors in copies.items():  # weight copies (EMA, old policy), sharded like the weights
        copies_full[name] = None if tensors is None else {}
        for n, t in (tensors or {}).items():  # one tensor at a time: at most one full tensor on the device
            t = t.full_tensor()
            if is_main:
                copies_full[name][n] = t.cpu()
    return weights, optim_state, copies_full


def fsdp_load(model, optimizer, trainable, weights, optim_state):
    """Scatter full tensors into the shards: rank 0 passes what it read from the checkpoint (weights by name,
    optimizer.state_dict() keyed by position), the other ranks pass empty dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    names = [n for n, _ in trainable]
    if is_main:  # keyed by position -> by name
        optim_state = {"state": {names[i]: s for i, s in optim_state["state"].items()},
                       "param_groups": [dict(g, params=[names[i] for i in g["params"]])
                                        for g in optim_state["param_groups"]]}
    # strict=False: the file holds parameters only; the buffers (fixed positional tables) stay as built.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)


def shard_like(tensors, trainable):
    """Full tensors by name (read by every rank) -> this rank's shards of the matching FSDP parameters, on their
    device, in float32 (the copies' dtype, policy.Policy._copy)."""
    from torch.distributed.tensor import distribute_tensor
    return {n: distribute_tensor(tensors[n].to(q.device, torch.float32), q.device_mesh, q.placements,
                                 src_data_rank=None)
            for n, q in trainable}


def local(t):
    """The tensor a rank holds: an FSDP DTensor's local shard (a view that shares its storage, so writing into it
    writes the parameter), any other tensor itself. Lets multi-tensor ops (torch._foreach_*) run on shards."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t
