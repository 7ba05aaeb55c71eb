"""scripts/anchor_bench.py (flow_grpo's step timed on our pipeline), its phase in scripts/gpu_bench.sh and its table in
scripts/gpu_bench_summary.py.

Without the fetched code (CI), our sde.py stands in behind flow_grpo's four functions: the loop, its call counts and
FLOPs against bench.py's, the ratio, and the two checks (log-probs against sde.py's, |ratio - 1| before the first
optimizer step) are tested on it. With third_party/flow_grpo (scripts/fetch_flow_grpo.sh PATH), flow_grpo's own
rollout must give sde.py's log-probs on the same transitions, and gpu_bench.sh's anchor phase runs on the tiny model.
"""
import importlib.util
import json
import math
import os
import subprocess

import pytest

import anchor_bench
import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_bench.sh")
HAVE_FLOW_GRPO = os.path.isfile(os.path.join(ROOT, "third_party", "flow_grpo", "COMMIT"))
NEEDS_FLOW_GRPO = pytest.mark.skipif(not HAVE_FLOW_GRPO, reason="third_party/flow_grpo missing: run "
                                     "scripts/fetch_flow_grpo.sh PATH (a flow_grpo checkout) to run flow_grpo's code")
spec = importlib.util.spec_from_file_location("gpu_bench_summary",
                                              os.path.join(ROOT, "scripts", "gpu_bench_summary.py"))
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)

RUN = ["--model", "tiny", "--threads", "1", "--steps", "1", "--warmup", "1", "--repeats", "1"]
# The bench recipe's algorithm at toy size: CFG in sampling and training, a LoRA, the KL to the base, 4 steps of which
# int(4 x 0.99) = 3 are trained (flow_grpo's count and ours agree there), float32 so that both sides are exact.
FLAGS = ["--", "--num-steps", "4", "--group-size", "4", "--prompts-per-step", "2", "--sample-batch-size", "4",
         "--train-batch-size", "4", "--guidance-scale", "4.5", "--lora-rank", "4", "--lora-alpha", "8", "--kl-beta",
         "0.04", "--timestep-fraction", "0.99", "--global-std", "--clip-range", "1e-4", "--mixed-precision", "no"]


def calls(result):
    """Every kind of call of a step: phase, calls per step, input shapes, TFLOP."""
    return sorted((c["phase"], c["per_step"], json.dumps(c["shapes"], sort_keys=True), round(c["tflop"], 12))
                  for c in result["calls"])


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """bench.py's figures for FLAGS: our step, the reference of every comparison below."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    bench.main(RUN + ["--json", str(path)] + FLAGS)
    with open(path) as f:
        return path, json.load(f)


def test_stand_in_does_the_work_bench_counts(ours, tmp_path):
    """sde.py behind flow_grpo's signatures: per step 8 rollout forwards (4 steps x 2 batches), 2 decodes, 6 training
    forwards and 6 reference forwards (3 trained steps x 2 batches), the same shapes and FLOPs as bench.py's step; its
    log-probs are sde.py's and its first update is on-policy; --compare divides ours by it."""
    path, b = ours
    r = anchor_bench.main(RUN + ["--impl", "sde", "--check-logprob", "--compare", str(path), "--json",
                                 str(tmp_path / "a.json")] + FLAGS)
    assert {c["phase"]: c["per_step"] for c in r["calls"]} == {"rollout": 8, "decode": 2, "train": 6, "reference": 6}
    assert calls(r) == calls(b)
    assert r["tflop_per_step"] == pytest.approx(b["tflop_per_step"], rel=1e-12) and r["vs_ours"]["tflop_per_step"] == 1
    for key in ("end_to_end_samples_per_s", "rollout_samples_per_s", "train_samples_per_s"):
        assert r["vs_ours"][key] == pytest.approx(b[key] / r[key])
    assert r["seconds"] == pytest.approx(r["seconds_sampling"] + r["seconds_reward"] + r["seconds_training"])
    assert r["logprob_steps"] == 3 and r["logprob_max_abs_diff"] < 1e-6 and r["first_ratio_dev"] < 1e-6
    with open(tmp_path / "a.json") as f:
        assert json.load(f)["end_to_end_samples_per_s"] == r["end_to_end_samples_per_s"]


def test_checks_see_shifted_log_probs(monkeypatch):
    """A rollout whose log-probs are 0.01 too high shows as 0.01 in the agreement and as |ratio - 1| = 1 - e^-0.01
    before the first optimizer step: both checks can fail."""
    stand_in = anchor_bench.sde_impl

    def shifted():
        impl = stand_in()
        rollout = impl.pipeline_with_logprob

        def pipeline_with_logprob(*args, **kwargs):
            images, latents, log_probs = rollout(*args, **kwargs)
            return images, latents, [lp + 0.01 for lp in log_probs]
        impl.pipeline_with_logprob = pipeline_with_logprob
        return impl

    monkeypatch.setattr(anchor_bench, "sde_impl", shifted)
    r = anchor_bench.main(RUN + ["--impl", "sde", "--check-logprob"] + FLAGS)
    assert r["logprob_max_abs_diff"] == pytest.approx(0.01, rel=1e-3)
    assert r["first_ratio_dev"] == pytest.approx(1 - math.exp(-0.01), rel=1e-3)


def test_refusals_name_the_fix(tmp_path, capsys):
    """What train_sd3.py does not run is refused in one line naming the flag; a missing checkout names the script."""
    with pytest.raises(SystemExit):
        anchor_bench.parse_args(["--model", "tiny", "--", "--sde-window", "fast"])
    assert "flow_grpo's train_sd3.py runs with --sde-window all: change those train.py flags" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="run scripts/fetch_flow_grpo.sh PATH"):
        anchor_bench.load_flow_grpo(str(tmp_path))


