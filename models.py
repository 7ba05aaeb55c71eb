"""The model interface: load a diffusers pipeline, encode prompts, guided velocity, decode, schedule, LoRA.

Everything the RL loop needs from a text-to-image (or -video) model goes through these functions,
so that `sde.py`, `losses.py`, `train.py` and `eval.py` never branch on the model family:

    encode_prompts(pipe, prompts, *, max_sequence_length=None) -> embeds (dict of [B, ...] tensors)
    initial_noise(pipe, batch, resolution, *, num_frames=None)  -> x at sigma = 1, float32 [B, *latent_shape]
    velocity(pipe, x, sigma, embeds)                             -> v, the prediction at noise level sigma
    decode(pipe, latents)                  -> uint8 images [B, H, W, 3] (videos [B, F, H, W, 3])
    generate(pipe, x, sigmas, embeds, ...)                       -> a rollout (SDE or ODE) and its images
    sigmas(pipe, num_steps, resolution, *, shift=None)           -> the family's native schedule, 1 -> 0
    trained_modules(pipe)                  -> {name: module} of what trains (one transformer, or a family's experts)
    add_lora / reference / save_lora                             -> the policy, its frozen base, the checkpoint

Each calls the adapter of the pipeline's record, families.MODELS[name] (a file per family in families/, with the table
of models): load_pipeline tags the pipeline with its model name and family(pipe) reads it. Convention (rectified flow,
as diffusers' schedulers): `x_s = (1 - s) x0 + s eps`, the network predicts `v ~ eps - x0`, and the Euler step from
`s` to `s'` is `x + (s' - s) v`; classifier-free guidance is `v_u + g (v_c - v_u)` (Ho & Salimans 2022, eq. 6 with
g = 1 + w, as diffusers writes it). Each family maps its pipeline onto this, checked against the pipeline's own
__call__ by tests/test_models.py, tests/test_families.py and tests/test_edit_models.py.

Text length (max_sequence_length, the default of encode_prompts): the record's tokens, capped by a tiny tokenizer's
context: sd3 128 T5 tokens after the 77 CLIP ones, as Flow-GRPO encodes SD3 prompts (scripts/train_sd3.py; diffusers'
own default is 256); flux 512 (FluxPipeline's default); wan, qwen-image, flux2-klein, z-image 512, their pipelines'
defaults (and what Flow-GRPO / UniRL use).

Departures from the diffusers defaults, and why:
1. A pipeline without a T5 encoder (`tiny`) gets no T5 tokens, where diffusers would append
   zero tokens: they carry no information and would triple the CPU cost of `tiny`.
2. Trainable LoRA weights are kept in float32 even when the model runs in bf16 (as the
   diffusers LoRA training scripts do), so that small Adam updates are not rounded away.
3. Classifier-free guidance runs the unconditional and conditional halves as one batched forward
   (the Wan, Qwen-Image and FLUX.2 pipelines run two); the results agree to float rounding.
"""

import collections
import contextlib
import hashlib
import json
import logging
import os
import time

import torch

import distributed
import families
import flags
import prompt_store
import sde

MODELS = families.MODELS  # the registry: name -> families.Family


_TRUNCATION_SEEN = set()


def _truncation_once(record):
    """A logging filter for the pipelines' prompt-truncation warnings: each distinct one once, cut to 300 characters
    (diffusers repeats the whole cut-off text at every encode: a 1 MB prompt would log 1 MB per step)."""
    message = record.getMessage()
    if "truncated" not in message:
        return True
    if message in _TRUNCATION_SEEN:
        return False
    _TRUNCATION_SEEN.add(message)
    if len(message) > 300:
        record.msg, record.args = f"{message[:300]}... ({len(message)} characters)", ()
    return True


def load_pipeline(name, model_path=None, *, dtype=torch.float32, device="cpu"):
    """Build or load model `name` (a key of MODELS), frozen, on `device`, tagged with its name (family reads it)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    pipe = MODELS[name].load(model_path, dtype=dtype, device=device).to(device)
    pipe.model_name = name
    pipeline_log = logging.getLogger(type(pipe).__module__)
    if _truncation_once not in pipeline_log.filters:
        pipeline_log.addFilter(_truncation_once)
    for module in _modules(pipe):
        module.requires_grad_(False)  # add_lora decides what trains
    return pipe


def _modules(pipe):
    return [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]


def trained_modules(pipe):
    """{attribute: module} of the pipeline's denoisers, the modules that train (the record's `trained`): one
    transformer, or several a family's velocity routes between (Wan 2.2's two experts). Absent ones are skipped."""
    found = {name: getattr(pipe, name, None) for name in family(pipe).trained}
    return {name: module for name, module in found.items() if module is not None}


def named_parameters(modules):
    """(name, parameter) of every module's parameters; with several modules each name starts with its module's
    ("transformer_2.blocks.0..."), with one the names are the module's own (as a checkpoint of one transformer)."""
    for prefix, module in modules.items():
        for name, param in module.named_parameters():
            yield (f"{prefix}.{name}" if len(modules) > 1 else name), param


# ----------------------------------------------------------------------------- the adapter

def family(pipe):
    """The record (families.Family) of a pipeline's model: its adapter, by the name load_pipeline gave it."""
    name = getattr(pipe, "model_name", None)
    if name not in MODELS:
        raise ValueError(f"pipeline {type(pipe).__name__} has no model name of families.MODELS ({name!r}): build it "
                         f"with models.load_pipeline, one of {', '.join(MODELS)}")
    return MODELS[name]


