"""scripts/gpu_bench.sh and its summary: the resume verdict, the bench rows (reserved and allocated memory, MFU, the
first-update ratio) and a cut run's row; the whole script on the CPU model (slow)."""
import importlib.util
import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_bench_summary",
                                              os.path.join(ROOT, "scripts", "gpu_bench_summary.py"))
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)


def fake_run(folder, rows, tensors):
    """A run folder: metrics.jsonl rows and a step-2 checkpoint holding `tensors` ({copy: {name: tensor}})."""
    os.makedirs(os.path.join(folder, "checkpoints", "2"))
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for copy, named in tensors.items():
        save_file(named, os.path.join(folder, "checkpoints", "2", copy + ".safetensors"))


def weights(scale=1.0):
    return {c: {"w": torch.arange(6.0).reshape(2, 3) * scale} for c in ("trainable", "ema", "old")}


ROWS = [{"step": 1, "loss": 0.5, "seconds": 3.0}, {"step": 2, "loss": 0.25, "reward_mean": 0.1, "seconds": 2.0}]


@pytest.mark.parametrize("case,verdict", [
    ("identical", "resume: identical"), ("rounding", "same up to kernel rounding"), ("lost", "resume: DIFFERS"),
    ("missing", "resume: FAILED, no step 2 in resumed")])
def test_resume_verdict(tmp_path, case, verdict):
    """Times differ freely; a figure or tensor within 1e-3 is kernel rounding; a reset copy or an unresumed run is
    not."""
    straight = [dict(r, seconds=r["seconds"] + 1) for r in ROWS]
    fake_run(tmp_path / "straight", straight, weights())
    resumed_rows = {"identical": ROWS, "rounding": [ROWS[0], dict(ROWS[1], loss=0.25 * (1 + 1e-5))],
                    "lost": ROWS, "missing": ROWS[:1]}[case]
    resumed = weights()
    if case == "rounding":
        resumed["ema"] = {"w": resumed["ema"]["w"] * (1 + 1e-6)}
    if case == "lost":  # the EMA restarted from the weights: off by far more than rounding
        resumed["ema"] = {"w": resumed["ema"]["w"] * 0.9}
    fake_run(tmp_path / "resumed", resumed_rows, resumed)
    line, detail = summary.resume_verdict(str(tmp_path))
    assert line.startswith(verdict) if case != "rounding" else verdict in line, line
    if case in ("rounding", "lost"):
        assert "  copies compared: trainable, ema, old" in detail
        assert any("checkpoint 2 ema" in d for d in detail)


@pytest.mark.parametrize("case,verdict", [
    ("spread", "resume: same up to the device's run-to-run rounding"), ("lost", "resume: DIFFERS"),
    ("no_second", "resume: DIFFERS")])
def test_resume_verdict_against_run_to_run(tmp_path, case, verdict):
    """With a second uninterrupted run, a resume that differs by no more than 3x what the two uninterrupted runs differ
    by (a GPU's non-deterministic kernels) passes; a reset copy (10 %) does not, and without the second run 4e-3 is
    beyond the fixed tolerance."""
    fake_run(tmp_path / "straight", ROWS, weights())
    noisy = [ROWS[0], dict(ROWS[1], loss=0.25 * (1 + 2e-2))]  # 2 %: a gradient norm's run-to-run rounding on an H200
    if case != "no_second":
        fake_run(tmp_path / "straight_2", noisy, {c: {"w": w["w"] * (1 + 3e-3)} for c, w in weights().items()})
    resumed = weights(1 + 4e-3)
    if case == "lost":
        resumed["ema"] = {"w": resumed["ema"]["w"] * 0.9}
    fake_run(tmp_path / "resumed", [ROWS[0], dict(ROWS[1], loss=0.25 * (1 - 1e-2))], resumed)
    line, detail = summary.resume_verdict(str(tmp_path))
    assert line.startswith(verdict), line
    if case == "lost":
        assert line.endswith(": ema)"), line  # the one copy beyond the spread is named
    if case != "no_second":
        assert any("checkpoint 2 ema" in d and "two uninterrupted runs: 3.0e-03" in d for d in detail), detail


