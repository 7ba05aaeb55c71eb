"""The prompt-embedding store (--prompt-store, prompt_store.py and models.prompt_store_of): every prompt encoded once
into files and read back bit for bit without the text encoders; reused by a resumed run; refused in one line for
other prompts, text tokens, negative prompt or encoders, and for a damaged file; built by every rank for its share."""
import json
import os
import sys

import pytest
import torch

import models
import prompt_store
from test_gpu_perf import count_encodes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every model of the registry built in code (the tiny twins, the shapes model) whose prompts can be text alone: a new
# family's twin is compared as soon as it has its MODELS line. The edit models that require source images never store
# a prompt (their text is encoded with the images, models.encode_prompts).
TEXT_MODELS = [name for name, record in models.MODELS.items() if not record.hub and record.source_images != "required"]
TEXTS = ["a red cube", "two blue spheres on a long wooden table next to a window", "x", "a green tree in the rain",
         "a white cat", "three small yellow cones and a large purple cylinder", "a dog"]


@pytest.fixture(scope="module")
def pipes():
    return {}


def fresh_pipe(pipes, name):
    if name not in pipes:
        pipes[name] = models.load_pipeline(name)
    pipe = pipes[name]
    pipe.prompt_cache = pipe.prompt_store = pipe.prompt_store_dir = None
    return pipe


def build(pipe, directory, **kw):
    """models.prompt_cache as train.py calls it, with --prompt-store `directory` and no cache -> its line."""
    pipe.prompt_store_dir = str(directory)
    return models.prompt_cache(pipe, 0, **dict(dict(texts=TEXTS, negative_prompt="blurry", batch_size=2), **kw))


def test_every_registered_text_model_is_compared():
    """The list is the registry's, not a hand-made one: every family that generates from text has a model in it."""
    text_families = {r.name for r in models.MODELS.values() if r.source_images != "required"}
    assert {models.MODELS[name].name for name in TEXT_MODELS} == text_families
    assert {"tiny", "shapes", "tiny-flux", "tiny-ltx2", "tiny-qwen-image-2.1", "tiny-hunyuan-video-1.5"} <= \
        set(TEXT_MODELS)


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_every_prompt_from_the_store_equals_a_fresh_encode_bit_for_bit(name, pipes, tmp_path, monkeypatch):
    """Each built-in model (a family's tiny twin), shards of 3 prompts encoded in batches of 2: every prompt read back
    from the store, with and without CFG's negative, is the fresh encode of the batch it was encoded in, bit for bit
    (dtypes, shapes, masks and padding of the variable-length families included), the text encoders never called after
    the build and moved off the device; every prompt is read through its shard's CRC-32. The rule a family's encode
    must keep for this: docs/design.md, "A model family"."""
    assert_store_equals_fresh(fresh_pipe(pipes, name), tmp_path / name, monkeypatch)


def assert_store_equals_fresh(pipe, directory, monkeypatch):
    """The store built in `directory` serves every prompt of TEXTS as the fresh encode of its batch, bit for bit
    (tests/test_new_family.py calls it on a family defined there)."""
    name = pipe.model_name
    monkeypatch.setattr(prompt_store, "SHARD_PROMPTS", 3)
    encode_fresh = models._encode_fresh
    seen = count_encodes(monkeypatch)
    line = build(pipe, directory)
    assert "7 prompts" in line and "encoded ahead" in line
    assert seen == [TEXTS[0:2], TEXTS[2:3], TEXTS[3:5], TEXTS[5:6], TEXTS[6:7], ["blurry"]], name  # in its batches
    store, tokens = pipe.prompt_store, models.default_tokens(pipe)
    assert store.offloaded_from == pipe._execution_device and len(store.shards) == 3
    monkeypatch.setattr(models, "_encode_fresh", None)  # the encoders may not run now
    got = {(i, g): models.encode_prompts(pipe, TEXTS[i:j], guidance_scale=g, negative_prompt="blurry")
           for i, j in ((0, 2), (2, 3), (3, 5), (5, 6), (6, 7)) for g in (1.0, 3.0)}
    monkeypatch.setattr(models, "_encode_fresh", encode_fresh)  # the encoders again, for the reference
    for (i, g), out in got.items():
        j = {0: 2, 2: 3, 3: 5, 5: 6, 6: 7}[i]
        want = models._encode_fresh(pipe, TEXTS[i:j], guidance_scale=g, negative_prompt="blurry",
                                    max_sequence_length=tokens)
        assert sorted(out) == sorted(want), (name, i, g)
        for k in want:
            assert out[k].dtype == want[k].dtype and out[k].shape == want[k].shape, (name, i, g, k)
            assert out[k].device == want[k].device and torch.equal(out[k], want[k]), (name, i, g, k)
    assert store.reads == 2 * len(TEXTS) + 1  # every prompt twice, and the negative once, at opening


