"""benchmarks/tree_serving.py on tiny random weights (CPU): a chain server and a tree server answer each workload, and
the rows say what each ran (its verify lengths), its speed against the chain's and its accept length."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import tree_serving


def test_smoke_serves_the_chain_and_the_tree(tmp_path: Path) -> None:
    assert tree_serving.main(["--smoke", "--budgets", "4", "--num-prompts", "3", "--warmup", "1",
                              "--max-new-tokens", "12", "--out", str(tmp_path), "--commit", "abc1234",
                              "--tag", "forced"]) == 0
    (path,) = tmp_path.glob("tree_serving_*_abc1234_forced.json")  # NOTE: a tag keeps a second run of a day apart
    assert path.with_suffix(".png").is_file()
    result = json.loads(path.read_text())
    rows = {(row["workload"], row["budget"]): row for row in result["rows"]}
    assert set(rows) == {(workload, budget) for workload in ("gsm8k", "code") for budget in (0, 4)}
    for (workload, budget), row in rows.items():
        chain = rows[(workload, 0)]
        assert row["completed"] == 3 and row["failed"] == 0 and row["clients"] == 1
        assert row["tok_s"] > 0 and row["accept_length"] >= 1 and row["chain_tok_s"] == chain["tok_s"]
        assert row["over_chain"] == pytest.approx(row["tok_s"] / chain["tok_s"], rel=1e-2)  # NOTE: tok_s is rounded
        # NOTE: the smoke draft's block is 8: the chain verifies 8 rows, a tree of 4 nodes stands as length 12
        assert set(row["cycles_by_verify_length"]) == ({"12"} if budget else {"8"})
        assert row["policy"] == ("tree" if budget else "chain")
        # NOTE: on the CPU adaptive verify is off by default (cycles not timed live): every tree server cycle a tree
        assert row["verify_policy"] == "fixed" and row.get("tree_cycle_share") == (1.0 if budget else None)
        assert row["serve_flags"] == ("--speculative-tree-budget 4" if budget else "default")
    assert result["commit"] == "abc1234" and result["gpu"] and result["date"]
