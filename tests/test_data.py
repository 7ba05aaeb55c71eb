"""data.py: prompt files, per-epoch prompt order, and the split of samples over ranks."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import data

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"


def write(folder, name, text_or_bytes):
    path = Path(folder) / name
    if isinstance(text_or_bytes, bytes):
        path.write_bytes(text_or_bytes)
    else:
        path.write_text(text_or_bytes, encoding="utf-8")
    return path


def load_quiet(path, **kwargs):
    """load_prompts -> (prompts, metadata, list of warning messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prompts, metadata = data.load_prompts(path, **kwargs)
    return prompts, metadata, [str(w.message) for w in caught]


# ----------------------------------------------------------------------------- parsing

def test_jsonl_rows_metadata_and_stripping(tmp_path):
    rows = [{"input": "  A logo saying \"Miles\"  ", "metadata": {"rm_type": "ocr"}},
            {"input": "a cat\twearing sunglasses\n"},
            {"input": "a dog", "metadata": None, "extra": 3}]
    path = write(tmp_path, "p.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    prompts, metadata, caught = load_quiet(path)
    assert prompts == ['A logo saying "Miles"', "a cat\twearing sunglasses", "a dog"]
    assert metadata == [{"rm_type": "ocr"}, {}, {}]
    assert caught == []  # a trailing newline is not a blank row


def test_txt_one_prompt_per_line(tmp_path):
    path = write(tmp_path, "p.txt", "\ufeffa red apple\r\n  a blue car  \nlast line without newline")
    prompts, metadata, caught = load_quiet(path)
    assert prompts == ["a red apple", "a blue car", "last line without newline"]  # BOM and CRLF removed
    assert metadata == [{}, {}, {}]
    assert caught == []


def test_jsonl_line_separator_inside_a_string_is_one_row(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"input": "two\u2028parts"}\n')
    prompts, _, _ = load_quiet(path)
    assert prompts == ["two\u2028parts"]


def test_custom_keys(tmp_path):
    rows = [{"prompt": "a tree", "info": {"rm_type": "pickscore"}}, {"prompt": "a boat"}]
    path = write(tmp_path, "p.jsonl", "\n".join(json.dumps(r) for r in rows))
    prompts, metadata, _ = load_quiet(path, input_key="prompt", metadata_key="info")
    assert prompts == ["a tree", "a boat"]
    assert metadata == [{"rm_type": "pickscore"}, {}]


def test_empty_metadata_key_takes_the_whole_row(tmp_path):
    # GenEval's own files: the prompt and its clauses side by side in one flat object per line
    rows = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
            {"tag": "counting", "include": [{"class": "bus", "count": 2}], "exclude": [{"class": "bus", "count": 3}],
             "prompt": "a photo of two buses"}]
    path = write(tmp_path, "evaluation_metadata.jsonl", "\n".join(json.dumps(r) for r in rows))
    prompts, metadata, caught = load_quiet(path, input_key="prompt", metadata_key="")
    assert caught == [] and prompts == ["a photo of a cat", "a photo of two buses"]
    assert metadata == rows
    assert load_quiet(path, input_key="prompt")[1] == rows  # rows without the default key but with tag and include


def test_bad_rows_skipped_with_one_warning(tmp_path):
    lines = ['{"input": "good one"}',
             "",                               # 2 blank
             "{not json",                      # 3 bad JSON
             '["a list"]',                     # 4 not an object
             '{"input": "   "}',               # 5 empty prompt
             '{"input": 7}',                   # 6 prompt not a string
             '{"input": "x", "metadata": 1}',  # 7 metadata not an object
             '{"input": "good two", "metadata": {"rm_type": "ocr"}}']
    path = write(tmp_path, "p.jsonl", "\n".join(lines) + "\n")
    prompts, metadata, caught = load_quiet(path)
    assert prompts == ["good one", "good two"]
    assert metadata == [{}, {"rm_type": "ocr"}]
    assert len(caught) == 1
    message = caught[0]
    assert str(path) in message and "skipped 6 of 8 rows" in message and "line 2" in message
    assert "\n" not in message


def test_invalid_utf8_row_skipped(tmp_path):
    path = write(tmp_path, "p.txt", b"caf\xe9 latin-1\nplain ascii\n")
    prompts, _, caught = load_quiet(path)
    assert prompts == ["plain ascii"]
    assert len(caught) == 1 and "not UTF-8" in caught[0] and "line 1" in caught[0]


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl") as info:
        data.load_prompts(path)
    assert "\n" not in str(info.value)


def test_folder_is_not_a_prompt_file(tmp_path):
    folder = tmp_path / "set.txt"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="is a folder"):
        data.load_prompts(folder)


