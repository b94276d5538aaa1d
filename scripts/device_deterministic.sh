#!/usr/bin/env bash
# --enable-deterministic-inference on one GPU (#22 part 3), in one command of the device tool's `run` (carrying .whl):
# the bf16 determinism tests (tests/gpu/test_deterministic_gpu.py, and the batch-invariant kernel tests natively), then
# benchmarks/deterministic_cost.py (flag off vs on, same run). Logs and JSON go to $OUT (else ./device-out).
# Budgets in seconds: TEST_S (0 skips the tests), BENCH_S (0 skips the benchmark); BENCH_ARGS passes flags through.
# Usage: BLOCKSPEC_COMMIT=$(git rev-parse --short HEAD) scripts/device_deterministic.sh   (no git there)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
if [ "${TEST_S:-420}" -gt 0 ]; then
    timeout "${TEST_S:-420}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_deterministic_gpu.py \
        tests/deterministic/test_batch_invariant_matmul.py tests/deterministic/test_batch_invariant_attention.py tests/deterministic/test_batch_invariant_rows.py \
        2>&1 | tee "$out/gpu_tests_deterministic_${BLOCKSPEC_COMMIT:-unknown}.log" | tail -8
fi
if [ "${BENCH_S:-0}" -gt 0 ]; then
    # shellcheck disable=SC2086
    timeout "${BENCH_S}" python3 -m benchmarks.deterministic_cost --out "$out" ${BENCH_ARGS:-} 2>&1 \
        | tee "$out/deterministic_cost.log" | grep -E "^(cost|wrote)"
fi
