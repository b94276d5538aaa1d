#!/usr/bin/env bash
# Warm start on one GPU (issue 25), in one command of the device tool's `run` (carrying .whl if there are wheels):
# `blockspec serve` on Llama-3.1-8B shapes (dummy weights, DFlash, piecewise graphs) started with Triton's on-disk
# cache cold (an empty TRITON_CACHE_DIR: start-up alone) and then warm (the same directory again: start-up, then a
# varied load; Triton compiles after /health must stay 0), then the `gpu` warm-start tests, then a table.
# Budgets in seconds (total under 4 minutes): COLD_S, WARM_S, TEST_S. Logs and JSON go to $OUT (else ./device-out).
# Usage: scripts/device_warm_start.sh
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
TRITON_CACHE_DIR=$(mktemp -d /tmp/triton-cache-XXXXXX)
export TRITON_CACHE_DIR
cold_s=${COLD_S:-100} warm_s=${WARM_S:-70} status=0
# NOTE: the script's own start-up deadline comes first, so it stops its server itself (a server outlives a kill)
timeout "$cold_s" python3 benchmarks/warm_start.py --tag cold --no-load --out "$out" \
    --startup-timeout $((cold_s - 15)) > "$out/warm_start_cold.log" 2>&1 || status=1
tail -1 "$out/warm_start_cold.log"
timeout "$warm_s" python3 benchmarks/warm_start.py --tag warm --out "$out" \
    --startup-timeout $((warm_s / 2)) > "$out/warm_start_warm.log" 2>&1 || status=1
tail -1 "$out/warm_start_warm.log"
grep -h "start-up\|compiled after start-up" "$out"/warm_start_llama8b/server_*.log | tail -12
timeout "${TEST_S:-60}" python3 -m pytest -q -p no:cacheprovider tests/test_warm_start_gpu.py 2>&1 \
    | tee "$out/warm_start_gpu_tests.log" | tail -8
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 benchmarks/warm_start.py --table "$out"/warm_start_llama8b_cold.json "$out"/warm_start_llama8b_warm.json
exit $status