def is_video(pipe):
    """True for families whose samples are videos [B, F, H, W, 3] (wan)."""
    return family(pipe).video


def _hw(resolution):
    """--resolution as (height, width): an int is a square, a pair is (height, width)."""
    if isinstance(resolution, int):
        return resolution, resolution
    height, width = resolution
    return int(height), int(width)


def latent_shape(pipe, resolution, *, num_frames=None):
    """Per-sample shape of the latent that sde.rollout sees: sd3 (C, h, w), flux packed (h w / 4, 4 C),
    wan (C, F', h, w), and the other families' own (families/). `resolution`: an int (square) or
    (height, width), the latter for the unpacked families (sd3, wan, z-image)."""
    return family(pipe).shape(pipe, *_hw(resolution), num_frames)


def initial_noise(pipe, batch, resolution, *, num_frames=None, generator=None):
    """x at sigma = 1: standard normal, float32 [B, *latent_shape], drawn as the pipelines draw it
    (so the same generator gives the same noise as pipe(..., generator=generator)).
    num_frames: video frames (wan; default its pipeline's 81), None for image models."""
    return family(pipe).noise(pipe, batch, *_hw(resolution), num_frames, generator)


def default_tokens(pipe):
    """The default max_sequence_length of encode_prompts: the record's reference value (module docstring), capped by
    its tokenizer's context (the tiny models' tokenizers are short); 0 where the pipeline lacks that tokenizer (SD3
    without T5)."""
    spec = family(pipe)
    tokenizer = getattr(pipe, spec.tokenizer)
    return 0 if tokenizer is None else min(spec.tokens, tokenizer.model_max_length)


@torch.no_grad()
def encode_prompts(pipe, prompts, *, negative_prompt="", guidance_scale=1.0, max_sequence_length=None, images=None,
                   resolution=None):
    """Text embeddings, batch first. sd3: `prompt_embeds` [B, 77 + T5 tokens, D], `pooled` [B, P],
    and for guidance_scale > 1 `neg_prompt_embeds`, `neg_pooled` (the negative prompt encoded
    once, expanded to B). flux: `prompt_embeds` [B, T5 tokens, D], `pooled` [B, P] (FLUX.1-dev
    has no negative prompt: guidance enters through its guidance embedding). The families in
    families/: `prompt_embeds` (+ `prompt_mask`, on the CPU, where prompts have their own lengths) and the
    `neg_` versions under CFG. max_sequence_length: text tokens (T5 for sd3 / flux); default
    default_tokens(pipe).

    images: per prompt, the source images of an edit (uint8 [H, W, 3], data.source_images), for the
    models that take them (a record's source_images: flux-kontext, qwen-image-edit(-plus), flux2-klein, shapes-edit).
    They are resized to `resolution` and encoded into `ref_latents` / `ref_shapes` (families/common.py, "reference
    images"), and for Qwen-Image-Edit also into the text; velocity() then conditions on them. None, or
    only empty lists, for text-to-image: every other model refuses source images in one line.

    With a prompt store on the pipeline (prompt_cache below, --prompt-store), the prompts it holds are read from its
    files, the text encoders not called; with a prompt cache, each prompt is encoded once and its rows come from the
    cache afterwards; prompts with source images are always encoded afresh."""
    prompts = list(prompts)
    if images is not None and not any(len(refs) for refs in images):
        images = None  # prompts without source images: text-to-image
    cache = getattr(pipe, "prompt_cache", None)
    kwargs = dict(negative_prompt=negative_prompt, guidance_scale=guidance_scale, resolution=resolution,
                  max_sequence_length=default_tokens(pipe) if max_sequence_length is None else max_sequence_length)
    store = getattr(pipe, "prompt_store", None)
    if store is not None and prompts and images is None and _in_store(store, prompts, **kwargs) and \
            not _encoders_train(pipe):
        try:
            return _assemble(store.rows(prompts), store.negative if guidance_scale > 1 else {}, pipe._execution_device)
        except prompt_store.DamagedRow as e:  # train.py: one warning, then that prompt is encoded (_in_store)
            if not store.encode_damaged:
                raise
            print(f"warning: {e} (this run encodes that prompt with its text encoders from now on)", flush=True)
    if cache is None or not prompts or images is not None or _encoders_train(pipe):  # edits: text depends on images
        with _encoders_on(pipe):
            return _encode_fresh(pipe, prompts, images=images, **kwargs)
    return _encode_cached(pipe, cache, prompts, **kwargs)


def _encode_fresh(pipe, prompts, *, negative_prompt="", guidance_scale=1.0, max_sequence_length=None, images=None,
                  resolution=None):
    """encode_prompts without the cache: the text encoders run on every prompt."""
    prompts = list(prompts)
    spec = family(pipe)
    tokens = default_tokens(pipe) if max_sequence_length is None else max_sequence_length
    if images is not None and not any(len(refs) for refs in images):
        images = None  # prompts without source images: text-to-image
    if images is not None:
        if spec.source_images is None:
            takes = ", ".join(dict.fromkeys(f.name for f in MODELS.values() if f.source_images))
            raise ValueError(f"model family {spec.name} generates from text alone and takes no source images; edit "
                             f"with {takes}, or drop the 'image' field of the prompt rows")
        if len(images) != len(prompts) or resolution is None:
            raise ValueError(f"encode_prompts: give one list of source images per prompt ({len(images)} for "
                             f"{len(prompts)} prompts) and the resolution to resize them to")
    extra = dict(images=images, size=_hw(resolution) if images else None) if spec.source_images else {}
    return spec.encode(pipe, prompts, negative_prompt, guidance_scale, tokens, **extra)


