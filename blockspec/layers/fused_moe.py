"""The MoE experts fused for CUDA (Triton): SparseMoe's "triton" backend, equal to `experts_reference` (layers/moe.py).

Four steps, six launches (four for a single token's direct tiles, three with `down_columns`), static shapes
throughout (no host sync: the whole layer captures in a CUDA graph), after the router's GEMM (one more launch):
0. `fused_route` (one launch): each token's softmax over the router logits, its top k and their renormalisation,
   in fp32 (SparseMoe's `route` as four torch launches or more). For up to FUSED_ROUTER_MAX_TOKENS tokens the
   router's GEMM and this step are one launch instead (layers/fused_router.py, sharing `route_row`), so a decode
   layer of one token runs four launches in all.
1. `sort_by_expert` (two small launches: counts, then placement by atomic counters): the T·k (token, slot) pairs
   grouped by expert, each expert's group padded to a multiple of BLOCK_M rows, so every block of BLOCK_M sorted
   rows belongs to one expert. The buffer is sized for the worst case (every hit expert padded), and the blocks past
   the used ones are marked -1. NOTE: two launches rather than a chain of small torch ops (a sort, cumsums,
   gathers): in a decode graph every layer pays for each launch. A single token skips the sort (`direct` tiles):
   its k pairs, k distinct experts, are blocks 0..k-1 as they come from the router.
2. `_gate_up_kernel`: per (block, column tile of I) one grouped-GEMM tile: the block's tokens × its expert's gate
   and up rows, SiLU(gate)·up, stored per pair. `_down_kernel`: the same over the down projection, scaled by the
   pair's routing weight. Blocks marked -1 return at once, so only the experts actually hit are read: a decode
   step reads the k experts per token it routes to, not all E. Direct tiles with `prefetch_down` have each down
   program, resident under PDL while the gate/up kernel runs, ask L2 for its down weights before it waits.
3. `_combine_kernel`: each token's k weighted rows summed in fp32 (a fixed order: the result does not depend on
   which other tokens share the batch). Direct tiles with `down_columns` fold it into the down projection
   (`_down_direct_kernel`: a program per token and column tile streams the token's k experts together and sums
   them), one launch less per layer.

NOTE: the tiles follow the average rows per expert (T·k / E), except under batch-invariant kernels, where they are
fixed (a row's sums then never depend on the batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from blockspec.pdl import L2_LINE_BYTES, pdl_enabled, pdl_launch, prefetch_to_l2, wait_for_previous_grid


@dataclass(frozen=True)
class ExpertTiles:
    block_m: int  # sorted (token, slot) rows per block: each expert's group is padded to a multiple of it
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    # NOTE: direct: block b holds pair b alone, its expert read from the routing itself: no sort launches. For a
    # single token (its k experts are distinct, so no expert is read twice) the sort is pure launch latency.
    direct: bool = False
    # NOTE: direct tiles only: the down projection sums each token's k experts itself, this many output columns a
    # program (`_down_direct_kernel`: no combine launch, no pair buffer); None keeps the down and combine
    # kernels. A token's k experts are all in each program, so narrow column tiles keep about one program per SM
    # streaming weights (2048 / 16 = 128 programs for one token).
    down_columns: Optional[int] = None
    # NOTE: direct tiles with the down and combine kernels only: under PDL each down program is resident while the
    # gate/up kernel still runs, and asks L2 for its slab of the down weights before it waits (its expert comes from
    # the routing, final before the gate/up kernel started), so the layer's last third of weight bytes streams
    # beside its first two; the gate/up kernel then reads its weights evict-first, which keeps those slabs in L2
    prefetch_down: bool = False

    def __post_init__(self) -> None:
        if self.down_columns is not None and not self.direct:
            raise ValueError("ExpertTiles.down_columns folds the combine into direct tiles' down projection only")
        if self.prefetch_down and (not self.direct or self.down_columns is not None):
            raise ValueError("ExpertTiles.prefetch_down is for direct tiles with the down and combine kernels only")
        if self.down_columns is not None and (self.down_columns < 16 or self.down_columns & (self.down_columns - 1)):
            raise ValueError(f"ExpertTiles.down_columns must be a power of two, at least 16 (got {self.down_columns})")


BATCH_INVARIANT_TILES = ExpertTiles(16, 64, 64)
# NOTE: `_count_experts_kernel`'s one program: its tally tile, warps, pairs a trip at most (a few experts' lanes make a
# tall tile whose layout spills), sentinel rows a store
COUNT_TILE_ELEMENTS, COUNT_WARPS, COUNT_CHUNK_MAX, FILL_CHUNK = 16384, 16, 512, 4096
FOLD_TILE_ELEMENTS = 8192  # NOTE: `_down_direct_kernel`'s weight tile per step: 64 values a thread over 4 warps
PREFETCH_LANES = 256  # NOTE: L2 lines a down program asks for per trip of its prefetch (prefetch_down)
# NOTE: the best sets of benchmarks/moe.py's tile sweep (Qwen3-30B-A3B experts, bf16): BLOCK_K 128 wherever a
# block is 16 or 32 rows tall, 64 rows tall at about 64 rows per expert (docs/performance.md has the table)
EXPERT_TILES = (ExpertTiles(16, 64, 128), ExpertTiles(32, 64, 128), ExpertTiles(64, 64, 64))
# NOTE: without down_columns: the fold's first form (the k experts one after the other in each program) read slower
# than down + combine for one token on the H100; its form that streams them together is for the tile sweep to time
# (docs/performance.md)
DIRECT_TILES = ExpertTiles(16, 64, 128, direct=True)


def choose_tiles(num_pairs: int, num_experts: int, batch_invariant: bool = False,
                 num_tokens: Optional[int] = None) -> ExpertTiles:
    """Blocks about as tall as the experts' average share of the pairs (decode: 16, padding is wasted work); one
    token's pairs go to their blocks directly (no sort)."""
    if batch_invariant:
        return BATCH_INVARIANT_TILES
    if num_tokens == 1:
        return DIRECT_TILES
    rows_per_expert = num_pairs / max(num_experts, 1)
    return EXPERT_TILES[0 if rows_per_expert <= 16 else 1 if rows_per_expert <= 32 else 2]


