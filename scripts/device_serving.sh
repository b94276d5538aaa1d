#!/usr/bin/env bash
# One GPU call for serving work (the device tool's `run`, carrying .whl): installs the carried wheels (py-spy among
# them), optionally runs the `gpu` tests (TEST_S > 0), then benchmarks/serving_vs_engine.py with SHAPES, MODES, CONC,
# PYSPY_S (seconds of py-spy over the top level, 0 = none), TAG and EXTRA (more serve flags). JSON, PNG, logs and
# profiles go to $OUT (else ./device-out).
# Usage: BLOCKSPEC_COMMIT=$(git rev-parse --short HEAD) SHAPES=smollm2 PYSPY_S=5 scripts/device_serving.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
if [ "${TEST_S:-0}" -gt 0 ]; then
    timeout "$TEST_S" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu/test_gpu.py tests/kernels/test_triton_ops.py \
        tests/runner/test_piecewise.py tests/attention/test_triton_attention.py tests/scheduler/test_overlap_schedule.py tests/kernels/test_pdl.py \
        tests/dflash/test_dflash_oracle.py tests/dflash/test_dflash_lossless.py tests/scheduler/test_step_plan.py tests/dflash/test_last_layer_tap.py} 2>&1 \
        | tee "$out/gpu_tests_${BLOCKSPEC_COMMIT}.log" | tail -6
fi
timeout "${SERVE_S:-480}" python3 -m benchmarks.serving_vs_engine --shapes "${SHAPES:-smollm2,llama8b}" \
    --modes "${MODES:-dflash,target}" --concurrency "${CONC:-1,8,64}" --max-rounds "${ROUNDS:-8}" \
    --py-spy-s "${PYSPY_S:-0}" --tag "${TAG:-}" --out "$out" \
    --extra-flags="--attention-backend triton --enforce-piecewise-cuda-graph ${EXTRA:-}" 2>&1 | tail -"${TAIL:-60}"
