"""Tensor parallelism on 2 GPUs (NCCL): TP=2 with full and piecewise CUDA graphs (their captures hold the
all-reduces) gives TP=1's greedy tokens in fp32, target-only and DFlash; a killed rank does not hang rank 0."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

from blockspec import Engine  # noqa: E402
from blockspec.engine.rank_processes import TensorParallelError  # noqa: E402
from tests.support.tiny_models import save_tiny_draft, save_tiny_model  # noqa: E402
from tests.support.tp_testing import assert_same_outputs, generate, tp_engine  # noqa: E402

GREEDY = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def gpu_flags(model_path: Path, **extra: Any) -> dict[str, Any]:
    flags: dict[str, Any] = dict(model_path=str(model_path), device="cuda", dtype="float32", page_size=16,
                                 max_total_tokens=8192, chunked_prefill_size=8, skip_tokenizer_init=True,
                                 cuda_graph_bs=[1, 2, 4], enforce_piecewise_cuda_graph=True,
                                 piecewise_cuda_graph_max_tokens=64)
    return {**flags, **extra}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("spec", [False, True])
def test_tp2_with_graphs_matches_tp1(tmp_path: Path, kind: str, spec: bool) -> None:
    target = save_tiny_model(kind, tmp_path / "target")
    extra: dict[str, Any] = {}
    if spec:
        save_tiny_draft(tmp_path / "draft", target, [0, 2], 8, num_layers=2, seed=3)
        extra = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(tmp_path / "draft"))
    flags = gpu_flags(tmp_path / "target", **extra)
    with Engine(**flags) as engine:
        expected = generate(engine, GREEDY, logprobs=False)
    with tp_engine(flags, seconds=600.0) as engine:
        got = generate(engine, GREEDY, logprobs=False)
        counts = engine.get_server_info()["internal_states"][0]["forward_counts"]
    assert_same_outputs(expected, got, atol=1e-3)
    assert counts["graph"] > 0 and counts["piecewise"] > 0, counts


def test_killed_rank_does_not_hang_nccl(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path / "target")
    with tp_engine(gpu_flags(tmp_path / "target"), seconds=300.0) as engine:
        assert engine.ranks is not None
        os.kill(engine.ranks.processes[0].pid, 9)
        with pytest.raises(TensorParallelError):
            generate(engine, GREEDY, logprobs=False)
