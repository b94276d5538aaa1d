"""benchmarks/host_overhead.py on CPU, a few steps: per mode the host time of decode and extend steps (the model's
forwards taken out), the commit in the report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import benchmarks

ROOT = Path(benchmarks.__file__).resolve().parent.parent


def test_short_run_reports_host_time_per_step(tmp_path: Path) -> None:
    root = ROOT
    out = tmp_path / "host.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", BLOCKSPEC_COMMIT="test",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    args = ["--out", str(out), "--device", "cpu", "--clients", "4", "--prompt-len", "8", "--max-new-tokens", "8",
            "--block-size", "4", "--warmup-steps", "3", "--steps", "12"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.host_overhead", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["commit"] == "test" and report["device"] == "cpu"
    assert [r["mode"] for r in report["results"]] == ["dflash", "target"]
    for result in report["results"]:
        steps = result["all"]
        assert steps["steps"] == 12 and steps["running_mean"] > 0
        assert 0 < steps["host_us_mean"] < steps["wall_us_mean"] and steps["forward_us_mean"] > 0
        assert result["extend_steps"]["steps"] + result["decode_steps"]["steps"] == 12
        assert result["decode_steps"]["steps"] > 0 and result["arrivals_per_step"] > 0
