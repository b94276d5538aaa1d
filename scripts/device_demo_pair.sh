#!/usr/bin/env bash
# The demo pair (SmolLM2-135M-Instruct with real weights + the shipped DFlash draft) on one GPU, for the benchmarks
# that need real weights: greedy_drift.py (#22), prefix_cache.py --shapes demo (#20) and serving_vs_engine.py on
# GSM8K chats (#18's shape (a); CONC levels, both modes, default serve flags; SERVING_S cuts it). The GGUF travels in
# parts (scripts/device_gguf.sh; `scripts/train_draft_v2.sh split` makes them), one per `run`, back to back; calls that only bring a part run `stash` (or any other
# device work, carrying the part along). State (the GGUF, the converted model) stays in .device-state/demo_pair while
# the machine is warm.
#   1. carry .whl + part00            scripts/device_demo_pair.sh stash
#   2. carry part01 (and so on)       scripts/device_demo_pair.sh stash
#   3. carry the last part            BLOCKSPEC_COMMIT=<c> scripts/device_demo_pair.sh drift
#   4. (no carry)   BLOCKSPEC_COMMIT=<c> scripts/device_demo_pair.sh prefix   (or serving)
# DRIFT_FLAGS / PREFIX_FLAGS / SERVING_FLAGS add flags to greedy_drift.py / prefix_cache.py / serving_vs_engine.py;
# SERVING_EXTRA adds serve flags (both sides), TAG a suffix, MODES the modes of the serving stage; DRIFT_S / PREFIX_S /
# SERVING_S cut each run.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 stash|drift|prefix|serving ..." >&2; exit 2; }
source "$(dirname "$0")/device_gguf.sh"
source "$(dirname "$0")/device_env.sh"
state=${STATE:-.device-state/demo_pair}
code=0
model=""
for stage in "$@"; do
    case $stage in
        stash)
            ls -l "$gguf_parts" 2>/dev/null
            continue ;;
        drift|prefix|serving) ;;
        *)
            echo "unknown stage $stage (stash, drift, prefix, serving)" >&2
            exit 2 ;;
    esac
    if [ -z "$model" ]; then
        assemble_gguf "$state" || exit 1
        model=$(python3 -c "from pathlib import Path; from blockspec.smollm2 import ensure_smollm2_dir
print(ensure_smollm2_dir(Path('$state'), gguf_file=Path('$state/$gguf_name')))") || exit 1
    fi
    if [ "$stage" = drift ]; then
        timeout "${DRIFT_S:-250}" python3 -m benchmarks.greedy_drift --model-path "$model" --out "$out" \
            ${DRIFT_FLAGS:-} > "$out/greedy_drift.log" 2>&1 || code=$?
        grep -v -E "INFO (blockspec|httpx)" "$out/greedy_drift.log" | tail -"${TAIL:-25}"
    elif [ "$stage" = serving ]; then
        timeout "${SERVING_S:-560}" python3 -m benchmarks.serving_vs_engine --shapes smollm2 --model-dir "$model" \
            --tokenizer-path "$model" --accept-len 0 --dataset gsm8k --concurrency "${CONC:-1,8,32,64}" \
            --modes "${MODES:-dflash,target}" --num-prompts 1024 --max-rounds 16 --tag "demo_pair${TAG:-}" --out "$out" \
            ${SERVING_FLAGS:-} --extra-flags="--attention-backend triton --enforce-piecewise-cuda-graph ${SERVING_EXTRA:-}" \
            > "$out/serving${TAG:-}.log" 2>&1 || code=$?
        grep -v -E "INFO (blockspec|httpx)" "$out/serving${TAG:-}.log" | tail -"${TAIL:-25}"
    else
        timeout "${PREFIX_S:-560}" python3 -m benchmarks.prefix_cache --shapes demo --demo-model-dir "$model" --out "$out" \
            ${PREFIX_FLAGS:-} > "$out/prefix_cache.log" 2>&1 || code=$?
        grep -v -E "INFO (blockspec|httpx)" "$out/prefix_cache.log" | tail -"${TAIL:-25}"
    fi
done
exit $code
