"""The walk over a verified draft tree (DDTree): from the root, step to the child whose token is the target's token at
the current row (its argmax, or the request's own choice: tree_sampling.py) while there is one; the first unmatched
token is the bonus token. On the device, graph-capturable: no host read and no loop over the walk's length. Also the
walk a simulated acceptance takes (benchmarks)."""
from __future__ import annotations

import torch

from blockspec.speculative.tree_build import DraftTree
from blockspec.speculative.walk_outputs import WalkOutputs, walk_outputs


def greedy_walk_outputs(tree: DraftTree, row_tokens: torch.Tensor, target_tokens: torch.Tensor, slots: torch.Tensor
                        ) -> WalkOutputs:
    """The greedy walk (greedy_tree_walk) along the target's token at every tree row `target_tokens` [bs, B + 1], and
    the outputs a cycle takes from it: `row_tokens` [bs, B + 1] the tree rows' tokens (the root's, then the nodes'),
    `slots` [bs, b + B] the cycle's slots (of positions kv_len ..). On CUDA one Triton launch (tree_walk_kernel.py,
    the same integers, where the torch form takes a gather per output and a concatenation); else the torch form."""
    budget = tree.budget
    block = slots.shape[1] - budget
    if target_tokens.is_cuda:
        from blockspec.speculative.tree_walk_kernel import fused_walk_outputs  # NOTE: needs Triton

        return fused_walk_outputs(tree, row_tokens, target_tokens, slots, block)
    accepted, path = reference_tree_walk(tree, target_tokens, block - 1)
    return walk_outputs(accepted, path, row_tokens, target_tokens, slots, budget)


def greedy_tree_walk(tree: DraftTree, target_tokens: torch.Tensor, path_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [bs, 1], path [bs, path_len + 1]) from the target's token at every tree row `target_tokens`
    [bs, B + 1]: `accepted` nodes were walked; path[:, d] is the tree row walked at depth d for d <= accepted (row 0,
    the root, at depth 0) and d itself past it, so that moving block row path[d] to block row d compacts the walk
    and leaves the rows after it in place.

    NOTE: a row is on the walk when it and all its ancestors match the target's token at their parents; siblings hold
    distinct tokens, so at most one child of a row matches and those rows form one path from the root. On CUDA one
    Triton launch (tree_walk_kernel.py, the same integers); else `reference_tree_walk`."""
    if target_tokens.is_cuda:
        from blockspec.speculative.tree_walk_kernel import fused_tree_walk  # NOTE: needs Triton

        return fused_tree_walk(tree.tokens, tree.parents, tree.depths, tree.ancestors, target_tokens, path_len)
    return reference_tree_walk(tree, target_tokens, path_len)


def reference_tree_walk(tree: DraftTree, target_tokens: torch.Tensor, path_len: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_tree_walk in torch ops (the CPU path and the kernel's oracle)."""
    bs, rows = target_tokens.shape
    node_tokens = torch.cat([target_tokens[:, :1], tree.tokens], dim=1)  # NOTE: the root's entry matches by fiat
    matched = node_tokens == target_tokens.gather(1, tree.parents)
    matched[:, 0] = True
    on_walk = ~(tree.ancestors & ~matched[:, None, :]).any(-1)  # [bs, B + 1]
    accepted = (tree.depths * on_walk).amax(1, keepdim=True)
    depth_index = torch.arange(path_len + 1, device=target_tokens.device)
    at_depth = on_walk[:, :, None] & (tree.depths[:, :, None] == depth_index)  # [bs, B + 1, path_len + 1]
    row_index = torch.arange(rows, device=target_tokens.device)[None, :, None]
    walked = (at_depth * row_index).sum(1)
    path = torch.where(depth_index <= accepted, walked, depth_index.expand(bs, -1))
    return accepted, path


def simulated_tree_walk(drawn: torch.Tensor, path_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted, path) as greedy_tree_walk returns them for a simulated acceptance (benchmarks: `drawn` [bs, 1]
    accepted nodes, at most the tree's rows − 1): the walk takes tree rows 0..accepted as if they were its path, so
    the compaction, the draft KV and the committed tokens cost what a verified walk of that length costs whatever
    shape the (dummy-weight) draft's tree has. The committed tokens are not the model's."""
    depth_index = torch.arange(path_len + 1, device=drawn.device)
    return drawn.clamp(max=path_len), depth_index.expand(drawn.shape[0], -1).contiguous()
