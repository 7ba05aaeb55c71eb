"""The prompt store against hostile use (issue 78): two runs writing one --prompt-store folder at once, a shard copied
over another of the same size, a folder of the user's own files, a read-only folder, a row that fails its CRC-32 in the
middle of a run, and the advice to delete the store naming the store's folder. Each is refused in one line, warned
about, or works; no run reads another prompt file's embeddings."""
import errno
import json
import os
import shutil
import sys
import time

import pytest
import torch

import models
import prompt_store
from test_gpu_perf import count_encodes
from test_prompt_store import _row_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE = ["a red cube", "two blue spheres", "a green tree", "a white cat", "a dog", "three cones"]
TWO = ["a yellow car", "an old house", "a small boat", "a black bird", "a fox", "four rings"]  # ONE's lengths


@pytest.fixture(scope="module")
def pipe():
    return models.load_pipeline("tiny")


def build(pipe, directory, texts=ONE):
    """models.prompt_cache as train.py calls it, with --prompt-store `directory` -> its line."""
    pipe.prompt_cache = pipe.prompt_store = None
    pipe.prompt_store_dir = str(directory)
    return models.prompt_cache(pipe, 0, texts=texts, negative_prompt="", batch_size=2)


def fresh(pipe, texts):
    return models._encode_fresh(pipe, texts, max_sequence_length=models.default_tokens(pipe))


def assert_rows_are(pipe, texts):
    """The store's rows of each of `texts` are its fresh encode (in batches of 2, as the store encoded them)."""
    for i in range(0, len(texts), 2):
        got, want = models.encode_prompts(pipe, texts[i:i + 2]), fresh(pipe, texts[i:i + 2])
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), texts[i:i + 2]


# ----------------------------------------------------------------------------- two runs in one folder

def _writer(directory, texts, rows_delay, manifest_delay, ready, go, out):
    """A run's store build (python tests/test_campaign6_store.py writer ...): each shard write and the manifest's
    delayed by the given seconds, started when `go` exists; what it got is written to `out`."""
    pipe = models.load_pipeline("tiny")
    write_rows, write_manifest = prompt_store.write_rows, prompt_store.write_manifest
    prompt_store.write_rows = lambda *a: time.sleep(rows_delay) or write_rows(*a)
    prompt_store.write_manifest = lambda *a: time.sleep(manifest_delay) or write_manifest(*a)
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    try:
        result = dict(line=build(pipe, directory, texts))
    except ValueError as e:
        result = dict(refused=str(e))
    with open(out, "w") as f:
        json.dump(result, f)


def start_writers(tmp_path, *runs):
    """Start a writer per (name, texts, rows_delay, manifest_delay), all at once once all are loaded -> {name: Popen}."""
    import forkserver
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    procs = {}
    for name, texts, rows_delay, manifest_delay in runs:
        procs[name] = forkserver.start([sys.executable, os.path.join("tests", "test_campaign6_store.py"), "writer",
                                        str(tmp_path / "store"), json.dumps(texts), str(rows_delay),
                                        str(manifest_delay), str(tmp_path / f"{name}.ready"), str(tmp_path / "go"),
                                        str(tmp_path / f"{name}.json")], cwd=ROOT, env=env)
    deadline = time.time() + 120
    while not all((tmp_path / f"{name}.ready").exists() for name in procs) and time.time() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    return procs


