#!/usr/bin/env bash
# Issue #24 (a better shipped draft) on one H200: benchmarks/draft_v2.py's stages, one device `run` each (each well
# under the 10-minute limit), sharing .device-state/draft_v2 (git-ignored: it stays on the warm machine between
# calls). The SmolLM2 GGUF (98 MB) cannot travel in one call (64 MiB per call with the working tree), so it goes in
# parts sized to the tree (scripts/device_gguf.sh), one per call; every call but the last only leaves its part there.
#
# Here, once per tree size:  PYTHON=.venv/bin/python scripts/train_draft_v2.sh split   -> .carry/gsm8k/train.jsonl
#   (from GSM8K_DIR, ../shared/data/gsm8k) and .carry/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.partNN; it prints each
#   call's carry (47 MB of tree: 6 parts).
# Device, one `run` each, in this order and back to back (an idle machine is given back after 30 s):
#   a. carry .whl + part00                       scripts/train_draft_v2.sh stash
#   b. carry .carry/gsm8k/train.jsonl + part01   scripts/train_draft_v2.sh stash
#   c. carry part02 .. the part before the last, one a call, each   scripts/train_draft_v2.sh stash
#   d. carry the last part                       BLOCKSPEC_COMMIT=<c> scripts/train_draft_v2.sh data
#   e. (no carry)   BLOCKSPEC_COMMIT=<c> scripts/train_draft_v2.sh train    (RUN, LAYERS, TRAIN_MIN, MIX_RATIO, EXTRA)
#   f. (no carry)   BLOCKSPEC_COMMIT=<c> scripts/train_draft_v2.sh bench    (RUN: the run to serve; default the best)
# A carry names single files, never .carry/smollm2 itself: a carried folder replaces the one on the machine.
# V2_FLAGS adds draft_v2.py flags to every stage: V2_FLAGS="--smoke --device cpu" runs the whole chain on a CPU.
# GENERAL=benchmarks/data/draft_v2_general gives the data stage the committed generated prompts (no Magpie: ≈ 210 s
#   less); unset, the data stage generates them.
# Results go to $OUT: data (generation_info.json, general_heldout.jsonl, log), train (training_info_<run>.json, the
# draft as draft_v2_<run>.tar.part*, result JSON + PNG, log), bench (draft_v2_<date>_<commit>.json + PNG, log).
set -uo pipefail
stage=${1:?usage: $0 split|stash|data|train|bench}
source "$(dirname "$0")/device_gguf.sh"
name=$gguf_name
parts=$gguf_parts
state=${STATE:-.device-state/draft_v2}
if [ "$stage" = split ]; then
    source_gguf=$("${PYTHON:-python3}" -c 'from blockspec.smollm2 import smollm2_gguf_path; print(smollm2_gguf_path())') || exit 1
    mkdir -p .carry/gsm8k
    cp "${GSM8K_DIR:-../shared/data/gsm8k}/train.jsonl" .carry/gsm8k/train.jsonl
    split_gguf "$source_gguf" || exit 1
    exit 0
fi
source "$(dirname "$0")/device_env.sh"
mkdir -p "$state"
case $stage in
    stash)
        ls -l "$parts" .carry/gsm8k 2>/dev/null
        exit 0 ;;
    data)
        assemble_gguf "$state" || exit 1
        timeout "${DATA_S:-570}" python3 benchmarks/draft_v2.py data --state "$state" --out "$out" --gguf "$state/$name" \
            --gsm8k-train .carry/gsm8k/train.jsonl ${GENERAL:+--general-prompts "$GENERAL"} ${V2_FLAGS:-} \
            > "$out/draft_v2_data.log" 2>&1
        code=$?
        [ $code -eq 124 ] && echo "data stage cut at ${DATA_S:-570} s: the train stage generates the responses left"
        ;;
    train)
        timeout "${TRAIN_S:-590}" python3 benchmarks/draft_v2.py train --state "$state" --out "$out" --gguf "$state/$name" \
            --run "${RUN:-v2}" --num-layers "${LAYERS:-5}" --train-minutes "${TRAIN_MIN:-6.5}" --deadline-s "${DEADLINE_S:-540}" \
            --mix-ratio "${MIX_RATIO:-0.3}" --extra-train-flags "${EXTRA:-}" ${V2_FLAGS:-} > "$out/draft_v2_train_${RUN:-v2}.log" 2>&1
        code=$? ;;
    bench)
        timeout "${BENCH_S:-400}" python3 benchmarks/draft_v2.py bench --state "$state" --out "$out" --gguf "$state/$name" \
            --run "${RUN:-}" ${V2_FLAGS:-} > "$out/draft_v2_bench.log" 2>&1
        code=$? ;;
    *)
        echo "unknown stage $stage (split, stash, data, train, bench)" >&2
        exit 2 ;;
esac
grep -v -E "INFO (httpx|blockspec\.(runner|startup|engine|speculative))" "$out"/draft_v2_*.log | tail -"${TAIL:-40}"
exit $code
