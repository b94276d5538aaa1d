"""DDTree's tree build after the top-B over the vocabulary (tree_build.py's torch form), as one Triton program per
request: one launch where the torch form is about 130 (a handful per depth, then the final order, then one gather per
depth for the ancestor mask), each a few microseconds inside the greedy-cycle graph.

Per depth d ≥ 1 the program keeps the torch form's candidates: the top-B of {s_i + log q_d(u_j)} over the previous
depth's top-B prefix scores s (descending) and the top-B tokens of q_d (descending). Both lists are sorted, so a sum
(i, j) is beaten by every (i', j') ≤ (i, j) but itself, (i + 1)(j + 1) − 1 sums: only the pairs with
(i + 1)(j + 1) ≤ B can be among the top-B (about B·ln B of the B² pairs, 280 at B = 64), and those are what the
program sorts. The sort keys pack the fp32 score above the pair's index, so a sort of 64-bit integers orders by
score descending and breaks ties towards the smaller index (torch's first-in-order), and each sum is the one fp32
addition the torch form makes: the same scores bit for bit. The final order is a stable sort over the depth-major
candidates (shallower first on ties, so a parent precedes a child that ties it), as in the torch form; then parents,
depths and the ancestor mask (each row's walk to the root).

NOTE: the depth loop reads no global memory: every depth's top-B scores are loaded once before it, the previous
depth's scores pass between depths in registers (`tl.gather`), and a candidate's token is looked up only for the B
nodes of the final tree (the loop keeps its slot among its depth's top-B). The depths' candidates and the tree rows'
ranks go through global scratch and `tl.debug_barrier()` (a CTA barrier: its threads' global writes are visible to
each other after it)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from blockspec.pdl import pdl_launch, wait_for_previous_grid
from blockspec.speculative.score_keys import key_index, key_score, leading, score_key

ANCESTOR_ROWS = 16  # NOTE: tree rows per step of the ancestor mask's loop
MIN_BLOCK = 16  # NOTE: no block edge below it (a budget of 1 would make one-element blocks)
DEFAULT_WARPS = 8  # NOTE: of 1, 2, 4 and 8 the fastest or within 1 % in every row measured (benchmarks/tree_build.py)


@triton.jit
def _tree_build_kernel(scores_ptr, tokens_ptr, pairs_ptr, cand_scores_ptr, cand_slots_ptr, cand_parents_ptr,
                       rank_ptr, out_tokens_ptr, out_parents_ptr, out_depths_ptr, out_ancestors_ptr, depth_count,
                       budget, num_pairs, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):
    """One request's tree from scores / tokens [L, B] (each depth's top-B log q and tokens, descending; L <=
    BLOCK_L). Scratch per request: pairs [BLOCK_P] (the pairs that can make the top-B, as i·BLOCK_B + j), cand_* and
    rank [L, B] (each depth's top-B prefixes: score, the last token's slot in its depth's top-B, parent slot; tree
    row of the chosen ones)."""
    wait_for_previous_grid(PDL)
    request = tl.program_id(0).to(tl.int64)
    span = depth_count * budget
    scores = scores_ptr + request * span
    tokens = tokens_ptr + request * span
    cand_scores = cand_scores_ptr + request * span
    cand_slots = cand_slots_ptr + request * span
    cand_parents = cand_parents_ptr + request * span
    rank = rank_ptr + request * span
    pairs = pairs_ptr + request * BLOCK_P
    slots = tl.arange(0, BLOCK_B)
    in_budget = slots < budget

    # the pairs (i, j) with (i + 1)(j + 1) <= B, in row-major order
    flat = tl.arange(0, BLOCK_B * BLOCK_B)
    row, col = flat // BLOCK_B, flat % BLOCK_B
    can_win = (row < budget) & (col < budget) & ((row + 1) * (col + 1) <= budget)
    place = tl.cumsum(can_win.to(tl.int32), axis=0) - 1
    tl.store(pairs + place, flat, mask=can_win)
    # every depth's top-B scores, [BLOCK_L, BLOCK_B] flattened (0.0 past L and B: never read below)
    lanes = tl.arange(0, BLOCK_L * BLOCK_B)
    lane_depth, lane_slot = lanes // BLOCK_B, lanes % BLOCK_B
    all_scores = tl.load(scores + lane_depth * budget + lane_slot,
                         mask=(lane_depth < depth_count) & (lane_slot < budget), other=0.0)
    # depth 0: the top-B tokens themselves, children of the root
    previous = tl.gather(all_scores, slots, 0)
    tl.store(cand_scores + slots, previous, mask=in_budget)
    tl.store(cand_slots + slots, slots, mask=in_budget)
    tl.store(cand_parents + slots, slots * 0, mask=in_budget)
    # NOTE: rank 0 (the root) for the candidates left out of the tree: a node whose parent is left out (only with NaN
    # scores, which sort above everything) gets the root as parent, as in the torch form, never an uninitialised row
    # index that the ancestor mask's walk would then load from
    everywhere = tl.arange(0, BLOCK_C)
    tl.store(rank + everywhere, everywhere * 0, mask=everywhere < span)
    tl.debug_barrier()

    p = tl.arange(0, BLOCK_P)
    p_valid = p < num_pairs
    pair = tl.load(pairs + p, mask=p_valid, other=0)
    parent_slot, token_slot = pair // BLOCK_B, pair % BLOCK_B
    # NOTE: the previous depth's top-B scores stay in registers (a gather per depth, no global round trip and no
    # barrier in the loop); the depths' candidates go to scratch for the final order only
    for depth in range(1, depth_count):
        above = tl.gather(previous, parent_slot, 0)
        here = tl.gather(all_scores, depth * BLOCK_B + token_slot, 0)
        summed = tl.where(p_valid, above + here, float("-inf"))
        best = leading(tl.sort(score_key(summed, pair, BLOCK_B * BLOCK_B), descending=True), BLOCK_P, BLOCK_B)
        chosen = key_index(best, BLOCK_B * BLOCK_B)
        previous = key_score(best)
        at = depth * budget + slots
        tl.store(cand_scores + at, previous, mask=in_budget)
        tl.store(cand_slots + at, (chosen % BLOCK_B).to(tl.int32), mask=in_budget)
        tl.store(cand_parents + at, (chosen // BLOCK_B).to(tl.int32), mask=in_budget)
    tl.debug_barrier()

    # the tree: the top-B of all depths' candidates, stable over the depth-major order
    c = tl.arange(0, BLOCK_C)
    best = leading(tl.sort(score_key(tl.load(cand_scores + c, mask=c < span, other=float("-inf")), c, BLOCK_C),
                            descending=True), BLOCK_C, BLOCK_B)
    order = key_index(best, BLOCK_C)
    node_depth = order // budget  # NOTE: depth - 1
    tl.store(rank + order, (slots + 1).to(tl.int32), mask=in_budget)
    tl.debug_barrier()
    has_parent = in_budget & (node_depth > 0)
    parent_candidate = (node_depth - 1) * budget + tl.load(cand_parents + order, mask=has_parent, other=0)
    node_parents = tl.load(rank + parent_candidate, mask=has_parent, other=0).to(tl.int64)
    width = budget + 1
    token_slot_of_node = tl.load(cand_slots + order, mask=in_budget, other=0)
    node_tokens = tl.load(tokens + node_depth * budget + token_slot_of_node, mask=in_budget, other=0)
    tl.store(out_tokens_ptr + request * budget + slots, node_tokens, mask=in_budget)
    # NOTE: tree row 0 is the root (its own parent, depth 0); row k + 1 is node k
    tl.store(out_parents_ptr + request * width + slots, node_parents * 0, mask=slots == 0)
    tl.store(out_parents_ptr + request * width + 1 + slots, node_parents, mask=in_budget)
    tl.store(out_depths_ptr + request * width + slots, node_depth * 0, mask=slots == 0)
    tl.store(out_depths_ptr + request * width + 1 + slots, node_depth + 1, mask=in_budget)

    # the ancestor mask: row r sees itself and every row on its walk to the root (depth_count steps reach it). The
    # walk reads each row's parent from registers (rows past the tree: the root), not from global memory: one
    # dependent load per step and row block was most of the build at B = 64
    columns = tl.arange(0, BLOCK_R)
    row_parents = tl.where((columns > 0) & (columns < width),
                           tl.gather(node_parents, tl.minimum(tl.maximum(columns - 1, 0), BLOCK_B - 1), 0),
                           0).to(tl.int32)
    for start in range(0, width, ROWS):
        rows = start + tl.arange(0, ROWS)
        rows_valid = rows < width
        current = tl.where(rows_valid, rows, 0)
        sees = columns[None, :] == current[:, None]
        for _ in range(depth_count):
            current = tl.gather(row_parents, current, 0)
            sees = sees | (columns[None, :] == current[:, None])
        tl.store(out_ancestors_ptr + request * width * width + rows[:, None] * width + columns[None, :],
                 sees.to(tl.int8), mask=rows_valid[:, None] & (columns[None, :] < width))


def staircase_pairs(budget: int) -> int:
    """How many (i, j) of [0, B)² have (i + 1)(j + 1) <= B: the pairs a depth's top-B can come from."""
    return sum(budget // (i + 1) for i in range(budget))


def fused_tree_build(top_scores: torch.Tensor, top_tokens: torch.Tensor, num_warps: Optional[int] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_build.tree_from_candidates in one launch: top_scores [bs, L, B] fp32 and top_tokens [bs, L, B] int64
    (each depth's top-B log-probabilities and tokens, descending) → (tokens [bs, B], parents [bs, B + 1], depths
    [bs, B + 1] int64, ancestors [bs, B + 1, B + 1] bool). `num_warps`: the program's warps (default DEFAULT_WARPS;
    benchmarks/tree_build.py times others)."""
    bs, depth_count, budget = top_scores.shape
    device = top_scores.device
    top_scores = top_scores.float().contiguous()
    top_tokens = top_tokens.contiguous()
    block_b = max(MIN_BLOCK, triton.next_power_of_2(budget))
    num_pairs = staircase_pairs(budget)
    block_p = max(triton.next_power_of_2(num_pairs), block_b)
    block_c = max(triton.next_power_of_2(depth_count * budget), block_b)
    tokens = torch.empty((bs, budget), dtype=torch.int64, device=device)
    parents = torch.empty((bs, budget + 1), dtype=torch.int64, device=device)
    depths = torch.empty((bs, budget + 1), dtype=torch.int64, device=device)
    ancestors = torch.empty((bs, budget + 1, budget + 1), dtype=torch.bool, device=device)
    if bs == 0:
        return tokens, parents, depths, ancestors
    pairs = torch.empty((bs, block_p), dtype=torch.int32, device=device)
    cand_scores = torch.empty((bs, depth_count, budget), dtype=torch.float32, device=device)
    cand_slots = torch.empty((bs, depth_count, budget), dtype=torch.int32, device=device)
    cand_parents = torch.empty((bs, depth_count, budget), dtype=torch.int32, device=device)
    rank = torch.empty((bs, depth_count, budget), dtype=torch.int32, device=device)
    _tree_build_kernel[(bs,)](
        top_scores, top_tokens, pairs, cand_scores, cand_slots, cand_parents, rank, tokens, parents, depths,
        ancestors.view(torch.int8), depth_count, budget, num_pairs, BLOCK_B=block_b,
        BLOCK_L=triton.next_power_of_2(depth_count), BLOCK_P=block_p,
        BLOCK_C=block_c, BLOCK_R=max(MIN_BLOCK, triton.next_power_of_2(budget + 1)), ROWS=ANCESTOR_ROWS,
        num_warps=num_warps or DEFAULT_WARPS, **pdl_launch(top_scores),
    )
    return tokens, parents, depths, ancestors
