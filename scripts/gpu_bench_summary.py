"""The summary of scripts/gpu_bench.sh: a markdown table of its bench runs, ours against flow_grpo's step (the anchor
phase), and the verdict of its resume check.

    python scripts/gpu_bench_summary.py OUT     # OUT: the folder gpu_bench.sh wrote

The anchor table sets each of our bench runs beside scripts/anchor_bench.py's run of flow_grpo's code with the same
flags on the same device: samples/s, MFU and FLOPs per step (1.00x: the same model work), each as ours over flow_grpo's,
and the share of the goal of GOAL_FACTOR x today's end-to-end samples/s (TODAY, docs/throughput.md), which was
measured on an H200: on another device that column compares devices as well.

A bench run that was cut at its time limit has no JSON: its row then gives what its run folder's metrics.jsonl logged
(steps completed, seconds per step). The resume check compares step 2 of the run stopped after step 1 and resumed with
step 2 of the uninterrupted run: every logged figure that is not a time, and every tensor of the step-2 checkpoint
(trainable weights, EMA, old copy). On a GPU the two can differ by the rounding of kernels that are not deterministic
(atomics in some backward passes); a resume that lost or misplaced state differs by far more. A second uninterrupted
run (`straight_2`) measures that rounding: two runs of the same command on one H200 differ in step 2 by up to 2 % in
the gradient norm, 7 % in the (tiny) reward spread and 4e-3 in the checkpoint's weights, with or without
torch.use_deterministic_algorithms (docs/gpu/), so where it exists each figure and tensor may differ by SPREAD times
its run-to-run difference.
"""
import json
import math
import os
import sys

TOLERANCE = 1e-3  # relative: beyond kernel rounding of one step, short of any lost state (a reset EMA, a fresh Adam)
RUNS = ("sd3_bench", "sd3_bench_compile", "sd3_bench_gc")
COPIES = ("trainable", "ema", "old")
SPREAD = 3  # a resume may differ by up to this many times two uninterrupted runs' difference (one pair measures it)
TODAY = 1.085  # samples/s of sd3_bench on one H200 (docs/throughput.md, "Measured on one H200")
GOAL_FACTOR = 2  # the goal: twice that


def metrics(folder):
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def bench_row(out, name):
    path = os.path.join(out, name + ".json")
    if os.path.isfile(path):
        with open(path) as f:
            r = json.load(f)
        return (f"| {name} | {r['device']} | {r['end_to_end_samples_per_s']:.3f} | {r['rollout_samples_per_s']:.3f} | "
                f"{r['train_samples_per_s']:.3f} | {r['seconds']:.1f} | {r['peak_mem_mib'] / 1024:.1f} | "
                f"{r.get('peak_reserved_mib', math.nan) / 1024:.1f} | {100 * r.get('mfu', math.nan):.1f} % | "
                f"{r.get('first_ratio_dev', math.nan):.2e} | {r['overhead_ratio']:.3f} |")
    steps = [r for r in metrics(os.path.join(out, name)) if "seconds" in r]
    if not steps:
        return f"| {name} | failed, cut or skipped before a step was logged (see {name}.log) |" + " |" * 9
    seconds = ", ".join(f"{r['seconds']:.1f}" for r in steps)
    return f"| {name} | cut: {len(steps)} step(s) logged, seconds {seconds} (see {name}.log) |" + " |" * 9


