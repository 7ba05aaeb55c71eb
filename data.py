"""Prompts: files, per-epoch shuffling, and how each prompt's group is spread over ranks.

Prompt files come in two formats:

    prompts.txt     one prompt per line (the format of Flow-GRPO's prompt sets)
    prompts.jsonl   one JSON object per line, e.g.
                    {"input": "A photo of a cat wearing sunglasses"}
                    {"input": "A logo saying \\"Miles\\"", "metadata": {"rm_type": "ocr"}}

`metadata` is optional; its `rm_type` picks the reward for that one prompt (see rewards.py). A relative path that
is not found from the working folder is read from the repository's (`prompts/tiny.txt` from any folder).
With `metadata_key=""` the whole row is the metadata: GenEval's own files (evaluation_metadata.jsonl,
Flow-GRPO's train_metadata.jsonl: {"tag": ..., "include": [...], "prompt": ...}) load as they are
with `input_key="prompt", metadata_key=""`.

Source images (image editing). A JSONL row may name the image(s) an edit starts from under
`image_key` ("image", the key of Flow-GRPO's counting_edit rows): one path or a list of paths,
relative to the prompt file's folder (or absolute):

                    {"prompt": "make two circles into three", "image": "edit/0001.png", "tag": ...}

They are checked when the prompts load (a missing, unreadable or non-image file is one error naming
the line) and travel with the sample in ONE way, for the model and every reward alike: its metadata
holds them under `source_images`, a list of absolute paths, and `source_images(metadata)` reads
them as uint8 arrays [H, W, 3] (RGB). A row without them has no `source_images` key.

Sampling is stateless. The prompt stream of a run is perm(epoch 0) ++ perm(epoch 1) ++ ..., each
permutation seeded from (seed, epoch), and optimizer step s takes items [s P, (s + 1) P) of it, so
a resumed run needs only the step number. Each of the P prompts of a step is sampled G times
(its group); the P * G samples are cut into world_size contiguous slices, one per rank, so a
group may span ranks. Rewards are gathered across ranks before the group statistics, which is why
this costs nothing (Flow-GRPO arXiv:2505.05470, Sec. 4, samples G images per prompt and normalises
within the group).
"""

import functools
import json
import os
import warnings

import torch

FORMATS = (".jsonl", ".txt")  # accepted prompt-file extensions
MAX_PROMPT_BYTES = 256 << 20  # a prompt file is read whole: 256 MiB holds millions of prompts
_EXAMPLE_ROW = '{"input": "a red apple on a table"}'
SOURCE_KEY = "source_images"  # the metadata key under which a sample's source images travel (absolute paths)


# Rows that are their own metadata, read whole when they have no metadata key: GenEval's (its evaluation_metadata.jsonl,
# Flow-GRPO's train_metadata.jsonl) and the shapes world's edits (prompts/shapes_edit_*.jsonl).
FLAT_ROWS = ({"tag", "include"}, {"edit", "source", "target"})


