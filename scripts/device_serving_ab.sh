#!/usr/bin/env bash
# One GPU call comparing serve-flag variants through benchmarks/serving_vs_engine.py in the same lease (the device
# tool's `run`, carrying .whl): each variant is a set of extra flags for both the engine and the server, run in turn
# with its own --tag, SHAPES / MODES / CONC as in device_serving.sh (Poisson off; PROMPTS prompts, ROUNDS per client:
# 1024 / 16 make a 64-client level last seconds, not the < 1 s that start-up effects dominate); CLIENT_PROCS client
# processes (rows carry the clients' and the server processes' CPU shares); each run is cut at RUN_S seconds. Measured
# on the H200 (2026-12-02): one shape and mode at one level takes ≈ 180 s on a fresh machine (Triton compiles; a cut
# run leaves no row) and ≈ 150 s after it, ≈ 60 s less when its engine phase is reused (the variants share
# --engine-cache: one that changes only server flags reuses the first's). Mind the session's device time left.
# PYSPY_S > 0: the first variant's top level runs again for ~PYSPY_S s under py-spy (serving_vs_engine.py --py-spy-s;
# its summary lands in the log). Output (JSON per variant, an A/B plot of them all, log, profiles) goes to $OUT.
# A variant named parent:NAME runs the tree in PARENT_DIR (an older commit, PARENT_COMMIT: `git archive <commit>
# --prefix=ab_parent/ | tar -x`, carried as an untracked folder) with the same flags: an A/B across commits.
# HOST_S > 0: first benchmarks/host_overhead.py on the device (the engine loop's host time per step split into intake,
# step, publish and flush; --frontends 4, both modes), cut at HOST_S seconds; its JSON lands in $OUT.
# Usage: BLOCKSPEC_COMMIT=$(git rev-parse --short HEAD) VARIANTS="default=;threads16=--host-threads 16;mixed=--enable-mixed-chunk" \
#        scripts/device_serving_ab.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
here=$PWD
out=$(cd "$out" && pwd)
IFS=';' read -ra variants <<< "${VARIANTS:-default=;threads16=--host-threads 16}"
py_spy_s=${PYSPY_S:-0}
if [ "${HOST_S:-0}" -gt 0 ]; then
    PYTHONPATH=/tmp/site:$here timeout "$HOST_S" python3 -m benchmarks.host_overhead --device cuda \
        --frontends 4 --out "$out/host_overhead_$(date +%F)_${BLOCKSPEC_COMMIT}.json" 2>&1 | grep -E "^(dflash|target) " \
        | tee -a "$out/serving_ab.log"
fi
ab_jsons=()
for variant in "${variants[@]}"; do
    name=${variant%%=*}
    flags=${variant#*=}
    tree=$here commit=$BLOCKSPEC_COMMIT
    if [ "${name#parent:}" != "$name" ]; then
        name=parent_${name#parent:} tree=$here/${PARENT_DIR:?a parent: variant needs PARENT_DIR} commit=${PARENT_COMMIT:?}
    fi
    echo "== variant $name ($commit): ${flags:-(no extra flags)}"
    # NOTE: trees from #48 on run the benchmarks as a package (python -m); an older parent runs them by path
    if [ -f "$tree/benchmarks/__init__.py" ]; then bench=(-m benchmarks.serving_vs_engine); else bench=(benchmarks/serving_vs_engine.py); fi
    (cd "$tree" && BLOCKSPEC_COMMIT=$commit PYTHONPATH=/tmp/site:$tree timeout "${RUN_S:-260}" python3 "${bench[@]}" --shapes "${SHAPES:-smollm2}" --modes "${MODES:-dflash}" \
        --concurrency "${CONC:-64}" --poisson-rate 0 --num-prompts "${PROMPTS:-1024}" --max-rounds "${ROUNDS:-16}" \
        --client-procs "${CLIENT_PROCS:-4}" --no-plot --engine-cache /tmp/blockspec-engine-cache --py-spy-s "$py_spy_s" \
        --tag "ab_$name" --out "$out" \
        --extra-flags="--attention-backend triton --enforce-piecewise-cuda-graph $flags") 2>&1 \
        | grep -E "^ +(smollm2|llama8b) |engine [0-9]|took|!!|^process|^  +[0-9. ]+%|self:|inclusive" | tee -a "$out/serving_ab.log"
    py_spy_s=0
    # NOTE: a variant cut at RUN_S stops its server on SIGTERM; one that survived would hold the GPU's memory and fail
    # every variant after it
    if pkill -f -- "-m blockspec[.]serve" 2>/dev/null; then sleep 5; fi
    ab_jsons+=("$out"/serving_vs_engine_*_ab_"$name".json)
done
# NOTE: the variants side by side in run order (a variant cut before its row leaves no JSON: the glob stays literal)
existing=()
for json in "${ab_jsons[@]}"; do [ -f "$json" ] && existing+=("$json"); done
if [ ${#existing[@]} -gt 0 ]; then
    python3 -m benchmarks.plots --serving-ab --out "$out/serving_ab_$(date +%F)_${BLOCKSPEC_COMMIT}.png" "${existing[@]}" \
        || echo "no A/B plot (benchmarks.plots --serving-ab failed)"
fi
