#!/usr/bin/env bash
# Issue #24 (a better shipped draft) on one H200: benchmarks/draft_v2.py's stages, one device `run` each (each well
# under the 10-minute limit), sharing .device-state/draft_v2 (git-ignored: it stays on the warm machine between
# calls). The SmolLM2 GGUF (98 MB) cannot travel in one call (64 MiB per call with the working tree), so it goes in
# parts sized to the tree (scripts/device_lib.sh), one per call; every call but the last only leaves its part there.
#
# Here, once per tree size:  PYTHON=.venv/bin/python scripts/train_draft_v2.sh split   -> .carry/gsm8k/train.jsonl
#   (from GSM8K_DIR, ../shared/data/gsm8k) and .carry/smollm2/partNN; it prints how many parts (one a call) (50 MB of tree and 8 MiB kept for .carry/draft_v2: 8 parts, 2026-12-03).
# Device, one `run` each, in this order and back to back (an idle machine is given back after 30 s):
#   a. carry .whl + part00                       scripts/train_draft_v2.sh stash
#   b. carry .carry/gsm8k + .carry/draft_v2 + part01   scripts/train_draft_v2.sh stash
#   c. carry part02 .. the part before the last, one a call, each   scripts/train_draft_v2.sh stash
#   d. carry the last part                       BLOCKSPEC_COMMIT=<c> scripts/train_draft_v2.sh data
#      (with GENERAL=benchmarks/data/draft_v2_general while slim: carry its prompts.train.jsonl too; the whole
#      tree, 68 MiB on 2026-12-07, does not fit a call, so slim stays on through the chain)
#   e. (no carry*)  BLOCKSPEC_COMMIT=<c> scripts/train_draft_v2.sh train    (RUN, LAYERS, TRAIN_MIN, MIX_RATIO, EXTRA)
#   f. (no carry*)  BLOCKSPEC_COMMIT=<c> scripts/train_draft_v2.sh bench    (RUN: the run to serve; default the best)
#   * but an --init-from draft (e) or a compared draft (f) that slim keeps out: the shipped one, 37 MiB
# A run longer than one call: `train-start` (the train stage in its own process session, which outlives the call, as
#   the device keeps such processes while the machine stays warm; its files under $STATE/background), then
#   `train-wait` calls back to back (each waits up to WAIT_S, default 570 s, exits 75 while the run goes on and hands
#   back what it wrote once it has ended; bench refuses to start while it runs), then bench: e.g. TRAIN_MIN=16 DEADLINE_S=1150 TRAIN_S=1200 for one 16-minute schedule. A run gone
#   without an exit code (killed with its call) makes train-wait train the same recipe in the foreground instead.
# A carry names single files, never .carry/smollm2 itself: a carried folder replaces the one on the machine.
# CHAIN_BUDGET_S (train-start): the device seconds the chain may use from its first call; the run's TRAIN_MIN,
#   DEADLINE_S and TRAIN_S are then what is left after CHAIN_RESERVE_S (default 240: train-wait, bench, a margin).
# WORDING_OFFSET (data): GSM8K wordings start this far along the rotation (3: the three an offset-0 state never asked).
# V2_FLAGS adds draft_v2.py flags to every stage: V2_FLAGS="--smoke --device cpu" runs the whole chain on a CPU.
# Responses survive a lost machine and a session: data and train leave the response cache in $OUT as
#   responses.tar.xz (5.1 MB for the 30,000 of 2026-12-03); copy it to .carry/draft_v2/ here, and the next data stage
#   starts from it. The cache is keyed by the prompts' ids: a changed prompt set reuses every prompt it still has.
# MORE_GENERAL=N / MORE_MATH=N (data) add N new Magpie prompts (math: behind a tutor system prompt; seeds from MORE_SEED,
#   default 1) to the state's general training set, once per state; MIX_RATIO (data and train) must then let them in.
#   GEN_WORKERS=N runs N generation processes side by side on the GPU (the 135M target decodes host-bound).
# GENERAL=benchmarks/data/draft_v2_general gives the data stage the committed generated prompts (no Magpie: ≈ 210 s
#   less); unset, the data stage generates them.
# Results go to $OUT: data (generation_info.json, general_heldout.jsonl, log), train (training_info_<run>.json, the
# draft as draft_v2_<run>.tar.part*, result JSON + PNG, log), bench (draft_v2_<date>_<commit>.json + PNG, log).
set -uo pipefail
stage=${1:?usage: $0 split|stash|data|train|train-start|train-wait|bench}
source "$(dirname "$0")/device_lib.sh"
name=$gguf_name
state=${STATE:-.device-state/draft_v2}
if [ "$stage" = split ]; then
    source_gguf=$("${PYTHON:-python3}" -c 'from blockspec.models.smollm2 import smollm2_gguf_path; print(smollm2_gguf_path())') || exit 1
    mkdir -p .carry/gsm8k .carry/draft_v2
    cp "${GSM8K_DIR:-../shared/data/gsm8k}/train.jsonl" .carry/gsm8k/train.jsonl
    # NOTE: call 2 keeps 12 MiB for .carry/draft_v2 (47,986 responses: 9.1 MB, 2026-12-04) when it holds an archive;
    # more need a larger reserve
    reserve=0
    if [ -n "$(ls -A .carry/draft_v2)" ]; then
        reserve=$(( 12 * 1024 * 1024 - $(du -cb .carry/draft_v2 | tail -1 | cut -f1) ))
        [ "$reserve" -lt 0 ] && reserve=0
    fi
    second=$(( reserve + $(du -cb .carry/gsm8k .carry/draft_v2 | tail -1 | cut -f1) ))
    split_gguf "$source_gguf" "$(du -cb .whl | tail -1 | cut -f1)" "$second" || exit 1
    exit 0