# ----------------------------------------------------------------------------- the prompt-embedding cache
#
# Every step encodes its prompts, and every evaluation its held-out prompts, with text encoders that stay on the
# GPU for the whole run (T5-XXL: 9.5 GB in half precision). The cache keeps each prompt's embedding rows on the CPU
# after its first encode, keyed by (text, text tokens): the cache belongs to one pipeline object (its model and
# weights) and lives as long as the process, so a changed prompt file or model can never read stale rows, and is
# bypassed while any text-encoder weight trains. The negative prompt (CFG) is one more entry, encoded once per
# (text, tokens, CFG on). Prompts with source images (edits) are not cached: Qwen-Image-Edit's VL encoder reads the
# image into the text, and the references of every edit model are VAE latents of the image.
#
# A cached row is exactly the row of the batch it was first encoded in. Another batch can round differently in the
# last bit (the matmul kernels depend on the batch size; 2e-7 on the tiny models' pooled CLIP), as any change of
# batching does: a run whose steps repeat their prompt sets (and every evaluation) reproduces the uncached run bit
# for bit, others agree to float rounding. Masked families (variable-length text) keep each row cut to its own
# tokens and are padded back to the batch's longest, as their encoders pad.

DEFAULT_PROMPT_CACHE_GB = 4.0  # SD3.5 with CFG: 1.7 MB a prompt (77 + 128 tokens x 4096, bf16): ~2400 prompts


class PromptCache:
    """Embedding rows by key, least recently used first out, within `max_bytes` (tensors on the CPU)."""

    def __init__(self, max_bytes):
        self.max_bytes, self.bytes, self.entries = int(max_bytes), 0, collections.OrderedDict()
        self.offloaded_from = None  # the device the text encoders were moved off (offload_text_encoders)
        self.hits = self.misses = 0

    def get(self, key):
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key, value):
        """Store value (a dict of tensors) unless it alone exceeds the budget; evict the oldest entries to fit."""
        size = _nbytes(value)
        if key in self.entries or size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            self.bytes -= _nbytes(self.entries.popitem(last=False)[1])
        self.entries[key] = value
        self.bytes += size

    def fits(self, value):
        return self.bytes + _nbytes(value) <= self.max_bytes


def _nbytes(value):
    return sum(t.numel() * t.element_size() for t in value.values())


def _text_encoders(pipe):
    return [m for name, m in pipe.components.items() if name.startswith("text_encoder") and
            isinstance(m, torch.nn.Module)]


def _encoders_train(pipe):
    return any(p.requires_grad for m in _text_encoders(pipe) for p in m.parameters())


def _offloaded_from(pipe):
    """The device the text encoders were moved off (offload_text_encoders, a prompt store); None while on it."""
    for holder in (getattr(pipe, "prompt_store", None), getattr(pipe, "prompt_cache", None)):
        if holder is not None and holder.offloaded_from is not None:
            return holder.offloaded_from
    return None


@contextlib.contextmanager
def _encoders_on(pipe):
    """Inside, the text encoders are on the pipeline's device, also after offload_text_encoders (a cache miss)."""
    device = _offloaded_from(pipe)
    if device is None:
        yield
        return
    for m in _text_encoders(pipe):
        m.to(device)
    try:
        yield
    finally:
        for m in _text_encoders(pipe):
            m.to("cpu")


def _to_cpu(t):
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def _split_rows(out, n):
    """encode_prompts' output for n prompts -> (n row dicts of [1, ...] CPU tensors, the negative's row dict), each
    masked row cut to its own tokens; None when the layout is not one this understands (then nothing is cached)."""
    masked = "prompt_mask" in out
    rows, neg = [{} for _ in range(n)], {}
    for key, value in out.items():
        if key.startswith("neg_"):
            if not torch.equal(value, value[:1].expand_as(value)):
                return None  # a negative that differs per row (it would see each row's images)
            neg[key] = _to_cpu(value[:1])
        else:
            for i in range(n):
                rows[i][key] = _to_cpu(value[i:i + 1])
    for part, prefix in [(r, "") for r in rows] + ([(neg, "neg_")] if neg else []):
        if masked:
            mask = part[prefix + "prompt_mask"][0]
            length = int(mask.sum())
            if not bool(mask[:length].all()):
                return None  # not right-padded: cannot be cut and padded back
            for key in (prefix + "prompt_embeds", prefix + "prompt_mask"):
                part[key] = part[key][:, :length].contiguous()
    return rows, neg


def _assemble(rows, neg, device):
    """Row dicts (and the negative's) -> encode_prompts' output on `device`: masked rows right-padded with zeros to
    the longest of the batch and the negative (families.common.with_negative), the negative expanded to the batch."""
    rows = [dict(r) for r in rows]
    neg = dict(neg)
    if "prompt_mask" in rows[0]:
        length = max([r["prompt_embeds"].shape[1] for r in rows] + [v.shape[1] for k, v in neg.items()
                                                                        if k == "neg_prompt_embeds"])
        for part, prefix in [(r, "") for r in rows] + ([(neg, "neg_")] if neg else []):
            e, m = families.common.pad_tokens(part[prefix + "prompt_embeds"], part[prefix + "prompt_mask"], length)
            part[prefix + "prompt_embeds"], part[prefix + "prompt_mask"] = e, m
    home = {k: "cpu" if k.endswith("prompt_mask") else device for k in list(rows[0]) + list(neg)}  # masks: the CPU
    out = {k: torch.cat([r[k] for r in rows]).to(home[k]) for k in rows[0]}  # (families.common.host_mask)
    out.update({k: v.to(home[k]).expand(len(rows), *v.shape[1:]) for k, v in neg.items()})
    return out