def shipped(path):
    """`path`, or the repository's file of that relative name (prompts/tiny.txt) when the path is not here: the prompt
    sets the repository ships are found from any working folder."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    ours = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    return ours if os.path.exists(ours) else path


def load_prompts(path, *, input_key="input", metadata_key="metadata", check=None, image_key="image"):
    """Read a `.jsonl` or `.txt` prompt file -> (prompts: list[str], metadata: list[dict]).

    Prompts are stripped of surrounding whitespace. A JSONL row's metadata is the object under
    `metadata_key` (missing or null gives {}), or the whole row when `metadata_key` is "" or when
    the row has no `metadata_key` but the keys of FLAT_ROWS beside its prompt: GenEval's `tag` and
    `include` (the flat rows of GenEval's evaluation_metadata.jsonl and of the dataset/geneval/*_metadata.jsonl
    files of Flow-GRPO, DiffusionNFT and AWM), the shapes edits' `edit`, `source` and `target`. Rows that are blank, not UTF-8, not valid JSON, not a
    JSON object, without a non-empty string under `input_key`, or with metadata that is not an
    object are skipped and reported in one warning (path, count per reason, first line number). A
    trailing newline does not make a blank row.

    A row's source images (a path or a list of paths under `image_key`, relative to the prompt
    file) are checked here and put into its metadata (a copy) under SOURCE_KEY as absolute paths.

    `check(metadata)`, if given, runs on every kept row (e.g. `rewards.geneval_rows_check(detector)`);
    the first ValueError it raises is raised again as one line naming the path, the line and the
    prompt. Raises ValueError (unknown extension, no valid row, a row `check` refuses, a source image
    that is missing, unreadable or not an image) or FileNotFoundError (missing file), each with a
    one-line message that names the path (and line) and the fix.
    """
    path = shipped(os.fspath(path))
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"{path}: unknown prompt file type {ext or '(no extension)'!r}; "
                         f"use .jsonl (one JSON object per line, like {_EXAMPLE_ROW}) or .txt (one prompt per line)")
    if os.path.isdir(path):
        raise FileNotFoundError(f"{path}: is a folder, not a prompt file; "
                                "pass the path of a .jsonl or .txt file inside it")
    if os.path.exists(path) and not os.path.isfile(path):  # opening a FIFO would wait for a writer; a device: endless
        raise ValueError(f"{path}: not a regular file (a pipe, a device or a socket); write the prompts to a .jsonl or "
                         ".txt file and pass its path")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: prompt file not found; check the path "
                                f"(the repository ships sets in prompts/, e.g. prompts/tiny.txt)")
    if os.path.getsize(path) > MAX_PROMPT_BYTES:  # read whole below: a huge file would fill the memory first
        raise ValueError(f"{path}: {os.path.getsize(path) / 2**30:.1f} GiB, more than the {MAX_PROMPT_BYTES >> 20} "
                         "MiB a prompt file may hold (it is read whole, on every rank); keep the prompts the run "
                         "draws, or split the file")
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark written by some editors
        raw = raw[3:]
    if b"\x00" in raw:  # UTF-16 text (each line would decode as UTF-8 with a NUL in every other place) or binary
        raise ValueError(f"{path}: the file holds NUL bytes (UTF-16 text or a binary file), not UTF-8 text; re-save "
                         "it as UTF-8")
    # Split bytes, not text: str.splitlines also breaks at U+2028, which JSON allows inside strings.
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the trailing newline ends the last row; it is not a row of its own

    prompts, metadata = [], []
    skipped = {}  # reason -> count
    first_bad = None  # 1-based line number of the first skipped row
    other_keys = {}  # keys holding non-empty strings in object rows that lack input_key (for the error hint)
    checked = {}  # source image path -> None if it opens as an image, else what is wrong with it
    for lineno, line in enumerate(lines, start=1):
        reason, prompt, meta = _parse_row(line, ext, input_key, metadata_key, other_keys, image_key)
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            first_bad = first_bad or lineno
            continue
        if SOURCE_KEY in meta:
            meta = dict(meta, **{SOURCE_KEY: _check_sources(path, lineno, meta[SOURCE_KEY], image_key, checked)})
        if check is not None:
            try:
                check(meta)
            except ValueError as err:
                raise ValueError(f"{path}, line {lineno} ({prompt[:40]!r}): {err}") from None
        prompts.append(prompt)
        metadata.append(meta)

    if not prompts:
        raise ValueError(_no_rows_message(path, ext, len(lines), skipped, input_key, metadata_key, other_keys))
    if skipped:
        counts = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
        warnings.warn(f"{path}: skipped {sum(skipped.values())} of {len(lines)} rows ({counts}); "
                      f"first at line {first_bad}", stacklevel=2)
    return prompts, metadata


def _parse_row(line, ext, input_key, metadata_key, other_keys, image_key=None):
    """One line (bytes) -> (skip reason or None, prompt, metadata); a row's `image_key` value, unchecked, goes into
    a copy of the metadata under SOURCE_KEY."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8", None, None
    if not text.strip():
        return "blank", None, None
    if ext == ".txt":
        return None, text.strip(), {}
    try:
        row = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; deep nesting overflows the decoder
        return "bad JSON", None, None
    if not isinstance(row, dict):
        return "not an object", None, None
    prompt = row.get(input_key)
    if not isinstance(prompt, str) or not prompt.strip():
        if input_key not in row:
            for key, value in row.items():
                if isinstance(value, str) and value.strip():
                    other_keys[key] = other_keys.get(key, 0) + 1
        return f"no prompt under {input_key!r}", None, None
    flat = not metadata_key or (metadata_key not in row and any(k <= row.keys() for k in FLAT_ROWS))
    meta = row if flat else row.get(metadata_key)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        return f"{metadata_key!r} not an object", None, None
    if image_key and row.get(image_key) is not None:  # null: no source image
        meta = dict(meta, **{SOURCE_KEY: row[image_key]})
    return None, prompt.strip(), meta


