"""The batch-invariant GEMM (--enable-deterministic-inference): each output row bit-identical for any number of rows
M (1, 3, 16, 37; the same row content), correct against F.linear, written into a given buffer; the same check
catches a reduction order that follows M. Linear / StackedLinear route through it under a batch-invariant KernelMode.

On CPU under TRITON_INTERPRET=1 (root conftest), fp32 and fp16; natively on CUDA."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.layers.batch_invariant_matmul import batch_invariant_linear  # noqa: E402
from blockspec.layers.kernel_mode import KernelMode  # noqa: E402
from blockspec.layers.linear import Linear, StackedLinear, linear_into  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROW_COUNTS = (1, 3, 16, 37)
Matmul = Callable[[torch.Tensor], torch.Tensor]


def rows_differing_across_m(matmul: Matmul, x: torch.Tensor) -> int:
    """Rows whose result depends on how many rows came with them: x[:m] for every m in ROW_COUNTS against the
    37-row product, and the rows placed after 5 others (a row's position in the batch must not matter either)."""
    full = matmul(x)
    differing = sum(int((matmul(x[:m]) != full[:m]).any(-1).sum()) for m in ROW_COUNTS[:-1])
    shifted = matmul(torch.cat([torch.randn_like(x[:5]), x[:16]]))[5:]
    return differing + int((shifted != full[:16]).any(-1).sum())


def operands(k: int, n: int, dtype: torch.dtype, bias: bool = False) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    x = torch.randn(max(ROW_COUNTS), k, dtype=dtype, device=DEVICE)
    weight = torch.randn(n, k, dtype=dtype, device=DEVICE) / k ** 0.5
    return x, weight, torch.randn(n, dtype=dtype, device=DEVICE) if bias else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k,n,bias", [(40, 96, False), (256, 72, True), (64, 200, False)])
def test_rows_do_not_depend_on_m(dtype: torch.dtype, k: int, n: int, bias: bool) -> None:
    x, weight, b = operands(k, n, dtype, bias)
    assert rows_differing_across_m(lambda rows: batch_invariant_linear(rows, weight, b), x) == 0
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batch_invariant_linear(x, weight, b).float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype,k", [(torch.float32, 40), (torch.float16, 512)])
def test_the_check_catches_a_reduction_chosen_by_m(dtype: torch.dtype, k: int) -> None:
    """Split-K for small M (as a cuBLAS-style heuristic picks: two partial sums over halves of K, added at the end)
    changes some rows' bits. NOTE: a shorter K step alone need not: on tensor cores a 64-wide dot is four 16-wide
    MMAs into one accumulator, the same order of additions as four 16-wide steps."""
    x, weight, _ = operands(k, 64, dtype)
    half = k // 2

    def by_m(rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] >= 16:
            return batch_invariant_linear(rows, weight)
        partials = [batch_invariant_linear(rows[:, part], weight[:, part]).float()
                    for part in (slice(0, half), slice(half, k))]
        return (partials[0] + partials[1]).to(dtype)

    assert rows_differing_across_m(by_m, x) > 0
    assert rows_differing_across_m(lambda rows: batch_invariant_linear(rows, weight), x) == 0


def test_strided_input_and_output_buffer() -> None:
    """q|k|v-style views in, a static buffer (piecewise graphs) out: written in place, same bits as contiguous."""
    x, weight, b = operands(48, 40, torch.float32, bias=True)
    wide = torch.randn(x.shape[0], 80, device=DEVICE)
    wide[:, 16:64] = x
    out = torch.full((x.shape[0], 40), float("nan"), device=DEVICE)
    returned = batch_invariant_linear(wide[:, 16:64], weight, b, out=out)
    assert returned.data_ptr() == out.data_ptr()
    assert torch.equal(out, batch_invariant_linear(x, weight, b))
    assert batch_invariant_linear(x[:0], weight).shape == (0, 40)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_linear_layers_follow_the_kernel_mode(batch_invariant: bool) -> None:
    kernels = KernelMode(batch_invariant=batch_invariant)
    torch.manual_seed(0)
    layer = Linear(24, 40, bias=True, kernels=kernels).to(DEVICE)
    stacked = StackedLinear(24, [16, 8, 8], ["q_proj", "k_proj", "v_proj"], kernels=kernels).to(DEVICE)
    x = torch.randn(5, 24, device=DEVICE)
    with torch.no_grad():
        if batch_invariant:
            assert torch.equal(layer(x), batch_invariant_linear(x, layer.weight, layer.bias))
            assert torch.equal(stacked.forward_rows(x, 16, 32), batch_invariant_linear(x, stacked.weight[16:]))
        else:
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
            torch.testing.assert_close(stacked.forward_rows(x, 16, 32), F.linear(x, stacked.weight[16:]))
        out = torch.empty(5, 40, device=DEVICE)
        linear_into(layer, x, out)
        torch.testing.assert_close(out, layer(x), atol=0, rtol=0)