def test_a_resumed_run_reuses_its_store_and_encodes_nothing(tmp_path, monkeypatch, capsys):
    """train.py --prompt-store under CFG with held-out evaluations: the first run encodes every training and held-out
    prompt once, at the start; its resume opens the same files (not rewritten) and never runs a text encoder."""
    import train
    monkeypatch.chdir(ROOT)
    (tmp_path / "p.txt").write_text("a red apple\na blue car\na small house\n")
    (tmp_path / "e.txt").write_text("a white cat\na green tree\n")
    store, out = tmp_path / "store", str(tmp_path / "run")

    def run(*extra):
        train.main(["--model", "tiny", "--prompts", str(tmp_path / "p.txt"), "--prompts-per-step", "2",
                    "--group-size", "2", "--sample-batch-size", "2", "--train-batch-size", "2", "--num-steps", "3",
                    "--resolution", "32", "--log-images-every", "0", "--loss", "grpo", "--guidance-scale", "3",
                    "--eval-every", "1", "--eval-prompts", str(tmp_path / "e.txt"), "--eval-steps", "2",
                    "--prompt-store", str(store), "--out", out, *extra])
    seen = count_encodes(monkeypatch)
    run("--steps", "1")
    assert seen == [["a red apple", "a blue car", "a small house", "a white cat", "a green tree"], [""]]  # ahead,
    # one batch, and the (empty) negative prompt; nothing after
    assert "encoded ahead" in capsys.readouterr().out
    files = {f: os.stat(store / f).st_mtime_ns for f in os.listdir(store)}
    seen.clear()
    run("--steps", "2", "--resume", "auto")
    assert seen == [] and "reused" in capsys.readouterr().out
    assert {f: os.stat(store / f).st_mtime_ns for f in os.listdir(store)} == files
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] == r["loss"] for r in rows)


def test_other_prompts_tokens_negative_or_encoders_are_refused_in_one_line(pipes, tmp_path):
    """A store is read only by what wrote it, for the prompts it holds: a changed prompt, another text length, another
    negative prompt, other encoder weights or dtype are each refused in one line naming what differs and the fix."""
    pipe = fresh_pipe(pipes, "tiny-flux")
    build(pipe, tmp_path, max_sequence_length=16)
    build(pipe, tmp_path, max_sequence_length=16)  # the same: reused
    refusals = [
        (dict(texts=TEXTS[:2] + ["a blue cube"] + TEXTS[3:], max_sequence_length=16),
         r"other prompts \(prompt 3 is 'x' there and 'a blue cube' here"),
        (dict(texts=TEXTS + ["one more"], max_sequence_length=16), "other prompts .7 prompts there, 8 here"),
        (dict(max_sequence_length=8), "tokens 16 where this run has 8"),
        (dict(max_sequence_length=16, negative_prompt="dark"), "negative_prompt 'blurry' where this run has 'dark'"),
    ]
    for kw, match in refusals:
        with pytest.raises(ValueError, match=match) as e:
            build(pipe, tmp_path, **kw)
        assert "\n" not in str(e.value) and "delete it to encode the prompts again" in str(e.value)
    weight = pipe.text_encoder_2.shared.weight
    saved = weight[0, 0].item()
    try:
        with torch.no_grad():
            weight[0, 0] = saved + 1e-3
        with pytest.raises(ValueError, match="text_encoder_2 'T5EncoderModel float32 [0-9a-f]+' where this run has"):
            build(pipe, tmp_path, max_sequence_length=16)
        with torch.no_grad():
            weight[0, 0] = saved
        build(pipe, tmp_path, max_sequence_length=16)  # the same weights again: reused
        pipe.text_encoder.to(torch.bfloat16)
        with pytest.raises(ValueError, match="text_encoder 'CLIPTextModel float32 [0-9a-f]+' where this run has "
                                             "'CLIPTextModel bfloat16"):
            build(pipe, tmp_path, max_sequence_length=16)
    finally:
        pipes.pop("tiny-flux")


