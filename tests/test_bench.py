"""scripts/bench.py on the tiny model: every figure present and finite, and the counted calls match the recipe.

No wall-clock thresholds here: speed is what bench.py reports, never what a test asserts.
"""
import json
import math
import os
import sys

import pytest

import bench
import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 prompts x 2 samples, one rollout batch of 4, 4 denoising steps at 32 px (full fine-tune, no KL: tiny's preset);
# SMALL adds LoRA + KL so that every phase, the reference forward included, runs.
SMALL_FULL = ["--group-size", "2", "--prompts-per-step", "2", "--sample-batch-size", "4", "--train-batch-size", "4",
              "--num-steps", "4", "--resolution", "32"]
SMALL = SMALL_FULL + ["--lora-rank", "4", "--lora-alpha", "8", "--kl-beta", "0.01"]


def run_bench(tmp_path, *flags, train_flags=SMALL):
    path = tmp_path / "bench.json"
    cmd = [sys.executable, "scripts/bench.py", "--model", "tiny", "--steps", "1", "--warmup", "1", "--repeats", "2", "--threads", "1",
           "--json", str(path), *flags, "--", *train_flags]
    proc = forkserver.run(cmd, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(path.read_text()), proc.stdout


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return run_bench(tmp_path_factory.mktemp("bench"), "--peak-tflops", "0.5")


def test_every_figure_is_finite_and_positive(small):
    result, _ = small
    for key in bench.REQUIRED_KEYS + ("pure_seconds", "seconds", "tflop_per_step"):
        assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    assert 0.5 < result["overhead_ratio"] < 10, result["overhead_ratio"]  # sane, not a speed threshold
    assert result["mfu"] == pytest.approx(result["tflop_per_step"] / result["seconds"] / 0.5)  # --peak-tflops 0.5
    assert result["pure_mfu"] == pytest.approx(result["tflop_per_step"] / result["pure_seconds"] / 0.5)


def test_rates_follow_from_the_logged_step_times(small):
    result, _ = small
    assert result["samples_per_step"] == 4 and result["measured_steps"] == 1
    assert result["end_to_end_samples_per_s"] == pytest.approx(4 / result["seconds"])
    assert result["rollout_samples_per_s"] == pytest.approx(4 / result["seconds_sampling"])
    assert result["train_samples_per_s"] == pytest.approx(4 / result["seconds_training"])
    # The step contains both phases, so it cannot be faster than either of them.
    assert result["end_to_end_samples_per_s"] < min(result["rollout_samples_per_s"], result["train_samples_per_s"])


def test_counted_calls_match_the_recipe(small):
    """4 sampling forwards and 1 decode per rollout batch; 3 trained steps (the last is never trained), each
    a forward + backward and, with --kl-beta > 0, a reference forward; all at batch 4, 16 x 8 x 8 latents."""
    result, stdout = small
    per_step = {c["phase"]: c["per_step"] for c in result["calls"]}
    assert per_step == {"rollout": 4, "decode": 1, "train": 3, "reference": 3}
    for call in result["calls"]:
        latent = call["shapes"]["0" if call["phase"] == "decode" else "hidden_states"]
        assert latent == [4, 16, 8, 8], call
        assert call["seconds"] > 0 and call["tflop"] > 0
    train_flop = next(c["tflop"] for c in result["calls"] if c["phase"] == "train")
    ref_flop = next(c["tflop"] for c in result["calls"] if c["phase"] == "reference")
    assert 1.5 < train_flop / ref_flop < 3.5  # forward + backward ~ 2-3 forwards
    assert result["tflop_per_step"] == pytest.approx(sum(c["per_step"] * c["tflop"] for c in result["calls"]))
    assert "overhead ratio" in stdout and "samples/s" in stdout


@pytest.mark.parametrize("argv, needle", [
    (["--group-size", "4"], "after `--`"),
    (["--", "--steps", "3"], "--steps after `--` is set by bench.py"),
    (["--steps", "0"], "must be >= 1"),
    (["--window-size", "3"], "belongs to --windows"),
    (["--", "--eval-every", "5"], "--eval-every samples outside the measured step"),
    (["--losses", "--windows"], "--losses makes three runs"),
    (["--losses", "--", "--loss", "nft"], "--losses sets --loss"),
    (["--baseline=--mixed-precision no", "--losses"], "--baseline makes runs of its own"),
    (["--baseline", " "], "--baseline needs the train.py flags"),
    (["--baseline=--lr 1e-3", "--rounds", "0"], "--rounds must be >= 1"),
])
def test_bad_flags_fail_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--rewards", "--reward-images", "0"], "--reward-images must be >= 1"),
    (["--rewards", "--reward-size", "-3"], "--reward-size must be >= 1"),
    (["--peak-tflops", "-5"], "--peak-tflops must be a finite number > 0"),
    (["--peak-tflops", "0"], "--peak-tflops must be a finite number > 0"),
    (["--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0"),
])
def test_bad_values_are_refused_before_any_work(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_json_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys):
    """The figures are written at the end of the run: a path that cannot take them is refused at the start."""
    (tmp_path / "a_file").write_text("x")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    cases = [(tmp_path, "is a folder"), (tmp_path / "a_file" / "bench.json", "is not a folder")]
    if not os.access(read_only, os.W_OK):  # root writes anywhere
        cases.append((read_only / "bench.json", "cannot be written"))
    for path, needle in cases:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--json", str(path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and str(path) in err, err
    args = bench.parse_args(["--json", str(tmp_path / "new" / "folders" / "bench.json")])  # made at the end
    assert args.json == str(tmp_path / "new" / "folders" / "bench.json")


def test_recipe_files_go_to_train():
    args = bench.parse_args(["@recipes/sd3_bench.args", "--model", "sd3-random", "--", "--gradient-checkpointing"])
    assert args.model == "sd3-random"
    assert args.train_args == ["@recipes/sd3_bench.args", "--gradient-checkpointing"]


@pytest.mark.slow
def test_windows_speedups(tmp_path):
    path = tmp_path / "windows.json"
    cmd = [sys.executable, "scripts/bench.py", "--windows", "--model", "tiny", "--steps", "1", "--warmup", "1", "--repeats", "1", "--threads", "1",
           "--json", str(path), "--", *SMALL_FULL, "--num-steps", "6"]
    proc = forkserver.run(cmd, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(path.read_text())
    assert set(result["speedup_vs_all"]) == set(bench.WINDOWS)
    assert result["speedup_vs_all"]["all"] == 1.0
    trained = {name: next(c["per_step"] for c in r["calls"] if c["phase"] == "train") for name, r in result["windows"].items()}
    assert trained == {"all": 5, "fast": 2, "mix": 2, "mix+flash": 2}
    sampled = {name: next(c["per_step"] for c in r["calls"] if c["phase"] == "rollout") for name, r in result["windows"].items()}
    assert sampled["all"] == sampled["fast"] == sampled["mix"] == 6 and sampled["mix+flash"] < 6  # flash: fewer solver steps
    compute = result["compute_speedup_vs_all"]  # priced at the same per-call times: exact functions of the counts
    assert compute["all"] == 1.0 and compute["fast"] == pytest.approx(compute["mix"]) and compute["mix+flash"] > compute["mix"] > 1
    for name, r in result["windows"].items():
        assert result["equal_load_speedup_vs_all"][name] == pytest.approx(
            compute[name] * result["windows"]["all"]["overhead_ratio"] / r["overhead_ratio"])


def test_nft_step_counts_its_calls(tmp_path):
    """DiffusionNFT on the full fine-tune: 4 dpm2 rollout forwards and 1 decode per batch; int(4 x 0.99) = 3 training
    sigmas, each a forward + backward and a no-grad forward of the old copy (replayed as it is: no adapter)."""
    result, stdout = run_bench(tmp_path, train_flags=SMALL_FULL + ["--loss", "nft"])
    per_step = {c["phase"]: c["per_step"] for c in result["calls"]}
    assert per_step == {"rollout": 4, "decode": 1, "train": 3, "reference": 3}
    assert all(c["seconds"] > 0 for c in result["calls"]) and math.isfinite(result["overhead_ratio"])
    assert result["train_argv"][result["train_argv"].index("--loss") + 1] == "nft"


@pytest.mark.slow
def test_losses_side_by_side(tmp_path):
    path = tmp_path / "losses.json"
    cmd = [sys.executable, "scripts/bench.py", "--losses", "--model", "tiny", "--steps", "1", "--warmup", "1", "--repeats", "1",
           "--threads", "1", "--json", str(path), "--", *SMALL, "--train-timesteps", "2"]
    proc = forkserver.run(cmd, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(path.read_text())
    assert result["speedup_vs_grpo"]["grpo"] == 1.0 and set(result["losses"]) == set(bench.LOSSES)
    calls = {name: {c["phase"]: c["per_step"] for c in r["calls"]} for name, r in result["losses"].items()}
    # grpo: 3 trained SDE steps, each with a KL reference forward; nft: 3 sigmas, old copy + base per sigma;
    # awm: 2 strata (--train-timesteps 2), EMA anchor + base per sigma. Same rollout: 4 forwards (CFG 1), 1 decode.
    assert calls == {"grpo": {"rollout": 4, "decode": 1, "train": 3, "reference": 3},
                     "nft": {"rollout": 4, "decode": 1, "train": 3, "reference": 6},
                     "awm": {"rollout": 4, "decode": 1, "train": 2, "reference": 4}}
    for name, r in result["losses"].items():
        assert result["speedup_vs_grpo"][name] == pytest.approx(
            r["end_to_end_samples_per_s"] / result["losses"]["grpo"]["end_to_end_samples_per_s"])
    compute = result["compute_speedup_vs_grpo"]
    assert compute["grpo"] == 1.0 and compute["nft"] < 1  # nft makes grpo's calls at the same shapes, and 3 more


@pytest.mark.slow
def test_baseline_ratio_against_the_recipe_with_other_flags(tmp_path):
    path = tmp_path / "baseline.json"
    cmd = [sys.executable, "scripts/bench.py", "--model", "tiny", "--steps", "1", "--warmup", "1", "--repeats", "1",
           "--threads", "1", "--rounds", "1", "--baseline=--prompts-per-step 4", "--json", str(path), "--", *SMALL_FULL]
    proc = forkserver.run(cmd, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(path.read_text())
    (pair,) = result["rounds"]
    assert result["baseline_flags"] == ["--prompts-per-step", "4"]
    assert pair["baseline"]["samples_per_step"] == 8 and pair["recipe"]["samples_per_step"] == 4  # the flags applied
    assert result["time_ratio"] == pytest.approx(pair["recipe"]["seconds"] / pair["baseline"]["seconds"])
    assert result["pure_ratio"] == pytest.approx(pair["recipe"]["pure_seconds"] / pair["baseline"]["pure_seconds"])
    assert result["cpu_ratio"] == pytest.approx(pair["recipe"]["cpu_seconds"] / pair["baseline"]["cpu_seconds"])
    for run in pair.values():  # one measured step: its CPU seconds, within twice its wall time (one thread + reward)
        assert run["cpu_seconds_per_step"] == [run["cpu_seconds"]] and 0 < run["cpu_seconds"] < 2 * run["seconds"]


def test_reward_throughput_times_every_offline_scorer(tmp_path):
    path = tmp_path / "rewards.json"
    proc = forkserver.run([sys.executable, "scripts/bench.py", "--rewards", "--reward-images", "2", "--reward-size", "64",
                           "--ocr-workers", "1", "--json", str(path)], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(path.read_text())
    rates = result["reward_images_per_s"]
    assert set(rates) == {"jpeg_compressibility", "jpeg_incompressibility", "ocr (rapidocr, 1 worker(s))",
                          "pickscore (tiny random CLIP stand-in)", "hps (tiny random open_clip stand-in)",
                          "clipscore (tiny random CLIP stand-in)", "imagereward (tiny random BLIP stand-in)",
                          "hpsv3 (tiny random Qwen2-VL stand-in)", "aesthetic (tiny random CLIP stand-in)",
                          "unifiedreward (client, instant local server)"}
    assert all(math.isfinite(r) and r > 0 for r in rates.values())
    assert set(result["reward_images_per_cpu_s"]) == set(rates)
    assert all(math.isfinite(r) and r > 0 for r in result["reward_images_per_cpu_s"].values())
    # FLOPs of the real models against closed forms: 2 x tokens x weights of every matmul, plus attention's two
    # token-by-token products (2 x 2 x tokens^2 x width per layer).
    flops, tokens = result["reward_flops_per_image"], result["hpsv3_tokens"]
    vit_l14 = 24 * (2 * 257 * 12 * 1024**2 + 4 * 257**2 * 1024) + 2 * 256 * 3 * 14**2 * 1024 + 2 * 1024 * 768
    mlp = 2 * (768 * 1024 + 1024 * 128 + 128 * 64 + 64 * 16 + 16)
    assert flops["aesthetic"] == pytest.approx(vit_l14 + mlp, rel=1e-3)
    assert flops["clipscore"] > flops["aesthetic"]
    vit_l16 = 24 * (2 * 197 * 12 * 1024**2 + 4 * 197**2 * 1024) + 2 * 196 * 3 * 16**2 * 1024
    bert = 12 * (2 * 35 * (6 * 768**2 + 2 * 768 * 3072) + 2 * 197 * 2 * 1024 * 768  # self q k v o, cross q o, FFN;
                 + 4 * 35**2 * 768 + 4 * 35 * 197 * 768)  # cross k v over the 197 image tokens; both attentions
    assert flops["imagereward"] == pytest.approx(vit_l16 + bert, rel=1e-3)
    per_layer = 2 * 3584**2 + 2 * 3584 * 512 + 3 * 3584 * 18944  # q, o; k, v (4 of 28 heads); gate, up, down
    language = 28 * (2 * tokens * per_layer + 4 * tokens**2 * 3584)
    assert 700 < tokens < 900 and 1.1e12 < flops["hpsv3"] - language < 1.5e12  # the rest: the vision tower


def test_sd35_medium_forward_flops_at_the_recipes_text_length():
    """The FLOPs behind the GPU figures' MFU (docs/throughput.md): SD3.5-M's transformer on one 512 px sample, counted by
    FlopCounterMode on the meta device, 2.22 TFLOP at sd3_bench.args' 205 text tokens (77 CLIP + 128 T5), 2.44 at
    diffusers' default 256 T5 tokens."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import families

    transformer = families.build_published("sd3.5-medium", "transformer", device="meta")
    for tokens, tflop in [(77 + 128, 2.2237), (77 + 256, 2.4426)]:
        with torch.device("meta"):
            inputs = dict(hidden_states=torch.randn(1, 16, 64, 64), encoder_hidden_states=torch.randn(1, tokens, 4096),
                          pooled_projections=torch.randn(1, 2048), timestep=torch.tensor([500.0]))
        with FlopCounterMode(display=False) as counter:
            transformer(**inputs, return_dict=False)
        assert counter.get_total_flops() / 1e12 == pytest.approx(tflop, abs=1e-3)
