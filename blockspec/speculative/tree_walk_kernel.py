"""DDTree's greedy walk (tree_walk.greedy_tree_walk's torch form, about 18 launches) as one Triton program per
request: a tree row is on the walk when it and every ancestor hold the target's token at their parent (the ancestor
mask row by row against that match vector); the walk's length is the deepest such row, and path[d] the one at depth
d (rows past the walk: d itself). The same integers as the torch form; no reduction order to differ in. The same
program also writes what a cycle takes from the walk (walk_outputs.WalkOutputs: its rows, walked rows and the KV
compaction's sources), where the torch form takes a gather per output and a concatenation after it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockspec.pdl import pdl_launch, wait_for_previous_grid
from blockspec.speculative.tree_build import DraftTree
from blockspec.speculative.walk_outputs import WalkOutputs

WALK_ROWS = 16  # NOTE: tree rows per step of the loop over the ancestor mask
MIN_BLOCK = 16


@triton.jit
def _tree_walk_kernel(target_ptr, tokens_ptr, parents_ptr, depths_ptr, ancestors_ptr, accepted_ptr, path_ptr,
                      row_tokens_ptr, slots_ptr, rows_ptr, walked_ptr, sources_ptr,
                      budget, path_len, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                      OUTPUTS: tl.constexpr = False, PDL: tl.constexpr = False):
    """target [B + 1] (the target's token at every tree row), tokens [B], parents / depths [B + 1], ancestors
    [B + 1, B + 1] (int8) of one request → accepted (a scalar) and path [path_len + 1]. With OUTPUTS, instead of
    those two, walk_outputs.WalkOutputs for a block of b = path_len + 1 rows: the cycle's rows [2(b + B)] (row_tokens
    [B + 1] the tree rows' tokens), walked rows [b] and sources [b] (slots [b + B] the cycle's)."""
    wait_for_previous_grid(PDL)
    request = tl.program_id(0).to(tl.int64)
    width = budget + 1
    target = target_ptr + request * width
    cols = tl.arange(0, BLOCK_R)
    col_valid = cols < width
    col_parents = tl.load(parents_ptr + request * width + cols, mask=col_valid, other=0)
    node_tokens = tl.load(tokens_ptr + request * budget + cols - 1, mask=col_valid & (cols > 0), other=0)
    # NOTE: the root matches by fiat; so do the padding columns, which no row has for an ancestor
    matched = (node_tokens == tl.load(target + col_parents, mask=col_valid, other=0)) | (cols == 0) | ~col_valid
    depth_index = tl.arange(0, BLOCK_D)
    walked = tl.zeros((BLOCK_D,), dtype=tl.int64)
    accepted = tl.program_id(0).to(tl.int64) * 0
    for start in range(0, width, ROWS):
        rows = start + tl.arange(0, ROWS)
        rows_valid = rows < width
        ancestors = tl.load(ancestors_ptr + request * width * width + rows[:, None] * width + cols[None, :],
                            mask=rows_valid[:, None] & col_valid[None, :], other=0)
        blocked = tl.sum(((ancestors != 0) & ~matched[None, :]).to(tl.int32), axis=1) > 0
        on_walk = rows_valid & ~blocked
        row_depths = tl.load(depths_ptr + request * width + rows, mask=rows_valid, other=0)
        accepted = tl.maximum(accepted, tl.max(tl.where(on_walk, row_depths, 0), axis=0))
        at_depth = on_walk[:, None] & (row_depths[:, None] == depth_index[None, :])
        walked += tl.sum(tl.where(at_depth, rows.to(tl.int64)[:, None], 0), axis=0)
    path = tl.where(depth_index <= accepted, walked, depth_index.to(tl.int64))
    in_block = depth_index <= path_len
    if OUTPUTS:
        block = path_len + 1
        walked_rows = tl.minimum(path, budget)
        tokens = tl.load(row_tokens_ptr + request * width + walked_rows, mask=in_block, other=0)
        chosen = tl.load(target + walked_rows, mask=in_block, other=0)
        sources = tl.load(slots_ptr + request * (block + budget) + path, mask=in_block, other=0)
        row = rows_ptr + request * 2 * (block + budget)
        tl.store(row + depth_index, tl.where(depth_index == 0, accepted, tokens), mask=in_block)
        tl.store(row + block + budget + depth_index, chosen, mask=in_block)
        padding = tl.arange(0, BLOCK_R)
        in_padding = padding < budget
        tl.store(row + block + padding, padding.to(tl.int64) * 0, mask=in_padding)
        tl.store(row + 2 * block + budget + padding, padding.to(tl.int64) * 0, mask=in_padding)
        tl.store(walked_ptr + request * block + depth_index, walked_rows, mask=in_block)
        tl.store(sources_ptr + request * block + depth_index, sources, mask=in_block)
    else:
        tl.store(path_ptr + request * (path_len + 1) + depth_index, path, mask=in_block)
        tl.store(accepted_ptr + request, accepted)


def fused_tree_walk(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
                    target_tokens: torch.Tensor, path_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_walk.greedy_tree_walk in one launch: a tree's tokens [bs, B], parents / depths [bs, B + 1] int64 and
    ancestors [bs, B + 1, B + 1] bool, the target's token at every tree row [bs, B + 1] → (accepted [bs, 1], path
    [bs, path_len + 1]) int64."""
    bs, rows = target_tokens.shape
    device = target_tokens.device
    accepted = torch.empty((bs, 1), dtype=torch.int64, device=device)
    path = torch.empty((bs, path_len + 1), dtype=torch.int64, device=device)
    if bs == 0:
        return accepted, path
    # NOTE: the OUTPUTS pointers are never read without OUTPUTS (a constexpr): the path stands in for them
    _tree_walk_kernel[(bs,)](
        target_tokens.contiguous(), tokens.contiguous(), parents.contiguous(), depths.contiguous(),
        ancestors.contiguous().view(torch.int8), accepted, path, path, path, path, path, path, rows - 1, path_len,
        BLOCK_R=max(MIN_BLOCK, triton.next_power_of_2(rows)),
        BLOCK_D=max(MIN_BLOCK, triton.next_power_of_2(path_len + 1)), ROWS=WALK_ROWS, **pdl_launch(target_tokens),
    )
    return accepted, path


