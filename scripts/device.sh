#!/usr/bin/env bash
# The one entry point for GPU work (the device tool's `run` executes it there; the carrying details live in
# scripts/device_lib.sh). Several commands may follow each other in one call: `scripts/device.sh stash gpu-test`.
#
# Here (this machine):
#   wheels            the pinned wheel set the GPU machine lacks, into .whl (git-ignored; ≈ 33 MB)
#   slim on|off|status  keep the shipped draft and the draft-training prompts out of what travels (commits refused)
#   parent REV        the package and benchmark scripts of commit REV in .ab/parent, for `ab` there (carry .ab)
#   plan              wheels + slim + the SmolLM2 GGUF in parts, then prints the calls of a full GPU session: the
#                     whole GPU suite in the first call (GPU_SHARDS, default 1: a shard per call), the GGUF parts
#                     beside it and in the next calls, the seed check in the last (device time: ≈ 4 start + 9 + 1 + 4)
# There (the GPU machine; BLOCKSPEC_COMMIT=<short hash> names the results, the copy there has no git history):
#   gpu-test [K/N]    every test marked gpu or cuda (`pytest -m "gpu or cuda" tests`, TEST_S seconds, default 520,
#                     GPU_WORKERS pytest-xdist processes on the one GPU, default 8: one process took 15.5 min on the
#                     H100, three 476 s, four 390 s (H100) and 282 s (H200) in session 37, eight 142 s (H100) in
#                     session 38), or the K-th of N
#                     shards of it (scripts/gpu_shard.py);
#                     the log is $OUT/gpu_suite_<date>_<commit>[_shardKofN].log (commit it to benchmarks/results/)
#   stash             keeps the GGUF parts this call carried on the warm machine (.device-state/demo)
#   seed              the seed's serve command on the demo pair, FlashInfer and Triton (benchmarks/seed_gpu.py;
#                     needs every GGUF part stashed and blockspec/assets/smollm2-135m-dflash-b16 carried)
#   bench MODULE ARGS python3 -m benchmarks.MODULE ARGS --out $OUT (the rest of the line is its arguments; an
#                     argument DEMO_DIR becomes the demo target converted from the stashed GGUF parts)
#   ab ROUNDS ARGS    a same-run A/B of benchmarks/step_latency.py ARGS: the carried parent, then this tree, ROUNDS
#                     times, then its --ab-summary (e.g. `ab 2 --batch-sizes 1 32 --contexts 512 --graphs-only
#                     --skip-reference`; #48's check against the commit before the house change)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_lib.sh
state=.device-state/demo
commit=${BLOCKSPEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
status=0

plan() {
    local source parts index carry
    download_wheels > /dev/null || return 1
    slim on > /dev/null
    source=$(python3 -c 'from blockspec.models.smollm2 import smollm2_gguf_path; print(smollm2_gguf_path())') || return 1
    parts=$(split_gguf "$source" "$(du -cb .whl | tail -1 | cut -f1)") || return 1
    echo "tree $(( $(tree_bytes) / 1048576 )) MiB (slim), .whl $(du -sh .whl | cut -f1), GGUF in $parts parts; calls:"
    local shards=${GPU_SHARDS:-1} calls head what
    head=$(git rev-parse --short HEAD)
    calls=$(( parts > shards ? parts : shards ))
    for (( index = 0; index < calls; index++ )); do
        carry=$( [ "$index" -eq 0 ] && echo -n ".whl, " )
        what=""
        if [ "$index" -lt "$parts" ]; then
            carry+=$(printf '%s/part%02d' "$gguf_parts" "$index")
            what="stash"
        fi
        if [ "$shards" -eq 1 ]; then
            [ "$index" -eq 0 ] && what="$what gpu-test"
        elif [ "$index" -lt "$shards" ]; then
            what="$what gpu-test $(( index + 1 ))/$shards"
        fi
        echo "  carry [${carry%, }]: BLOCKSPEC_COMMIT=$head scripts/device.sh ${what# }"
    done
    echo "  carry [${slim_paths[0]}]: BLOCKSPEC_COMMIT=$head scripts/device.sh seed"
    echo "then the issues' measurements on the warm machine, one call each, in this order (what each resolves;" \
         "benchmarks/<module>.py says more):"
    echo "  #50's DFlash2 demo draft (scripts/train_draft_v2.sh; v6's chain, 1ce39de, in docs/performance.md), the" \
         "whole session with the suite, as session 40 ran it (23cf764: the chain ran out of the H100's memory, the" \
         "feature cache is bounded since): here \`scripts/train_draft_v2.sh split\` with slim on; run: carry [.whl," \
         "part00] \`scripts/train_draft_v2.sh stash && scripts/device.sh gpu-test\` (the chain's clock starts here;" \
         "leave gpu-test out only when a whole suite already ran on the head's blockspec/ (the last: cf06cd8," \
         "575 passed): it takes about 230 s of the training's" \
         "budget);" \
         "carry [.carry/gsm8k/train.jsonl, .carry/draft_v2/responses.tar.xz if there is one, part01] stash (a" \
         "fresh checkout has none: .carry is not committed, and 23cf764's 53,986 answers went with session 41's" \
         "checkout; the data stage then generates them, 50,986 in 130 s at 1ce39de, and hands back" \
         "responses.tar.xz: keep it in .carry/draft_v2 for the next chain); carry each middle part in its own" \
         "stash call; slim stays on (the whole tree is 68 MiB, over a call's 64): run with carry [the last part," \
         "${slim_paths[1]}] (the data stage reads the committed prompts): DATA_S=420" \
         "GENERAL=benchmarks/data/draft_v2_general MIX_RATIO=all" \
         "WORDING_OFFSET=3 MORE_MATH=3000 MORE_SEED=6 scripts/train_draft_v2.sh data (433 s at 23cf764; the" \
         "committed prompts already hold v6's 3,000 math turns of seed 5, so seed 6 asks for new ones: seeds" \
         "0-6 and 101-104 are then used);" \
         "RUN=dflash2 MIX_RATIO=all CHAIN_BUDGET_S=<budget left at the first call - 70> CHAIN_RESERVE_S=430 (the" \
         "bench with its 420 s timeout on an H100, whose slower host serves the demo pair slower; 300 on an H200:" \
         "the bench took 228 s at 1ce39de; more only when the #51 calls below must follow)" \
         "EXTRA=\"--draft-arch dflash2 --selector-rank 120 --init-from blockspec/assets/smollm2-135m-dflash-b16" \
         "--compile-draft --lr 3e-4\" scripts/train_draft_v2.sh train-start with carry [${slim_paths[0]}] (the" \
         "draft it grows from); two train-wait calls; then, with carry [${slim_paths[0]}] again," \
         "scripts/device.sh bench dflash2 --part heldout --state .device-state/draft_v2 --heldout-draft" \
         "v6=blockspec/assets/smollm2-135m-dflash-b16 dflash2=.device-state/draft_v2/runs/dflash2 (the held-out" \
         "sets and the 1-client speed-up, v6 beside it; timeout 420). The chain needs about 1,300 s from its first" \
         "call: the stashes and a cold start about 120, data 250-430 (H200 / a slow H100 host), the bench about 230" \
         "(228 at 1ce39de), and the training 420 or more (v6 was 8.1 min); with less left after failed starts, send" \
         "the optional cycle re-read instead (\`scripts/device.sh bench dflash2 --part cycle\`, 78 s at e4d342f;" \
         "9058073 read 1.03 / 1.07 / 1.05 at bs 1 / 16 / 64). Session 49 (8c3d65f, H100): data 60 s (every answer" \
         "restored); a foreground train of 6.6 min (TRAIN_MIN=6.9 DEADLINE_S=505 TRAIN_S=575, with" \
         "--feature-cache-device-gib 40) ran 1,594 steps, one epoch, and read GSM8K 4.59, general 3.34, long" \
         "3.19; the bench read the 1-client speed-up 3.41x against v6's 3.55x, so v6 stays shipped" \
         "(docs/performance.md). train-start copies its --init-from draft into the state since (a background" \
         "run lost the carried one to the next call's tree). Next chain (the trainer traces without duck sizing" \
         "since 8c3d65f's run, so gpu-test goes in call 1): continue that draft, kept in" \
         ".carry/dflash2_8c3d65f/draft_v2_dflash2 (git-ignored files stay on the warm machine between calls): after" \
         "the part02 stash," \
         "one call carrying its config.json, model.safetensors.index.json, training_info.json and shards 1-3" \
         "(\`ls .carry/dflash2_8c3d65f/draft_v2_dflash2\`), one carrying shards 4-6; then the data call; then a" \
         "foreground RUN=dflash2 MIX_RATIO=all TRAIN_MIN=<6.9 or more> DEADLINE_S=505 TRAIN_S=575" \
         "EXTRA=\"--draft-arch dflash2 --init-from .carry/dflash2_8c3d65f/draft_v2_dflash2 --compile-draft --lr 3e-4" \
         "--feature-cache-device-gib 40 (H100; none on an H200)\" scripts/train_draft_v2.sh train; then the bench" \
         "as above. Goals: GSM8K >= 4.6, general >= 3.5, 1-client speed-up >= 3.5x (8c3d65f: 4.59 / 3.34 / 3.41x)"
    echo "  BLOCKSPEC_COMMIT=$head scripts/device.sh bench moe --parts layer kernels router --batch-sizes 1 8 32" \
         "64 (#51: the layer against its floor, each kernel's device us per layer, and the router alone at each" \
         "launch shape (2 experts x 1 warp, the default since 5a596b7, was the fastest at 1, 8 and 16 tokens)," \
         "about 60 s, only when the MoE layer changed; c3885e2 read every row <= 1.5x: decode bs 1 1.48x, verify" \
         "bs 64 1.46x (1.47-1.52x across runs of the same kernels), every other row <= 1.22x;" \
         "--router-tokens 0 --tag unfused for the router unfused); the tile sweep" \
         "(BLOCKSPEC_COMMIT=$head scripts/device.sh bench moe --parts tiles --batch-sizes 1 --tile-grid small --tag" \
         "tiles) only when the tiles changed: at 83b4158 down + combine (1.29x) beat prefetch_down (1.53x) and the" \
         "fold (2.49x)"
    echo "  BLOCKSPEC_COMMIT=$head scripts/device.sh bench moe --parts serving (#51: DFlash ÷ target-only served at" \
         "1 and 64 clients, accept length 6, Qwen3-30B-A3B dummy weights, 269 s at c3885e2: 3.50x / 2.13x; only" \
         "when the MoE or serving path changed)"
    echo "checks of closed issues' rows, only when their code changed since the commit named:"
    echo "  carry [${slim_paths[0]}]: BLOCKSPEC_COMMIT=$head scripts/device.sh bench serving_vs_engine --shapes" \
         "smollm2 --model-dir DEMO_DIR --accept-len 0 --dataset gsm8k --num-prompts 1319 --max-rounds 24" \
         "--concurrency 1,64 --poisson-rate 0 --budget-s 330 --tag demo_pair (needs the stashes; about 260 s), then" \
         "the 8B rows: --shapes llama8b --prompt-len 128 --max-new-tokens 128 --num-prompts 512 --max-rounds 8" \
         "--concurrency 1,64 --budget-s 250 --tag llama8b_128 (about 430 s) and --prompt-len 1024 --max-new-tokens" \
         "256 --num-prompts 256 --max-rounds 4 --budget-s 330 --tag llama8b_1024 (about 540 s) (#49's server ÷" \
         "engine at 64 clients, only when the engine loop, scheduler or HTTP path changed since cf06cd8: 6ece024" \
         "read 0.91-1.00 in every row; the demo target's chat row moves about 0.03 from call to call)"
    echo "  carry [${slim_paths[0]}]: BLOCKSPEC_COMMIT=$head scripts/device.sh bench tree_serving" \
         "--target DEMO_DIR --draft ${slim_paths[0]} --shape smollm2-135m/demo-draft --budgets 32 48" \
         "(#52's serving check: the demo pair through blockspec serve at 1 client, adaptive as served, about 130 s" \
         "a budget; --tag forced --extra-flags '--speculative-adaptive-verify off' for a tree every cycle; c417e43" \
         "read B = 48 1.27x GSM8K / 1.26x code as served, B = 32 forced 1.24x / 1.31x)"
    echo "  carry [${slim_paths[0]}]: BLOCKSPEC_COMMIT=$head scripts/device.sh bench cycle_profile" \
         "--target DEMO_DIR --draft ${slim_paths[0]} --shape smollm2-135m/demo-draft --budgets 16 32 64" \
         "(#52: the kernels a tree cycle adds over the chain's on the demo pair at batch 1, each one's device µs;" \
         "a12b99c read +171 / 226 / 361 µs at B = 16 / 32 / 64, 85f733e's tree mask load took 22 µs off each)"
    echo "  BLOCKSPEC_COMMIT=$head scripts/device.sh bench verify_attention (#52: the chain's and a tree's verify" \
         "attention at batch 1 by split count and tiles over contexts 128..4096, the served variant marked; about two" \
         "minutes)"
    echo "  BLOCKSPEC_COMMIT=$head scripts/device.sh bench tree_build (#52: the fused top-B and tree build against" \
         "the torch forms, about a minute)"
    echo "  BLOCKSPEC_COMMIT=$head scripts/device.sh bench tree_verify --dummy-shape llama8b --adaptive" \
         "--chain-adaptive --budgets 16 32 --batch-sizes 1 4 16 64 (#52: adaptive never below 0.97 of the chain)"
    echo "then here: scripts/device.sh slim off"
}

gpu_test() {
    # $1: "" (the whole suite) or K/N (one shard: scripts/gpu_shard.py). NOTE: the log is verbose (one line a test),
    # so a call cut off at its limit still names every test that ran and how it ended.
    local shard=${1:-} log name=gpu_suite_$(date +%F)_${commit} targets=(tests)
    if [ -n "$shard" ]; then
        mapfile -t targets < <(python3 scripts/gpu_shard.py "$shard") || { status=1; return; }
        name="${name}_shard${shard%/*}of${shard#*/}"
    fi
    log="$out/$name.log"
    # NOTE: GPU_WORKERS pytest-xdist processes share the one GPU, a test file each at a time (--dist loadfile keeps a
    # file's module fixtures, the trained tiny drafts, in one process). They can share it because every test engine
    # sizes its KV pool by max_total_tokens: one sized by --mem-fraction-static would take most of the card and the
    # next worker's engine would fail with "leaves no memory for the KV cache".
    local workers=${GPU_WORKERS:-8} parallel=()
    if [ "$workers" -gt 1 ]; then
        if python3 -c "import xdist" 2> /dev/null; then
            parallel=(-n "$workers" --dist loadfile)
        else
            echo "pytest-xdist is missing: the suite runs in one process" | tee "$log.note"
        fi
    fi
    timeout "${TEST_S:-520}" python3 -m pytest -v -p no:cacheprovider -m "gpu or cuda" -rfEs --durations=25 \
        "${parallel[@]}" "${targets[@]}" > "$log" 2>&1
    local rc=$?
    [ "$rc" -eq 124 ] && echo "TIMED OUT after ${TEST_S:-520} s: the log names the tests that ran" | tee -a "$log"
    grep -E "^(\[gw[0-9]+\] )?(FAILED|ERROR) " "$log" | head -40
    tail -"${TAIL:-25}" "$log"
    [ "$rc" -eq 0 ] || status=1
}

demo_dir() {
    # The demo target converted from the stashed GGUF parts (once per warm machine); prints its directory.
    assemble_gguf "$state" >&2 || return 1
    python3 -c "from pathlib import Path; from blockspec.models.smollm2 import ensure_smollm2_dir
print(ensure_smollm2_dir(Path('$state'), gguf_file=Path('$state/$gguf_name')))"
}

seed() {
    local model
    [ -f blockspec/assets/smollm2-135m-dflash-b16/config.json ] \
        || { echo "carry blockspec/assets/smollm2-135m-dflash-b16 (the shipped draft) with this call" >&2; return 1; }
    model=$(demo_dir) || return 1
    timeout "${SEED_S:-540}" python3 -m benchmarks.seed_gpu --model-dir "$model" --out "$out" || status=1
}

bench() {
    # $1 MODULE, then its arguments; an argument DEMO_DIR stands for the converted demo target (demo_dir)
    local module=$1 arg args=()
    shift
    for arg in "$@"; do
        if [ "$arg" = DEMO_DIR ]; then arg=$(demo_dir) || return 1; fi
        args+=("$arg")
    done
    python3 -m "benchmarks.$module" "${args[@]}" --out "$out"
}

[ $# -ge 1 ] || { sed -n '2,22p' "$0"; exit 2; }
case $1 in
    wheels) download_wheels; exit ;;
    slim) slim "${2:-status}"; exit ;;
    plan) plan; exit ;;
    parent) export_parent "${2:?parent REV}"; exit ;;
esac
device_env || exit 1
while [ $# -gt 0 ]; do
    case $1 in
        gpu-test)
            if [[ ${2:-} =~ ^[0-9]+/[0-9]+$ ]]; then gpu_test "$2"; shift; else gpu_test; fi ;;
        stash) stash_parts "$state" ;;
        seed) seed || status=1 ;;
        bench)
            [ $# -ge 2 ] || { echo "bench MODULE [ARGS...]" >&2; exit 2; }
            bench "${@:2}" || status=1
            break ;;
        ab)
            [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "ab ROUNDS [step_latency ARGS...]" >&2; exit 2; }
            ab_step_latency "${@:2}" || status=1
            break ;;
        *) echo "unknown command $1 (gpu-test, stash, seed, bench, ab; here: wheels, slim, plan, parent)" >&2; exit 2 ;;
    esac
    shift
done
exit $status