def _check_sources(path, lineno, value, image_key, checked):
    """A row's source images (a path or a list of paths, relative to the prompt file) -> their absolute paths, each
    opened once as an image; anything else is one ValueError naming the file, the line and the fix."""
    where = f"{path}, line {lineno}"
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p.strip() for p in paths):
        raise ValueError(f"{where}: {image_key!r} must be a path or a list of paths of source images (relative to "
                         f"the prompt file), got {json.dumps(value)[:80]}")
    folder = os.path.dirname(os.path.abspath(path))
    resolved = [os.path.normpath(os.path.join(folder, os.path.expanduser(p))) for p in paths]
    for given, full in zip(paths, resolved):
        if full not in checked:
            checked[full] = _image_problem(full)
        if checked[full]:
            raise ValueError(f"{where}: source image {given!r} {checked[full]}; fix the path (relative to "
                             f"{os.path.dirname(path) or '.'}/) or remove the row")
    return resolved


def _image_problem(path):
    """None when `path` is a readable image file, else what is wrong (for the one-line error)."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.exists(path):
        return f"does not exist ({path})"
    if not os.path.isfile(path):
        return f"is not a file ({path})"
    try:
        with Image.open(path) as image:
            image.verify()  # the header and, for PNG, every chunk's checksum
        _read_image(path)  # the pixels too (a stream truncated or garbled inside valid chunks), kept for the run
    except UnidentifiedImageError:
        return f"is not an image PIL can read ({path})"
    except Image.DecompressionBombError as e:  # PIL refuses images above Image.MAX_IMAGE_PIXELS
        return f"is too large to decode ({' '.join(str(e).split())[:120]})"
    except (OSError, SyntaxError, ValueError) as e:  # truncated, bad checksum, unreadable (permissions)
        return f"cannot be read as an image ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
    return None


def source_images(metadata):
    """The source images of a sample: uint8 arrays [H, W, 3] (RGB), one per path in metadata[SOURCE_KEY]; [] for a
    sample without any. Files are read once and kept (read-only arrays; the last 256 paths)."""
    return [_read_image(p) for p in (metadata or {}).get(SOURCE_KEY, ())]


@functools.lru_cache(maxsize=256)
def _read_image(path):
    import numpy as np
    from PIL import Image

    try:
        with Image.open(path) as image:
            if image.mode.startswith("I"):  # 16- or 32-bit grey: convert("RGB") would clip it to 255, near-white
                grey = np.asarray(image, dtype=np.float64)
                top = 65535.0 if image.mode.startswith("I;16") or grey.max() <= 65535 else 2.0**32 - 1
                image = Image.fromarray(np.round(np.clip(grey, 0, top) / top * 255).astype(np.uint8))
            elif image.mode == "F":  # 32-bit float grey (a TIFF): convert("RGB") would read [0, 1] as 0 or 1 of 255,
                grey = np.nan_to_num(np.asarray(image, dtype=np.float64))  # black; [0, 1] is the float convention,
                top = 1.0 if grey.max() <= 1.0 else 255.0  # a file with larger values is read as [0, 255]
                image = Image.fromarray(np.round(np.clip(grey, 0, top) / top * 255).astype(np.uint8))
            array = np.asarray(image.convert("RGB"))
    except (OSError, Image.DecompressionBombError) as e:  # checked at load; a file changed or truncated since then
        raise ValueError(f"source image {path} cannot be read ({type(e).__name__}: {e}); fix or replace it") from None
    array.flags.writeable = False  # one copy serves every sample that names it
    return array


def _no_rows_message(path, ext, num_lines, skipped, input_key, metadata_key, other_keys):
    """The one-line error for a file without a single usable prompt, naming the likely fix."""
    if "not UTF-8" in skipped and set(skipped) <= {"not UTF-8", "blank"}:
        return f"{path}: the file is not UTF-8 text; re-save it as UTF-8"
    if skipped.get("blank", 0) == num_lines:
        how = "one prompt per line" if ext == ".txt" else f"one JSON object per line, like {_EXAMPLE_ROW}"
        return f"{path}: the file has no prompts (it is empty or blank); write {how}"
    if other_keys:
        keys = sorted(other_keys, key=lambda k: -other_keys[k])
        shown = ", ".join(repr(k[:40]) for k in keys[:5]) + (", ..." if len(keys) > 5 else "")
        best = keys[0] if keys[0].isprintable() and " " not in keys[0] else repr(keys[0])
        return (f"{path}: no row has a non-empty string under input key {input_key!r}; "
                f"the rows have string fields {shown}; pass --input-key {best}")
    bad_meta = f"{metadata_key!r} not an object"
    if bad_meta in skipped:
        return (f"{path}: every row with a prompt has a non-object under metadata key {metadata_key!r}; "
                f"pass --metadata-key naming an object field, or make {metadata_key!r} an object like "
                f"{{\"rm_type\": \"ocr\"}}")
    counts = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
    return (f"{path}: no valid row ({counts}); each line must be a JSON object with a non-empty string "
            f"under {input_key!r}, like {_EXAMPLE_ROW}, or use a .txt file with one prompt per line")


def ocr_targets_missing(prompts):
    """How many prompts have no text for the OCR reward to read.

    Same rule as rewards.ocr_score: the target is the text between the first pair of double
    quotes, compared with spaces removed; a prompt with fewer than two '"' or with only spaces
    between the first two scores 0 whatever the image shows, so its group gets no signal.
    """
    missing = 0
    for prompt in prompts:
        parts = prompt.split('"')
        if len(parts) < 3 or not parts[1].replace(" ", ""):
            missing += 1
    return missing


def seeded(*parts):
    """A CPU generator seeded from integers (seed, step, rank, ...): one stream per tuple, the same numbers in any
    process and after a resume. Every seeded draw of the project goes through it (prompt order, rollout noise,
    fast windows' batches, the held-out evaluation's per-prompt noise)."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % 2**63
    return torch.Generator().manual_seed(seed)


