#!/usr/bin/env bash
# The first run on a GPU, in one command of under 10 minutes on one H200: throughput, memory, MFU and the bf16
# on-policy ratio of the README's anchor recipe, the same step as flow_grpo's own code runs it, and a resume of a
# 2-step run (the EMA and old-copy path) on the GPU. Random SD3.5-medium weights (--model sd3-random): no hub access.
# Its figures on an H200: docs/runs/gpu/.
#
#   scripts/fetch_flow_grpo.sh PATH        # once, for the anchor phase: flow_grpo's files into third_party/flow_grpo/
#   scripts/gpu_bench.sh                   # figures in ./bench_out (or $OUT): *.json, *.log, summary.md
#
# Phases, in this order, each under its own time limit; a phase cut at its limit still reports the steps it logged
# (from its run folder's metrics.jsonl), and the phases after it run:
#   bench   scripts/bench.py @recipes/sd3_bench.args (512 px, 10 steps, CFG 4.5, LoRA r32, bf16) at 2 prompts x 8 samples
#           instead of 8 x 16: a step 8x smaller than the recipe's (14.7 s on an H200, docs/runs/gpu/, where the
#           recipe's takes 150-200 s), so 1 warm-up + 2 measured steps fit BENCH_S with room. Reports samples/s, MFU,
#           the peak allocated and reserved memory, and |ratio - 1| on the first update (bf16 rounding).
#   anchor  scripts/anchor_bench.py with the bench phase's flags: flow_grpo's pipeline_with_logprob, sde_step_with_logprob
#           and loss (third_party/flow_grpo, from scripts/fetch_flow_grpo.sh; skipped without it) on the same pipeline,
#           prompts and batch, timed and counted by bench.py's code: samples/s and MFU beside ours, and its rollout's
#           log-probs against sde.py's on the same transitions. About the bench phase's time: ANCHOR_S.
#   resume  train.py --loss nft with an EMA on sd3-random (the EMA and the old copy live beside the weights on the GPU):
#           a 1-step run that checkpoints, the same run continued with --resume auto --steps 2, and an uninterrupted
#           2-step run; step 2's metrics and checkpoint (weights, EMA, old copy) of the two are compared. A second
#           uninterrupted run (straight_2) measures how far two runs of one command differ on the device (kernels that
#           are not deterministic), the yardstick of that comparison.
#   compile the bench phase with --compile (torch.compile of the transformer; the first step pays the compilation), when
#           at least COMPILE_MIN_S of BUDGET_S are left. Its bare replays run the eager module, so its overhead ratio
#           under 1 is what compiling saves.
#   gc      the bench phase with --gradient-checkpointing, when at least GC_MIN_S of BUDGET_S are left (measured on an
#           H200 already: docs/runs/gpu/; BUDGET_S=800 on a longer lease runs every phase).
#
# Offline machines: wheels of the pinned diffusers, transformers, tokenizers, peft and open_clip_torch (whose CLIP
# vocabulary the random models' tokenizers read) in $WHEELS (default wheels/), and of regex (transformers checks its
# version at import), are installed without their dependencies into a folder on PYTHONPATH when one of them cannot be
# imported; the machine's own huggingface_hub serves if it is 1.31 or newer (the pinned 2.x needs httpx2).
# The interpreter is $PYTHON, else python, else python3. The reward is jpeg_compressibility (about free), so the step
# time is the model's; scripts/bench.py times the reward on its own.
#
# Budget: BUDGET_S=570 keeps the whole script inside one 600 s command (the longest the GPU machine runs one) with 30 s
# to spare. On an H200 the bench phase's train.main took 74 s (3 steps of 15-21 s, the model's loading, the bare
# replays; docs/runs/gpu/sd3_bench.json) and the whole script 325 s with bench, resume (three runs then) and gc. The
# anchor phase runs the same forwards on the same pipeline. BENCH_S and ANCHOR_S (150 each) allow about twice
# train.main's time, RESUME_S (180) the four runs, and the compile phase gets what is left (the first compiled step
# pays the compilation; a run cut there still reports the seconds of the steps it logged); gc runs on a larger budget.
#
# Knobs (environment): BUDGET_S (570: the whole script), BENCH_S (150), ANCHOR_S (150), RESUME_S (180: the four runs
# together), COMPILE_MIN_S (150), GC_MIN_S (150), STEPS (2 measured) and WARMUP (1) of the bench runs, MODEL /
# BENCH_ARGS / RESUME_ARGS (the model and the flags of each phase; the test suite runs the script on the CPU model with
# ALLOW_CPU=1), FLOW_GRPO (third_party/flow_grpo), PHASES (the phases to run: "bench anchor resume compile gc"), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./bench_out}
BUDGET_S=${BUDGET_S:-570}
BENCH_S=${BENCH_S:-150}
ANCHOR_S=${ANCHOR_S:-150}
RESUME_S=${RESUME_S:-180}
COMPILE_MIN_S=${COMPILE_MIN_S:-150}
GC_MIN_S=${GC_MIN_S:-150}
STEPS=${STEPS:-2}
WARMUP=${WARMUP:-1}
MODEL=${MODEL:-sd3-random}
PHASES=" ${PHASES:-bench anchor resume compile gc} "
small="--prompts-per-step 2 --group-size 8 --sample-batch-size 8 --train-batch-size 8"  # 16 samples, not 128
BENCH_ARGS=${BENCH_ARGS:-@recipes/sd3_bench.args -- $small}
small="--resolution 512 --prompts prompts/pickscore_train.txt --num-steps 10 --group-size 4 --prompts-per-step 2"
small+=" --sample-batch-size 4 --train-batch-size 4 --minibatches 1 --lora-rank 32 --lora-alpha 64 --mixed-precision bf16"
RESUME_ARGS=${RESUME_ARGS:-$small}
WHEELS=${WHEELS:-wheels}
FLOW_GRPO=${FLOW_GRPO:-third_party/flow_grpo}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

