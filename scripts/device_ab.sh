#!/usr/bin/env bash
# One GPU call (the device tool's `run`, carrying .whl and the parent tree): the `gpu` and Triton tests of this tree,
# then a same-run A/B of benchmarks/step_latency.py (bs 1 and 32, ctx 512, Triton, graphs on) between this tree and
# PARENT_DIR (an older tree: `git archive <commit> --prefix=ab_parent/ | tar -x`), alternating ROUNDS times.
# Logs and JSON go to $OUT (else ./device-out). Budgets in seconds: TEST_S (0 skips the tests), STEP_S per run.
# Usage: BLOCKSPEC_COMMIT=<this> PARENT_COMMIT=<parent> PARENT_DIR=ab_parent scripts/device_ab.sh
# Then, here: python -m benchmarks.step_latency --ab-summary <out>/step_latency_<date>_ab_*.json
set -uo pipefail
out=${OUT:-device-out}
mkdir -p "$out"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH
here=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TEST_S:-300}" -gt 0 ]; then
    PYTHONPATH=/tmp/site:$here timeout "${TEST_S:-300}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py \
        tests/kernels/test_triton_ops.py tests/runner/test_piecewise.py tests/attention/test_triton_attention.py tests/scheduler/test_overlap_schedule.py \
        tests/dflash/test_dflash_oracle.py tests/dflash/test_dflash_lossless.py tests/kernels/test_pdl.py tests/scheduler/test_step_plan.py \
        tests/attention/test_flashinfer.py 2>&1 | tee "$out/gpu_tests_${BLOCKSPEC_COMMIT}.log" | tail -6
fi
for round in $(seq "${ROUNDS:-1}"); do
    for side in new parent; do
        if [ "$side" = new ]; then dir=$here commit=$BLOCKSPEC_COMMIT; else dir=$here/$PARENT_DIR commit=$PARENT_COMMIT; fi
        # NOTE: trees from #48 on run the benchmarks as a package (python -m); an older parent runs them by path
        if [ -f "$dir/benchmarks/__init__.py" ]; then bench=(-m benchmarks.step_latency); else bench=(benchmarks/step_latency.py); fi
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir BLOCKSPEC_COMMIT=$commit timeout "${STEP_S:-200}" python3 \
            "${bench[@]}" --batch-sizes 1 32 --contexts 512 --graphs-only --skip-reference --repeat 15 \
            --tag "ab_${side}_${commit}_r${round}${ROUND_TAG:-}" --out "$out") > "$out/step.log" 2>&1
        echo "== $side $commit round $round"; grep -E "^ *triton|TB/s" "$out/step.log"
    done
done
rm -f "$out/step.log"
