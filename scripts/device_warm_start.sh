#!/usr/bin/env bash
# Warm start on one GPU (issue 25), in one command of the device tool's `run` (carrying .whl if there are wheels):
# `blockspec serve` (dummy weights, DFlash, piecewise graphs) on Llama-3.1-8B shapes and on the demo pair's shapes
# (SmolLM2-135M + its draft), each started with Triton's on-disk cache cold (an empty TRITON_CACHE_DIR of its own)
# and then warm (the same directory again); the warm 8B server also serves a varied load, after which Triton's
# compiles since /health must be 0. Then the `gpu` warm-start tests and a table. Budgets in seconds (all together
# about 6 minutes; a cold 8B start took 81 s at ddd1de9): COLD_8B_S, WARM_8B_S, COLD_DEMO_S, WARM_DEMO_S, TEST_S (0 skips the gpu test). Logs and JSON go to $OUT (else
# ./device-out). Usage: scripts/device_warm_start.sh
set -uo pipefail
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
status=0

# run SHAPE TAG BUDGET [flags of warm_start.py]: one server start-up (+ load unless --no-load) within BUDGET seconds.
# NOTE: the script's own start-up deadline comes first, so it stops its server itself (a server outlives a kill).
run() {
    local shape=$1 tag=$2 budget=$3
    shift 3
    timeout "$budget" python3 -m benchmarks.warm_start --shape "$shape" --tag "$tag" --out "$out" \
        --startup-timeout $((budget * 3 / 4)) "$@" > "$out/warm_start_${shape}_${tag}.log" 2>&1 || status=1
    tail -1 "$out/warm_start_${shape}_${tag}.log" | cut -c1-400
}

for shape in llama8b smollm2; do
    TRITON_CACHE_DIR=$(mktemp -d "/tmp/triton-cache-$shape-XXXXXX")
    export TRITON_CACHE_DIR
    if [ "$shape" = llama8b ]; then
        run llama8b cold "${COLD_8B_S:-150}" --no-load
        run llama8b warm "${WARM_8B_S:-120}"
    else
        run smollm2 cold "${COLD_DEMO_S:-35}" --no-load
        run smollm2 warm "${WARM_DEMO_S:-20}" --no-load
    fi
done
grep -h "compiled after start-up" "$out"/warm_start_*/server_*.log | head -20
if [ "${TEST_S:-50}" -gt 0 ]; then  # NOTE: TEST_S=0 skips the gpu test (run with the others)
    timeout "$TEST_S" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_warm_start_gpu.py 2>&1 \
        | tee "$out/warm_start_gpu_tests.log" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
python3 -m benchmarks.warm_start --table "$out"/warm_start_llama8b_cold.json "$out"/warm_start_llama8b_warm.json \
    "$out"/warm_start_smollm2_cold.json "$out"/warm_start_smollm2_warm.json
exit $status