def _encode_cached(pipe, cache, prompts, *, negative_prompt, guidance_scale, max_sequence_length, resolution):
    """encode_prompts through the cache: the missing prompts (and the negative, the first time) encoded in one
    batch, in the order given, so that a first encode is the uncached one."""
    tokens, cfg = max_sequence_length, guidance_scale > 1
    kwargs = dict(negative_prompt=negative_prompt, guidance_scale=guidance_scale, max_sequence_length=tokens,
                  resolution=resolution)
    neg_key = ("negative", negative_prompt, tokens, cfg)
    rows = {p: cache.get(("prompt", p, tokens)) for p in prompts}
    neg = cache.get(neg_key)
    missing = [p for p in prompts if rows[p] is None]  # in order, repeats kept: all missing -> the uncached batch
    cache.hits += len(prompts) - len(missing)
    cache.misses += len(missing)
    if missing or neg is None:
        texts = missing or [negative_prompt]
        with _encoders_on(pipe):
            out = _encode_fresh(pipe, texts, **kwargs)
        split = _split_rows(out, len(texts))
        if split is None:  # a layout without per-prompt rows: encoded afresh, uncached
            if texts != prompts:
                with _encoders_on(pipe):
                    out = _encode_fresh(pipe, prompts, **kwargs)
            return out
        fresh, neg = split
        for p, row in zip(missing, fresh):
            if rows[p] is None:  # a repeated prompt takes its first row
                rows[p] = row
                cache.put(("prompt", p, tokens), row)
        cache.put(neg_key, neg)
    return _assemble([rows[p] for p in prompts], neg, pipe._execution_device)


def prompt_cache(pipe, gigabytes, *, texts=(), offload=False, guidance_scales=(1.0,), negative_prompt="",
                 max_sequence_length=None, batch_size=16):
    """Give `pipe` a prompt-embedding cache of `gigabytes` (CPU memory, per process; 0: none) -> a line for the log.

    offload: encode `texts` (training and held-out prompts, without source images) ahead, in batches of
    batch_size, for each of `guidance_scales` (whether CFG's negative is needed), until all are in or the cache is
    full, then move the text encoders to the CPU; a later miss moves them back for its encode (an edit's source
    images, a prompt that did not fit). gigabytes None: DEFAULT_PROMPT_CACHE_GB on a GPU, none on a CPU.

    With pipe.prompt_store_dir (--prompt-store, set by policy.Policy), `texts` and the negative prompt are first read
    from, or encoded ahead into, the prompt store in that folder (prompt_store_of below), and the text encoders leave
    the GPU; the cache then holds what the store does not (an edit's prompts, another negative prompt)."""
    lines = []
    if getattr(pipe, "prompt_store_dir", None):
        lines.append(prompt_store_of(pipe, pipe.prompt_store_dir, texts, negative_prompt=negative_prompt,
                                     max_sequence_length=max_sequence_length, batch_size=batch_size))
    if gigabytes is None:  # GPU time is what the cache saves; the CPU runs stay as they were
        gigabytes = DEFAULT_PROMPT_CACHE_GB if offload or pipe._execution_device.type == "cuda" else 0
    if offload and gigabytes <= 0:
        raise ValueError("--offload-text-encoders reads every prompt from the prompt cache: give --prompt-cache-gb > 0")
    if gigabytes <= 0:
        return "; ".join(lines) or None
    pipe.prompt_cache = cache = PromptCache(gigabytes * 2**30)
    if not offload or lines:  # a store holds every prompt, and has moved the encoders off
        return "; ".join(lines + [f"prompt cache: {gigabytes:g} GB"])
    texts = list(dict.fromkeys(texts))
    tokens = default_tokens(pipe) if max_sequence_length is None else max_sequence_length
    for cfg in sorted({g > 1 for g in guidance_scales}):  # the negative of each CFG setting used
        encode_prompts(pipe, texts[:1] or [negative_prompt], negative_prompt=negative_prompt,
                       guidance_scale=2.0 if cfg else 1.0, max_sequence_length=tokens)
    for i in range(0, len(texts), batch_size):
        before = cache.bytes
        encode_prompts(pipe, texts[i:i + batch_size], negative_prompt=negative_prompt, max_sequence_length=tokens)
        if cache.bytes + (cache.bytes - before) > cache.max_bytes:
            break  # the next batch would evict this one: the rest are encoded when they come, the encoders moved in
    done = sum(("prompt", t, tokens) in cache.entries for t in texts)
    offload_text_encoders(pipe)
    return (f"prompt cache: {gigabytes:g} GB, {done} of {len(texts)} prompts encoded ahead "
            f"({cache.bytes / 2**30:.2f} GB); text encoders moved to the CPU")


