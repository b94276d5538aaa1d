"""benchmarks/adaptive_verify.py --smoke on CPU: the JSON layout #19 asks for (rows with profile, context, bs and the
three throughputs), the plot beside it, the commit from $BLOCKSPEC_COMMIT."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import benchmarks

ROOT = Path(benchmarks.__file__).resolve().parent.parent


def test_smoke_run_writes_rows_and_plot(tmp_path: Path) -> None:
    root = ROOT
    env = dict(os.environ, OMP_NUM_THREADS="1", BLOCKSPEC_COMMIT="test",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.adaptive_verify", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("adaptive_verify_*_test.json")
    assert path.with_suffix(".png").is_file()
    report = json.loads(path.read_text())
    assert report["commit"] == "test" and report["gpu"] == "cpu"
    rows = report["rows"]
    assert [(r["profile"], r["context"], r["bs"]) for r in rows] == [
        (profile, 16, bs) for bs in (1, 2) for profile in ("demo", "geometric6")
    ]
    for row in rows:
        assert {"profile", "context", "bs", "target_tok_s", "fixed_tok_s", "adaptive_tok_s"} <= set(row)
        assert min(row["target_tok_s"], row["fixed_tok_s"], row["adaptive_tok_s"]) > 0
        assert row["adaptive_num_draft_tokens"] in report["verify_length_startup"]["verify_lengths"]
    assert report["verify_length_startup"]["mode"] == "adaptive"
    assert set(report["goals"]) >= {"envelope_goal_met", "target_goal_met", "bs1_goal_met", "bs64_goal_met"}
