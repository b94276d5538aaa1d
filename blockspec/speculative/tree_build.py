"""DDTree's draft tree, built on the device: the B most likely continuations of a DFlash draft block.

A DFlash draft gives, in one forward, an independent distribution q_d for every block position d = 1..L. A prefix
u_1..u_d scores Σ log q_j(u_j); DDTree (Ringel & Romano) verifies the B prefixes of the highest scores. They are
ancestor-closed (a prefix never scores above its parent), so they form a tree under the root (the bonus token).

No heap and no host read (the build lives inside the greedy-cycle CUDA graph): since q_d does not depend on the
prefix, the top-B prefixes of length d are the top-B of {s + log q_d(u)} over the top-B prefixes s of length d - 1
and the top-B tokens u of q_d (a prefix outside the top-B of its length has B better ones, and so do all its
extensions by the same token). The tree is the top-B over all lengths of those per-length candidates."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.models.logit_scale import UNSCALED, LogitScale
from blockspec.speculative.tree_budget import check_budget


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees of B nodes each, as tree rows: row 0 the root (the bonus token), rows 1..B the nodes
    by descending score, so a parent always precedes its children. Fixed shapes per (batch size, B)."""

    tokens: torch.Tensor  # [bs, B] int64: the token of tree row i + 1
    parents: torch.Tensor  # [bs, B + 1] int64: the tree row of each row's parent (the root's: 0, itself)
    depths: torch.Tensor  # [bs, B + 1] int64: tokens between a row and the root (root 0)
    ancestors: torch.Tensor  # [bs, B + 1, B + 1] bool: [i, j] when row j is row i itself or one of its ancestors

    @property
    def budget(self) -> int:
        return int(self.tokens.shape[1])


def build_tree(logits: torch.Tensor, budget: int, scale: LogitScale = UNSCALED) -> DraftTree:
    """The tree of the `budget` most likely prefixes of the per-position draft distributions softmax(`scale` of
    `logits`) ([bs, L, V] raw head outputs, finite, any float dtype; log-probabilities are logits too).
    Graph-capturable: device ops only, shapes fixed by (bs, L, budget). On CUDA the candidates are two Triton
    launches that scale the rows as they read them (top_candidates_kernel.py: the same tokens, ties to the smaller
    token, where torch's top-k order is unspecified; the log-probabilities up to the logsumexp's rounding) and the
    tree from them one more (tree_build_kernel.py: the same tree, ties within a depth aside); else `top_candidates`
    of the scaled rows and `tree_from_candidates`, the oracles of both. Above MAX_FUSED_BUDGET the candidates are the
    torch form's on CUDA too (the fused top-B's sorts would outgrow the registers)."""
    if not logits.is_cuda:
        return tree_from_candidates(*top_candidates(scale.apply(logits), budget))
    # NOTE: need Triton
    from blockspec.speculative.top_candidates_kernel import MAX_FUSED_BUDGET, fused_top_candidates
    from blockspec.speculative.tree_build_kernel import fused_tree_build

    if budget <= MAX_FUSED_BUDGET:
        candidates = fused_top_candidates(logits, budget, scale=scale)
    else:
        candidates = top_candidates(scale.apply(logits), budget)
    return DraftTree(*fused_tree_build(*candidates))


def top_candidates(logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, tokens) [bs, L, B]: each position's `budget` most likely tokens and their log-probabilities, each row
    descending."""
    check_budget(budget, logits.shape[-1])
    logits = logits.float()
    top_logits, top_tokens = logits.topk(budget, dim=-1)
    # NOTE: log q_d(u) = logit - logsumexp over the row: no second [bs, L, V] tensor for a log-softmax
    return top_logits - logits.logsumexp(-1, keepdim=True), top_tokens


def tree_from_candidates(top_scores: torch.Tensor, top_tokens: torch.Tensor) -> DraftTree:
    """The tree of the B best prefixes from each position's top-B (scores, tokens) [bs, L, B] (top_candidates).

    NOTE: ties are broken towards shallower prefixes (a stable sort over depth-major candidates), so a child that
    ties its parent (q = 1) never enters without it: the tree stays ancestor-closed whatever the values."""
    bs, depth_count, budget = top_scores.shape
    device = top_scores.device
    scores, tokens, parent_slots = [top_scores[:, 0]], [top_tokens[:, 0]], [torch.zeros_like(top_tokens[:, 0])]
    for depth in range(1, depth_count):
        candidates = (scores[-1][:, :, None] + top_scores[:, depth, None, :]).reshape(bs, budget * budget)
        best, index = candidates.topk(budget, dim=-1)
        scores.append(best)
        parent_slots.append(index // budget)
        tokens.append(top_tokens[:, depth].gather(1, index % budget))
    all_scores = torch.stack(scores, 1).reshape(bs, -1)  # [bs, L·B] depth-major: candidate (d, s) at d·B + s
    order = all_scores.sort(dim=-1, descending=True, stable=True).indices[:, :budget]  # [bs, B]
    rank = torch.zeros_like(all_scores, dtype=torch.int64)
    rank.scatter_(1, order, torch.arange(1, budget + 1, device=device).expand(bs, budget))  # tree row per candidate
    node_depth = order // budget  # depth - 1
    node_tokens = torch.stack(tokens, 1).reshape(bs, -1).gather(1, order)
    node_parent_slot = torch.stack(parent_slots, 1).reshape(bs, -1).gather(1, order)
    parent_candidate = ((node_depth - 1).clamp(min=0) * budget + node_parent_slot)
    node_parents = torch.where(node_depth > 0, rank.gather(1, parent_candidate), torch.zeros_like(order))
    zero = torch.zeros((bs, 1), dtype=torch.int64, device=device)
    parents = torch.cat([zero, node_parents], dim=1)
    depths = torch.cat([zero, node_depth + 1], dim=1)
    return DraftTree(node_tokens, parents, depths, ancestor_mask(parents, depth_count))


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[bs, R, R] bool from parent rows [bs, R] (root row 0, its own parent): row i sees itself and, after
    `max_depth` rounds of `sees(i) = {i} ∪ sees(parent(i))`, every ancestor."""
    bs, rows = parents.shape
    itself = torch.eye(rows, dtype=torch.bool, device=parents.device).expand(bs, rows, rows)
    sees = itself
    index = parents[:, :, None].expand(bs, rows, rows)
    for _ in range(max_depth):
        sees = itself | sees.gather(1, index)
    return sees