def offload_text_encoders(pipe, holder=None):
    """Move the text encoders to the CPU: encode_prompts then reads the cache (or `holder`, the prompt store), and
    moves them back for a miss."""
    holder = holder or pipe.prompt_cache
    if _offloaded_from(pipe) is None:
        holder.offloaded_from = pipe._execution_device
        for m in _text_encoders(pipe):
            m.to("cpu")


# ----------------------------------------------------------------------------- the prompt-embedding store
#
# The cache above holds about 2400 SD3.5 prompts, and a prompt file of Flow-GRPO's holds tens of thousands, each seen
# once an epoch: with the encoders offloaded nearly every step moved them (11 GB) to the GPU and back. The store
# (--prompt-store DIR, prompt_store.py for its files) encodes every training and held-out prompt once, ahead, into
# files on the node's disk (about 1.7 MB a prompt for SD3.5), and every later step reads its prompts' rows from them,
# the encoders on the CPU for the rest of the run. A run, a resume or a later run with the same identity (the model,
# each text encoder's class, dtype and weights, the tokenizers, the text tokens, the negative prompt) and the same
# prompts reads the same files; any other is refused in one line, as a damaged file is.
#
# Every rank of a node encodes its share (shard k by local rank k mod the node's ranks) and writes it to the node's
# folder, then local rank 0 writes the manifest; rather than rank 0 encoding everything and sending it: the encoders
# are already on every GPU when the run starts, so the share costs no memory and divides the one-off encode by the
# GPUs of a node, and a node-local folder must be written on each node anyway (an SD3.5 prompt file of 50000 prompts
# is 84 GB: encoding it again is faster than sending it between nodes). A folder that several nodes share gets each
# file written whole by each node in turn (renamed into place): correct, at the cost of the nodes' repeated work.
# Another run is kept out of the folder while a run opens or builds its store (prompt_store.claim: a lock file, held
# by each node's local rank 0), so two runs never leave one's manifest beside the other's shards.
# Rows are the rows of the batches the store encoded (batch_size prompts within one shard), as the cache's.

def _in_store(store, prompts, *, negative_prompt, guidance_scale, max_sequence_length, resolution):
    """Whether the store serves this encode: every prompt in it, at its text tokens and (CFG) its negative prompt."""
    identity = store.identity
    return (max_sequence_length == identity["tokens"] and (guidance_scale <= 1 or
            negative_prompt == identity["negative_prompt"]) and
            all(p in store.index and p not in store.damaged for p in prompts))