def test_train_refuses_a_changed_prompt_file_in_one_line(tmp_path, monkeypatch):
    """The run's own path: a store of another prompt file stops train.py with one `error:` line; a --prompt-store
    that is a file is refused before any model loads."""
    import train
    monkeypatch.chdir(ROOT)
    common = ["--model", "tiny", "--prompts-per-step", "1", "--group-size", "2", "--sample-batch-size", "2",
              "--train-batch-size", "2", "--num-steps", "2", "--resolution", "32", "--log-images-every", "0",
              "--steps", "1", "--prompt-store", str(tmp_path / "store")]
    (tmp_path / "p.txt").write_text("a red apple\n")
    train.main(common + ["--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "one")])
    (tmp_path / "p.txt").write_text("a red apple\na blue car\n")
    with pytest.raises(SystemExit) as e:
        train.main(common + ["--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "two")])
    assert str(e.value).startswith("error: --prompt-store") and "other prompts" in str(e.value)
    assert "\n" not in str(e.value)
    (tmp_path / "file").write_text("")
    loaded = []
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit):
        train.main(common[:-1] + [str(tmp_path / "file"), "--prompts", str(tmp_path / "p.txt"),
                                  "--out", str(tmp_path / "three")])
    assert loaded == []


def test_a_damaged_store_is_an_error_naming_the_file_never_other_numbers(pipes, tmp_path, monkeypatch):
    """A truncated, emptied, missing or garbled shard, or a garbled manifest: one line naming the file and the fix,
    when the store opens. A byte garbled inside one prompt's embedding leaves the sizes and headers whole: that
    prompt's read fails its CRC-32, the others still read. A folder with shards but no manifest (a build killed
    before its end) is built again."""
    monkeypatch.setattr(prompt_store, "SHARD_PROMPTS", 3)
    pipe = fresh_pipe(pipes, "tiny")
    build(pipe, tmp_path)
    shard = tmp_path / "shard-00001.safetensors"  # TEXTS[3:6]
    whole = shard.read_bytes()
    for data, match in ((whole[:-100], r"shard-00001.safetensors holds \d+ bytes where the manifest wrote \d+ "
                                       r"\(truncated or replaced\)"),
                        (b"", "shard-00001.safetensors holds 0 bytes"),
                        (b"\xff" * 16 + whole[16:], "shard-00001.safetensors cannot be read")):
        shard.write_bytes(data)
        with pytest.raises(ValueError, match=match) as e:
            build(pipe, tmp_path)
        assert "\n" not in str(e.value) and str(e.value).endswith(prompt_store.FIX)
    shard.write_bytes(whole)
    begin, end = _row_bytes(shard, "prompt_embeds", 1)  # TEXTS[4]'s embedding
    shard.write_bytes(whole[:begin + 5] + bytes([whole[begin + 5] ^ 0x40]) + whole[begin + 6:])
    build(pipe, tmp_path)
    assert models.encode_prompts(pipe, TEXTS[3:4] + TEXTS[5:])["prompt_embeds"].shape[0] == 3
    with pytest.raises(ValueError, match="shard-00001.safetensors row 1 .'a white cat'. fails its CRC-32") as e:
        models.encode_prompts(pipe, TEXTS[4:5])
    assert "\n" not in str(e.value)
    shard.unlink()
    with pytest.raises(ValueError, match="shard-00001.safetensors is missing"):
        build(pipe, tmp_path)
    shard.write_bytes(whole)
    manifest = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(manifest[:40])
    with pytest.raises(ValueError, match="its manifest or texts.json cannot be read"):
        build(pipe, tmp_path)
    (tmp_path / "manifest.json").unlink()  # unfinished: built again over its files
    assert "encoded ahead" in build(pipe, tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text()) == json.loads(manifest)
    assert (tmp_path / "shard-00001.safetensors").read_bytes() == whole


def _row_bytes(path, key, j):
    """(first, end) byte of row j of `key` in a shard file (safetensors: an 8-byte header length, the JSON header, then
    each tensor's bytes at its data_offsets)."""
    from safetensors import safe_open
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:8 + n])[key]["data_offsets"]
    with safe_open(str(path), "pt") as handle:
        bounds = handle.get_tensor(f"offsets/{key}").tolist()
    size = (end - begin) // bounds[-1]  # bytes per element of the first dimension
    return 8 + n + begin + bounds[j] * size, 8 + n + begin + bounds[j + 1] * size


# ----------------------------------------------------------------------------- two ranks, each its share

def _ranks_worker(out):
    """Under torchrun (2 ranks, gloo): both build one store of TEXTS in shards of 2 prompts; each records what it
    encoded and what it reads back; rank 0 writes them."""
    import distributed
    distributed.init()
    prompt_store.SHARD_PROMPTS = 2
    pipe = models.load_pipeline("tiny")
    seen, fresh = [], models._encode_fresh
    models._encode_fresh = lambda p, prompts, **kw: seen.append(list(prompts)) or fresh(p, prompts, **kw)
    pipe.prompt_store_dir = os.path.join(out, "store")
    models.prompt_cache(pipe, 0, texts=TEXTS, negative_prompt="blurry", batch_size=2)
    read = models.encode_prompts(pipe, TEXTS, guidance_scale=3.0, negative_prompt="blurry")
    everyone = [None] * distributed.WORLD
    torch.distributed.all_gather_object(everyone, dict(seen=seen, read={k: v.tolist() for k, v in read.items()}))
    if distributed.is_main:
        with open(os.path.join(out, "ranks.json"), "w") as f:
            json.dump(everyone, f)
    distributed.finish()


def test_two_ranks_encode_their_shares_and_read_every_prompt(tmp_path):
    """4 shards over 2 ranks of a node: rank 0 encodes shards 0 and 2 and the negative, rank 1 shards 1 and 3, each
    once; both then read all 7 prompts, the same rows, the fresh encodes of their batches."""
    import forkserver
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join("tests", "test_prompt_store.py"), "ranks", str(tmp_path)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = forkserver.run(cmd, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    zero, one = json.loads((tmp_path / "ranks.json").read_text())
    assert zero["seen"] == [TEXTS[0:2], TEXTS[4:6], ["blurry"]] and one["seen"] == [TEXTS[2:4], TEXTS[6:7]]
    assert zero["read"] == one["read"]
    pipe = models.load_pipeline("tiny")
    rows = [models._encode_fresh(pipe, TEXTS[i:i + 2], guidance_scale=3.0, negative_prompt="blurry",
                                 max_sequence_length=0) for i in range(0, 7, 2)]
    for key in ("prompt_embeds", "pooled"):
        assert torch.equal(torch.tensor(zero["read"][key]), torch.cat([r[key] for r in rows]))
    assert torch.equal(torch.tensor(zero["read"]["neg_prompt_embeds"]), rows[0]["neg_prompt_embeds"][:1].expand(
        7, -1, -1))


if __name__ == "__main__":  # the two-rank worker, under torchrun
    _ranks_worker(sys.argv[2])
