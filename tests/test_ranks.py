"""What NCCL would hang on, run on 2 CPU processes (gloo): every rank must make the same collectives in the same order.

One 2-rank run and one single-process run share a prompt file whose rows pick their own reward components
(metadata rm_type) so that the two ranks hold different ones, and a held-out file spread so that each rank's share of
the evaluation scores other components. The reward is a custom scorer that records, per rank, the prompts it scored.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import distributed
import forkserver
from test_train import ROOT, metrics

# A "custom" scorer: the brightness of each image in [0, 1] and its complement as an extra entry; it records the
# prompts it scored in <custom-rm-args>/rank<RANK>.txt.
SCORER = '''
import os

def brightness(images, prompts, metadata, folder):
    with open(os.path.join(folder, "rank" + os.environ.get("RANK", "0") + ".txt"), "a") as f:
        f.writelines(p + "\\n" for p in prompts)
    value = images.float().mean(dim=tuple(range(1, images.dim()))) / 255
    return {"reward": value, "darkness": 1 - value, "failed": [bool(m.get("fail")) for m in metadata]}
'''
# --no-shuffle, 2 prompts per step, each prompt's group of 2 on one rank: rank 0 gets rows 0, 2, 4, rank 1 rows 1, 3, 5.
TRAIN_ROWS = [
    ("a red circle", {"rm_type": "jpeg_compressibility"}),  # step 1: the ranks hold as many components, other ones
    ("a blue square", {"rm_type": "jpeg_incompressibility"}),
    ("a green triangle", {}),  # step 2: rank 1 holds one component more (--reward's, and its own)
    ("a white star", {"rm_type": "jpeg_incompressibility"}),
    ("a black moon", {"fail": True}),  # step 3: every sample of rank 0 fails (a reward service that gave up)
    ("a yellow sun", {}),
]
# Held-out: images 0, 2, 4 on rank 0 (jpeg_compressibility only), 1, 3 and a padding copy of 3 on rank 1 (custom).
HELD_OUT = [("held-out red", {"rm_type": "jpeg_compressibility"}), ("held-out blue", {}),
            ("held-out green", {"rm_type": "jpeg_compressibility"}), ("held-out white", {}),
            ("held-out black", {"rm_type": "jpeg_compressibility"})]
FLAGS = ["--model", "tiny", "--resolution", "32", "--num-steps", "2", "--group-size", "2", "--prompts-per-step", "2",
         "--sample-batch-size", "1", "--train-batch-size", "1", "--no-shuffle", "--log-images-every", "0",
         "--reward", "custom", "--eval-every", "3", "--eval-steps", "2",
         "--mixed-precision", "bf16"]  # evaluation samples under the run's autocast (bf16 runs on CPUs too)


def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps({"input": text, "metadata": meta}) + "\n" for text, meta in rows)
    return str(path)


def torchrun(tmp_path, flags, timeout=400, script="train.py"):
    """2 processes under torchrun (forked ranks, tests/forkserver.py); a run that outlives `timeout` (collectives that
    never pair up) is killed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *flags]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    try:
        proc = forkserver.run(cmd, cwd=ROOT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"torchrun hung past {timeout} s:\n{(e.output or '')[-2000:]}\n{(e.stderr or '')[-2000:]}")
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same flags on 2 ranks (3 steps) and in one process (the step-0 evaluation is what they share)."""
    root = tmp_path_factory.mktemp("ranks")
    (root / "scorer.py").write_text(SCORER)
    prompts, held_out = write_rows(root / "train.jsonl", TRAIN_ROWS), write_rows(root / "held_out.jsonl", HELD_OUT)
    flags = FLAGS + ["--prompts", prompts, "--eval-prompts", held_out,
                     "--custom-rm-path", f"{root / 'scorer.py'}:brightness"]
    for name in ("two", "one"):
        (root / name / "scored").mkdir(parents=True)
    torchrun(root / "two", flags + ["--steps", "3", "--out", str(root / "two" / "run"),
                                    "--custom-rm-args", str(root / "two" / "scored")])
    one = forkserver.run([sys.executable, "train.py", *flags, "--steps", "1", "--out", str(root / "one" / "run"),
                          "--custom-rm-args", str(root / "one" / "scored")], cwd=ROOT,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"), timeout=300)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    return root


def test_ranks_holding_different_reward_components_gather_each_one_in_place(runs):
    """Rows that choose their own components leave the ranks with different ones: each is gathered on every rank,
    NaN where a rank has none, so the logged means are those of the samples that have it (before, the ranks paired
    different components in one gather, then made different numbers of gathers and hung)."""
    rows = metrics(runs / "two" / "run")
    assert [r["step"] for r in rows] == [1, 2, 3] and not any(r.get("skipped") for r in rows), rows
    first, second, third = rows
    # Step 1: jpeg_compressibility (-kB) only on rank 0, jpeg_incompressibility (+kB) only on rank 1, no custom.
    assert first["reward/jpeg_compressibility_mean"] < 0 < first["reward/jpeg_incompressibility_mean"], first
    assert first["reward/custom_mean"] is None and first.get("reward/darkness_mean") is None, first  # no rank has it
    assert first["reward_mean"] == pytest.approx(
        (first["reward/jpeg_compressibility_mean"] + first["reward/jpeg_incompressibility_mean"]) / 2, rel=1e-5)
    # Step 2: custom and its extra entry only on rank 0, jpeg_incompressibility only on rank 1.
    assert 0 < second["reward/custom_mean"] < 1 and second.get("reward/jpeg_compressibility_mean") is None, second
    assert second["reward/darkness_mean"] == pytest.approx(1 - second["reward/custom_mean"], rel=1e-5)
    assert second["reward_mean"] == pytest.approx(
        (second["reward/custom_mean"] + second["reward/jpeg_incompressibility_mean"]) / 2, rel=1e-5)
    # Step 3: rank 0's group lost its reward (--reward-on-error skip's marks): dropped, rank 1's trains.
    assert third["dropped_groups"] == 1 and third["grad_norm"] > 0, third
    assert third["reward/custom_mean"] == pytest.approx(third["reward_mean"], rel=1e-5), third  # rank 1's only


def test_evaluation_is_split_over_the_ranks_and_equals_one_process(runs):
    """Each rank samples and scores its share of the held-out images (rank 1 scores held-out prompts), and the
    step-0 figures (means, standard errors, every component's) and eval_base.pt equal the single process's."""
    two, one = (runs / name / "run" for name in ("two", "one"))
    scored = (runs / "two" / "scored" / "rank1.txt").read_text().splitlines()
    assert {"held-out blue", "held-out white"} <= set(scored), scored  # rank 1 evaluated its share
    rows = {name: [json.loads(line) for line in open(path / "eval.jsonl")]
            for name, path in (("two", two), ("one", one))}
    assert [r["step"] for r in rows["two"]] == [0, 3] and [r["step"] for r in rows["one"]] == [0]
    assert rows["two"][0] == rows["one"][0]  # bit for bit: each image has its own noise and forward of batch 1
    assert rows["two"][0]["jpeg_compressibility"] < 0 < rows["two"][0]["custom"] < 1, rows["two"][0]
    assert math.isfinite(rows["two"][1]["rise"]) and math.isfinite(rows["two"][1]["rise_se"]), rows["two"][1]
    base = {name: torch.load(path / "eval_base.pt") for name, path in (("two", two), ("one", one))}
    assert sorted(base["two"]) == sorted(base["one"]) == ["custom", "darkness", "failed", "fingerprint",
                                                          "jpeg_compressibility", "reward"]
    assert base["two"].pop("fingerprint") == base["one"].pop("fingerprint")  # the same held-out set and flags
    for key in base["one"]:  # per image, in held-out order (NaN where the image's row does not use the entry)
        torch.testing.assert_close(base["two"][key], base["one"][key], rtol=0, atol=0, equal_nan=True)
    assert base["one"]["jpeg_compressibility"][[0, 2, 4]].lt(0).all() and base["one"]["custom"][[1, 3]].gt(0).all()


def test_evaluation_samples_under_the_run_autocast(tmp_path, monkeypatch):
    """--mixed-precision bf16: the held-out images are sampled under bf16 autocast, as the rollouts (before:
    float32)."""
    import eval as evaluation
    import models
    import train as train_module
    monkeypatch.chdir(ROOT)
    seen, velocity, sample_images = [], models.velocity, evaluation.sample_images
    inside = []

    def record_velocity(*a, **k):
        if inside:
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)
        return velocity(*a, **k)

    def record_sampling(*a, **k):
        inside.append(1)
        try:
            return sample_images(*a, **k)
        finally:
            inside.pop()
    monkeypatch.setattr(models, "velocity", record_velocity)
    monkeypatch.setattr(evaluation, "sample_images", record_sampling)
    train_module.main(["--model", "tiny", "--resolution", "32", "--num-steps", "2", "--group-size", "2",
                       "--prompts-per-step", "1", "--sample-batch-size", "2", "--train-batch-size", "2", "--steps", "1",
                       "--eval-every", "1", "--eval-prompts", "prompts/tiny.txt", "--eval-steps", "2",
                       "--log-images-every", "0", "--mixed-precision", "bf16", "--out", str(tmp_path / "run")])
    assert seen and set(seen) == {torch.bfloat16}, seen


def test_eval_py_samples_under_the_autocast_asked_for(tmp_path, monkeypatch):
    """eval.py --mixed-precision bf16 scores a bf16 run's checkpoints as it sampled; the default stays float32."""
    import eval as evaluation
    import models
    seen, velocity = [], models.velocity

    def record_velocity(*a, **k):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)
        return velocity(*a, **k)
    monkeypatch.setattr(models, "velocity", record_velocity)
    monkeypatch.chdir(ROOT)
    common = ["--model", "tiny", "--max-prompts", "2", "--eval-steps", "2", "--resolution", "32", "--grid-rows", "2"]
    for precision, dtype in (("bf16", torch.bfloat16), ("no", torch.float32)):
        seen.clear()
        evaluation.main([*common, "--mixed-precision", precision, "--out", str(tmp_path / precision)])
        assert seen and set(seen) == {dtype}, (precision, seen)