def _weights_digest(module):
    """16 hex digits of SHA-256 over a module's tensors: names, dtypes, shapes and two integer sums of their bits
    (plain, and weighted by position mod 251), computed where the tensors are: exact and free of the order in which a
    device sums, so every rank and every GPU model computes the same digest of the same weights."""
    digest, sums = hashlib.sha256(), []
    for name, t in module.state_dict().items():
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        bits = t.detach().contiguous().reshape(-1)
        bits = bits.view(torch.int32) if bits.element_size() >= 4 else bits.view((torch.int8, torch.int16)[
            bits.element_size() - 1])  # 8-byte tensors as two int32 each: no sum can overflow int64
        for start in range(0, bits.numel(), 1 << 22):
            chunk = bits[start:start + (1 << 22)].long()
            weight = torch.arange(start, start + len(chunk), device=chunk.device) % 251 + 1
            sums += [chunk.sum(), (chunk * weight).sum()]
    if sums:
        digest.update(torch.stack(sums).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _store_identity(pipe, tokens, negative_prompt):
    """What a prompt's stored rows depend on besides its text (prompt_store.py's manifest, compared on reuse)."""
    identity = dict(model=pipe.model_name, tokens=tokens, negative_prompt=negative_prompt, encoders={}, tokenizers={})
    for name, part in sorted(pipe.components.items()):
        if name.startswith("text_encoder") and isinstance(part, torch.nn.Module):
            dtypes = "/".join(sorted({str(q.dtype).replace("torch.", "") for q in part.parameters()}))
            identity["encoders"][name] = f"{type(part).__name__} {dtypes} {_weights_digest(part)}"
        elif name.startswith("tokenizer") and hasattr(part, "get_vocab"):
            vocab = json.dumps(sorted(part.get_vocab().items())).encode()
            identity["tokenizers"][name] = f"{type(part).__name__} {len(part)} {hashlib.sha256(vocab).hexdigest()[:16]}"
    return identity


def _store_rows(pipe, texts, *, guidance_scale=1.0, **kwargs):
    """Freshly encoded rows of `texts` -> (rows, the negative's row), as the cache splits them."""
    split = _split_rows(_encode_fresh(pipe, texts, guidance_scale=guidance_scale, **kwargs), len(texts))
    if split is None:
        raise ValueError(f"--prompt-store: model {pipe.model_name}'s text embeddings have no row per prompt to store; "
                         "drop --prompt-store")
    return split


def _build_store(pipe, directory, texts, *, negative_prompt, tokens, batch_size):
    """This rank's share of the store's files (the section's notes): shard k where k is its local rank mod the
    node's ranks, each encoded in batches of batch_size, and on local rank 0 the negative prompt (under CFG)."""
    os.makedirs(directory, exist_ok=True)
    kwargs = dict(negative_prompt=negative_prompt, max_sequence_length=tokens)
    with _encoders_on(pipe):
        for k, (first, count) in enumerate(prompt_store.shards(len(texts))):
            if k % distributed.LOCAL_WORLD == distributed.LOCAL_RANK:
                rows = []
                for i in range(first, first + count, batch_size):
                    rows += _store_rows(pipe, texts[i:min(i + batch_size, first + count)], **kwargs)[0]
                prompt_store.write_rows(os.path.join(directory, prompt_store.shard_name(k)), rows)
        if distributed.LOCAL_RANK == 0:
            negative = _store_rows(pipe, [negative_prompt], guidance_scale=2.0, **kwargs)[1]  # encoded alone, as cached
            prompt_store.write_rows(os.path.join(directory, "negative.safetensors"), [negative])


def _store_step(directory, step):
    """step() on every rank -> its value; a ValueError on any rank (a refusal, a failed write) raised on every rank,
    as its one line there and as a pointer to it on the others: no rank is left waiting for another."""
    value, problem = None, None
    try:
        value = step()
    except ValueError as e:
        problem = e
    if distributed.any_rank_host(problem is not None):
        raise problem or ValueError(f"--prompt-store {directory}: another rank refused its store (its line above)")
    return value


def prompt_store_of(pipe, directory, texts, *, negative_prompt="", max_sequence_length=None, batch_size=16):
    """Give `pipe` the prompt store in `directory` for `texts` (and the negative prompt), built first where the
    folder holds none (every rank its share), then move the text encoders to the CPU -> a line for the log. A store
    of another identity or other prompts, or a damaged one, raises ValueError in one line (on every rank)."""
    start = time.time()
    tokens = default_tokens(pipe) if max_sequence_length is None else max_sequence_length
    texts = list(dict.fromkeys(texts))
    identity = _store_identity(pipe, tokens, negative_prompt)
    job = distributed.broadcast(f"{os.uname().nodename} pid {os.getpid()} at {time.time():.6f}")  # this run's name
    lock = None

    def opened():  # None where this node builds the store, which a folder it cannot write refuses before encoding
        found = prompt_store.open_store(directory, identity, texts)
        if found is None and lock is not None and not lock.writable:
            raise prompt_store.unwritable(directory, lock.problem)
        return found

    claim = (lambda: prompt_store.claim(directory, job)) if distributed.LOCAL_RANK == 0 else (lambda: None)
    try:  # each node's local rank 0 holds the folder for the node's ranks (prompt_store.claim) until the store is open
        lock = _store_step(directory, claim)
        store = _store_step(directory, opened)
        built = store is None
        if distributed.any_rank_host(built):  # some node has no store: its ranks build one, every rank waits for them
            _store_step(directory, lambda: built and _build_store(
                pipe, directory, texts, negative_prompt=negative_prompt, tokens=tokens, batch_size=batch_size))
            _store_step(directory, lambda: built and distributed.LOCAL_RANK == 0 and
                        prompt_store.write_manifest(directory, identity, texts))  # the files' sizes and digests
            store = _store_step(directory, lambda: store or prompt_store.open_store(directory, identity, texts))
    finally:
        if lock is not None:
            lock.release()
    pipe.prompt_store = store
    offload_text_encoders(pipe, store)
    how = (f"encoded ahead by {distributed.LOCAL_WORLD} rank(s) a node in {time.time() - start:.0f} s" if built
           else "reused")
    return (f"prompt store {directory}: {len(texts)} prompts, {store.bytes / 2**30:.2f} GB, {how}; text encoders "
            "moved to the CPU")


def velocity(pipe, x, sigma, embeds, *, guidance_scale=1.0, modules=None):
    """The guided velocity v(x, sigma) ~ eps - x0, same shape as x, in the transformer's dtype
    (float32 for z-image, whose guidance the pipeline combines in float32).

    sigma: float or [B] tensor. modules: {name: callable} in place of trained_modules(pipe), e.g. the DDP / FSDP /
    compiled wrappers to train through. Gradients flow unless the caller disables them.

    The family receives sigma on x's device, except a family of several trained modules (Wan 2.2's experts): it
    routes each sample by its sigma, so a sigma the caller holds on the host (a float, a CPU tensor) reaches it there,
    and it reads the routes without waiting for the device.
    """
    trained = trained_modules(pipe)
    with _lora_input(trained.values(), x.device.type):  # no float32 round trip of the LoRA inputs under autocast
        assert embeds["prompt_embeds"].shape[0] == x.shape[0], "embeds and x must have the same batch size"
        on = "cpu" if len(trained) > 1 and not (torch.is_tensor(sigma) and sigma.device.type != "cpu") else x.device
        # non_blocking: a host value is staged from pageable memory at once, without waiting for the device's queue
        sigma = torch.as_tensor(sigma, dtype=torch.float32).to(on, non_blocking=True).expand(x.shape[0])  # [B]
        return family(pipe).velocity(pipe, modules or trained, x, sigma, embeds, guidance_scale)


def generate(pipe, x, sigmas, embeds, *, guidance_scale=1.0, solver=None, autocast=contextlib.nullcontext,
             **rollout):
    """Samples from the noise x [B, ...] through `sigmas`, then decoded, without gradients: an SDE rollout
    (sde.rollout's trajectory; **rollout: sde_steps, kind, eta, generator, flash, flash_ratio) or, given a
    deterministic `solver` (euler, dpm2), sde.ode_sample keeping the clean sample alone ({"latents": [B, 1, ...]}).
    The forwards and the decode run under autocast(). -> (trajectory, uint8 images [B, H, W, 3] (video:
    [B, F, H, W, 3])). The one sampling loop of train.py, eval.py and scripts/."""
    def v(x_, s_):  # what the sampler calls; CFG lives inside
        return velocity(pipe, x_, s_, embeds, guidance_scale=guidance_scale)
    with torch.no_grad(), autocast():
        if solver is not None:
            traj = {"latents": sde.ode_sample(v, x, sigmas, solver=solver)[:, None]}
        else:
            traj = sde.rollout(v, x, sigmas, **rollout)
        return traj, decode(pipe, traj["latents"][:, -1])


@torch.no_grad()
def decode(pipe, latents):
    """Latents at sigma = 0 -> uint8 images [B, H, W, 3] on the CPU (as the pipelines' "np" output, x 255);
    for video families (wan) uint8 videos [B, F, H, W, 3]."""
    return family(pipe).decode(pipe, latents)


# ----------------------------------------------------------------------------- native schedules

def sigmas(pipe, num_steps, resolution, *, shift=None, num_frames=None):
    """The schedule the family's own pipeline samples with at `resolution`: float32 [num_steps + 1], 1 -> 0.

    sd3: sde.sd3_sigmas(num_steps, shift) with the scheduler's shift (3 for SD3.5). flux: FluxPipeline's
    linspace(1, 1/N, N) with its resolution-dependent exponential shift (common.dynamic_shift_mu of the image
    tokens, the scheduler's base/max shift). The other families: their pipelines' (families/ docstrings).
    shift: a static shift in place of the family's own (sd3, wan, z-image) or of its resolution-dependent one.
    num_frames: a video's frames, for a schedule that counts them (ltx2's shift counts the video's tokens: its
    latent shape, asked here first, records them)."""
    if num_steps < 1:
        raise ValueError(f"--num-steps must be at least 1, got {num_steps}")
    if shift is not None and shift <= 0:
        raise ValueError(f"--shift must be positive, got {shift}")
    if num_frames is not None and family(pipe).video:
        latent_shape(pipe, resolution, num_frames=num_frames)
    return family(pipe).sigmas(pipe, num_steps, *_hw(resolution), shift)


# ----------------------------------------------------------------------------- LoRA

def add_lora(pipe, rank, alpha, *, target_modules=None):
    """Make the trained modules (trained_modules) trainable: on each a LoRA adapter (Hu et al. 2021) of `rank` and
    scale alpha / rank on `target_modules` (default: the record's lora_targets), or, for rank 0, all of its weights
    (full fine-tune). Everything else stays frozen. Returns the trainable parameters."""
    for module in _modules(pipe):
        module.requires_grad_(False)
    spec = family(pipe)
    params = []
    for transformer in trained_modules(pipe).values():
        # Layers whose output the model discards (Qwen-Image's last text stream) get no gradient at all,
        # which DDP refuses: they are left out of training.
        unused = spec.unused(transformer)
        if rank == 0:
            transformer.requires_grad_(True)
            for name in unused:
                transformer.get_submodule(name).requires_grad_(False)
        else:
            _add_adapter(transformer, rank, alpha, list(target_modules or spec.lora_targets), unused)
        params += [p for p in transformer.parameters() if p.requires_grad]
    return params


def _add_adapter(transformer, rank, alpha, targets, unused):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets,
                                       exclude_modules=unused or None))
    params = [p for p in transformer.parameters() if p.requires_grad]
    assert params, f"no LoRA layer matched target modules {targets}"
    for p in params:
        p.data = p.data.float()  # departure 2 (module docstring)
    transformer._lora_layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]  # _lora_input


