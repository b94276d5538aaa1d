#!/usr/bin/env bash
# Issue #20's (b) on the demo pair's shapes, at kernel level, on one GPU (the device tool's `run`, carrying .whl; no
# GGUF: dummy SmolLM2 weights and the shipped draft): a cache-hit extend (31 questions of 22 tokens behind 4,110
# cached tokens each), the cache-off extend step (2 x 4,110 fresh) and the cold prefix (1 x 4,132), eager and
# piecewise, top kernels and the host split; then, with TUNE_S > 0, tune_attention.py's cached-prefix extend cases
# (8B heads). Logs and JSON go to $OUT. Budgets in seconds: PROFILE_S, TUNE_S. CASES replaces the cases; SPLITS
# (e.g. "1 4 8") compares the graphed extend attention's split counts (profile_prefill.py --graph-extend-splits;
# each value captures the graphs again: raise PROFILE_S).
# Usage: BLOCKSPEC_COMMIT=<c> scripts/device_prefix_profile.sh   (other work may follow in the same call)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout "${PROFILE_S:-240}" python3 benchmarks/profile_prefill.py --shape smollm2 --top 10 --host-split 5 \
    --cases ${CASES:-31x682+4110 2x8220 1x4132} --graph-extend-splits ${SPLITS:-4} \
    > "$out/profile_prefill_cached.log" 2>&1
code=$?
grep -v -E "INFO (blockspec|httpx)" "$out/profile_prefill_cached.log" | tail -"${TAIL:-70}"
if [ "${TUNE_S:-0}" -gt 0 ]; then
    timeout "$TUNE_S" python3 benchmarks/tune_attention.py --quick --cases "extend bs32 x24" "extend bs16 x48" \
        --out "$out" > "$out/tune_attention_cached.log" 2>&1 || code=$?
    tail -20 "$out/tune_attention_cached.log"
fi
exit $code
