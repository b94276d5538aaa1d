"""benchmarks/verify_attention.py on tiny shapes (CPU, the kernels under Triton's interpreter): every variant of each
verify block (the chain's, a tree's) timed at each context, the engine's own variant marked once, every variant's
output the served one's."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import verify_attention


def test_smoke_times_every_variant_of_both_blocks(tmp_path: Path) -> None:
    assert verify_attention.main(["--smoke", "--out", str(tmp_path), "--commit", "abc1234"]) == 0
    (path,) = tmp_path.glob("verify_attention_*_abc1234.json")
    assert path.with_suffix(".png").is_file()
    result = json.loads(path.read_text())
    assert result["settings"]["shape"] == "smollm2" and result["settings"]["layers"] == 2
    rows = result["rows"]
    assert {(row["block"], row["query_tokens"], row["budget"]) for row in rows} == {("chain", 4, 0), ("tree", 7, 6)}
    for block in ("chain", "tree"):
        mine = [row for row in rows if row["block"] == block]
        assert sum(row["served"] for row in mine) == 1
        assert {(1, "16,16,4,1"), (2, "16,16,4,1")} <= {(row["splits"], row["tiles"]) for row in mine}
        assert all(row["us_per_layer"] > 0 and row["max_diff_vs_served"] < 1e-4 for row in mine)


def test_tiles_are_four_numbers_and_an_optional_edges() -> None:
    assert verify_attention.tiles_spec("64,64,4,3,edges") == "64,64,4,3,edges"
    tiles = verify_attention.parse_tiles("128,32,8,2")
    assert (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages, tiles.mask_edges_only) == (
        128, 32, 8, 2, False)
    for bad in ("64,32,4", "64,32,4,2,wide", "a,32,4,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            verify_attention.tiles_spec(bad)