# A signal during the reward wait, on 2 ranks where rank 1 does not see the checkpoint rank 0 wrote (another node's
# disk, or a network file system's stale cache). Each rank records the saves it took part in, then exits.
STOP_WORKER = """
import json, os, sys, types
import torch.distributed as dist
import distributed, run

out = sys.argv[1]
distributed.init()
if distributed.RANK == 0:
    os.makedirs(os.path.join(out, "checkpoints", "3"))
    open(os.path.join(out, "checkpoints", "3", "state.json"), "w").write("{}")
distributed.barrier()
if distributed.RANK == 1:
    isfile = os.path.isfile
    os.path.isfile = lambda path: False if path.endswith("state.json") else isfile(path)
saves = []


class Policy:
    def checkpoint(self, args, step, state):
        dist.barrier()  # collective, as checkpoints.write
        saves.append(step)


def exit_now():
    json.dump(saves, open(os.path.join(out, f"rank{distributed.RANK}.json"), "w"))
    distributed.finish()
    os._exit(0)


r = run.Run.__new__(run.Run)
r.args, r.policy, r.signal, r.bad_in_a_row = types.SimpleNamespace(out=out), Policy(), "SIGTERM", 0
r._exit_now = exit_now
r._stop_while_waiting(3)
"""


# The held-out evaluation whose reward fails on rank 1 only; each rank records how its evaluation ended.
EVAL_ERROR_WORKER = """
import contextlib, os, sys, types
import torch
import distributed, run, eval as evaluation

out = sys.argv[1]
device = distributed.init()
evaluation.sample_images = lambda pipe, texts, **k: torch.zeros(len(texts), 8, 8, 3, dtype=torch.uint8)


def reward_fn(images, prompts, metadata):
    if distributed.RANK == 1:
        raise ValueError("reward 'custom' returned 1 scores for 2 samples")
    return {"reward": torch.zeros(len(prompts))}


r = run.Run.__new__(run.Run)
r.args = types.SimpleNamespace(eval_samples_per_prompt=1, resolution=8, eval_steps=2, guidance_scale=1.0, seed=0,
                               sample_batch_size=2, negative_prompt="", shift=None, num_frames=None,
                               max_sequence_length=None, out=out)
r.policy = types.SimpleNamespace(train=torch.nn.Linear(1, 1).train, ema_weights=contextlib.nullcontext,
                                 gathered=contextlib.nullcontext, pipe=None,
                                 autocast=contextlib.nullcontext)
r.device, r.held_out, r.reward_fn = device, (["a", "b", "c"], [{}, {}, {}]), reward_fn
try:
    r.evaluate(0)
    ended = "evaluated"
except SystemExit as e:
    ended = str(e)
open(os.path.join(out, f"rank{distributed.RANK}.txt"), "w").write(ended)
distributed.finish()
"""


