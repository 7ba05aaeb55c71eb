"""The prompt-embedding store: every prompt of a run's prompt files encoded once, ahead, into files on local disk and
read back per step, so that no text encoder needs to be on the GPU (models.prompt_cache builds and reads it).

    DIR/manifest.json                what the store holds: the identity of what encoded it (the model, each text
                                     encoder's class, dtype and a digest of its weights, the tokenizers, the text
                                     tokens, the negative prompt), the prompts' count and SHA-256, each shard's file,
                                     first prompt, prompt count and size in bytes
    DIR/texts.json                   the prompts, in row order
    DIR/shard-00000.safetensors ...  SHARD_PROMPTS prompts each: per embedding key the prompts' rows concatenated
                                     along their first dimension (a masked family's rows cut to their own tokens) with
                                     `offsets/<key>` [n + 1], and `crc32` [n], a CRC-32 of each prompt's bytes
    DIR/negative.safetensors         the negative prompt's rows (CFG's), one row in the same layout

Each file is written under a temporary name and renamed, the manifest last: a folder without a manifest was never
finished and is built again over; one with a manifest is trusted only for the identity and prompts it names, which a
run compares with its own before reading a row (`open_store` refuses a mismatch in one line naming the fix). A
shard's size and header are checked when the store opens (truncated, emptied or replaced), and each prompt's bytes
against its CRC-32 when it is read (garbled): a damaged file is an error naming it, never other numbers.

    shards(n) -> [(first, count)]                 the rows each shard holds
    write_rows(path, rows) -> bytes written       rows: [{key: [1, ...] CPU tensor}] of one shard (or the negative)
    write_manifest(directory, identity, texts, files)    after every shard is written: texts.json, then the manifest
    open_store(directory, identity, texts) -> PromptStore, or None where there is no finished store
    PromptStore.index {text: row}, .rows(texts) -> [{key: [1, ...]}], .negative {neg_key: [1, ...]}
"""
import bisect
import hashlib
import json
import os
import zlib

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT = "prompt-store-1"
SHARD_PROMPTS = 1024  # prompts per shard file: SD3.5 with its 205 text tokens, 1.7 GB in bf16 (built in CPU memory)
FIX = "delete it to encode the prompts again, or give another --prompt-store folder"


def shards(n):
    """[(first row, rows)] of the shards of n prompts, in order."""
    return [(first, min(SHARD_PROMPTS, n - first)) for first in range(0, n, SHARD_PROMPTS)]


def shard_name(k):
    return f"shard-{k:05d}.safetensors"


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def row_crc(row):
    """CRC-32 of one prompt's tensors, key by key in sorted order (dtype, shape and bytes)."""
    crc = 0
    for key in sorted(row):
        t = row[key]
        crc = zlib.crc32(f"{key}:{t.dtype}:{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(_bytes(t), crc)
    return crc


def write_rows(path, rows):
    """Rows ([{key: [1, ...] CPU tensor}], the same keys and dtypes in each) -> one safetensors file at `path`, written
    under a temporary name and renamed. -> its size in bytes."""
    keys = sorted(rows[0])
    tensors = {"crc32": torch.tensor([row_crc(r) for r in rows], dtype=torch.int64)}
    for key in keys:
        parts = [r[key][0] for r in rows]  # [d, ...] each; pooled [P], masked embeddings [own tokens, D]
        lengths = torch.tensor([0] + [p.shape[0] for p in parts], dtype=torch.int64)
        tensors[key] = torch.cat(parts).contiguous()
        tensors[f"offsets/{key}"] = lengths.cumsum(0)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"format": FORMAT})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path)


def _write_json(path, value):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def texts_digest(texts):
    return hashlib.sha256(json.dumps(list(texts)).encode()).hexdigest()


def write_manifest(directory, identity, texts, files):
    """The store's texts.json and manifest.json (last: the store exists from then on). files: {name: bytes}."""
    _write_json(os.path.join(directory, "texts.json"), list(texts))
    _write_json(os.path.join(directory, "manifest.json"), dict(
        format=FORMAT, identity=identity, prompts=len(texts), texts_sha256=texts_digest(texts),
        shards=[dict(file=shard_name(k), first=first, rows=count, bytes=files[shard_name(k)])
                for k, (first, count) in enumerate(shards(len(texts)))],
        negative=dict(file="negative.safetensors", bytes=files["negative.safetensors"])))


def _differences(held, wanted):
    """What differs between the identity a store was written by and the run's, in words."""
    found = []
    for key in sorted(set(held) | set(wanted)):
        a, b = held.get(key), wanted.get(key)
        if a != b:
            found.append(f"{key} {a!r} where this run has {b!r}" if not isinstance(a, dict) else
                         f"{key}: " + "; ".join(_differences(a, b or {})))
    return found


