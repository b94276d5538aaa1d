"""benchmarks/cycle_profile.py on tiny random weights (CPU): a row per cycle (the chain, a tree per budget) with the
documented keys, the tree cycles launching more ops than the chain's, and a diff naming the tree's own code."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import cycle_profile

ROW_KEYS = {"cycle", "budget", "bs", "verify_length", "graphs", "device", "wall_ms", "device_us_per_cycle",
            "ops_per_cycle", "top_kernels", "top_sources"}
DIFF_KEYS = {"budget", "bs", "graphs", "device", "added_ops_per_cycle", "added_device_us_per_cycle", "added_wall_ms",
             "kernels", "sources"}


def test_smoke_profiles_the_chain_and_each_tree(tmp_path: Path) -> None:
    assert cycle_profile.main(["--smoke", "--budgets", "4", "8", "--out", str(tmp_path), "--commit", "abc1234"]) == 0
    (path,) = tmp_path.glob("cycle_profile_*_abc1234.json")
    assert path.with_suffix(".png").is_file()
    result = json.loads(path.read_text())
    assert result["commit"] == "abc1234" and result["gpu"] and result["date"]
    settings = result["settings"]
    assert settings["shape"] == "smoke" and settings["block_size"] == 8 and settings["kernels_in_graphs"] is None
    rows = {row["budget"]: row for row in result["rows"]}
    assert set(rows) == {0, 4, 8} and len(result["rows"]) == 3
    for budget, row in rows.items():
        assert set(row) == ROW_KEYS
        assert row["cycle"] == ("chain" if budget == 0 else "tree") and row["bs"] == 1
        assert row["verify_length"] == 8 + budget and row["device"] == "cpu" and not row["graphs"]
        assert row["wall_ms"] > 0 and row["device_us_per_cycle"] > 0 and row["ops_per_cycle"] > 0
        assert row["top_kernels"] and all(entry["name"].startswith("aten::") for entry in row["top_kernels"])
    # NOTE: counts only (CPU times mean nothing): each counted op is a launch on the GPU
    assert rows[4]["ops_per_cycle"] > rows[0]["ops_per_cycle"] and rows[8]["ops_per_cycle"] > rows[0]["ops_per_cycle"]
    diffs = {diff["budget"]: diff for diff in result["diffs"]}
    assert set(diffs) == {4, 8}
    for budget, diff in diffs.items():
        assert set(diff) == DIFF_KEYS
        assert diff["added_ops_per_cycle"] == round(rows[budget]["ops_per_cycle"] - rows[0]["ops_per_cycle"], 3)
        assert diff["kernels"] and all(entry["added_calls"] > 0 for entry in diff["kernels"])
        sources = {entry["source"] for entry in diff["sources"]}
        assert any(source.startswith("blockspec/speculative/tree_") for source in sources)
