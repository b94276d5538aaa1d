"""The DFlash2 draft's two fused Triton kernels (CUDA; the torch code in models/ stays the reference and the CPU path).

- `block_causal_conv`: GroupedDynamicCausalConv's convolution, out[t] = Σ_o (base[o] + dynamic[t, o, group]) ·
  hidden[t - o] over the taps o inside t's block, one launch (the torch form is about 15 launches and a [T, taps, H]
  weight tensor per convolution, ten convolutions in a 5-layer draft).
- `candidate_walk`: CandidateSelector's greedy walk, one program per block chasing its rows' [k, k] transition tables
  (the torch form is three launches per row). The same fp32 additions and first-index argmax as the torch walk, so
  the same picks.

Both are row-local (nothing depends on the batch) and take static shapes (they run inside the CUDA graphs)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockspec.pdl import pdl_launch, wait_for_previous_grid


@triton.jit
def _block_causal_conv_kernel(hidden_ptr, dynamic_ptr, base_ptr, out_ptr, width, block_size, group_size,
                              stride_h, stride_o, stride_dt, stride_do, TAPS: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = False):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    groups = cols // group_size
    inside = row % block_size  # NOTE: taps reach back at most this many rows (never across the block start)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for offset in tl.static_range(TAPS):
        if offset <= inside:
            weight = tl.load(base_ptr + offset * width + cols, mask=mask, other=0.0).to(tl.float32)
            weight += tl.load(dynamic_ptr + row * stride_dt + offset * stride_do + groups, mask=mask,
                              other=0.0).to(tl.float32)
            x = tl.load(hidden_ptr + (row - offset) * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            acc += weight * x
    tl.store(out_ptr + row * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_causal_conv(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int,
                      group_size: int) -> torch.Tensor:
    """hidden [T, H] (T a whole number of blocks), dynamic [T, taps, H / group_size] (any strides with a unit last
    one), base [taps, H] → [T, H] in hidden's dtype (the taps summed in fp32)."""
    rows, width = hidden.shape
    taps = base.shape[0]
    assert hidden.stride(1) == 1 and dynamic.stride(2) == 1 and base.is_contiguous() and rows % block_size == 0
    out = torch.empty_like(hidden)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(width))
    _block_causal_conv_kernel[(rows, triton.cdiv(width, block))](
        hidden, dynamic, base, out, width, block_size, group_size, hidden.stride(0), out.stride(0), dynamic.stride(0),
        dynamic.stride(1), TAPS=taps, BLOCK=block, **pdl_launch(hidden),
    )
    return out


@triton.jit
def _candidate_walk_kernel(unary_ptr, ids_ptr, transitions_ptr, out_ptr, rows, top_k, stride_un, stride_ur,
                           stride_in, stride_ir, stride_tn, stride_tr, stride_ta, stride_on,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_grid(PDL)
    block = tl.program_id(0).to(tl.int64)
    candidates = tl.arange(0, BLOCK_K)
    mask = candidates < top_k
    # NOTE: row 0's predecessor is the anchor, whose k transition rows are equal: row 0 of them will do
    chosen = tl.program_id(0) * 0
    for j in range(rows):
        unary = tl.load(unary_ptr + block * stride_un + j * stride_ur + candidates, mask=mask, other=-float("inf"))
        after = tl.load(transitions_ptr + block * stride_tn + j * stride_tr + chosen * stride_ta + candidates,
                        mask=mask, other=0.0)
        chosen = tl.argmax(unary + after, axis=0, tie_break_left=True).to(tl.int32)
        token = tl.load(ids_ptr + block * stride_in + j * stride_ir + chosen)
        tl.store(out_ptr + block * stride_on + j, token)


def candidate_walk(unary: torch.Tensor, ids: torch.Tensor, transitions: torch.Tensor) -> torch.Tensor:
    """CandidateSelector.greedy_walk: unary [N, P, k] fp32, ids [N, P, k] int64, transitions [N, P, k, k] fp32 →
    [N, P] int64 token ids."""
    n, rows, top_k = unary.shape
    assert unary.stride(2) == 1 and ids.stride(2) == 1 and transitions.stride(3) == 1
    out = torch.empty((n, rows), dtype=ids.dtype, device=ids.device)
    if n == 0:
        return out
    _candidate_walk_kernel[(n,)](
        unary, ids, transitions, out, rows, top_k, unary.stride(0), unary.stride(1), ids.stride(0), ids.stride(1),
        transitions.stride(0), transitions.stride(1), transitions.stride(2), out.stride(0),
        BLOCK_K=max(16, triton.next_power_of_2(top_k)), **pdl_launch(unary),
    )
    return out