@contextlib.contextmanager
def _lora_input(transformers, device_type):
    """Inside, under autocast, peft's LoRA layers take their input as it comes. peft (0.21, lora/layer.py
    Linear.forward) casts it to the adapter's dtype, float32 here (departure 2), and autocast casts it straight
    back for the matmuls of lora_A and lora_B, which run in the autocast dtype with a half copy of the float32
    weights (the master weights stay float32, the compute is in half): two copies of a full activation per adapted
    layer, for the same bits. Without autocast (a half-precision base called as is) peft's cast stays, as the
    dtypes must match there."""
    layers = [layer for t in transformers for layer in getattr(t, "_lora_layers", ())]
    if not layers or not torch.is_autocast_enabled(device_type):
        yield
        return
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.cast_input_dtype_enabled = True


def _has_lora(transformer):
    return bool(getattr(transformer, "_hf_peft_config_loaded", False))


@contextlib.contextmanager
def reference(pipe):
    """Inside, the trained modules run without their LoRA adapters: the frozen base model, the
    reference of the KL penalty. Trainability flags are restored on exit."""
    transformers = list(trained_modules(pipe).values())
    if not all(_has_lora(t) for t in transformers):
        raise RuntimeError("reference() needs a LoRA adapter, and full fine-tuning (LoRA rank 0) keeps no frozen "
                           "copy; train with a LoRA rank > 0 or without the KL penalty (beta 0)")
    flags = [(p, p.requires_grad) for t in transformers for p in t.parameters()]
    for t in transformers:
        t.disable_adapters()
    try:
        yield
    finally:
        for t in transformers:
            t.enable_adapters()
        for p, flag in flags:
            p.requires_grad_(flag)


def has_adapter(pipe):
    """Whether the trained modules carry LoRA adapters (then reference() runs the frozen base)."""
    return all(_has_lora(t) for t in trained_modules(pipe).values())