def worker(tmp_path, source):
    (tmp_path / "worker.py").write_text(source)
    torchrun(tmp_path, [str(tmp_path)], timeout=120, script=str(tmp_path / "worker.py"))


def test_a_signal_during_the_reward_wait_saves_on_every_rank_or_on_none(tmp_path):
    """Whether the last complete step is still to be saved is rank 0's view, on every rank: the save is collective,
    and a rank that does not see rank 0's file would otherwise enter it alone and hang."""
    worker(tmp_path, STOP_WORKER)
    assert [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)] == [[], []]  # step 3 was saved already


def test_a_reward_failing_in_the_evaluation_of_one_rank_stops_every_rank_in_one_line(tmp_path):
    """The held-out reward fails on rank 1 only: both ranks stop with one line (rank 0 is told it failed elsewhere)
    instead of rank 0 waiting in the gather of the scores."""
    worker(tmp_path, EVAL_ERROR_WORKER)
    ended = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert ended == ["error: the held-out evaluation at step 0: the reward failed on another rank",
                     "error: the held-out evaluation at step 0: reward 'custom' returned 1 scores for 2 samples"]


@pytest.mark.parametrize("n", [1, 4, 5, 7])
def test_shares_cover_every_item_once_and_gather_back_in_order(n, monkeypatch):
    """distributed.share over 3 ranks: strided, padded to one size (the same forwards on every rank); gather_share
    puts the shares' rows back in item order and drops the padding."""
    world, shares = 3, []
    monkeypatch.setattr(distributed, "WORLD", world)
    for rank in range(world):
        monkeypatch.setattr(distributed, "RANK", rank)
        shares.append(distributed.share(n))
    assert len({len(s) for s in shares}) == 1  # one size: the same forwards on every rank
    assert all(s[:len(range(r, n, world))] == list(range(r, n, world)) for r, s in enumerate(shares)), shares
    assert sorted({i for s in shares for i in s}) == list(range(n))  # every item, padding repeats one of them
    rows = torch.tensor([i * 10.0 for s in shares for i in s])  # what all_gather_cat returns: rank 0's rows first
    monkeypatch.setattr(distributed, "all_gather_cat", lambda t: rows)
    assert distributed.gather_share(None, n).tolist() == [i * 10.0 for i in range(n)]


