"""Small fused Triton kernels for the decode loop: RMSNorm(+residual add), rotary on q and k, SiLU·mul.

Each replaces 6–16 elementwise torch launches; inside CUDA graphs launch count is what costs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_ptr + row * stride_r + cols, x.to(residual_ptr.dtype.element_ty), mask=mask)
    variance = tl.sum(x * x, 0) / n_cols
    # NOTE: HF order: normalise in fp32, cast to the input dtype, then multiply by the weight.
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim; with `residual`, first does residual += x (in place) and normalises that."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    r2 = residual.view(-1, shape[-1]) if residual is not None else x2
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), shape[-1], eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(shape[-1]),
    )
    return out.view(shape)


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, stride_tok, stride_head, stride_table, num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_table + dims)
    sin = tl.load(sin_ptr + pos * stride_table + dims)
    mask = (heads < num_heads)[:, None]
    base = x_ptr + token * stride_tok + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_inplace(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on x [T, H, D] in place; cos/sin tables are [max_pos, D] (halves repeated)."""
    t, h, d = x.shape
    if t == 0:
        return x
    _rotary_kernel[(t,)](
        x, positions, cos_table, sin_table, x.stride(0), x.stride(1), cos_table.stride(0), h,
        HALF=d // 2, BLOCK_H=triton.next_power_of_2(h),
    )
    return x


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