def test_unknown_extension_names_accepted_ones(tmp_path):
    path = write(tmp_path, "p.csv", "a,b\n")
    with pytest.raises(ValueError) as info:
        data.load_prompts(path)
    message = str(info.value)
    assert str(path) in message and ".jsonl" in message and ".txt" in message and "\n" not in message


@pytest.mark.parametrize("name,content,expected", [
    ("empty.txt", "", "no prompts"),
    ("blank.jsonl", "\n  \n\n", "no prompts"),
    ("junk.jsonl", "{bad\n[1, 2]\n", "no valid row"),
    ("latin1.txt", b"\xe9t\xe9\n\xff\n", "not UTF-8"),
    ("meta.jsonl", '{"input": "a", "metadata": "ocr"}\n', "--metadata-key"),
])
def test_no_valid_row_is_one_line_error(tmp_path, name, content, expected):
    path = write(tmp_path, name, content)
    with pytest.raises(ValueError) as info:
        data.load_prompts(path)
    message = str(info.value)
    assert str(path) in message and expected in message and "\n" not in message


def test_wrong_input_key_suggests_the_right_one(tmp_path):
    rows = [{"prompt": "a tree", "id": 3}, {"prompt": "a boat", "caption": "x"}]
    path = write(tmp_path, "p.jsonl", "\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError) as info:
        data.load_prompts(path)
    message = str(info.value)
    assert "--input-key prompt" in message and "'caption'" in message and "'id'" not in message
    assert data.load_prompts(path, input_key="prompt")[0] == ["a tree", "a boat"]


# ----------------------------------------------------------------------------- source images (editing)

def png(path, color=(200, 10, 10), size=(6, 4)):
    from PIL import Image

    Image.new("RGB", size, color).save(path)
    return path


def test_source_images_resolve_relative_to_the_prompt_file_and_load(tmp_path):
    (tmp_path / "imgs").mkdir()
    png(tmp_path / "imgs" / "a.png")
    png(tmp_path / "b.png", color=(0, 0, 255), size=(3, 5))
    rows = [{"prompt": "make it blue", "image": "imgs/a.png", "tag": "colors"},  # Flow-GRPO's counting_edit key
            {"prompt": "combine them", "image": ["imgs/a.png", str(tmp_path / "b.png")]},  # several, one absolute
            {"prompt": "a plain prompt"},
            {"prompt": "null is none", "image": None}]
    path = write(tmp_path, "p.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    prompts, metadata, caught = load_quiet(path, input_key="prompt", metadata_key="")  # cwd is not tmp_path
    assert caught == [] and len(prompts) == 4
    a, b = str(tmp_path / "imgs" / "a.png"), str(tmp_path / "b.png")
    assert metadata[0][data.SOURCE_KEY] == [a] and metadata[0]["tag"] == "colors"
    assert metadata[1][data.SOURCE_KEY] == [a, b]
    assert data.SOURCE_KEY not in metadata[2] and data.SOURCE_KEY not in metadata[3]
    first, second = data.source_images(metadata[1])
    assert first.dtype == second.dtype == "uint8" and first.shape == (4, 6, 3) and second.shape == (5, 3, 3)
    assert first[0, 0].tolist() == [200, 10, 10] and second[0, 0].tolist() == [0, 0, 255]
    assert data.source_images(metadata[2]) == [] and data.source_images({}) == []
    assert not first.flags.writeable  # one cached copy serves every sample; nobody may paint on it


def test_source_images_with_a_metadata_object_and_another_key(tmp_path):
    png(tmp_path / "s.png")
    rows = [{"input": "edit", "src": "s.png", "metadata": {"rm_type": "ocr"}}]
    path = write(tmp_path, "p.jsonl", json.dumps(rows[0]) + "\n")
    _, metadata, _ = load_quiet(path, image_key="src")
    assert metadata == [{"rm_type": "ocr", data.SOURCE_KEY: [str(tmp_path / "s.png")]}]
    assert load_quiet(path)[1] == [{"rm_type": "ocr"}]  # the default key "image" is absent: no sources


@pytest.mark.parametrize("what, value, expected", [
    ("missing", "nowhere.png", r"line 2: source image 'nowhere.png' does not exist .*nowhere.png\); fix the path"),
    ("folder", "sub", r"line 2: source image 'sub' is not a file"),
    ("text", "notes.png", r"line 2: source image 'notes.png' is not an image PIL can read"),
    ("truncated", "cut.png", r"line 2: source image 'cut.png' cannot be read as an image"),
    ("number", 7, r"line 2: 'image' must be a path or a list of paths of source images .*got 7"),
    ("empty list", [], r"line 2: 'image' must be a path or a list of paths"),
    ("list with a number", ["ok.png", 3], r"line 2: 'image' must be a path or a list of paths"),
])
def test_bad_source_image_is_one_line_naming_the_row(tmp_path, what, value, expected):
    png(tmp_path / "ok.png")
    (tmp_path / "sub").mkdir()
    (tmp_path / "notes.png").write_text("not an image")
    png(tmp_path / "big.png", size=(64, 64))
    (tmp_path / "cut.png").write_bytes((tmp_path / "big.png").read_bytes()[:-30])  # the end chunk cut off
    rows = [{"input": "fine", "image": "ok.png"}, {"input": "bad", "image": value}]
    path = write(tmp_path, "p.jsonl", "\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=expected) as error:
        data.load_prompts(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_each_source_image_is_checked_once(tmp_path, monkeypatch):
    png(tmp_path / "one.png")
    path = write(tmp_path, "p.jsonl", "".join(json.dumps({"input": f"p{i}", "image": "one.png"}) + "\n"
                                              for i in range(50)))
    opened = []
    real = data._image_problem
    monkeypatch.setattr(data, "_image_problem", lambda p: opened.append(p) or real(p))
    assert len(data.load_prompts(path)[0]) == 50 and len(opened) == 1


# ----------------------------------------------------------------------------- fuzz

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
_rows = st.one_of(
    st.text(max_size=40),                                                # random text
    _json_values.map(json.dumps),                                        # any JSON value
    st.dictionaries(st.sampled_from(["input", "metadata", "prompt"]), _json_values, max_size=3).map(json.dumps),
    st.builds(lambda p, m: json.dumps({"input": p, "metadata": m}), st.text(max_size=20), _json_values),
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * (n // 2)),       # nested junk, deeper than the decoder
)


def check_load(path):
    try:
        prompts, metadata, _ = load_quiet(path)
    except (ValueError, FileNotFoundError) as error:
        message = str(error)
        assert message and "\n" not in message and str(path) in message
        return
    assert prompts and len(prompts) == len(metadata)
    for prompt, meta in zip(prompts, metadata):
        assert isinstance(prompt, str) and prompt and prompt == prompt.strip()
        assert isinstance(meta, dict)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")  # module scope: one folder reused across hypothesis examples


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=300), ext=st.sampled_from([".jsonl", ".txt"]))
def test_fuzz_random_bytes(fuzz_dir, raw, ext):
    check_load(write(fuzz_dir, "fuzz" + ext, raw))


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(_rows, max_size=8), newline=st.sampled_from(["\n", "\r\n"]))
@example(rows=['{"input": "a red cube"}', '{"input": "a\x00b"}'], newline="\n")  # a NUL: the whole file is refused
def test_fuzz_malformed_json_lines(fuzz_dir, rows, newline):
    path = write(fuzz_dir, "fuzz.jsonl", newline.join(rows))
    check_load(path)
    # every row that is an object with a non-empty string prompt and object-or-null metadata is kept
    expected = []
    for row in newline.join(rows).split("\n"):
        try:
            obj = json.loads(row)
        except (ValueError, RecursionError):
            continue
        if (isinstance(obj, dict) and isinstance(obj.get("input"), str) and obj["input"].strip()
                and isinstance(obj.get("metadata", {}), (dict, type(None)))):
            expected.append(obj["input"].strip())
    if "\x00" in newline.join(rows):  # a NUL byte: UTF-16 or binary, refused whole in one line (data.load_prompts)
        with pytest.raises(ValueError, match="NUL bytes"):
            load_quiet(path)
    elif expected:
        assert load_quiet(path)[0] == expected


# ----------------------------------------------------------------------------- step_prompt_ids

def reference_stream(num_prompts, num_items, seed, shuffle):
    """Brute force: concatenate whole epochs until the stream is long enough."""
    stream, epoch = [], 0
    while len(stream) < num_items:
        if shuffle:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            stream += torch.randperm(num_prompts, generator=g).tolist()
        else:
            stream += list(range(num_prompts))
        epoch += 1
    return stream[:num_items]


def test_full_epoch_covers_every_prompt_once():
    n, p = 24, 6
    for epoch in range(3):
        ids = [i for s in range(epoch * n // p, (epoch + 1) * n // p)
               for i in data.step_prompt_ids(n, s, prompts_per_step=p, seed=5)]
        assert sorted(ids) == list(range(n))


def test_epochs_differ_and_seed_reproducible():
    n = 32
    epoch0 = data.step_prompt_ids(n, 0, prompts_per_step=n, seed=1)
    epoch1 = data.step_prompt_ids(n, 1, prompts_per_step=n, seed=1)
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert data.step_prompt_ids(n, 1, prompts_per_step=n, seed=1) == epoch1
    assert data.step_prompt_ids(n, 1, prompts_per_step=n, seed=2) != epoch1
    assert epoch0 != list(range(n))  # actually shuffled


def test_no_shuffle_is_file_order():
    got = [data.step_prompt_ids(5, s, prompts_per_step=3, shuffle=False) for s in range(4)]
    assert got == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]


@pytest.mark.parametrize("n,p,seed,shuffle", [(10, 3, 0, True), (7, 4, 11, True), (3, 8, 4, True), (5, 5, 2, True),
                                              (1, 3, 0, True), (7, 3, 0, False)])
def test_wraparound_matches_reference_stream(n, p, seed, shuffle):
    steps = 12
    stream = reference_stream(n, steps * p, seed, shuffle)
    for s in range(steps):
        assert data.step_prompt_ids(n, s, prompts_per_step=p, seed=seed, shuffle=shuffle) == stream[s * p:(s + 1) * p]


def test_step_prompt_ids_rejects_bad_sizes():
    with pytest.raises(ValueError):
        data.step_prompt_ids(0, 0, prompts_per_step=2)
    with pytest.raises(ValueError):
        data.step_prompt_ids(4, 0, prompts_per_step=0)
    with pytest.raises(ValueError):
        data.step_prompt_ids(4, -1, prompts_per_step=2)


# ----------------------------------------------------------------------------- rank_samples

@pytest.mark.parametrize("prompt_ids,group_size,world_size", [([7, 2, 9], 4, 4), ([3, 3, 1, 0], 6, 8),
                                                               ([5], 8, 2), ([1, 2], 3, 1), ([4, 0], 3, 6)])
def test_rank_slices_concatenate_to_the_global_list(prompt_ids, group_size, world_size):
    expected_prompts = [pid for pid in prompt_ids for _ in range(group_size)]
    expected_groups = [g for g, _ in enumerate(prompt_ids) for _ in range(group_size)]
    got_prompts, got_groups = [], []
    for rank in range(world_size):
        prompts, groups = data.rank_samples(prompt_ids, group_size=group_size, rank=rank, world_size=world_size)
        assert len(prompts) == len(groups) == len(expected_prompts) // world_size
        got_prompts += prompts
        got_groups += groups
    assert got_prompts == expected_prompts and got_groups == expected_groups


def test_group_spans_ranks():
    # 2 prompts x group 3 over 2 ranks: the group of prompt 8 is split 1 / 2
    assert data.rank_samples([5, 8], group_size=3, rank=0, world_size=2) == ([5, 5, 5], [0, 0, 0])
    assert data.rank_samples([5, 8], group_size=3, rank=1, world_size=2) == ([8, 8, 8], [1, 1, 1])
    assert data.rank_samples([5, 8], group_size=3, rank=0, world_size=3) == ([5, 5], [0, 0])
    assert data.rank_samples([5, 8], group_size=3, rank=1, world_size=3) == ([5, 8], [0, 1])


def test_rank_samples_bad_divisibility_raises():
    with pytest.raises(ValueError, match="3 x 3 = 9"):
        data.rank_samples([1, 2, 3], group_size=3, rank=0, world_size=2)
    with pytest.raises(ValueError):
        data.rank_samples([1, 2], group_size=2, rank=2, world_size=2)


# ----------------------------------------------------------------------------- ocr targets

def test_ocr_targets_missing():
    prompts = ['a sign saying "OPEN"', "no quotes here", 'one " quote', 'empty ""', 'spaces "  " only',
               'two "A" and "B"', '"LEADING" quote']
    assert data.ocr_targets_missing(prompts) == 4
    assert data.ocr_targets_missing([]) == 0


# ----------------------------------------------------------------------------- shipped prompt sets

SHIPPED = ["tiny.txt", "ocr_train.txt", "ocr_test.txt", "pickscore_train.txt", "pickscore_test.txt",
           "hps_train.txt", "hps_test.txt", "mixed.jsonl"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_prompt_file_loads_cleanly(name):
    prompts, metadata, caught = load_quiet(PROMPTS_DIR / name)
    assert caught == [] and len(prompts) >= 16 and len(set(prompts)) == len(prompts)
    assert all(isinstance(m, dict) for m in metadata)


@pytest.mark.parametrize("name", ["ocr_train.txt", "ocr_test.txt"])
def test_ocr_sets_have_a_target_on_every_line(name):
    prompts, _ = data.load_prompts(PROMPTS_DIR / name)
    assert data.ocr_targets_missing(prompts) == 0


def test_mixed_rows_name_their_reward():
    prompts, metadata = data.load_prompts(PROMPTS_DIR / "mixed.jsonl")
    kinds = [m.get("rm_type") for m in metadata]
    assert set(kinds) == {"ocr", "pickscore"}
    ocr_prompts = [p for p, k in zip(prompts, kinds) if k == "ocr"]
    assert data.ocr_targets_missing(ocr_prompts) == 0


@pytest.mark.parametrize("task", ["ocr", "pickscore", "hps"])
def test_train_and_test_sets_disjoint(task):
    train, _ = data.load_prompts(PROMPTS_DIR / f"{task}_train.txt")
    test, _ = data.load_prompts(PROMPTS_DIR / f"{task}_test.txt")
    assert not {p.lower() for p in train} & {p.lower() for p in test}


def test_test_sets_disjoint_from_every_training_file():
    test = set()
    for name in ["ocr_test.txt", "pickscore_test.txt", "hps_test.txt"]:
        test |= {p.lower() for p in data.load_prompts(PROMPTS_DIR / name)[0]}
    for name in ["tiny.txt", "ocr_train.txt", "pickscore_train.txt", "hps_train.txt", "mixed.jsonl"]:
        assert not test & {p.lower() for p in data.load_prompts(PROMPTS_DIR / name)[0]}, name