def test_two_runs_writing_one_store_at_once_never_train_on_the_others_embeddings(pipe, tmp_path):
    """Run A (prompts ONE) writes its shards late, run B (TWO, the same lengths) its manifest late, into one folder at
    once: without a lock B's manifest ended beside A's shard and every later run of TWO read ONE's embeddings,
    'reused'. Now one run holds the folder while it builds, the other waits for it (saying so, naming the holder)
    and is then refused in one line; a later run of either prompt file reads its own rows or is refused."""
    procs = start_writers(tmp_path, ("a", ONE, 0.5, 0.0), ("b", TWO, 0.0, 2.0))
    outs = {name: proc.communicate(timeout=300) for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, outs[name]
    got = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in procs}
    winner = next(name for name in got if "line" in got[name])
    loser = "b" if winner == "a" else "a"
    assert "refused" in got[loser], got  # both said 'encoded ahead' or 'reused' before: one of them on other rows
    assert "holds the embeddings of other prompts" in got[loser]["refused"] and "\n" not in got[loser]["refused"]
    assert f"--prompt-store {tmp_path / 'store'}: waiting for the run writing it (host " in outs[loser][0]
    texts = dict(a=ONE, b=TWO)
    build(pipe, tmp_path / "store", texts[winner])
    assert_rows_are(pipe, texts[winner])
    with pytest.raises(ValueError, match="holds the embeddings of other prompts"):
        build(pipe, tmp_path / "store", texts[loser])


def test_a_build_killed_holding_the_folder_lets_go_of_it_and_is_built_again(pipe, tmp_path):
    """The lock dies with its run (a build killed before its end, SIGKILL): the next run takes the folder at once and
    builds the store again over the killed run's files."""
    proc = start_writers(tmp_path, ("a", ONE, 60.0, 0.0))["a"]
    deadline = time.time() + 60
    while not (tmp_path / "store" / prompt_store.HOLDER).exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    begin = time.time()
    assert "encoded ahead" in build(pipe, tmp_path / "store")
    assert time.time() - begin < 10  # not LOCK_WAIT_S
    assert_rows_are(pipe, ONE)
    assert not (tmp_path / "store" / prompt_store.HOLDER).exists()  # let go of with the lock


def test_a_folder_held_by_another_run_is_waited_for_then_refused_in_one_line(pipe, tmp_path, monkeypatch):
    """Another run's build that outlasts LOCK_WAIT_S: one line naming the holder and the fix. A lock held by this run
    (its holder on another node, a folder the nodes share) covers the rank at once."""
    monkeypatch.setattr(prompt_store, "LOCK_WAIT_S", 0.5)
    held = prompt_store.claim(str(tmp_path), "another run")
    try:
        begin = time.time()
        with pytest.raises(ValueError, match=rf"--prompt-store {tmp_path} is being written by another run \(host "
                                             rf"\S+, pid {os.getpid()}, since .*\) for over 0.5 s: wait for it to "
                                             "end, or give another --prompt-store folder") as e:
            build(pipe, tmp_path)
        assert "\n" not in str(e.value) and time.time() - begin >= 0.5
        covered = prompt_store.claim(str(tmp_path), "another run")
        assert not covered.held
        covered.release()
    finally:
        held.release()
    assert "encoded ahead" in build(pipe, tmp_path)


# ----------------------------------------------------------------------------- what the store checks

def test_a_shard_copied_over_another_of_the_same_size_is_refused_in_one_line(pipe, tmp_path, monkeypatch):
    """Shard 1 copied over shard 0 (3 prompts each, the same size, each a valid file whose rows pass their CRC-32s):
    it was reused, ONE[0:3] read as ONE[3:6]'s rows; now the manifest's digest of its rows refuses it, naming the file
    and the store's folder to delete."""
    monkeypatch.setattr(prompt_store, "SHARD_PROMPTS", 3)
    build(pipe, tmp_path)
    zero, one = tmp_path / "shard-00000.safetensors", tmp_path / "shard-00001.safetensors"
    assert zero.stat().st_size == one.stat().st_size
    shutil.copyfile(one, zero)
    with pytest.raises(ValueError, match=rf"--prompt-store {tmp_path}: shard-00000.safetensors holds other rows than "
                                         rf"the manifest recorded \(replaced by another file\); the store is the "
                                         rf"folder {tmp_path}: delete it to encode the prompts again") as e:
        build(pipe, tmp_path)
    assert "\n" not in str(e.value)