def _first_difference(held, texts):
    n = next((i for i, (a, b) in enumerate(zip(held, texts)) if a != b), min(len(held), len(texts)))
    if n < min(len(held), len(texts)):
        return f"prompt {n + 1} is {held[n][:60]!r} there and {texts[n][:60]!r} here"
    return f"{len(held)} prompts there, {len(texts)} here"


def open_store(directory, identity, texts):
    """The finished store in `directory` for this identity and these prompts (in order), or None where there is none
    (no folder, or no manifest: never finished). A store written by another model, text encoders, tokens or negative
    prompt, or for other prompts, and a damaged manifest or shard, raise ValueError in one line naming the fix."""
    where = f"--prompt-store {directory}"
    path = os.path.join(directory, "manifest.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        with open(os.path.join(directory, "texts.json")) as f:
            held = json.load(f)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, not {FORMAT!r}")
        if not isinstance(manifest.get("identity"), dict) or not all(isinstance(t, str) for t in held):
            raise ValueError("no identity, or texts that are not strings")
    except (OSError, ValueError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{where}: its manifest or texts.json cannot be read ({type(e).__name__}: {e}): "
                         f"{FIX}") from None
    if manifest.get("identity") != identity:
        raise ValueError(f"{where} holds embeddings written by other text encoders or settings "
                         f"({', '.join(_differences(manifest.get('identity') or {}, identity))}): {FIX}")
    if manifest.get("texts_sha256") != texts_digest(texts) or held != list(texts):
        raise ValueError(f"{where} holds the embeddings of other prompts ({_first_difference(held, texts)}; the "
                         f"prompt files changed): {FIX}")
    try:
        return PromptStore(directory, manifest, held)
    except (KeyError, TypeError, AttributeError) as e:  # valid JSON, not a manifest's fields
        raise ValueError(f"{where}: its manifest cannot be read ({type(e).__name__}: {e}): {FIX}") from None


class PromptStore:
    """A finished store, opened: each shard's size and header checked, its offsets and CRCs read; rows read on
    demand (safetensors maps the files: a row costs its own bytes)."""

    def __init__(self, directory, manifest, texts):
        self.directory, self.texts, self.identity = directory, texts, manifest["identity"]
        self.index = {t: i for i, t in enumerate(texts)}
        self.offloaded_from = None  # the device the text encoders were moved off (models.prompt_cache)
        self.reads = 0
        self.shards = [self._open(s["file"], s["bytes"], s["rows"]) for s in manifest["shards"]]
        self.first = [s["first"] for s in manifest["shards"]]
        negative = manifest["negative"]
        handle = self._open(negative["file"], negative["bytes"], 1)
        self.negative = self._row(handle, 0, negative["file"], "the negative prompt")
        self.bytes = sum(s["bytes"] for s in manifest["shards"]) + negative["bytes"]

    def _open(self, name, size, rows):
        path = os.path.join(self.directory, name)
        where = f"--prompt-store {self.directory}: {name}"
        try:
            found = os.path.getsize(path)
        except OSError:
            raise ValueError(f"{where} is missing: {FIX}") from None
        if found != size:
            raise ValueError(f"{where} holds {found} bytes where the manifest wrote {size} (truncated or replaced): "
                             f"{FIX}")
        try:
            handle = safe_open(path, framework="pt")
            keys = [k for k in handle.keys() if k != "crc32" and not k.startswith("offsets/")]
            shard = dict(handle=handle, name=name, keys=keys, crc=handle.get_tensor("crc32").tolist(),
                         offsets={k: handle.get_tensor(f"offsets/{k}").tolist() for k in keys})
        except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"{where} cannot be read ({type(e).__name__}: {e}): {FIX}") from None
        if len(shard["crc"]) != rows or any(len(o) != rows + 1 for o in shard["offsets"].values()):
            raise ValueError(f"{where} holds {len(shard['crc'])} rows where the manifest wrote {rows}: {FIX}")
        return shard

    def _row(self, shard, j, name, text):
        row = {k: shard["handle"].get_slice(k)[shard["offsets"][k][j]:shard["offsets"][k][j + 1]].unsqueeze(0)
               for k in shard["keys"]}
        if row_crc(row) != shard["crc"][j]:
            raise ValueError(f"--prompt-store {self.directory}: {name} row {j} ({text[:60]!r}) fails its CRC-32 (the "
                             f"file is damaged): {FIX}")
        self.reads += 1
        return row

    def rows(self, texts):
        """[{key: [1, ...] CPU tensor}] of each text, read from its shard and checked against its CRC-32."""
        out = []
        for text in texts:
            i = self.index[text]
            k = bisect.bisect_right(self.first, i) - 1  # the shard whose rows start at or before i
            out.append(self._row(self.shards[k], i - self.first[k], self.shards[k]["name"], text))
        return out
