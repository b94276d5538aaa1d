"""benchmarks/deterministic_cost.py --smoke on CPU (Triton interpreter): rows for the flag off and on, target-only and
DFlash, per batch size; the on ÷ off ratios; the plot beside the JSON; GPU, date and commit in the report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import benchmarks

ROOT = Path(benchmarks.__file__).resolve().parent.parent


def test_smoke_run_writes_rows_ratios_and_plot(tmp_path: Path) -> None:
    root = ROOT
    env = dict(os.environ, OMP_NUM_THREADS="1", BLOCKSPEC_COMMIT="test", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.deterministic_cost", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("deterministic_cost_*_test.json")
    assert path.with_suffix(".png").is_file()
    report = json.loads(path.read_text())
    assert report["commit"] == "test" and report["gpu"] == "cpu" and report["date"]
    rows = report["rows"]
    assert [(r["deterministic"], r["spec"], r["bs"]) for r in rows] == [
        (deterministic, spec, bs) for deterministic in (False, True) for spec in (False, True) for bs in (1, 2)]
    for row in rows:
        assert row["cycle_ms"] > 0 and row["prefill_ms"] > 0
        assert ("verify_ms" in row) == row["spec"] and ("greedy_cycle_ms" in row) == row["spec"]
    assert len(report["cost"]) == 4
    for ratio in report["cost"]:
        assert ratio["cycle_on_over_off"] > 0 and ratio["prefill_on_over_off"] > 0
        assert ("verify_on_over_off" in ratio) == ratio["spec"]