def test_bench_rows(tmp_path):
    """A finished run's row gives reserved and allocated memory, MFU and the first-update ratio; a run cut at its limit
    gives the steps its metrics.jsonl logged."""
    r = dict(device="NVIDIA H200", end_to_end_samples_per_s=0.5, rollout_samples_per_s=2.0, train_samples_per_s=1.0,
             seconds=32.0, peak_mem_mib=40 * 1024, peak_reserved_mib=48 * 1024, mfu=0.31, first_ratio_dev=2.5e-3,
             overhead_ratio=1.04)
    with open(tmp_path / "sd3_bench.json", "w") as f:
        json.dump(r, f)
    assert summary.bench_row(str(tmp_path), "sd3_bench") == \
        "| sd3_bench | NVIDIA H200 | 0.500 | 2.000 | 1.000 | 32.0 | 40.0 | 48.0 | 31.0 % | 2.50e-03 | 1.040 |"
    os.makedirs(tmp_path / "sd3_bench_gc")
    with open(tmp_path / "sd3_bench_gc" / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "seconds": 151.25}) + "\n")
    assert summary.bench_row(str(tmp_path), "sd3_bench_gc").startswith(
        "| sd3_bench_gc | cut: 1 step(s) logged, seconds 151.2")


def test_default_phases_parse(tmp_path, monkeypatch):
    """The GPU defaults of the bench and resume phases pass bench.py's and train.py's checks (before a GPU is spent)."""
    import re
    import bench
    import train
    monkeypatch.chdir(ROOT)
    text = open(os.path.join(ROOT, "scripts", "gpu_bench.sh")).read()
    small = re.findall(r'^small\+?="([^"]*)"', text, re.M)
    bench_small, resume_small = small[0].split(), (small[1] + small[2]).split()
    assert bench_small[:2] == ["--prompts-per-step", "2"] and "--resolution" in resume_small
    args = bench.parse_args(["--model", "sd3-random", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "b"),
                             "--json", str(tmp_path / "b.json"), "@recipes/sd3_bench.args", "--", *bench_small])
    p, targs = train.parse_args(args.train_args + ["--model", "sd3-random", "--reward", args.reward, "--steps", "3"])
    train.check_args(p, targs, 1)
    assert (targs.prompts_per_step * targs.group_size, targs.mixed_precision, targs.lora_rank) == (16, "bf16", 32)
    for tail in (["--steps", "1"], ["--steps", "2", "--resume", "auto"]):
        p, targs = train.parse_args(["--model", "sd3-random", "--reward", "jpeg_compressibility", "--loss", "nft",
                                     "--ema-decay", "0.9", "--ema-every", "1", "--ema-repeat", "1", "--save-every", "1",
                                     "--eval-every", "0", "--log-images-every", "0", *resume_small,
                                     "--out", str(tmp_path / "r"), *tail])
        train.check_args(p, targs, 1)
        assert targs.resolution == 512 and targs.ema_decay == 0.9


@pytest.mark.slow
def test_script_on_the_cpu_model(tmp_path):
    """The whole script on the tiny model (ALLOW_CPU=1): the bench JSON carries both memory peaks and the ratio, and
    the resumed run equals the uninterrupted one bit for bit."""
    env = dict(os.environ, ALLOW_CPU="1", MODEL="tiny", STEPS="1", WARMUP="1", OUT=str(tmp_path), GC_MIN_S="100000",
               COMPILE_MIN_S="100000",
               BENCH_ARGS="-- --group-size 4 --prompts-per-step 2 --sample-batch-size 4 --train-batch-size 4 "
                          "--num-steps 4",
               RESUME_ARGS="--num-steps 4 --group-size 4 --prompts-per-step 2 --sample-batch-size 4 "
                           "--train-batch-size 4 --lora-rank 4 --mixed-precision no")
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_bench.sh")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "sd3_bench.json") as f:
        r = json.load(f)
    assert r["peak_reserved_mib"] > 0 and r["peak_mem_mib"] > 0 and r["first_ratio_dev"] >= 0
    text = (tmp_path / "summary.md").read_text()
    assert "resume: identical" in text and "copies compared: trainable, ema, old" in text
