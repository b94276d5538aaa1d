"""Small fused Triton kernels for the decode loop: RMSNorm(+residual add), [q/k norm +] rope on q and k [+ K/V
cache store], SiLU·mul, and row argmax (greedy tokens from logits).

Each replaces 6–16 elementwise torch launches; inside CUDA graphs launch count is what costs."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from blockspec.pdl import pdl_launch, wait_for_previous_grid


@triton.jit
def _rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_grid(PDL)
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
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(shape[-1]), **pdl_launch(x),
    )
    return out.view(shape)


@triton.jit
def _norm_rope_heads(base, stride_head, num_heads, norm_weight_ptr, eps, cos, sin,
                     HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr):
    """Loads one token's heads [BLOCK_H, 2 * HALF] as halves, optionally RMS-normalises each head, rotates them."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    offsets = heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        # NOTE: HF order (as RMSNorm): normalise in fp32, cast to the input dtype, multiply by the weight, cast.
        dtype = base.dtype.element_ty
        inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(norm_weight_ptr + dims)[None, :]
        w2 = tl.load(norm_weight_ptr + HALF + dims)[None, :]
        x1 = (w1 * (x1 * inv).to(dtype)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype)).to(dtype).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _store_heads(base, stride_head, num_heads, x1, x2, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    offsets = heads[:, None] * stride_head + dims[None, :]
    tl.store(base + offsets, x1.to(base.dtype.element_ty), mask=mask)
    tl.store(base + offsets + HALF, x2.to(base.dtype.element_ty), mask=mask)


# NOTE: positions and slots are read one scalar per program; eager extends pass positions as a slice of build_batch's
# packed buffer, at an offset that varies with the batch, so alignment must not pick the compiled variant.
@triton.jit(do_not_specialize_on_alignment=("positions_ptr", "slots_ptr"))
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    eps, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cache_slot, stride_cache_head, stride_table, num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HAS_Q: tl.constexpr, QK_NORM: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per token: [q/k head norm], rope on q and k in place, [rotated k and v into the KV cache]."""
    wait_for_previous_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_table + dims)
    sin = tl.load(sin_ptr + pos * stride_table + dims)
    if HAS_Q:
        q_base = q_ptr + token * stride_q_tok
        q1, q2 = _norm_rope_heads(
            q_base, stride_q_head, num_q_heads, q_norm_ptr, eps, cos, sin, HALF, BLOCK_HQ, QK_NORM
        )
        _store_heads(q_base, stride_q_head, num_q_heads, q1, q2, HALF, BLOCK_HQ)
    k_base = k_ptr + token * stride_k_tok
    k1, k2 = _norm_rope_heads(k_base, stride_k_head, num_kv_heads, k_norm_ptr, eps, cos, sin, HALF, BLOCK_HK, QK_NORM)
    _store_heads(k_base, stride_k_head, num_kv_heads, k1, k2, HALF, BLOCK_HK)
    if STORE:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        # NOTE: k goes to the cache as the k tensor holds it (rounded to k's dtype), as a separate store would.
        k1 = k1.to(k_ptr.dtype.element_ty)
        k2 = k2.to(k_ptr.dtype.element_ty)
        _store_heads(k_cache_ptr + slot * stride_cache_slot, stride_cache_head, num_kv_heads, k1, k2, HALF, BLOCK_HK)
        heads = tl.arange(0, BLOCK_HK)
        mask = (heads < num_kv_heads)[:, None]
        v_offsets = token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
        v1 = tl.load(v_ptr + v_offsets, mask=mask, other=0.0)
        v2 = tl.load(v_ptr + v_offsets + HALF, mask=mask, other=0.0)
        _store_heads(v_cache_ptr + slot * stride_cache_slot, stride_cache_head, num_kv_heads, v1, v2, HALF, BLOCK_HK)


def rope_norm_store(
    q: Optional[torch.Tensor],
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    qk_norm: Optional[tuple[Optional[torch.Tensor], torch.Tensor, float]] = None,
    v: Optional[torch.Tensor] = None,
    store: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> None:
    """In one launch: optional per-head RMSNorm of q and k (weights, eps), rotate-half rope on q [T, Hq, D] and
    k [T, Hk, D] in place (cos/sin tables [max_pos, D // 2]), and with `store` = (k_cache, v_cache, slots) the
    rotated k and v [T, Hk, D] written at `slots`. q, k, v may be strided views (unit stride in the last dim)."""
    t, num_kv_heads, d = k.shape
    if t == 0:
        return
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, k, 0.0)
    k_cache, v_cache, slots = store if store is not None else (k, k, positions)
    value = v if v is not None else k
    query = q if q is not None else k
    assert k.stride(-1) == 1 and query.stride(-1) == 1 and value.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and (store is None or v is not None)
    assert (q is None or qk_norm is None) or q_weight is not None
    _rope_store_kernel[(t,)](
        query, k, value, positions, cos_table, sin_table, q_weight if q_weight is not None else k, k_weight,
        k_cache, v_cache, slots, eps,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), cos_table.stride(0), query.shape[1], num_kv_heads,
        HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(query.shape[1]), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        HAS_Q=q is not None, QK_NORM=qk_norm is not None, STORE=store is not None, **pdl_launch(k),
    )


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, stride_in, stride_out, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    wait_for_previous_grid(PDL)
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
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                    **pdl_launch(gate_up))
    return out


@triton.jit
def _chunk_argmax_kernel(x_ptr, best_val_ptr, best_idx_ptr, n_cols, stride_x, num_chunks, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Per (row, chunk of BLOCK columns): the chunk's max and its first column; a chunk holding NaN reports NaN
    and its first NaN (torch.argmax counts NaN as the largest value)."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan, cols, n_cols), 0)
    x = tl.where(is_nan, float("-inf"), x)
    top = tl.max(x, 0)
    first = tl.min(tl.where(x == top, cols, n_cols), 0)
    has_nan = first_nan < n_cols
    top = tl.where(has_nan, float("nan"), top)
    first = tl.where(has_nan, first_nan, first)
    tl.store(best_val_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _pick_argmax_kernel(best_val_ptr, best_idx_ptr, out_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr,
                        PDL: tl.constexpr = False):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    valid = chunks < num_chunks
    vals = tl.load(best_val_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"))
    idxs = tl.load(best_idx_ptr + row * num_chunks + chunks, mask=valid, other=2**31 - 1)
    is_nan = vals != vals
    any_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), vals), 0)
    winner = tl.where(any_nan, is_nan, vals == top) & valid
    tl.store(out_ptr + row, tl.min(tl.where(winner, idxs, 2**31 - 1), 0).to(tl.int64))


def argmax_rows(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """torch.argmax(x, -1) for 2-D fp32/fp16/bf16 x, compared in fp32 (first index on ties, NaN largest), in two
    short launches: per-chunk maxima over many programs, then one pick per row. int64 [rows]."""
    rows, n_cols = x.shape
    assert x.stride(-1) == 1 and n_cols + block <= 2**31 - 1  # int32 column indices
    num_chunks = triton.cdiv(n_cols, block)
    best_val = torch.empty((rows, num_chunks), dtype=torch.float32, device=x.device)
    best_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    _chunk_argmax_kernel[(rows, num_chunks)](x, best_val, best_idx, n_cols, x.stride(0), num_chunks, BLOCK=block,
                                             num_warps=8, **pdl_launch(x))
    _pick_argmax_kernel[(rows,)](best_val, best_idx, out, num_chunks, BLOCK_CHUNKS=triton.next_power_of_2(num_chunks),
                                 num_warps=1, **pdl_launch(x))
    return out
