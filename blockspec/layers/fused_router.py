"""The MoE router fused for CUDA (Triton): a few tokens' router logits and their routing in one launch, equal to
SparseMoe's `gate` (a bias-free Linear) followed by `fused_route` (layers/fused_moe.py).

Why: at decode the router is a GEMV over a small weight ([E, H]: 512 KB for Qwen3-30B-A3B), yet it costs a cuBLAS
launch, which PDL cannot overlap, and the routing launch after it. Here one launch does both:
- grid (T, ceil(E / EXPERTS_PER_PROGRAM)): program (t, p) computes token t's logits of experts [p·EPP, (p+1)·EPP) in
  fp32, rounds them to the Linear's output dtype and stores them to a scratch row [T, E];
- "the last program finishes": each program then bumps token t's arrival counter (an atomic with acquire/release
  semantics, after a barrier so all of the program's stores were issued); the one that arrives last reads the E
  logits back and routes them (`route_row`, the same code as `_route_kernel`), then sets the counter back to 0.

NOTE: the logits are rounded to the Linear's output dtype (bf16 for a bf16 model) before the softmax, because the
path this replaces routes the Linear's rounded logits (`route` and `fused_route` upcast them): routing the fp32 sums
would move every weight by up to a bf16 step of the logits and could swap a near-tied k-th expert. Rounded, the two
paths differ only where the summation orders (the kernel's against cuBLAS's, both in fp32) round to different bf16
neighbours.

NOTE: the counters are a persistent buffer of the layer (`router_counters`, one int32 per token up to
FUSED_ROUTER_MAX_TOKENS), zero between launches: each launch leaves them as it found them, which is what lets the
next launch, and every replay of a CUDA graph that captured this one, start clean without a memset. A launch that
died half way (an illegal address, say) would leave a counter off; the whole context is lost then anyway.
NOTE: one launch at a time per counter buffer: two streams running the same layer at once would share counters.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockspec.layers.fused_moe import ROUTE_NUM_WARPS, route_row, routing_blocks
from blockspec.pdl import pdl_launch, wait_for_previous_grid

# NOTE: the fused router runs for at most this many tokens (decode up to batch 16, one verify block of 16). Its grid
# has a program per token and expert group, so every token reads the whole router weight (from L2 after the first):
# the reads grow with T where the GEMM's do not, while what the fusion saves (a launch, and a GEMV PDL cannot
# overlap) does not grow with T. Past a few tokens the GEMM + `fused_route` path is the better one.
FUSED_ROUTER_MAX_TOKENS = 16
# NOTE: 2 experts a program over one warp: 64 programs per token for 128 experts, each streaming 2 weight rows (8 KB
# at hidden 2048 in bf16), so even one token keeps most SMs reading the weight at once. Chosen by the router sweep
# (`benchmarks/moe.py --parts router`, docs/performance.md): the fastest launch shape at 1, 8 and 16 tokens.
EXPERTS_PER_PROGRAM = 2
# NOTE: the hidden dimension is read in chunks of at most this many columns: all of Qwen3-30B-A3B's 2048 in one
# load (EXPERTS_PER_PROGRAM x 2048 elements over one warp: 128 fp32 partial sums per thread, the sweep's limit).
MAX_BLOCK_H = 2048
# NOTE: the last program routes over the launch's warps, so the default must be `fused_route`'s for the two paths to
# route bit-alike (ROUTE_NUM_WARPS says why)
NUM_WARPS = ROUTE_NUM_WARPS


def new_router_counters(device: torch.device) -> torch.Tensor:
    """The zeroed arrival counters one layer's fused router needs (FUSED_ROUTER_MAX_TOKENS int32)."""
    return torch.zeros(FUSED_ROUTER_MAX_TOKENS, dtype=torch.int32, device=device)