def tile_choices(batch_invariant: bool = False) -> tuple[ExpertTiles, ...]:
    """Every tile set choose_tiles can return: with the layer's shapes and dtype, these are all the kernel variants
    serving can launch (the integers that follow the batch are not specialised), so start-up compiles each."""
    return (BATCH_INVARIANT_TILES,) if batch_invariant else EXPERT_TILES + (DIRECT_TILES,)


# NOTE: the integers that follow the batch (pairs, blocks, capacity) are not specialised (Triton would compile a
# variant for 1 and for multiples of 16): start-up's warm-up can then compile every variant (tile_choices).
BATCH_INTEGERS = ("num_pairs", "num_blocks", "capacity")


# NOTE: the warps `route_row` runs over, in both of its kernels: its softmax sum over E experts is a reduction whose
# order follows the warps' layout, so two launches with other warp counts can round it to neighbouring floats once E
# passes one warp's lanes (Qwen3-30B-A3B's 128). One warp suits one row of E ≤ 128: no shared-memory round trip in the
# reductions, and it is what the fused router's fastest launch shape uses (docs/performance.md).
ROUTE_NUM_WARPS = 1


@triton.jit
def route_row(logits, valid, weights_ptr, ids_ptr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token's routing from its logits [BLOCK_E] (fp32; `valid`: the first E lanes): softmax in fp32, the TOP_K
    largest probabilities (ties: the lower expert), divided by their sum when RENORMALIZE; stores the TOP_K weights
    (fp32) and expert ids (int64) at weights_ptr / ids_ptr. NOTE: shared by `_route_kernel` and the fused router
    (layers/fused_router.py), so both route alike, ties included."""
    experts = tl.arange(0, BLOCK_E)
    logits = tl.where(valid, logits, -float("inf"))
    exps = tl.where(valid, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    remaining = tl.where(valid, exps / tl.sum(exps, axis=0), -1.0)  # NOTE: -1: below every probability
    slots = tl.arange(0, BLOCK_K)
    chosen_weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        expert = tl.min(tl.where(remaining == best, experts, BLOCK_E), axis=0)
        chosen_weights = tl.where(slots == slot, best, chosen_weights)
        chosen_ids = tl.where(slots == slot, expert.to(tl.int64), chosen_ids)
        remaining = tl.where(experts == expert, -2.0, remaining)  # NOTE: -2: below the padding's -1
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    tl.store(weights_ptr + slots, chosen_weights, mask=slots < TOP_K)
    tl.store(ids_ptr + slots, chosen_ids, mask=slots < TOP_K)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_lt, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr = False):
    """One program per token: `route_row` over its logits."""
    wait_for_previous_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_lt + experts, mask=valid, other=-float("inf")).to(tl.float32)
    route_row(logits, valid, weights_ptr + token * TOP_K, ids_ptr + token * TOP_K, TOP_K, BLOCK_E, BLOCK_K,
              RENORMALIZE)


def routing_blocks(num_experts: int, top_k: int) -> dict[str, int]:
    """`route_row`'s block sizes for E experts and top k (its kernels' BLOCK_E and BLOCK_K launch arguments)."""
    return dict(BLOCK_E=max(16, triton.next_power_of_2(num_experts)), BLOCK_K=max(2, triton.next_power_of_2(top_k)))


def fused_route(router_logits: torch.Tensor, num_experts: int, top_k: int,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.route in one launch: (weights [T, k] float32, expert ids [T, k] int64) for router logits [T, E]."""
    num_tokens = router_logits.shape[0]
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    assert router_logits.stride(-1) == 1 and router_logits.shape[1] == num_experts
    _route_kernel[(num_tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
        **routing_blocks(num_experts, top_k), RENORMALIZE=renormalize, num_warps=ROUTE_NUM_WARPS,
        **pdl_launch(router_logits),
    )
    return weights, ids


@triton.jit(do_not_specialize=BATCH_INTEGERS)
def _count_experts_kernel(ids_ptr, num_pairs, next_row_ptr, block_experts_ptr, num_blocks, pair_rows_ptr, capacity,
                          NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                          CHUNK: tl.constexpr, FILL_CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """One program: each expert's pair count padded to whole blocks; the first row of each expert's group (into
    next_row, the counters the placing kernel advances), each block's expert (-1 past the used rows), and the
    sentinel num_pairs in every row of pair_rows.

    NOTE: one program walks all T·k pairs, so its loop's trips cost the most where a batch has many pairs (a verify
    of 64 blocks: 8,192): each trip takes CHUNK ids and only adds matches into a [CHUNK, BLOCK_E] tally (no
    reduction, no barrier inside the loop; one sum after it), and the sentinel rows are written FILL_CHUNK at a
    time."""
    wait_for_previous_grid(PDL)
    experts = tl.arange(0, BLOCK_E)
    tally = tl.zeros((CHUNK, BLOCK_E), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        index = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + index, mask=index < num_pairs, other=BLOCK_E)  # NOTE: past the end: no expert
        tally += (ids[:, None] == experts[None, :]).to(tl.int32)
    counts = tl.sum(tally, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    group_end = tl.cumsum(padded, axis=0)
    tl.store(next_row_ptr + experts, group_end - padded, mask=experts < NUM_EXPERTS)
    used_rows = tl.sum(padded, axis=0)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        first_row = blocks * BLOCK_M
        # NOTE: the block's expert = how many groups end at or before its first row (empty groups end where the
        # previous one does, so they are skipped)
        expert = tl.sum((group_end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.where(first_row < used_rows, expert, -1), mask=blocks < num_blocks)
    for start in range(0, capacity, FILL_CHUNK):
        rows = start + tl.arange(0, FILL_CHUNK)
        tl.store(pair_rows_ptr + rows, tl.zeros((FILL_CHUNK,), dtype=tl.int32) + num_pairs, mask=rows < capacity)


@triton.jit(do_not_specialize=BATCH_INTEGERS[:1])
def _place_pairs_kernel(ids_ptr, num_pairs, next_row_ptr, pair_rows_ptr, CHUNK: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Every pair takes the next free row of its expert's group (an atomic counter per expert)."""
    wait_for_previous_grid(PDL)
    index = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    valid = index < num_pairs
    ids = tl.load(ids_ptr + index, mask=valid, other=0)
    rows = tl.atomic_add(next_row_ptr + ids, 1, mask=valid)
    tl.store(pair_rows_ptr + rows, index.to(tl.int32), mask=valid)


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_rows [capacity] int32, block_experts [capacity / block_m] int32) for expert ids [T, k]: pair_rows holds
    the pairs (t · k + slot) grouped by expert in ascending expert order, each group padded with the sentinel T · k
    to a multiple of block_m; block_experts[b] is the expert of rows [b · block_m, (b + 1) · block_m), -1 past the
    last used block. Two launches. NOTE: within a group the pairs come in no fixed order (atomics): each row is
    computed on its own and combined by pair, so the order changes no result. capacity = T·k + min(E, T·k)·(block_m
    - 1), rounded up to block_m: the most padding any routing needs, so the shapes depend on T only."""
    num_pairs = ids.numel()
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    pair_rows = torch.empty(capacity, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=ids.device)
    next_row = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1)
    block_e = max(16, triton.next_power_of_2(num_experts))
    # NOTE: the counting program tallies [CHUNK, BLOCK_E] tiles: COUNT_TILE_ELEMENTS over COUNT_WARPS warps keep
    # 32 tallies a thread in registers
    _count_experts_kernel[(1,)](
        flat, num_pairs, next_row, block_experts, block_experts.shape[0], pair_rows, capacity, NUM_EXPERTS=num_experts,
        BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=min(COUNT_CHUNK_MAX, max(16, COUNT_TILE_ELEMENTS // block_e)),
        FILL_CHUNK=FILL_CHUNK, num_warps=COUNT_WARPS, **pdl_launch(ids),
    )
    chunk = 128
    _place_pairs_kernel[(triton.cdiv(num_pairs, chunk),)](flat, num_pairs, next_row, pair_rows, CHUNK=chunk,
                                                         **pdl_launch(ids))
    return pair_rows, block_experts


@triton.jit
def _block_pairs(pair_rows_ptr, block_experts_ptr, num_pairs, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """(expert, pairs [BLOCK_M], valid [BLOCK_M]) of this program's block of sorted rows: its expert (-1: an unused
    block) and its (token, slot) pairs (the sentinel num_pairs on padding rows). DIRECT: block b is pair b alone and
    block_experts_ptr the flat expert ids (no sort ran)."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if DIRECT:
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, block, num_pairs).to(tl.int64)
    else:
        pairs = tl.load(pair_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pairs, pairs < num_pairs


@triton.jit(do_not_specialize=BATCH_INTEGERS[:1])
def _gate_up_kernel(x_ptr, w_ptr, pair_rows_ptr, block_experts_ptr, out_ptr, num_pairs, hidden, intermediate, top_k,
                    stride_xt, stride_we, stride_wn, stride_ot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr,
                    WEIGHT_EVICTION: tl.constexpr = "", PDL: tl.constexpr = False):
    """out[pair, cols] = SiLU(x[token] · gate[e, cols]) · (x[token] · up[e, cols]) for the block's pairs, e its
    expert (w [E, 2 I, H]: gate rows, then up rows). WEIGHT_EVICTION: the weight loads' L2 eviction policy."""
    wait_for_previous_grid(PDL)
    expert, pairs, valid = _block_pairs(pair_rows_ptr, block_experts_ptr, num_pairs, BLOCK_M, DIRECT)
    if expert < 0:
        return
    tokens = pairs // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < intermediate
    gate_rows = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    up_rows = gate_rows + intermediate * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, hidden, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_valid = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=valid[:, None] & k_valid[None, :],
                    other=0.0)
        w_mask = k_valid[:, None] & col_valid[None, :]
        gate_w = tl.load(gate_rows + ks[:, None], mask=w_mask, other=0.0, eviction_policy=WEIGHT_EVICTION)
        up_w = tl.load(up_rows + ks[:, None], mask=w_mask, other=0.0, eviction_policy=WEIGHT_EVICTION)
        gate = tl.dot(a, gate_w, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, up_w, up, input_precision=DOT_PRECISION)
    activated = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], activated.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_valid[None, :])


