"""The prompt-embedding store: every prompt of a run's prompt files encoded once, ahead, into files on local disk and
read back per step, so that no text encoder needs to be on the GPU (models.prompt_cache builds and reads it).

    DIR/store.lock                   the store's lock (fcntl.flock), held while a run opens or builds the store, and
                                     the mark of a store's folder; DIR/store.holder names the run holding it (host,
                                     pid), removed when it lets go
    DIR/manifest.json                what the store holds: the identity of what encoded it (the model, each text
                                     encoder's class, dtype and a digest of its weights, the tokenizers, the text
                                     tokens, the negative prompt), the prompts' count and SHA-256, each shard's file,
                                     first prompt, prompt count, size in bytes and the SHA-256 of its rows' CRC-32s
    DIR/texts.json                   the prompts, in row order
    DIR/shard-00000.safetensors ...  SHARD_PROMPTS prompts each: per embedding key the prompts' rows concatenated
                                     along their first dimension (a masked family's rows cut to their own tokens) with
                                     `offsets/<key>` [n + 1], and `crc32` [n], a CRC-32 of each prompt's bytes
    DIR/negative.safetensors         the negative prompt's rows (CFG's), one row in the same layout

A store is written only into an empty folder, or one the store marked as its own with its lock file: a file it did
not write is never overwritten (`claim` refuses such a folder in one line). One run at a time opens or builds the
store in a folder (`claim` waits for another run's build, up to LOCK_WAIT_S, then refuses naming it); the ranks of
one run are covered by their node's holder. Each file is written under a temporary name and renamed, the manifest
last: a folder without a manifest was never finished and is built again over; one with a manifest is trusted only
for the identity and prompts it names, which a run compares with its own before reading a row (`open_store` refuses
a mismatch in one line naming the fix). When the store opens, each shard's size and header are checked, and its
rows' CRC-32s against the digest the manifest recorded (a shard truncated, emptied, or replaced by another, even of
the same size); each prompt's bytes are checked against its CRC-32 when it is read (garbled): a damaged file is an
error naming it, never other numbers.

    claim(directory, job) -> StoreLock            held while the store is opened or built; .release()
    shards(n) -> [(first, count)]                 the rows each shard holds
    write_rows(path, rows) -> bytes written       rows: [{key: [1, ...] CPU tensor}] of one shard (or the negative)
    write_manifest(directory, identity, texts)    after every shard is written: texts.json, then the manifest
    open_store(directory, identity, texts) -> PromptStore, or None where there is no finished store
    PromptStore.index {text: row}, .rows(texts) -> [{key: [1, ...]}], .negative {neg_key: [1, ...]}; a row that fails
    its CRC-32 raises DamagedRow, and with .encode_damaged its prompt is left to the text encoders from then on
"""
import bisect
import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
import zlib

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT = "prompt-store-2"  # 2: the lock file, each shard's digest of its rows' CRC-32s in the manifest
SHARD_PROMPTS = 1024  # prompts per shard file: SD3.5 with its 205 text tokens, 1.7 GB in bf16 (built in CPU memory)
FIX = "delete it to encode the prompts again, or give another --prompt-store folder"
LOCK, HOLDER = "store.lock", "store.holder"
LOCK_WAIT_S = 600.0  # how long a run waits for another run's build of its folder (the ranks wait in a collective)


def fix(directory):
    """The end of every refusal of a store: the folder to delete named, not left to the line's last path."""
    return f"the store is the folder {directory}: {FIX}"


class DamagedRow(ValueError):
    """A stored prompt whose bytes fail their CRC-32."""


# ----------------------------------------------------------------------------- one run at a time in a folder

class StoreLock:
    """The folder's lock, held (or covered by this run's holder on another node: held False) -> .release()."""

    def __init__(self, directory, fd, held, writable, problem=None):
        self.directory, self.fd, self.held, self.writable, self.problem = directory, fd, held, writable, problem

    def release(self):
        if self.fd is not None:
            if self.held and self.writable:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.directory, HOLDER))
            os.close(self.fd)  # closing the file lets go of its flock
            self.fd = None


