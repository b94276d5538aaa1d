"""benchmarks/tree_build.py on tiny shapes (CPU, the kernels under Triton's interpreter): a row per batch size and
budget with both builds and both walks timed, the fused tree the torch form's and the fused walk the torch walk's; the
fused top-B timed alone and before the fused tree, its candidates the torch form's."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import tree_build


def test_smoke_times_both_builds_and_walks(tmp_path: Path) -> None:
    assert tree_build.main(["--smoke", "--out", str(tmp_path), "--commit", "abc1234"]) == 0
    (path,) = tmp_path.glob("tree_build_*_abc1234.json")
    assert path.with_suffix(".png").is_file()
    result = json.loads(path.read_text())
    assert {(row["bs"], row["budget"]) for row in result["rows"]} == {(1, 4), (3, 4), (1, 8), (3, 8)}
    for row in result["rows"]:
        assert row["same_tree"] and row["torch_ms"] > 0 and row["fused_ms"] > 0 and row["topk_ms"] > 0
        assert row["same_walk"] and row["walk_torch_ms"] > 0 and row["walk_fused_ms"] > 0
        assert set(row["fused_ms_by_warps"]) == {"1", "4"} and min(row["fused_ms_by_warps"].values()) > 0
        assert row["torch_over_fused"] == row["torch_ms"] / row["fused_ms"]
        assert row["same_top"] and row["topk_fused_ms"] > 0 and row["all_fused_ms"] > 0
        assert row["topk_torch_over_fused"] == row["topk_ms"] / row["topk_fused_ms"]
    assert result["commit"] == "abc1234" and result["gpu"] and result["date"]
