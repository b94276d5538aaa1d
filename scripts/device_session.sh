#!/usr/bin/env bash
# One GPU call for a session's merged work (the device tool's `run`, carrying .whl): the `gpu` and CUDA-capable tests
# (TESTS, within TEST_S seconds; their log is gpu_tests_<commit>.log), then benchmarks/adaptive_verify.py (ADAPT_S
# seconds; its JSON is saved row by row, so a cut-short run keeps what it measured). Output goes to $OUT.
# Usage: BLOCKSPEC_COMMIT=$(git rev-parse --short HEAD) scripts/device_session.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
if [ "${TEST_S:-280}" -gt 0 ]; then
    timeout "${TEST_S:-280}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu/test_warm_start_gpu.py \
        tests/gpu/test_gpu_adaptive.py tests/gpu/test_gpu.py tests/dflash/test_last_layer_tap.py tests/runner/test_piecewise.py \
        tests/scheduler/test_overlap_schedule.py tests/dflash/test_dflash_lossless.py tests/kernels/test_triton_ops.py \
        tests/attention/test_triton_attention.py tests/kernels/test_pdl.py tests/scheduler/test_step_plan.py tests/dflash/test_dflash_oracle.py} 2>&1 \
        | tee "$out/gpu_tests_${BLOCKSPEC_COMMIT}.log" | tail -15
fi
if [ "${ADAPT_S:-200}" -gt 0 ]; then
    timeout "${ADAPT_S:-200}" python3 -m benchmarks.adaptive_verify --out "$out" ${ADAPT_FLAGS:-} \
        > "$out/adaptive_verify.log" 2>&1
    grep -v "^{" "$out/adaptive_verify.log" | tail -40
fi