def test_a_folder_of_the_users_own_files_is_never_written_into(pipe, tmp_path):
    """A folder holding the user's own texts.json and no manifest: that file was overwritten by the store's. Now the
    store refuses the folder in one line naming the file and the fix, and writes nothing into it."""
    mine = tmp_path / "texts.json"
    mine.write_text('{"my": "own notes"}')
    with pytest.raises(ValueError, match=rf"--prompt-store {tmp_path} holds files no prompt store wrote \(texts.json\) "
                                         "and the store never overwrites them: point --prompt-store at an empty "
                                         "folder or at a prompt store's folder") as e:
        build(pipe, tmp_path)
    assert "\n" not in str(e.value)
    assert mine.read_text() == '{"my": "own notes"}' and os.listdir(tmp_path) == ["texts.json"]


def test_the_advice_to_delete_names_the_store_folder(pipe, tmp_path, monkeypatch):
    """train.py refusing a store of another prompt file: its "delete it" follows the store folder's own name (it
    followed the line's last words, whatever path or file they named)."""
    import train
    monkeypatch.chdir(ROOT)
    store = tmp_path / "store"
    (tmp_path / "p.txt").write_text("a red apple\n")
    common = ["--model", "tiny", "--prompts-per-step", "1", "--group-size", "2", "--sample-batch-size", "2",
              "--train-batch-size", "2", "--num-steps", "2", "--resolution", "32", "--log-images-every", "0",
              "--steps", "1", "--prompt-store", str(store), "--prompts", str(tmp_path / "p.txt")]
    train.main(common + ["--out", str(tmp_path / "one")])
    (tmp_path / "p.txt").write_text("a red apple\na blue car\n")
    with pytest.raises(SystemExit) as e:
        train.main(common + ["--out", str(tmp_path / "two")])
    line = str(e.value)
    assert line.startswith(f"error: --prompt-store {store} holds the embeddings of other prompts") and "\n" not in line
    assert line.endswith(f"; the store is the folder {store}: {prompt_store.FIX}")


# ----------------------------------------------------------------------------- a folder that cannot be written

def read_only(monkeypatch, directory):
    """`directory` as on a read-only file system, for root too: creating or writing a file there fails with EROFS
    (os.open, open, safetensors' save_file); reading works."""
    directory = str(directory)
    real_open, real_builtin, real_save = os.open, open, prompt_store.save_file
    inside = lambda path: os.path.abspath(str(path)).startswith(directory + os.sep)  # noqa: E731
    erofs = lambda path: OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))  # noqa: E731

    def os_open(path, flags, *a, **k):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise erofs(path)
        return real_open(path, flags, *a, **k)

    def builtin_open(path, mode="r", *a, **k):
        if isinstance(path, (str, os.PathLike)) and inside(path) and set(mode) & set("wax+"):
            raise erofs(path)
        return real_builtin(path, mode, *a, **k)

    def save_file(tensors, path, *a, **k):
        if inside(path):
            raise prompt_store.SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30)")
        return real_save(tensors, path, *a, **k)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr("builtins.open", builtin_open)
    monkeypatch.setattr(prompt_store, "save_file", save_file)


def test_a_read_only_folder_is_refused_before_encoding_and_its_store_still_read(pipe, tmp_path, monkeypatch):
    """A read-only --prompt-store folder that holds no store: one line before any prompt is encoded (it was a
    SafetensorError traceback after the encode); one that holds this run's store: read, as any other reader."""
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    build(pipe, full)
    seen = count_encodes(monkeypatch)
    read_only(monkeypatch, tmp_path)
    with pytest.raises(ValueError, match=rf"--prompt-store {empty} cannot be written \(OSError: \[Errno 30\] "
                                         r"Read-only file system.*\) and holds no prompt store: give a folder on the "
                                         "node's local disk that this run can write") as e:
        build(pipe, empty)
    assert "\n" not in str(e.value) and seen == [] and os.listdir(empty) == []
    assert "reused" in build(pipe, full) and seen == []
    monkeypatch.undo()
    assert_rows_are(pipe, ONE)