@NEEDS_FLOW_GRPO
def test_flow_grpo_rollout_is_sde_py(ours):
    """flow_grpo's pipeline_with_logprob on our pipeline: its log-probs at all 4 steps (its last step is stochastic
    too) equal sde.py's on the same transitions, its prompt embeddings ours, and its step does our step's work."""
    path, b = ours
    r = anchor_bench.main(RUN + ["--check-logprob", "--compare", str(path)] + FLAGS)
    assert r["impl"] == "flow_grpo" and len(r["flow_grpo_commit"]) == 40
    assert r["logprob_steps"] == 4 and r["logprob_max_abs_diff"] <= 1e-6 * r["logprob_scale"]
    assert r["logprob_stored_max_abs_diff"] == r["logprob_max_abs_diff"]  # float32: the states it kept are its inputs
    assert r["mean_max_abs_diff"] <= 1e-6 and r["embeds_max_abs_diff"] == 0 and r["pooled_max_abs_diff"] == 0
    assert calls(r) == calls(b) and r["first_ratio_dev"] < 1e-6


@NEEDS_FLOW_GRPO
def test_flow_grpo_bf16_rollout_scores_rounded_states():
    """In bf16 flow_grpo's rollout steps from the state cast to bf16 (its L171-172) and keeps the float32 one: its
    log-probs are sde.py's at the cast states exactly, differ at the stored ones, and its first update is off
    ratio 1."""
    r = anchor_bench.main(RUN[:4] + ["--steps", "1", "--warmup", "0", "--repeats", "1", "--check-logprob"]
                          + FLAGS[:-1] + ["bf16"])
    assert r["logprob_max_abs_diff"] <= 1e-6 * r["logprob_scale"] < r["logprob_stored_max_abs_diff"]
    assert r["first_ratio_dev"] > 1e-6


def run_script(tmp_path, **env):
    env = dict(os.environ, ALLOW_CPU="1", MODEL="tiny", OUT=str(tmp_path), STEPS="1", WARMUP="1", **env)
    done = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_anchor_phase_skips_without_flow_grpo(tmp_path):
    """Without the fetched code the phase says how to get it, and the summary says there is no anchor."""
    out = run_script(tmp_path, PHASES="anchor", FLOW_GRPO=str(tmp_path / "absent"))
    assert f"anchor: skipped, {tmp_path}/absent/COMMIT missing: run scripts/fetch_flow_grpo.sh PATH" in out
    assert not (tmp_path / "anchor.json").exists()
    text = (tmp_path / "summary.md").read_text()
    assert "anchor: no anchor.json" in text and "resume: not run" in text


@NEEDS_FLOW_GRPO
def test_anchor_phase_on_the_cpu_model(tmp_path):
    """gpu_bench.sh's bench and anchor phases on the tiny model: the anchor compares itself with the bench's JSON, and
    the summary's row of ours over flow_grpo's is that ratio."""
    run_script(tmp_path, PHASES="bench anchor", BENCH_ARGS="--threads 1 " + " ".join(FLAGS))
    with open(tmp_path / "anchor.json") as f:
        a = json.load(f)
    with open(tmp_path / "sd3_bench.json") as f:
        b = json.load(f)
    ratio = b["end_to_end_samples_per_s"] / a["end_to_end_samples_per_s"]
    assert a["vs_ours"]["end_to_end_samples_per_s"] == pytest.approx(ratio) and a["vs_ours"]["tflop_per_step"] == 1
    assert a["logprob_max_abs_diff"] <= 1e-6 * a["logprob_scale"]
    (row,) = [line for line in summary.anchor_table(str(tmp_path)) if line.startswith("| sd3_bench |")]
    assert f"| {ratio:.2f}x |" in row and row in (tmp_path / "summary.md").read_text()


def test_anchor_table(tmp_path):
    """Each bench run beside flow_grpo's: samples/s, MFU and FLOPs over flow_grpo's, and the share of the 2x goal."""
    def write(name, samples_per_s, mfu, tflop=2816.0):
        with open(tmp_path / f"{name}.json", "w") as f:
            json.dump(dict(device="NVIDIA H200", end_to_end_samples_per_s=samples_per_s, rollout_samples_per_s=3.0,
                           train_samples_per_s=1.5, mfu=mfu, tflop_per_step=tflop, flow_grpo_commit="a" * 40,
                           impl="flow_grpo", logprob_max_abs_diff=0.0, logprob_scale=3.0, mean_max_abs_diff=0.0,
                           first_ratio_dev=2e-5), f)
    assert summary.anchor_table(str(tmp_path)) == [
        "anchor: no anchor.json (skipped, cut or failed: see the console and anchor.log)"]
    write("anchor", 0.5, 0.10)
    write("sd3_bench", 1.085, 0.20)
    write("sd3_bench_compile", 1.3, 0.25)
    lines = summary.anchor_table(str(tmp_path))
    assert "goal 2x today's 1.085 samples/s on an H200 = 2.170 samples/s" in lines[0]
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ") and "---" not in line}
    assert "| 1.085 | 2.17x |" in rows["| sd3_bench"] and "| 2.00x | 1.00x | 50 % |" in rows["| sd3_bench"]
    assert "| 1.300 | 2.60x |" in rows["| sd3_bench_compile"] and "| 60 % |" in rows["| sd3_bench_compile"]
    assert "| 0.500 | 1.00x |" in rows["| flow_grpo (anchor)"]
    assert "first-update abs(ratio - 1) 2.00e-05" in lines[-1]
