"""Comparing two draft trees of the same candidates where ties may order them differently (bf16 logits at real
vocabularies tie often): each tree is well formed and holds the same multiset of prefix scores."""
from __future__ import annotations

import torch

from blockspec.speculative.tree_build import DraftTree, ancestor_mask


def prefix_scores(tree: DraftTree, scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[bs, B] each node's Σ log q_d(u_d) along its path, from the candidates (scores, tokens) [bs, L, B] it was built
    from, summed root-first in fp32 as the build does; asserts the tree is well formed on the way (a parent precedes
    its child one depth up, every node's token is a candidate of its depth, the ancestor mask follows the parents)."""
    scores, tokens = scores.float().cpu(), tokens.cpu()
    node_tokens, parents, depths = tree.tokens.cpu(), tree.parents.cpu(), tree.depths.cpu()
    bs, budget = node_tokens.shape
    assert torch.equal(tree.ancestors.cpu(), ancestor_mask(parents, scores.shape[1]))
    out = torch.zeros(bs, budget + 1, dtype=torch.float32)
    for b in range(bs):
        for row in range(1, budget + 1):
            parent, depth = int(parents[b, row]), int(depths[b, row])
            assert parent < row and depth == int(depths[b, parent]) + 1
            slot = (tokens[b, depth - 1] == node_tokens[b, row - 1]).nonzero().flatten()
            assert slot.numel() == 1, f"row {row}: token {int(node_tokens[b, row - 1])} is no depth-{depth} candidate"
            out[b, row] = out[b, parent] + scores[b, depth - 1, slot[0]]
    return out[:, 1:]


def assert_same_tree_up_to_ties(got: DraftTree, expected: DraftTree, scores: torch.Tensor,
                                tokens: torch.Tensor) -> None:
    """Both trees well formed, with equal sorted prefix scores per request (the same tree where no scores tie)."""
    got_scores = prefix_scores(got, scores, tokens).sort(dim=1, descending=True).values
    expected_scores = prefix_scores(expected, scores, tokens).sort(dim=1, descending=True).values
    assert torch.equal(got_scores, expected_scores)