left() { echo $((BUDGET_S - SECONDS)); }
want() { [[ "$PHASES" == *" $1 "* ]]; }
limit() { local want=$1 l; l=$(left); [ "$l" -lt 1 ] && l=1; [ "$want" -lt "$l" ] && echo "$want" || echo "$l"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null \
    || echo "nvidia-smi not found" > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
if ! "$PYTHON" -c "import diffusers, transformers, peft, importlib.util as u; assert u.find_spec('open_clip')" \
        2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "error: diffusers / transformers / peft / open_clip_torch missing and no wheels in $WHEELS/:" \
             "pip download the pinned ones (requirements.txt) into it on a connected machine"
        exit 1
    fi
    site=$(mktemp -d)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "${ALLOW_CPU:-0}" != 1 ]; then
    "$PYTHON" -c "import torch as t; assert t.cuda.is_available(); print('torch', t.__version__, t.cuda.get_device_name())" \
        || { echo "error: torch sees no CUDA GPU; this script measures GPU figures (CPU: python scripts/bench.py --model tiny)"
             exit 1; }
fi

bench() {  # name, seconds allowed, extra train.py flags...
    local name=$1 seconds=$2
    shift 2
    rm -rf "$OUT/$name" "$OUT/$name.json"
    echo "== $name: $WARMUP warm-up + $STEPS measured steps, at most ${seconds}s"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    timeout --signal=KILL "$seconds" "$PYTHON" scripts/bench.py --model "$MODEL" --steps "$STEPS" --warmup "$WARMUP" \
        --repeats 3 --out "$OUT/$name" --json "$OUT/$name.json" $BENCH_ARGS "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$OUT/$name.log"
    [ "$rc" = 0 ] || echo "$name: failed (exit $rc; 137 = cut at ${seconds}s); see $OUT/$name.log"
}

