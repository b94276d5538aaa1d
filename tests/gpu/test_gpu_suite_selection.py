"""`make gpu-test` runs the tests marked `gpu` (CUDA only) or `cuda` (CUDA where there is one): every test file that
can put work on a CUDA device carries one of the two marks, so the GPU suite is the whole set, not a hand-kept list."""
from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

TESTS = Path(__file__).resolve().parents[1]
USES_CUDA = re.compile(r"cuda\.is_available\(|device=.cuda.|torch\.device\(.cuda|import .*\bDEVICE\b")
MARKED = re.compile(r"mark\.(gpu|cuda)\b")
# NOTE: files that name a CUDA device without running on one
CPU_ONLY = {
    "test_flashinfer_plumbing.py": "a torch stand-in of FlashInfer; names a cuda device only to check errors",
    "test_sglang_flags.py": "names a cuda device only to ask the config whether piecewise graphs would be on",
}


def test_every_cuda_capable_test_file_is_in_the_gpu_suite() -> None:
    unmarked = [
        path.relative_to(TESTS).as_posix()
        for path in sorted(TESTS.rglob("test_*.py"))
        if path.name not in CPU_ONLY and USES_CUDA.search(path.read_text()) and not MARKED.search(path.read_text())
    ]
    assert unmarked == [], f"mark these pytest.mark.cuda (or gpu) so make gpu-test runs them: {unmarked}"


def test_the_gpu_suite_selects_by_mark() -> None:
    script = (TESTS.parent / "scripts" / "device.sh").read_text()
    assert '-m "gpu or cuda"' in script
    assert "gpu-test:" in (TESTS.parent / "Makefile").read_text()


def _gpu_shard_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_shard", TESTS.parent / "scripts" / "gpu_shard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shards_partition_the_suite_by_file_and_balance_test_counts() -> None:
    gpu_shard = _gpu_shard_module()
    counts = {"tests/a.py": 40, "tests/b.py": 35, "tests/c.py": 10, "tests/d.py": 9, "tests/e.py": 1}
    groups = gpu_shard.shards(counts, 2)
    assert sorted(f for group in groups for f in group) == sorted(counts)  # each file once
    loads = [sum(counts[f] for f in group) for group in groups]
    assert loads == [49, 46]
    assert gpu_shard.shards(counts, 1) == [sorted(counts)]
    assert gpu_shard.shards({"tests/a.py": 3}, 3) == [["tests/a.py"], [], []]


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b"])
def test_a_bad_shard_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _gpu_shard_module().parse_shard(text)


def test_device_gpu_test_runs_a_shard_through_gpu_shard() -> None:
    script = (TESTS.parent / "scripts" / "device.sh").read_text()
    assert "scripts/gpu_shard.py" in script and 'gpu_test "$2"' in script
