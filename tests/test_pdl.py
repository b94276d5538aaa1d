"""Programmatic dependent launch: off where it cannot work, and on the GPU a graph of PDL-launched kernels chained
through cuBLAS GEMMs gives bit-identical results to plain launches (a missing wait would read stale data)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from blockspec.layers import triton_ops  # noqa: E402
from blockspec.layers.pdl import pdl_enabled, pdl_launch  # noqa: E402


def test_pdl_is_off_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert not pdl_enabled(cpu)
    assert pdl_launch(torch.zeros(1)) == {}


def test_pdl_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOCKSPEC_PDL", "0")
    assert not pdl_enabled(torch.device("cuda", 0))


def _layer_chain(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, up: torch.Tensor,
                 down: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    for _ in range(layers):
        h = triton_ops.rmsnorm(x, norm_w, 1e-5, residual=residual)
        gate_up = h @ up.t()
        x = triton_ops.silu_mul(gate_up) @ down.t()
    logits = triton_ops.rmsnorm(x, norm_w, 1e-5, residual=residual) @ up.t()
    return triton_ops.argmax_rows(logits), residual


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 10, 320])
def test_graph_of_pdl_kernels_matches_plain_launches(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden, inter = 1024, 2048

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) / shape[-1] ** 0.5

    x0, r0, w = randn(rows, hidden), randn(rows, hidden), 1 + randn(hidden)
    up, down = randn(2 * inter, hidden), randn(hidden, inter)

    def run_graph() -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = x0.clone(), r0.clone()
        _layer_chain(x, residual.clone(), w, up, down, 1)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tokens, out_residual = _layer_chain(x, residual, w, up, down, 24)
        results = []
        for _ in range(3):
            residual.copy_(r0)
            graph.replay()
            results.append((tokens.clone(), out_residual.clone()))
        torch.cuda.synchronize()
        for tokens_i, residual_i in results[1:]:
            assert torch.equal(tokens_i, results[0][0]) and torch.equal(residual_i, results[0][1])
        return results[0]

    monkeypatch.setenv("BLOCKSPEC_PDL", "1")
    with_pdl = run_graph()
    monkeypatch.setenv("BLOCKSPEC_PDL", "0")
    plain = run_graph()
    assert torch.equal(with_pdl[0], plain[0])
    assert torch.equal(with_pdl[1], plain[1])