def test_a_shard_that_cannot_be_written_is_one_line_of_train_py(tmp_path, monkeypatch):
    """The real write failing (safetensors' SafetensorError, here a folder squatting on the shard's temporary name)
    stopped train.py with a traceback; now one `error:` line naming the store folder and the fix. With the lock
    file writable but the shards not (the simulated read-only file system after the lock): the same line."""
    import train
    monkeypatch.chdir(ROOT)
    store = tmp_path / "store"
    (store / f"shard-00000.safetensors.tmp-{os.getpid()}").mkdir(parents=True)
    (store / "store.lock").touch()  # a store's folder: a killed build's leftovers
    (tmp_path / "p.txt").write_text("a red apple\n")
    args = ["--model", "tiny", "--prompts-per-step", "1", "--group-size", "2", "--sample-batch-size", "2",
            "--train-batch-size", "2", "--num-steps", "2", "--resolution", "32", "--log-images-every", "0",
            "--steps", "1", "--prompt-store", str(store), "--prompts", str(tmp_path / "p.txt")]
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--out", str(tmp_path / "one")])
    line = str(e.value)
    assert line.startswith(f"error: --prompt-store {store} cannot be written (SafetensorError: Error while "
                           "serializing: I/O error: Is a directory") and "\n" not in line
    assert line.endswith("give a folder on the node's local disk that this run can write, or make this one writable")
    assert not (store / "manifest.json").exists()
    os.rmdir(store / f"shard-00000.safetensors.tmp-{os.getpid()}")
    monkeypatch.setattr(prompt_store, "save_file", lambda *a, **k: (_ for _ in ()).throw(
        prompt_store.SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30)")))
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--out", str(tmp_path / "two")])
    assert str(e.value).startswith(f"error: --prompt-store {store} cannot be written (SafetensorError: Error while "
                                   "serializing: I/O error: Read-only file system (os error 30))")


# ----------------------------------------------------------------------------- a damaged row in the middle of a run

def test_a_row_failing_its_crc_mid_run_is_a_warning_and_that_prompt_encoded(tmp_path, monkeypatch, capsys):
    """A resumed run whose stored row of 'a red apple' fails its CRC-32 at its first read, in the step: a traceback
    ended the run; now one warning naming the file, row, prompt and store folder, then that prompt is encoded by the
    text encoders (its rows those of a fresh encode) and the run ends its steps. Read directly (not by train.py),
    the row is still an error."""
    import train
    monkeypatch.chdir(ROOT)
    store, out = tmp_path / "store", str(tmp_path / "run")
    (tmp_path / "p.txt").write_text("a red apple\n")
    args = ["--model", "tiny", "--prompts", str(tmp_path / "p.txt"), "--prompts-per-step", "1", "--group-size", "2",
            "--sample-batch-size", "2", "--train-batch-size", "2", "--num-steps", "2", "--resolution", "32",
            "--log-images-every", "0", "--prompt-store", str(store), "--out", out]
    train.main(args + ["--steps", "1"])
    shard = store / "shard-00000.safetensors"
    whole = shard.read_bytes()
    begin, _ = _row_bytes(shard, "prompt_embeds", 0)
    shard.write_bytes(whole[:begin + 5] + bytes([whole[begin + 5] ^ 0x40]) + whole[begin + 6:])
    capsys.readouterr()
    seen = count_encodes(monkeypatch)
    train.main(args + ["--steps", "3", "--resume", "auto"])
    said = capsys.readouterr().out
    warnings = [line for line in said.splitlines() if line.startswith("warning: --prompt-store")]
    assert warnings == [f"warning: --prompt-store {store}: shard-00000.safetensors row 0 ('a red apple') fails its "
                        f"CRC-32 (the file is damaged); the store is the folder {store}: {prompt_store.FIX} (this run "
                        "encodes that prompt with its text encoders from now on)"]
    assert seen == [["a red apple"], ["a red apple"]]  # the two steps' encodes, none of them from the damaged row
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    pipe = models.load_pipeline("tiny")
    assert "reused" in build(pipe, store, ["a red apple"])
    with pytest.raises(prompt_store.DamagedRow, match="row 0 .'a red apple'. fails its CRC-32"):
        models.encode_prompts(pipe, ["a red apple"])


if __name__ == "__main__":  # a run's store build, started by start_writers
    _writer(sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), *sys.argv[6:9])
