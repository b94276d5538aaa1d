"""out = x @ weight.T for a few rows of x (M <= 16: a decode or DFlash block at batch 1): one Triton launch that
streams the weight once, no split-K, so no reduce kernel after it.

At such M a linear layer reads its weight and does almost no arithmetic, so its time is bytes ÷ bandwidth; each
program owns BLOCK_N output columns and walks K in BLOCK_K steps with pipelined loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # tl.dot needs >= 16 rows; x rows past M are masked to zero


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


DEFAULT_CONFIG = SkinnyConfig(32, 256, 4, 4)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_valid = cols < N
    row_valid = rows < M
    x_base = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_base = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_base + k0, mask=row_valid[:, None], other=0.0)
            w = tl.load(w_base + k0, mask=col_valid[:, None], other=0.0)
        else:
            k_valid = (k0 + ks) < K
            x = tl.load(x_base + k0, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_base + k0, mask=col_valid[:, None] & k_valid[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    out_offsets = rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, out: Optional[torch.Tensor] = None, config: SkinnyConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """x [M, K] (M <= 16, unit stride in K) @ weight [N, K].T → [M, N], written into `out` when given."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear takes x [<= {MAX_ROWS}, K] and weight [N, K] with unit stride in K, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (m, n) and out.stride(1) == 1
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
