#!/usr/bin/env bash
# Device calls carry the working tree with them (64 MiB a call in all, ≈ 56 MB of tree on 2026-12-04: the shipped
# draft 37 MB, the general prompts 8.4 MB), which left ≈ 9.6 MB a call for the SmolLM2 GGUF's parts (11 calls).
# `on` takes the large files no stash call needs out of what travels (out of git's index, ignored through
# .git/info/exclude; the files stay on disk), so the GGUF goes in two calls; `off` puts them back before the calls
# that use them (data, train, bench). Run `split` with the tree slim; never commit while it is. Usage: on|off|status
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
paths=(blockspec/assets/smollm2-135m-dflash-b16 benchmarks/data/draft_v2_general/prompts.train.jsonl)
exclude=.git/info/exclude
begin="# device_slim_tree.sh: begin" end="# device_slim_tree.sh: end"
case ${1:-status} in
    on)
        grep -q "$begin" "$exclude" 2>/dev/null && { echo "already slim"; exit 0; }
        git rm -r -q --cached "${paths[@]}"
        { echo "$begin"; printf '/%s\n' "${paths[@]}"; echo "$end"; } >> "$exclude"
        echo "slim: ${paths[*]} out of the tree that travels (still on disk)" ;;
    off)
        sed -i "/^$begin\$/,/^$end\$/d" "$exclude"
        git reset -q -- "${paths[@]}"
        git diff --quiet -- "${paths[@]}" || { echo "the slim paths differ from HEAD: check git status" >&2; exit 1; }
        echo "whole: ${paths[*]} tracked again" ;;
    status)
        grep -q "$begin" "$exclude" 2>/dev/null && echo slim || echo whole ;;
    *)
        echo "usage: $0 on|off|status" >&2; exit 2 ;;
esac
