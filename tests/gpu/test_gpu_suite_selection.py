"""`make gpu-test` runs the tests marked `gpu` (CUDA only) or `cuda` (CUDA where there is one): every test file that
can put work on a CUDA device carries one of the two marks, so the GPU suite is the whole set, not a hand-kept list."""
from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
USES_CUDA = re.compile(r"cuda\.is_available\(|device=.cuda.|torch\.device\(.cuda|import .*\bDEVICE\b")
MARKED = re.compile(r"mark\.(gpu|cuda)\b")
# NOTE: files that name a CUDA device without running on one
CPU_ONLY = {
    "test_flashinfer_plumbing.py": "a torch stand-in of FlashInfer; names a cuda device only to check errors",
    "test_sglang_flags.py": "names a cuda device only to ask the config whether piecewise graphs would be on",
}


def test_every_cuda_capable_test_file_is_in_the_gpu_suite() -> None:
    unmarked = [path.relative_to(TESTS).as_posix() for path in sorted(TESTS.rglob("test_*.py"))
                if path.name not in CPU_ONLY and USES_CUDA.search(path.read_text()) and not MARKED.search(path.read_text())]
    assert unmarked == [], f"mark these pytest.mark.cuda (or gpu) so make gpu-test runs them: {unmarked}"


def test_the_gpu_suite_selects_by_mark() -> None:
    script = (TESTS.parent / "scripts" / "device.sh").read_text()
    assert '-m "gpu or cuda"' in script
    assert "gpu-test:" in (TESTS.parent / "Makefile").read_text()