@triton.jit
def _round_to_bf16(value):
    """fp32 `value` rounded to the nearest bfloat16 (ties to even), kept in fp32: the rounding of the GPU's
    fp32 → bf16 conversion, for finite values. NOTE: in integer arithmetic on the bits because Triton's CPU
    interpreter truncates in that conversion; a value already exact in bf16 then converts the same everywhere."""
    bits = value.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _router_kernel(x_ptr, w_ptr, logits_ptr, counters_ptr, weights_ptr, ids_ptr, num_experts, hidden, stride_xt,
                   stride_we, stride_lt, TOP_K: tl.constexpr, EXPERTS_PER_PROGRAM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Program (t, p): logits[t, e] = x[t] · w[e] in fp32 for its experts e, stored rounded to logits' dtype (what
    the Linear returns); the last of token t's programs to arrive routes logits[t] (`route_row`) and resets
    counters[t] to 0."""
    wait_for_previous_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * EXPERTS_PER_PROGRAM + tl.arange(0, EXPERTS_PER_PROGRAM)
    expert_valid = experts < num_experts
    rows = w_ptr + experts.to(tl.int64)[:, None] * stride_we
    partial = tl.zeros((EXPERTS_PER_PROGRAM, BLOCK_H), dtype=tl.float32)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_valid = cols < hidden
        x = tl.load(x_ptr + token * stride_xt + cols, mask=col_valid, other=0.0).to(tl.float32)
        w = tl.load(rows + cols[None, :], mask=expert_valid[:, None] & col_valid[None, :], other=0.0)
        partial += w.to(tl.float32) * x[None, :]
    logits = tl.sum(partial, axis=1)
    # NOTE: rounded as the Linear rounds its output (bf16 for a bf16 model): the routing then sees the logits the
    # GEMM + fused_route path sees, up to the summation order within fp32
    if logits_ptr.dtype.element_ty == tl.bfloat16:
        logits = _round_to_bf16(logits)
    tl.store(logits_ptr + token * stride_lt + experts, logits.to(logits_ptr.dtype.element_ty), mask=expert_valid)
    # NOTE: every thread of the program has issued its stores before the (single) atomic releases them
    tl.debug_barrier()
    arrived = tl.atomic_add(counters_ptr + token, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        row = tl.arange(0, BLOCK_E)
        row_valid = row < num_experts
        # NOTE: .cg reads at L2, where the other programs' stores are, never a line this SM's L1 may hold
        row_logits = tl.load(logits_ptr + token * stride_lt + row, mask=row_valid, other=-float("inf"),
                             cache_modifier=".cg").to(tl.float32)
        route_row(row_logits, row_valid, weights_ptr + token * TOP_K, ids_ptr + token * TOP_K, TOP_K, BLOCK_E,
                  BLOCK_K, RENORMALIZE)
        tl.store(counters_ptr + token, 0)  # NOTE: every other program of the token has counted: no race


def fused_router(x: torch.Tensor, weight: torch.Tensor, counters: torch.Tensor, top_k: int, renormalize: bool,
                 experts_per_program: int = EXPERTS_PER_PROGRAM,
                 num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_route(F.linear(x, weight), E, top_k, renormalize) in one launch: (weights [T, k] float32, expert ids
    [T, k] int64) for hidden states x [T, H] and the router weight [E, H] (nn.Linear's layout, same dtype as x).
    `counters`: the layer's zeroed arrival counters (new_router_counters), left zeroed; T <= their number.
    `experts_per_program` (a power of two) and `num_warps` shape the launch: the layer uses the defaults, and
    `benchmarks/moe.py --parts router` times the others. NOTE: the result does not depend on `experts_per_program`;
    a `num_warps` other than ROUTE_NUM_WARPS may round the softmax sum differently once E passes 32 experts."""
    if experts_per_program < 1 or experts_per_program & (experts_per_program - 1):
        raise ValueError(f"fused_router: experts_per_program must be a power of two, got {experts_per_program}")
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    if num_tokens > counters.numel():
        raise ValueError(f"fused_router: {num_tokens} tokens, counters for {counters.numel()}")
    assert weight.shape[1] == hidden and weight.dtype == x.dtype, (tuple(weight.shape), weight.dtype, x.dtype)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and counters.dtype == torch.int32
    logits = torch.empty((num_tokens, num_experts), dtype=x.dtype, device=x.device)  # NOTE: scratch
    grid = (num_tokens, triton.cdiv(num_experts, experts_per_program))
    _router_kernel[grid](
        x, weight, logits, counters, weights, ids, num_experts, hidden, x.stride(0), weight.stride(0),
        logits.stride(0), TOP_K=top_k, EXPERTS_PER_PROGRAM=experts_per_program,
        BLOCK_H=min(MAX_BLOCK_H, triton.next_power_of_2(hidden)), **routing_blocks(num_experts, top_k),
        RENORMALIZE=renormalize, num_warps=num_warps,
        **pdl_launch(x),
    )
    return weights, ids