def test_two_experts_train_under_ddp_where_the_micro_batches_reach_one(tmp_path):
    """Wan 2.2's experts under torchrun, training only the first (high-noise) step: every micro-batch on both ranks
    reaches the first expert alone. Their gradients are averaged at the optimizer step (distributed.average_gradients,
    not DDP, which refuses a module without gradients); the replicas agree at the checkpoint, the first expert's
    adapter moved and the second's, which no rank reached, is untouched (its LoRA B still zero), as in one process."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    torchrun(tmp_path, ["--model", "tiny-wan2.2", "--lora-rank", "4", "--num-steps", "2", "--timestep-fraction", "0.5",
                        "--group-size", "2", "--prompts-per-step", "2", "--sample-batch-size", "1",
                        "--train-batch-size", "1", "--steps", "2", "--log-images-every", "0", "--out", str(out)])
    state = json.load(open(out / "checkpoints" / "2" / "state.json"))
    assert len(state["rank_checksums"]) == 2 and len(set(state["rank_checksums"])) == 1
    weights = load_file(out / "checkpoints" / "2" / "trainable.safetensors")
    lora_b = {name: [t for n, t in weights.items() if n.startswith(name + ".") and "lora_B" in n]
              for name in ("transformer", "transformer_2")}
    assert lora_b["transformer"] and lora_b["transformer_2"]
    assert max(t.abs().max() for t in lora_b["transformer"]) > 0
    assert all(torch.equal(t, torch.zeros_like(t)) for t in lora_b["transformer_2"])


def test_a_family_that_calls_its_transformer_twice_a_forward_trains_under_torchrun(tmp_path):
    """Qwen-Image 2.1 runs one forward per text length (families/qwen_image21.py), so under CFG a training forward calls
    the transformer twice, which DDP refuses before its backward; such a record (ddp False) has its gradients
    averaged at the optimizer step instead, and the replicas agree at the checkpoint."""
    out = tmp_path / "run"
    torchrun(tmp_path, ["--model", "tiny-qwen-image-2.1", "--guidance-scale", "4", "--train-cfg", "--num-steps", "2",
                        "--group-size", "2", "--prompts-per-step", "2", "--sample-batch-size", "2",
                        "--train-batch-size", "2", "--steps", "2", "--log-images-every", "0", "--out", str(out)])
    state = json.load(open(out / "checkpoints" / "2" / "state.json"))
    assert len(state["rank_checksums"]) == 2 and len(set(state["rank_checksums"])) == 1
    assert all(math.isfinite(r["loss"]) for r in metrics(out))
