"""benchmarks/tree_verify.py on tiny random weights (CPU): it writes its result into the --out directory with the
issue's rows, the chain's speed beside every tree row."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import tree_verify


def test_smoke_writes_the_rows(tmp_path: Path) -> None:
    assert tree_verify.main(["--smoke", "--budgets", "4", "--batch-sizes", "1", "2", "--workloads", "code",
                             "--rounds", "2", "--max-new-tokens", "12", "--adaptive", "--out", str(tmp_path),
                             "--commit", "abc1234"]) == 0
    (path,) = tmp_path.glob("tree_verify_*_abc1234.json")
    assert path.with_suffix(".png").is_file()
    result = json.loads(path.read_text())
    assert {(row["policy"], row["budget"], row["bs"]) for row in result["rows"]} == {
        (policy, budget, bs) for policy, budget in [("chain", 0), ("tree", 4), ("adaptive", 4)] for bs in (1, 2)}
    chain = {row["bs"]: row["tok_s"] for row in result["rows"] if row["policy"] == "chain"}
    for row in result["rows"]:
        assert {"shape", "workload", "bs", "budget", "accept_length", "tok_s", "chain_tok_s"} <= set(row)
        assert row["tok_s"] > 0 and row["accept_length"] >= 1 and row["chain_tok_s"] == chain[row["bs"]]
        cycles = row["cycles_by_verify_length"]  # NOTE: the measured round's cycles; the tree's length is 8 + 4
        assert sum(cycles.values()) > 0
        if row["policy"] == "tree":
            assert set(cycles) == {"12"} and row["tree_cycle_share"] == 1.0
        if row["policy"] == "chain":
            assert "12" not in cycles and "tree_cycle_share" not in row
        # NOTE: a row's rounds run one after the other: its batch never exceeds bs (2 rounds of bs 1 are not bs 2)
        batches = row["cycles_by_batch_size"]
        assert max(int(size) for size in batches) == row["bs"] and sum(batches.values()) == sum(cycles.values())
        assert row["wall_ms_per_cycle"] > 0
        if row["policy"] == "adaptive":
            view = row["policy_view"]
            assert view["graph_bs"] >= row["bs"] and {option["num_draft_tokens"] for option in view["cost_model"]} \
                >= {12}
        else:
            assert "policy_view" not in row
    assert result["commit"] == "abc1234" and result["gpu"] and result["date"]


def test_smoke_with_simulated_acceptance(tmp_path: Path) -> None:
    """The dummy-shape mode's engine flags on the tiny shape: chain and tree cycles commit their simulated lengths."""
    assert tree_verify.main(["--smoke", "--budgets", "4", "--batch-sizes", "2", "--workloads", "code", "--rounds", "1",
                             "--max-new-tokens", "16", "--simulate-accept-profile", "geometric:1",
                             "--simulate-tree-accept-profile", "geometric:100", "--out", str(tmp_path),
                             "--commit", "abc1234"]) == 0
    (path,) = tmp_path.glob("tree_verify_*_abc1234.json")
    rows = {row["policy"]: row for row in json.loads(path.read_text())["rows"]}
    assert rows["chain"]["accept_length"] == 1.0 and rows["chain"]["simulated_chain"] == "geometric:1"
    assert rows["tree"]["accept_length"] > 2.5 and rows["tree"]["simulated_tree"] == "geometric:100"