def save_lora(pipe, folder):
    """Write the adapters as the record exports them (common.save_lora: `folder/pytorch_lora_weights.safetensors` in
    the diffusers format, with its LoraConfig as metadata, so that `pipe.load_lora_weights(folder)` loads it; a second
    expert's in `folder/<its name>/`)."""
    if not has_adapter(pipe):
        raise RuntimeError("save_lora() needs a LoRA adapter; a full fine-tune (LoRA rank 0) is saved with "
                           "pipe.transformer.save_pretrained(folder)")
    family(pipe).save_lora(pipe, trained_modules(pipe), folder)


def _attention_backends():
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [b.value for b in AttentionBackendName]


def attention_backend(pipe, name, dtype=torch.float32):
    """The trained modules' attention through diffusers' attention backend `name` (set_attention_backend: flash,
    sage, xformers, the native SDPA kernels...), for the rollout, training and reference forwards alike; "native",
    diffusers' default (torch's SDPA, its kernel of choice), leaves the modules as they load. A backend whose package
    is missing is refused in one line, and so is one whose kernels cannot run a forward and backward on the modules'
    device in `dtype` (the forwards' autocast dtype): tried at once on a tiny input (FlexAttention has no backward on a
    CPU, the fused SDPA kernels without the math one no CPU kernel, flash no float32), not at the first step. Attention
    processors that do not dispatch (SD3's joint attention) keep native SDPA whatever the name: a warning says so."""
    if name == "native":
        return
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn
    before = _AttentionBackendRegistry.get_active_backend()[0]  # set_attention_backend makes `name` the process's
    modules = trained_modules(pipe).values()
    for module in modules:
        try:
            module.set_attention_backend(name)
        except (RuntimeError, ValueError, ImportError) as e:
            raise RuntimeError(f"--attention-backend {name}: {' '.join(str(e).split())[:200]} (or leave it native)")\
                from None
    dispatching = [m for module in modules for m in module.modules()
                   if hasattr(getattr(m, "processor", None), "_attention_backend")]
    if not dispatching:
        processors = sorted({type(m.processor).__name__ for module in modules for m in module.modules()
                             if getattr(m, "processor", None) is not None})
        distributed.print0(f"warning: --attention-backend {name} changes nothing on "
                           f"{getattr(pipe, 'model_name', 'this model')}: its attention ({', '.join(processors)}) "
                           "calls torch's SDPA itself, not diffusers' backends (leave it native)")
        return
    first = dispatching[0]
    head_dim = first.to_q.out_features // first.heads if hasattr(first, "to_q") and hasattr(first, "heads") else 64
    device = next(iter(modules)).device
    q, k, v = (torch.randn(1, 16, 2, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    try:  # [batch, tokens, heads, head_dim], as the processors call it
        dispatch_attention_fn(q, k, v, backend=name).float().sum().backward()
    except Exception as e:  # whatever the kernel raises (NotImplementedError, RuntimeError, ValueError, ...)
        for module in modules:
            module.reset_attention_backend()
        _AttentionBackendRegistry.set_active_backend(before)
        raise RuntimeError(f"--attention-backend {name} cannot run a forward and backward on {device.type} in "
                           f"{str(dtype).removeprefix('torch.')} here ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:160]}); pick another backend, or leave it native") from None


def add_arguments(parser):
    """The model flags, declared once; None means the preset of --model (train.py)."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="shapes", choices=list(MODELS),
                   help="model family (shapes: pretrained, learns on a CPU in minutes; tiny: random, the fastest)")
    g.add_argument("--model-path", default=None,
                   help="hub id or local folder of the pipeline (default: the family's hub id)")
    g.add_argument("--resolution", type=flags.resolution_arg, default=None,
                   help="image side in pixels, or HEIGHTxWIDTH (sd3, wan, z-image)")
    g.add_argument("--num-frames", type=flags.POSITIVE_INT, default=None,
                   help="video models (wan): frames per sample, 4 k + 1 (default: the pipeline's 81)")
    g.add_argument("--prompt-cache-gb", type=flags.NONNEG, default=None,
                   help="CPU memory per GPU for prompt embeddings, each prompt encoded once (models.prompt_cache; "
                        f"0: none; default {DEFAULT_PROMPT_CACHE_GB:g} on a GPU, 0 on a CPU)")
    g.add_argument("--attention-backend", default="native", choices=_attention_backends(),
                   help="diffusers' attention backend of the trained modules (recorded in args.json; native: torch's "
                        "SDPA as diffusers loads it)")
    g.add_argument("--offload-text-encoders", action="store_true",
                   help="encode every training and held-out prompt ahead into the prompt cache, then keep the text "
                        "encoders on the CPU (a miss moves them back for its encode)")
    g.add_argument("--prompt-store", default=None, metavar="DIR",
                   help="a folder on each node's local disk: every training and held-out prompt is encoded once, ahead "
                        "(each GPU its share), into files there and read back per step, the text encoders on the CPU; "
                        "later runs and resumes with the same model, text encoders, text tokens, negative prompt and "
                        "prompts reuse it, others are refused (models.prompt_store_of; default: none)")
    g.add_argument("--edit-vl-input", choices=list(families.qwen_image_edit.EDIT_VL_INPUTS), default="diffusers",
                   help="qwen-image-edit: what its VL encoder is shown of the source. diffusers: the resized image; "
                        "authors: Flow-GRPO's preprocessed tensor in [-1, 1], almost uniform after the Qwen2-VL "
                        "processor's 1/255 rescale (default: %(default)s)")
    return g