@triton.jit(do_not_specialize=BATCH_INTEGERS[:1])
def _down_kernel(h_ptr, w_ptr, routing_ptr, pair_rows_ptr, block_experts_ptr, out_ptr, num_pairs, hidden,
                 intermediate, stride_ht, stride_we, stride_wn, stride_ot, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr,
                 PREFETCH: tl.constexpr, LINE_ELEMENTS: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr = False):
    """out[pair, cols] = routing[pair] · (h[pair] · down[e, cols]), summed in fp32 and stored in out's dtype
    (w [E, H, I], contiguous). PREFETCH (direct tiles under PDL): the program's weight slab is asked of L2 first."""
    if PREFETCH:
        # NOTE: the one read before the wait: the direct tiles' expert ids come from the routing, whose grid
        # completed before the gate/up kernel's programs passed their waits, and so before this grid launched
        first_col = tl.program_id(1) * BLOCK_N
        slab_expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
        prefetch_to_l2(w_ptr + slab_expert * stride_we + first_col * stride_wn,
                       tl.minimum(BLOCK_N, hidden - first_col) * stride_wn, LINE_ELEMENTS, LANES)
    wait_for_previous_grid(PDL)
    expert, pairs, valid = _block_pairs(pair_rows_ptr, block_experts_ptr, num_pairs, BLOCK_M, DIRECT)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden
    down_rows = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, intermediate, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_valid = ks < intermediate
        a = tl.load(h_ptr + pairs[:, None] * stride_ht + ks[None, :], mask=valid[:, None] & k_valid[None, :],
                    other=0.0)
        w = tl.load(down_rows + ks[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(routing_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_valid[None, :])


@triton.jit
def _down_direct_kernel(h_ptr, w_ptr, routing_ptr, ids_ptr, out_ptr, hidden, intermediate, top_k, stride_ht,
                        stride_we, stride_wn, stride_ot, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Direct tiles' down projection and combine in one: out[t, cols] = the sum over t's k slots of
    routing[pair] · (h[pair] · down[e, cols]) in fp32, pair = t·k + slot and e its expert (w [E, H, I]).

    NOTE: the k experts' weight tiles are one [BLOCK_S, BLOCK_N, BLOCK_K] load per step, so a program keeps all k
    weight streams in flight at once; a loop over the slots, one expert after the other, makes each program a short
    dependent chain (docs/performance.md has what that form read)."""
    wait_for_previous_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_S)
    slot_valid = slots < top_k
    pairs = token * top_k + slots
    experts = tl.load(ids_ptr + pairs, mask=slot_valid, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden
    rows = w_ptr + experts[:, None, None] * stride_we + cols[None, :, None] * stride_wn  # [S, N, 1]
    row_valid = slot_valid[:, None, None] & col_valid[None, :, None]
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for start in range(0, intermediate, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_valid = ks < intermediate
        a = tl.load(h_ptr + pairs[:, None] * stride_ht + ks[None, :], mask=slot_valid[:, None] & k_valid[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(rows + ks[None, None, :], mask=row_valid & k_valid[None, None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    routing = tl.load(routing_ptr + pairs, mask=slot_valid, other=0.0)
    total = tl.sum(acc * routing[:, None], axis=0)
    tl.store(out_ptr + token * stride_ot + cols, total.to(out_ptr.dtype.element_ty), mask=col_valid)


@triton.jit
def _combine_kernel(pair_out_ptr, out_ptr, hidden, top_k, stride_pt, stride_ot, BLOCK_H: tl.constexpr,
                    PDL: tl.constexpr = False):
    """out[t] = sum over its k pairs of the weighted expert outputs, in slot order, in fp32 (whatever the pairs'
    dtype)."""
    wait_for_previous_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for slot in range(0, top_k):
        acc += tl.load(pair_out_ptr + (token * top_k + slot) * stride_pt + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block(size: int, preferred: int) -> int:
    """A tile edge for a dimension of `size`: `preferred`, or smaller for a small dimension (at least 16, tl.dot's
    minimum)."""
    return max(16, min(preferred, triton.next_power_of_2(size)))


def fused_experts(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    out: Optional[torch.Tensor] = None, batch_invariant: bool = False, tiles: Optional[ExpertTiles] = None,
) -> torch.Tensor:
    """experts_reference(x [T, H], gate_up_proj [E, 2 I, H], down_proj [E, H, I], weights [T, k], ids [T, k]) with
    the fused kernels, into `out` [T, H] when given. `tiles`: fixed tiles (benchmarks, tests) instead of
    choose_tiles's."""
    num_tokens, hidden = x.shape
    num_experts, double_intermediate, _ = gate_up_proj.shape
    intermediate = double_intermediate // 2
    top_k = ids.shape[1]
    num_pairs = num_tokens * top_k
    if out is None:
        out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    assert x.stride(-1) == 1 and gate_up_proj.is_contiguous() and down_proj.is_contiguous()
    chosen = tiles or choose_tiles(num_pairs, num_experts, batch_invariant, num_tokens)
    if chosen.direct:
        flat_ids = ids.reshape(-1)
        pair_rows, block_experts = flat_ids, flat_ids  # NOTE: pair_rows unread (DIRECT)
    else:
        pair_rows, block_experts = sort_by_expert(ids, num_experts, chosen.block_m)
    routing = weights.reshape(-1).to(torch.float32).contiguous()
    activated = torch.empty((num_pairs, intermediate), dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(num_warps=chosen.num_warps, num_stages=chosen.num_stages, DIRECT=chosen.direct, **pdl_launch(x))
    # NOTE: only where the down kernel can start early (PDL); never under the interpreter (PTX)
    prefetch = chosen.prefetch_down and pdl_enabled(x.device)
    num_blocks = block_experts.shape[0]
    block_n, block_k = _block(intermediate, chosen.block_n), _block(hidden, chosen.block_k)
    _gate_up_kernel[(num_blocks, triton.cdiv(intermediate, block_n))](
        x, gate_up_proj, pair_rows, block_experts, activated, num_pairs, hidden, intermediate, top_k, x.stride(0),
        gate_up_proj.stride(0), gate_up_proj.stride(1), activated.stride(0), BLOCK_M=chosen.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION=precision, WEIGHT_EVICTION="evict_first" if prefetch else "", **launch,
    )
    if chosen.down_columns is not None:
        block_s, block_n = max(2, triton.next_power_of_2(top_k)), _block(hidden, chosen.down_columns)
        # NOTE: a step's weight tile is [slots, columns, BLOCK_K]: at most FOLD_TILE_ELEMENTS (registers)
        block_k = max(16, min(_block(intermediate, chosen.block_k), FOLD_TILE_ELEMENTS // (block_s * block_n)))
        _down_direct_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
            activated, down_proj, routing, block_experts, out, hidden, intermediate, top_k, activated.stride(0),
            down_proj.stride(0), down_proj.stride(1), out.stride(0), BLOCK_S=block_s, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=chosen.num_warps, num_stages=chosen.num_stages, **pdl_launch(x),
        )
        return out
    # NOTE: the weighted expert outputs travel in the activations' dtype when it is 16-bit (each pair rounded once,
    # then summed in fp32 by the combine; the reference Qwen3-MoE sums them in bf16): this buffer is written and read
    # back whole, the largest traffic after the weights where a batch has many pairs (verify blocks)
    pair_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    pair_out = torch.empty((num_pairs, hidden), dtype=pair_dtype, device=x.device)
    block_n, block_k = _block(hidden, chosen.block_n), _block(intermediate, chosen.block_k)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        activated, down_proj, routing, pair_rows, block_experts, pair_out, num_pairs, hidden, intermediate,
        activated.stride(0), down_proj.stride(0), down_proj.stride(1), pair_out.stride(0), BLOCK_M=chosen.block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision, PREFETCH=prefetch,
        LINE_ELEMENTS=L2_LINE_BYTES // down_proj.element_size(), LANES=PREFETCH_LANES, **launch,
    )
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        pair_out, out, hidden, top_k, pair_out.stride(0), out.stride(0), BLOCK_H=block_h, **pdl_launch(x),
    )
    return out


def warm_up_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int,
                    batch_invariant: bool = False) -> int:
    """Runs fused_experts once per tile set serving can choose (tile_choices) on two dummy tokens, with the layer's
    weights and dtype: start-up's warm-up of an MoE layer shape. Returns the number of tile sets run."""
    num_experts, _, hidden = gate_up_proj.shape
    tokens, device = 2, gate_up_proj.device
    x = torch.zeros((tokens, hidden), dtype=gate_up_proj.dtype, device=device)
    ids = (torch.arange(tokens * top_k, device=device) % num_experts).view(tokens, top_k)
    weights = torch.full((tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=device)
    choices = tile_choices(batch_invariant)
    for tiles in choices:
        fused_experts(x, gate_up_proj, down_proj, weights, ids, batch_invariant=batch_invariant, tiles=tiles)
    return len(choices)