train() {  # log name, seconds allowed, train.py flags...
    local name=$1 seconds=$2
    shift 2
    echo "== $name: at most ${seconds}s"
    # shellcheck disable=SC2086
    timeout --signal=KILL "$seconds" "$PYTHON" train.py --model "$MODEL" --reward jpeg_compressibility --loss nft \
        --ema-decay 0.9 --ema-every 1 --ema-repeat 1 --save-every 1 --eval-every 0 --log-images-every 0 $RESUME_ARGS \
        "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 5 "$OUT/$name.log"
    [ "$rc" = 0 ] || echo "$name: failed (exit $rc; 137 = cut at ${seconds}s); see $OUT/$name.log"
}

anchor() {  # seconds allowed: flow_grpo's step with the bench phase's flags, against its JSON when there is one
    local seconds=$1 compare=()
    rm -f "$OUT/anchor.json"
    [ -f "$OUT/sd3_bench.json" ] && compare=(--compare "$OUT/sd3_bench.json")
    echo "== anchor: flow_grpo $(cat "$FLOW_GRPO/COMMIT"), $WARMUP warm-up + $STEPS measured steps, at most ${seconds}s"
    # shellcheck disable=SC2086
    timeout --signal=KILL "$seconds" "$PYTHON" scripts/anchor_bench.py --flow-grpo "$FLOW_GRPO" --check-logprob \
        ${compare[@]+"${compare[@]}"} --model "$MODEL" --steps "$STEPS" --warmup "$WARMUP" --repeats 3 \
        --json "$OUT/anchor.json" $BENCH_ARGS > "$OUT/anchor.log" 2>&1
    local rc=$?
    tail -n 20 "$OUT/anchor.log"
    [ "$rc" = 0 ] || echo "anchor: failed (exit $rc; 137 = cut at ${seconds}s); see $OUT/anchor.log"
}

# ---------------------------------------------------------------------------------------------------- bench
want bench && bench sd3_bench "$(limit "$BENCH_S")"

# ---------------------------------------------------------------------------------------------------- anchor
if want anchor && [ -f "$FLOW_GRPO/COMMIT" ]; then
    anchor "$(limit "$ANCHOR_S")"
elif want anchor; then
    rm -f "$OUT/anchor.json"
    echo "anchor: skipped, $FLOW_GRPO/COMMIT missing: run scripts/fetch_flow_grpo.sh PATH (a flow_grpo checkout), and" \
         "on the GPU machine carry third_party/flow_grpo"
fi

# ---------------------------------------------------------------------------------------------------- resume
if want resume; then
    rm -rf "$OUT/resumed" "$OUT/straight" "$OUT/straight_2"
    resume_end=$((SECONDS + $(limit "$RESUME_S")))
    train resumed_1 $(((resume_end - SECONDS) / 4)) --out "$OUT/resumed" --steps 1  # stops after step 1's checkpoint
    train resumed_2 $(((resume_end - SECONDS) / 3)) --out "$OUT/resumed" --steps 2 --resume auto
    train straight $(((resume_end - SECONDS) / 2)) --out "$OUT/straight" --steps 2
    train straight_2 $((resume_end - SECONDS)) --out "$OUT/straight_2" --steps 2
fi

# ---------------------------------------------------------------------------------------------------- compile
if want compile && [ "$(left)" -ge "$COMPILE_MIN_S" ]; then
    bench sd3_bench_compile "$(limit $(($(left) - 20)))" --compile
elif want compile; then
    echo "sd3_bench_compile: skipped, $(left)s left of BUDGET_S=${BUDGET_S} (COMPILE_MIN_S=${COMPILE_MIN_S})"
fi

# ---------------------------------------------------------------------------------------------------- gc
if want gc && [ "$(left)" -ge "$GC_MIN_S" ]; then
    bench sd3_bench_gc "$(limit $(($(left) - 20)))" --gradient-checkpointing
elif want gc; then
    echo "sd3_bench_gc: skipped, $(left)s left of BUDGET_S=${BUDGET_S} (GC_MIN_S=${GC_MIN_S})"
fi

"$PYTHON" scripts/gpu_bench_summary.py "$OUT" | tee "$OUT/summary.md"
echo "wrote $OUT/ in ${SECONDS}s"