fi
device_env || exit 1
mkdir -p "$state"
[ -f "$state/chain_started" ] || date +%s > "$state/chain_started"  # NOTE: the chain's first call (CHAIN_BUDGET_S)
responses_cache=${RESPONSES:-.carry/draft_v2/responses.tar.xz}
restore_responses() {
    # NOTE: the cache's meta names the converted target by absolute path; this machine's may differ. Its responses
    # are keyed by their prompts' ids: new general prompts (no GENERAL) reuse the GSM8K ones and generate the rest.
    [ -f "$responses_cache" ] && [ ! -f "$state/responses/meta.json" ] || return 0
    case " ${V2_FLAGS:-} " in
        *" --smoke "*) echo "not restoring $responses_cache: a smoke run asks other generation settings"; return 0 ;;
    esac
    xz -t "$responses_cache" || { echo "not restoring $responses_cache: the archive is damaged" >&2; return 0; }
    tar -C "$state" -xJf "$responses_cache" || return 1
    python3 -c 'import json, pathlib, sys; p = pathlib.Path(sys.argv[1]); m = json.loads(p.read_text());
m["target_model_path"] = str(pathlib.Path(sys.argv[2]).resolve()); p.write_text(json.dumps(m, indent=1))' \
        "$state/responses/meta.json" "$state/model/smollm2-135m-instruct"
    echo "restored $(cat "$state"/responses/responses.rank*.jsonl | wc -l) cached responses from $responses_cache"
}
background_alive() {
    # NOTE: any process of the background session: its timeout and python run in their own process groups
    [ -f "$state/background/pid" ] && pgrep -s "$(cat "$state/background/pid")" > /dev/null
}
refuse_while_training() {
    background_alive || return 0
    echo "a background train stage is still running (session $(cat "$state/background/pid")): train-wait first" >&2
    exit 2
}
save_responses() {
    # NOTE: written whole or not at all: a call cut mid-write must not bring back a damaged archive
    [ -d "$state/responses" ] || return 0
    tar -C "$state" -cf - responses | xz -T0 -3 > "$out/responses.partial" && mv "$out/responses.partial" "$out/responses.tar.xz"
}
case $stage in
    stash)
        stash_parts "$state"
        ls -l .carry/gsm8k 2>/dev/null
        exit 0 ;;
    data)
        stash_parts "$state"
        assemble_gguf "$state" || exit 1
        restore_responses || exit 1
        timeout "${DATA_S:-570}" python3 -m benchmarks.draft_v2 data --state "$state" --out "$out" --gguf "$state/$name" \
            --gsm8k-train .carry/gsm8k/train.jsonl ${GENERAL:+--general-prompts "$GENERAL"} --mix-ratio "${MIX_RATIO:-0.3}" \
            --more-general "${MORE_GENERAL:-0}" --more-math "${MORE_MATH:-0}" --more-seed "${MORE_SEED:-1}" \
            --gsm8k-wording-offset "${WORDING_OFFSET:-0}" --gen-workers "${GEN_WORKERS:-1}" ${V2_FLAGS:-} \
            > "$out/draft_v2_data.log" 2>&1
        code=$?
        [ $code -eq 124 ] && echo "data stage cut at ${DATA_S:-570} s: the train stage generates the responses left"
        save_responses ;;
    train)
        timeout "${TRAIN_S:-590}" python3 -m benchmarks.draft_v2 train --state "$state" --out "$out" --gguf "$state/$name" \
            --run "${RUN:-v2}" --num-layers "${LAYERS:-5}" --train-minutes "${TRAIN_MIN:-6.5}" --deadline-s "${DEADLINE_S:-540}" \
            --mix-ratio "${MIX_RATIO:-0.3}" --gen-workers "${GEN_WORKERS:-1}" --extra-train-flags "${EXTRA:-}" ${V2_FLAGS:-} \
            > "$out/draft_v2_train_${RUN:-v2}.log" 2>&1
        code=$?
        save_responses ;;
    train-start)
        background="$state/background"
        refuse_while_training
        if [ -n "${CHAIN_BUDGET_S:-}" ]; then
            # NOTE: the stage gets what the chain has left after CHAIN_RESERVE_S (collecting, bench, a margin); its
            # deadline leaves ≈ 100 s for what follows training and is not in it (train-draft's start-up, packing)
            left=$(( CHAIN_BUDGET_S - ($(date +%s) - $(cat "$state/chain_started")) - ${CHAIN_RESERVE_S:-240} ))
            [ "$left" -ge 300 ] || { echo "the chain has $left s left for training: too little" >&2; exit 2; }
            export DEADLINE_S=$(( left - 100 )) TRAIN_S=$(( left + 30 )) \
                TRAIN_MIN=$(awk "BEGIN { print ($left - 100) / 60 }")
            echo "chain budget: $left s for the train stage (TRAIN_MIN=$TRAIN_MIN)"
        fi
        rm -rf "$background" && mkdir -p "$background"
        # NOTE: a carried tracked path (the shipped draft, which slim deletes here) lasts only as long as its call:
        # the next call's copy of the slim tree removes it, maybe before the background run reads it (session 49's
        # first train-start); so --init-from (the `--init-from PATH` form) reads a copy. Git-ignored paths stay.
        read -r -d '' -a words <<< "${EXTRA:-}" || true
        for index in "${!words[@]}"; do
            if [ "${words[$index]}" = --init-from ] && [ -d "${words[$((index + 1))]:-}" ]; then
                rm -rf "$state/init_from"
                cp -r "${words[$((index + 1))]}" "$state/init_from" || { echo "--init-from: copy failed" >&2; exit 1; }
                words[$((index + 1))]="$state/init_from"
            fi
        done
        EXTRA="${words[*]}"
        printf 'export RUN=%q EXTRA=%q LAYERS=%q MIX_RATIO=%q GEN_WORKERS=%q V2_FLAGS=%q\n' "${RUN:-v2}" "${EXTRA:-}" \
            "${LAYERS:-5}" "${MIX_RATIO:-0.3}" "${GEN_WORKERS:-1}" "${V2_FLAGS:-}" > "$background/recipe.sh"
        # NOTE: setsid: a new session (its id is the pid written) outlives this call; `train` writes into $OUT, here
        # the background folder; rc appears whole (renamed) once the stage has ended
        OUT="$background" setsid bash -c 'echo $$ > "$1/pid"; "$0" train > "$1/stdout" 2>&1;
            echo $? > "$1/rc.partial"; mv "$1/rc.partial" "$1/rc"' "$0" "$background" < /dev/null > /dev/null 2>&1 &
        sleep "${START_WAIT_S:-30}"
        if [ -f "$background/rc" ]; then
            cat "$background/stdout"
            echo "the background train stage ended within ${START_WAIT_S:-30} s (exit $(cat "$background/rc"))" >&2
            exit 1
        fi
        echo "training in the background (session $(cat "$background/pid")); train-wait collects it"
        tail -3 "$background"/draft_v2_train_*.log 2>/dev/null
        exit 0 ;;
    train-wait)
        background="$state/background"
        [ -d "$background" ] || { echo "no background train stage here: train-start first (same machine)" >&2; exit 2; }
        end=$(( SECONDS + ${WAIT_S:-570} ))
        while [ ! -f "$background/rc" ] && [ "$SECONDS" -lt "$end" ]; do
            if ! background_alive && [ ! -f "$background/rc" ]; then
                echo "the background run is gone without an exit code (killed with its call?)" >&2
                # NOTE: only at the start of this call is there time for a foreground run within it
                [ "$SECONDS" -lt 30 ] || exit 1
                source "$background/recipe.sh" && rm -rf "$background"
                echo "training the same recipe in the foreground instead" >&2
                TRAIN_MIN=${FALLBACK_TRAIN_MIN:-7.5} DEADLINE_S=$(( 540 - SECONDS )) TRAIN_S=$(( 590 - SECONDS )) \
                    exec "$0" train
            fi
            sleep 5
        done
        if [ ! -f "$background/rc" ]; then
            echo "still training after this call's ${WAIT_S:-570} s: call train-wait again"
            grep -v -E "INFO (httpx|blockspec)" "$background"/draft_v2_train_*.log | tail -3
            exit 75  # NOTE: not 0: nothing is collected yet
        fi
        cp -r "$background"/. "$out"/ && rm -f "$out/stdout" "$out/rc" "$out/pid" "$out/recipe.sh"
        cat "$background/stdout"
        exit "$(cat "$background/rc")" ;;
    bench)
        refuse_while_training
        timeout "${BENCH_S:-400}" python3 -m benchmarks.draft_v2 bench --state "$state" --out "$out" --gguf "$state/$name" \
            --run "${RUN:-}" ${V2_FLAGS:-} > "$out/draft_v2_bench.log" 2>&1
        code=$? ;;
    *)
        echo "unknown stage $stage (split, stash, data, train, train-start, train-wait, bench)" >&2
        exit 2 ;;
esac
grep -v -E "INFO (httpx|blockspec\.(runner|startup|engine|speculative))" "$out"/draft_v2_*.log | tail -"${TAIL:-40}"
exit $code