def fused_walk_outputs(tree: DraftTree, row_tokens: torch.Tensor, target_tokens: torch.Tensor, slots: torch.Tensor,
                       block: int) -> WalkOutputs:
    """tree_walk.greedy_walk_outputs in one launch: the walk, then the cycle's rows, the walked rows and the KV
    compaction's sources (walk_outputs.walk_outputs of the walk) for a block of `block` rows."""
    bs, rows = target_tokens.shape
    budget = rows - 1
    if row_tokens.shape != (bs, rows) or slots.shape != (bs, block + budget) or tree.tokens.shape != (bs, budget):
        raise ValueError(f"a walk of {bs} trees of {budget} nodes over blocks of {block} takes row tokens [{bs}, "
                         f"{rows}], slots [{bs}, {block + budget}] and tree tokens [{bs}, {budget}]; got "
                         f"{list(row_tokens.shape)}, {list(slots.shape)} and {list(tree.tokens.shape)}")
    device = target_tokens.device
    outputs = WalkOutputs(torch.empty((bs, 2 * (block + budget)), dtype=torch.int64, device=device),
                          torch.empty((bs, block), dtype=torch.int64, device=device),
                          torch.empty((bs, block), dtype=slots.dtype, device=device))
    if bs == 0:
        return outputs
    # NOTE: accepted and path are not stored with OUTPUTS: the rows stand in for their pointers
    _tree_walk_kernel[(bs,)](
        target_tokens.contiguous(), tree.tokens.contiguous(), tree.parents.contiguous(), tree.depths.contiguous(),
        tree.ancestors.contiguous().view(torch.int8), outputs.rows, outputs.rows, row_tokens.contiguous(),
        slots.contiguous(), outputs.rows, outputs.walked_rows, outputs.sources, budget, block - 1,
        BLOCK_R=max(MIN_BLOCK, triton.next_power_of_2(rows)),
        BLOCK_D=max(MIN_BLOCK, triton.next_power_of_2(block)), ROWS=WALK_ROWS, OUTPUTS=True,
        **pdl_launch(target_tokens),
    )
    return outputs
