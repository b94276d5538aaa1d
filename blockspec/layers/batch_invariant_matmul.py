"""Batch-invariant GEMM for --enable-deterministic-inference: out = x @ weight.T (+ bias) in one Triton kernel.

cuBLAS picks its algorithm (tile shape, split-K) from M, the number of tokens, so a row's result depends on how many
other rows share the forward. Here the tiles depend only on (N, K, dtype), there is no split-K, and each program
reduces K in BLOCK_K steps from 0 upwards into one fp32 accumulator: every output row sees the same sequence of
roundings for any M, so a token's projections (and its logits) are the same in a 1-token decode, a verify block and
a long extend. The tiles are a host-side function of the weight alone, so graph capture at any M replays as is."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from blockspec.pdl import pdl_launch, wait_for_previous_grid


@dataclass(frozen=True)
class MatmulTiles:
    """Launch shape of _matmul_kernel: output tile, K step, programs grouped along M for L2 reuse, warps, stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


@functools.lru_cache(maxsize=None)
def matmul_tiles(n: int, k: int, dtype: torch.dtype) -> MatmulTiles:
    """NOTE: a function of (N, K, dtype) only. M must never choose the tiles: that is what makes rows invariant."""
    block_k = 64 if k >= 64 else 32
    if dtype == torch.float32:
        return MatmulTiles(64, 64, 32, num_stages=3)
    return MatmulTiles(64, 128 if n >= 4096 else 64, block_k)


# NOTE: M is never specialised (an M of 1 or a multiple of 16 would compile its own variant).
@triton.jit(do_not_specialize=("m",))
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, m, n, k,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_previous_grid(PDL)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_valid = rows < m
    col_valid = cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_valid = ks < k
        a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=col_valid[None, :] & k_valid[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [.., K], weight [N, K] (any strides), written into `out` [.., N] when given."""
    n, k = weight.shape
    assert x.shape[-1] == k and x.dtype == weight.dtype, (tuple(x.shape), tuple(weight.shape), x.dtype, weight.dtype)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    result = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device) if out is None else out
    out2 = result.view(m, n)  # NOTE: a view: a static output buffer must be written in place
    if m == 0 or n == 0:
        return result
    chosen = matmul_tiles(n, k, x.dtype)
    grid = (triton.cdiv(m, chosen.block_m) * triton.cdiv(n, chosen.block_n),)
    _matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, out2, m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), out2.stride(0), out2.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=chosen.block_m, BLOCK_N=chosen.block_n, BLOCK_K=chosen.block_k,
        GROUP_M=chosen.group_m, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=chosen.num_warps, num_stages=chosen.num_stages, **pdl_launch(x),
    )
    return result
