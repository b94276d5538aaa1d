"""benchmarks/profile_train_step.py: a CPU smoke run times every phase of a training step, with both feature
backends, and writes its JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cpu_smoke_run_writes_the_phases(tmp_path: Path, backend: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CPU run: Triton runs on CPU tensors only under the interpreter (set where CUDA is absent)")
    command = [sys.executable, str(BENCHMARKS / "profile_train_step.py"), "--device", "cpu", "--smoke", "--steps", "2",
               "--profile-steps", "1", "--top", "3", "--feature-backend", backend, "--out", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=BENCHMARKS, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = tmp_path.glob("profile_train_step_*.json")
    report = json.loads(path.read_text())
    assert report["feature_backend"] == backend and report["gpu"] == "cpu"
    assert set(report["phases_ms_median"]) == {"extract_features_ms", "build_batch_ms", "forward_and_loss_ms",
                                               "backward_ms", "optimizer_ms", "context_tokens"}
    assert len(report["step_ms_all"]) == 2 and all(t > 0 for t in report["step_ms_all"])
    assert 1 <= len(report["top_kernels"]) <= 3