def _holder(directory):
    """The run named as holding the folder's lock ({} where none is, or it is being named)."""
    try:
        with open(os.path.join(directory, HOLDER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _refuse_foreign(directory):
    """A folder without the store's lock file is a store's folder only where it is empty, or holds an older store's
    manifest (open_store then names its format); anything else is the user's, and stays untouched."""
    names = sorted(set(os.listdir(directory)) - {HOLDER})  # a holder's name left by a build killed before its lock
    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            older = str(json.load(f).get("format", "")).startswith("prompt-store")
    except (OSError, ValueError, AttributeError):
        older = False
    if names and not older:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(f"--prompt-store {directory} holds files no prompt store wrote ({shown}) and the store "
                         "never overwrites them: point --prompt-store at an empty folder or at a prompt store's folder")


def claim(directory, job):
    """Lock `directory` (created where missing) for this run while its store is opened or built -> StoreLock.

    job: the same string on every rank of the run; a lock held under it (another node of the run, a folder the nodes
    share) covers this rank too. Another run's lock is waited for, up to LOCK_WAIT_S, then refused in one line naming
    the holder. A folder this run cannot write is opened read-only (writable False; .problem says why): its finished
    store can still be read. A folder of files no store wrote is refused in one line, before anything is written."""
    where = f"--prompt-store {directory}"
    path = os.path.join(directory, LOCK)
    try:
        os.makedirs(directory, exist_ok=True)
        for name in (LOCK, HOLDER):  # a folder (or a link to nothing) where the store keeps its own files
            own = os.path.join(directory, name)
            if os.path.lexists(own) and not os.path.isfile(own):
                raise ValueError(f"{where}: its {name} is not a file (a folder, or a link to nothing), and the store "
                                 f"locks the folder with it: remove {own}, or give another --prompt-store folder")
        if not os.path.exists(path):
            _refuse_foreign(directory)
    except OSError as e:
        raise ValueError(f"{where} cannot be created or listed ({type(e).__name__}: {e}): give a folder on the "
                         "node's local disk that this run can write") from None
    writable, problem = True, None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only folder or file system (EACCES, EPERM, EROFS)
        writable, problem = False, e
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            raise ValueError(f"{where} cannot be written ({type(e).__name__}: {e}) and holds no prompt store: give "
                             "a folder on the node's local disk that this run can write") from None
    start, said = time.time(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _holder(directory)
            if holder.get("job") == job:  # this run's holder on another node: the run goes on under its lock
                return StoreLock(directory, fd, False, writable, problem)
            if time.time() - start > LOCK_WAIT_S:
                os.close(fd)
                raise ValueError(f"{where} is being written by another run ({_named(holder)}) for over "
                                 f"{LOCK_WAIT_S:g} s: wait for it to end, or give another --prompt-store folder") \
                    from None
            if not said and holder:
                print(f"{where}: waiting for the run writing it ({_named(holder)})", flush=True)
                said = True
            time.sleep(0.2)
    lock = StoreLock(directory, fd, True, writable, problem)
    if writable:  # the lock file itself is never written: a run that only reads the store leaves every file as it was
        try:
            _write_json(os.path.join(directory, HOLDER), dict(job=job, host=socket.gethostname(), pid=os.getpid(),
                                                              since=time.strftime("%Y-%m-%d %H:%M:%S")))
        except ValueError:
            lock.release()
            raise
    return lock


def _named(holder):
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}"


def unwritable(directory, problem):
    """The refusal of a build where the folder cannot be written (claim's .problem, or a write's error)."""
    return ValueError(f"--prompt-store {directory} cannot be written ({type(problem).__name__}: {problem}) and holds "
                      "no store of this run's prompts: give a folder on the node's local disk that this run can "
                      "write, or make this one writable")


# ----------------------------------------------------------------------------- writing

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


def rows_digest(crcs):
    """16 hex digits of SHA-256 over a shard's rows' CRC-32s: what the manifest records of the shard's content."""
    return hashlib.sha256(json.dumps([int(c) for c in crcs]).encode()).hexdigest()[:16]


def _written(path, write):
    """write(tmp) under a temporary name, then renamed to `path`; a failed write is one line naming the folder."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:  # a read-only or full disk: save_file raises SafetensorError
        raise unwritable(os.path.dirname(path), e) from None


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

    def write(tmp):
        save_file(tensors, tmp, metadata={"format": FORMAT})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    _written(path, write)
    return os.path.getsize(path)


def _write_json(path, value):
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(value, f)
            f.flush()
            os.fsync(f.fileno())
    _written(path, write)


def texts_digest(texts):
    return hashlib.sha256(json.dumps(list(texts)).encode()).hexdigest()


def _file_record(directory, name):
    """{file, bytes, rows_sha256} of a written shard, read back from it (under the lock: the file this run wrote)."""
    path = os.path.join(directory, name)
    with safe_open(path, framework="pt") as handle:
        crcs = handle.get_tensor("crc32").tolist()
    return dict(file=name, bytes=os.path.getsize(path), rows_sha256=rows_digest(crcs))


def write_manifest(directory, identity, texts):
    """The store's texts.json and manifest.json (last: the store exists from then on), each shard's size and digest
    read from its file."""
    _write_json(os.path.join(directory, "texts.json"), list(texts))
    _write_json(os.path.join(directory, "manifest.json"), dict(
        format=FORMAT, identity=identity, prompts=len(texts), texts_sha256=texts_digest(texts),
        shards=[dict(_file_record(directory, shard_name(k)), first=first, rows=count)
                for k, (first, count) in enumerate(shards(len(texts)))],
        negative=_file_record(directory, "negative.safetensors")))


# ----------------------------------------------------------------------------- reading

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
    except (OSError, ValueError, AttributeError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{where}: its manifest or texts.json cannot be read ({type(e).__name__}: {e}); "
                         f"{fix(directory)}") from None
    if manifest.get("identity") != identity:
        raise ValueError(f"{where} holds embeddings written by other text encoders or settings "
                         f"({', '.join(_differences(manifest.get('identity') or {}, identity))}); {fix(directory)}")
    if manifest.get("texts_sha256") != texts_digest(texts) or held != list(texts):
        raise ValueError(f"{where} holds the embeddings of other prompts ({_first_difference(held, texts)}; the "
                         f"prompt files changed); {fix(directory)}")
    try:
        return PromptStore(directory, manifest, held)
    except (KeyError, TypeError, AttributeError) as e:  # valid JSON, not a manifest's fields
        raise ValueError(f"{where}: its manifest cannot be read ({type(e).__name__}: {e}); {fix(directory)}") \
            from None


class PromptStore:
    """A finished store, opened: each shard's size, header and rows' digest checked, its offsets and CRCs read; rows
    read on demand (safetensors maps the files: a row costs its own bytes).

    encode_damaged (set by train.py): a row failing its CRC-32 is said in a warning and its prompt left to the text
    encoders (models.encode_prompts), rather than ending the run; .damaged holds those prompts."""

    def __init__(self, directory, manifest, texts):
        self.directory, self.texts, self.identity = directory, texts, manifest["identity"]
        self.index = {t: i for i, t in enumerate(texts)}
        self.offloaded_from = None  # the device the text encoders were moved off (models.prompt_cache)
        self.reads = 0
        self.encode_damaged, self.damaged = False, set()
        self.shards = [self._open(s, s["rows"]) for s in manifest["shards"]]
        self.first = [s["first"] for s in manifest["shards"]]
        negative = manifest["negative"]
        handle = self._open(negative, 1)
        self.negative = self._row(handle, 0, negative["file"], "the negative prompt")
        self.bytes = sum(s["bytes"] for s in manifest["shards"]) + negative["bytes"]

    def _open(self, record, rows):
        name, size = record["file"], record["bytes"]
        path = os.path.join(self.directory, name)
        where = f"--prompt-store {self.directory}: {name}"
        try:
            found = os.path.getsize(path)
        except OSError:
            raise ValueError(f"{where} is missing; {fix(self.directory)}") from None
        if found != size:
            raise ValueError(f"{where} holds {found} bytes where the manifest wrote {size} (truncated or replaced); "
                             f"{fix(self.directory)}")
        try:
            handle = safe_open(path, framework="pt")
            keys = [k for k in handle.keys() if k != "crc32" and not k.startswith("offsets/")]
            shard = dict(handle=handle, name=name, keys=keys, crc=handle.get_tensor("crc32").tolist(),
                         offsets={k: handle.get_tensor(f"offsets/{k}").tolist() for k in keys})
        except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"{where} cannot be read ({type(e).__name__}: {e}); {fix(self.directory)}") from None
        if len(shard["crc"]) != rows or any(len(o) != rows + 1 for o in shard["offsets"].values()):
            raise ValueError(f"{where} holds {len(shard['crc'])} rows where the manifest wrote {rows}; "
                             f"{fix(self.directory)}")
        if rows_digest(shard["crc"]) != record["rows_sha256"]:  # another shard's rows, or other prompts' of a run
            raise ValueError(f"{where} holds other rows than the manifest recorded (replaced by another file); "
                             f"{fix(self.directory)}")
        return shard

    def _row(self, shard, j, name, text):
        row = {k: shard["handle"].get_slice(k)[shard["offsets"][k][j]:shard["offsets"][k][j + 1]].unsqueeze(0)
               for k in shard["keys"]}
        if row_crc(row) != shard["crc"][j]:
            raise DamagedRow(f"--prompt-store {self.directory}: {name} row {j} ({text[:60]!r}) fails its CRC-32 (the "
                             f"file is damaged); {fix(self.directory)}")
        self.reads += 1
        return row

    def rows(self, texts):
        """[{key: [1, ...] CPU tensor}] of each text, read from its shard and checked against its CRC-32 (DamagedRow;
        with encode_damaged the text joins .damaged first)."""
        out = []
        for text in texts:
            i = self.index[text]
            k = bisect.bisect_right(self.first, i) - 1  # the shard whose rows start at or before i
            try:
                out.append(self._row(self.shards[k], i - self.first[k], self.shards[k]["name"], text))
            except DamagedRow:
                if self.encode_damaged:
                    self.damaged.add(text)
                raise
        return out
