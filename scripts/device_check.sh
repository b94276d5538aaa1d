#!/usr/bin/env bash
# One GPU session in one command (the device tool's `run`, carrying .whl): installs the carried wheels, runs the
# `gpu` tests and the Triton kernel tests (which run on CUDA when it is there), then the step-latency benchmark (Triton vs FlashInfer, z-lab reference) and the prefill
# benchmark. Logs and JSON go to $OUT (else ./device-out). Budgets in seconds: TEST_S, STEP_S, PREFILL_S.
# Usage: BLOCKSPEC_COMMIT=$(git rev-parse --short HEAD) scripts/device_check.sh   (pass the commit: no git there)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py tests/gpu/test_gpu_adaptive.py tests/attention/test_flashinfer.py \
    tests/attention/test_triton_attention.py tests/kernels/test_triton_ops.py tests/runner/test_piecewise.py 2>&1 | tee "$out/gpu_tests.log" | tail -8
timeout "${STEP_S:-300}" python3 -m benchmarks.step_latency --backends triton flashinfer --repeat 10 --out "$out" \
    > "$out/step_latency.log" 2>&1
grep -v '^{' "$out/step_latency.log" | tail -40
if [ "${PREFILL_S:-0}" -gt 0 ]; then
    timeout "$PREFILL_S" python3 -m benchmarks.prefill_latency --out "$out" > "$out/prefill_latency.log" 2>&1
    tail -20 "$out/prefill_latency.log"
fi
