#!/usr/bin/env bash
# flow_grpo's files that scripts/anchor_bench.py runs, copied into third_party/flow_grpo/ (ignored by git: its code is
# fetched, never committed here), with the commit they came from in third_party/flow_grpo/COMMIT.
#
#   scripts/fetch_flow_grpo.sh PATH      # from a flow_grpo checkout (a git work tree, or a bare/mirror git directory)
#   scripts/fetch_flow_grpo.sh           # git clone https://github.com/yifan123/flow_grpo (online), at $FLOW_GRPO_REF
#
# The files: flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py and sd3_sde_with_logprob.py (the rollout and
# the SDE step with its log-prob), flow_grpo/diffusers_patch/train_dreambooth_lora_sd3.py (encode_prompt),
# flow_grpo/stat_tracking.py (the per-prompt advantages), scripts/train_sd3.py (not imported: the training step that
# anchor_bench.py mirrors line by line, kept to check its citations against) and LICENSE.
# Read at commit ac4c86e8cae021841f1fde853d340e0db67690dd; $FLOW_GRPO_REF (default: the checkout's HEAD) picks another.
# The GPU machine gets the folder through the run tool's `carry` (docs/throughput.md, "The anchor").
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-third_party/flow_grpo}
REF=${FLOW_GRPO_REF:-HEAD}
FILES="flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py flow_grpo/diffusers_patch/sd3_sde_with_logprob.py
flow_grpo/diffusers_patch/train_dreambooth_lora_sd3.py flow_grpo/stat_tracking.py scripts/train_sd3.py LICENSE"

src=${1:-}
tmp=""
if [ -z "$src" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    git clone --quiet --filter=blob:none https://github.com/yifan123/flow_grpo "$tmp/flow_grpo" \
        || { echo "error: git clone of flow_grpo failed (offline?): pass a checkout, scripts/fetch_flow_grpo.sh PATH"
             exit 1; }
    src=$tmp/flow_grpo
fi
[ -d "$src" ] || { echo "error: $src is not a folder: pass a flow_grpo checkout, scripts/fetch_flow_grpo.sh PATH"
                   exit 1; }
git -C "$src" rev-parse --git-dir >/dev/null 2>&1 \
    || { echo "error: $src is not a git checkout of flow_grpo (its commit is recorded): git clone it, then pass it"
         exit 1; }
commit=$(git -C "$src" rev-parse --verify --quiet "$REF^{commit}") \
    || { echo "error: $src has no commit $REF: set FLOW_GRPO_REF to one it has"; exit 1; }
rm -rf "$DEST"
mkdir -p "$DEST"
for f in $FILES; do  # read from the commit, not the work tree: what COMMIT names is what is copied
    mkdir -p "$DEST/$(dirname "$f")"
    git -C "$src" show "$commit:$f" > "$DEST/$f" \
        || { echo "error: $f is not in flow_grpo at $commit: pick a commit that has it (FLOW_GRPO_REF)"; exit 1; }
done
echo "$commit" > "$DEST/COMMIT"
echo "flow_grpo $commit -> $DEST/ ($(echo $FILES | wc -w) files)"