def load(out, name):
    path = os.path.join(out, name + ".json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def anchor_table(out):
    """Lines of markdown: ours against flow_grpo's step (anchor.json), one row per bench run that wrote its JSON."""
    anchor = load(out, "anchor")
    if anchor is None:
        return ["anchor: no anchor.json (skipped, cut or failed: see the console and anchor.log)"]
    goal = GOAL_FACTOR * TODAY
    commit = anchor["flow_grpo_commit"]
    lines = [f"{f'flow_grpo {commit[:12]}' if commit else 'the ' + anchor['impl'] + ' stand-in'} against ours, same "
             f"flags and device; "
             f"goal {GOAL_FACTOR}x today's {TODAY} samples/s on an H200 = {goal:.3f} samples/s", "",
             "| run | device | end-to-end samples/s | vs flow_grpo | rollout samples/s | update samples/s | MFU "
             "| MFU vs flow_grpo | TFLOP/step vs flow_grpo | of the goal |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def row(name, r):
        mfu = r.get("mfu", math.nan)
        return (f"| {name} | {r['device']} | {r['end_to_end_samples_per_s']:.3f} | "
                f"{r['end_to_end_samples_per_s'] / anchor['end_to_end_samples_per_s']:.2f}x | "
                f"{r['rollout_samples_per_s']:.3f} | {r['train_samples_per_s']:.3f} | {100 * mfu:.1f} % | "
                f"{mfu / anchor.get('mfu', math.nan):.2f}x | {r['tflop_per_step'] / anchor['tflop_per_step']:.2f}x | "
                f"{100 * r['end_to_end_samples_per_s'] / goal:.0f} % |")
    lines.append(row("flow_grpo (anchor)", anchor))
    lines += [row(name, r) for name in RUNS if (r := load(out, name)) is not None]
    if "logprob_max_abs_diff" in anchor:
        lines += ["", f"flow_grpo's rollout log-probs against sde.py's on the same transitions: largest difference "
                      f"{anchor['logprob_max_abs_diff']:.2e} (log-probs up to {anchor['logprob_scale']:.3g}; "
                      f"transition means {anchor['mean_max_abs_diff']:.2e}), at the float32 states its update scores "
                      f"{anchor.get('logprob_stored_max_abs_diff', math.nan):.2e}; its first-update abs(ratio - 1) "
                      f"{anchor['first_ratio_dev']:.2e}"]
    return lines


def differences(a, b):
    """{figure: relative difference} over the figures both rows log that are numbers and not times."""
    out = {}
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if key.startswith("seconds") or "time" in key or isinstance(x, bool) or not isinstance(x, (int, float)) \
                or not isinstance(y, (int, float)):
            continue
        out[key] = 0.0 if x == y else abs(x - y) / max(abs(x), abs(y), 1e-12)
    return out


def tensor_differences(resumed, straight):
    """{copy: relative max-abs difference of its tensors} over the copies the step-2 checkpoints hold."""
    import torch
    from safetensors.torch import load_file
    out = {}
    for copy in COPIES:
        paths = [os.path.join(folder, "checkpoints", "2", copy + ".safetensors") for folder in (resumed, straight)]
        if not all(os.path.isfile(p) for p in paths):
            continue
        a, b = (load_file(p) for p in paths)
        if set(a) != set(b):
            out[copy] = math.inf
            continue
        diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        scale = max(a[k].float().abs().max().item() for k in a)
        out[copy] = diff / max(scale, 1e-12)
    return out


def step_two(folder):
    return {r["step"]: r for r in metrics(folder)}.get(2)


def resume_verdict(out):
    """(verdict line, detail lines) of the resume check."""
    resumed, straight, straight_2 = (os.path.join(out, name) for name in ("resumed", "straight", "straight_2"))
    if not any(os.path.exists(os.path.join(out, name)) for name in ("resumed", "straight", "resumed_1.log")):
        return "resume: not run (no resumed_1.log nor run folders: the phase was left out of PHASES)", []
    rows = {"resumed": step_two(resumed), "straight": step_two(straight)}
    missing = [name for name, row in rows.items() if row is None]
    if missing:
        return (f"resume: FAILED, no step 2 in {' and '.join(missing)} "
                "(see resumed_1.log, resumed_2.log, straight.log)", [])
    figures = differences(rows["resumed"], rows["straight"])
    tensors = tensor_differences(resumed, straight)
    if not tensors:
        return ("resume: FAILED, no step-2 checkpoint to compare", [])
    spread, second = None, step_two(straight_2)  # spread: {figure or copy: difference of two uninterrupted runs}
    if second is not None:
        spread = {**differences(second, rows["straight"]), **tensor_differences(straight_2, straight)}
    found = {**figures, **tensors}
    worst = max(found.values())

    def note(key):
        return "" if spread is None else f" (two uninterrupted runs: {spread.get(key, math.nan):.1e})"

    detail = [f"  step 2 {k}: relative difference {v:.1e}{note(k)}" for k, v in figures.items() if v > 0]
    detail += [f"  checkpoint 2 {k}: relative max difference {v:.1e}{note(k)}" for k, v in tensors.items()]
    beyond = [k for k, v in found.items() if v > TOLERANCE and (spread is None or v > SPREAD * spread.get(k, 0.0))]
    if worst == 0:
        verdict = "resume: identical (step 2's figures and checkpoint equal the uninterrupted run's, bit for bit)"
    elif worst <= TOLERANCE:
        verdict = f"resume: same up to kernel rounding (largest relative difference {worst:.1e} <= {TOLERANCE:g})"
    elif not beyond:
        verdict = (f"resume: same up to the device's run-to-run rounding (largest relative difference {worst:.1e}; "
                   f"each within {SPREAD}x what two uninterrupted runs differ by, up to {max(spread.values()):.1e})")
    else:
        verdict = (f"resume: DIFFERS (largest relative difference {worst:.1e} > {TOLERANCE:g}"
                   + ("" if spread is None else f" and > {SPREAD}x the run-to-run difference")
                   + f": {', '.join(beyond)})")
    return verdict, [f"  copies compared: {', '.join(tensors)}"] + detail


def main(out):
    print("| run | device | end-to-end samples/s | rollout samples/s | update samples/s | s/step | peak allocated GiB "
          "| peak reserved GiB | MFU | first-update abs(ratio - 1) | overhead ratio |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in RUNS:
        print(bench_row(out, name))
    print()
    print("\n".join(anchor_table(out)))
    verdict, detail = resume_verdict(out)
    print()
    print(verdict)
    print("\n".join(detail))
    return verdict


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("error: give the folder scripts/gpu_bench.sh wrote: python scripts/gpu_bench_summary.py bench_out")
    main(sys.argv[1])