def _epoch_order(num_prompts, epoch, seed, shuffle):
    """The prompt order of one epoch: a permutation seeded from (seed, epoch), or file order."""
    if not shuffle:
        return list(range(num_prompts))
    return torch.randperm(num_prompts, generator=seeded(seed, epoch)).tolist()  # one stream per (seed, epoch)


def step_prompt_ids(num_prompts, step, *, prompts_per_step, seed=0, shuffle=True):
    """The `prompts_per_step` prompt indices of optimizer step `step` (0-based).

    The stream perm(0) ++ perm(1) ++ ... is cut into consecutive blocks of `prompts_per_step`;
    a block that crosses an epoch boundary takes the end of one epoch and the start of the next,
    so every prompt is seen once per epoch even when `prompts_per_step` does not divide
    `num_prompts`. Stateless: the same arguments always give the same list.
    """
    if num_prompts < 1 or prompts_per_step < 1 or step < 0:
        raise ValueError(f"step_prompt_ids needs num_prompts >= 1, prompts_per_step >= 1 and step >= 0, "
                         f"got {num_prompts}, {prompts_per_step}, {step}")
    start, end = step * prompts_per_step, (step + 1) * prompts_per_step  # positions in the stream
    ids = []
    for epoch in range(start // num_prompts, (end - 1) // num_prompts + 1):
        order = _epoch_order(num_prompts, epoch, seed, shuffle)
        lo = max(start - epoch * num_prompts, 0)
        hi = min(end - epoch * num_prompts, num_prompts)
        ids.extend(order[lo:hi])
    return ids


def rank_samples(prompt_ids, *, group_size, rank, world_size):
    """This rank's share of a step's samples -> (sample_prompt_ids, group_ids).

    Globally every prompt of `prompt_ids` is sampled `group_size` times, in order:
    [p0]*G ++ [p1]*G ++ ... ([P * G] samples); a sample's group id is the position of its prompt
    in `prompt_ids` (so a prompt drawn twice in one step forms two groups). Rank r gets the r-th
    of `world_size` equal contiguous slices; a group may span ranks.
    """
    num_samples = len(prompt_ids) * group_size
    if group_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank_samples needs group_size >= 1 and 0 <= rank < world_size, "
                         f"got group_size={group_size}, rank={rank}, world_size={world_size}")
    if num_samples % world_size:
        raise ValueError(f"prompts per step x group size = {len(prompt_ids)} x {group_size} = {num_samples} samples "
                         f"do not split evenly over {world_size} ranks; pick sizes whose product is a multiple of "
                         "the world size")
    per_rank = num_samples // world_size
    sample_prompt_ids = [pid for pid in prompt_ids for _ in range(group_size)]  # [P * G]
    group_ids = [g for g in range(len(prompt_ids)) for _ in range(group_size)]  # [P * G]
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    return sample_prompt_ids[lo:hi], group_ids[lo:hi]


def add_arguments(parser):
    """The prompt-file flags, declared once; None means the preset of --model (train.py)."""
    g = parser.add_argument_group("data")
    g.add_argument("--prompts", default=None, help="training prompts: .txt (one per line) or .jsonl")
    g.add_argument("--eval-prompts", default=None, help="held-out prompts for --eval-every (default: none)")
    g.add_argument("--input-key", default=None, help="JSONL key of the prompt")
    g.add_argument("--metadata-key", default="metadata",
                   help="JSONL key of the per-sample metadata (rm_type, ...); '' takes the whole row (GenEval's files)")
    g.add_argument("--no-shuffle", action="store_true",
                   help="keep file order instead of a seeded permutation per epoch")
    return g
