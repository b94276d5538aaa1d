"""What a DDTree cycle takes from its walk (tree_cycle.TreeCycle.walk): the cycle's output rows, the tree row walked
at each depth and the KV compaction's sources; and their torch form from a walk's (accepted, path)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class WalkOutputs:
    """What a cycle takes from its walk (tree_cycle.TreeCycle.walk), for a block of b rows and B tree nodes:

    rows         [bs, 2(b + B)] int64, the cycle's output rows: [accepted | the walked rows' tokens at depth 1..b-1,
                 B zeros | the target's token at the walked rows of depth 0..b-1, B zeros] (only the first `accepted`
                 walked tokens, and `accepted` + 1 target tokens, are the walk's; the rest lie past it);
    walked_rows  [bs, b] int64: the tree row at each depth, path[d] clamped to B (past the walk: a row that exists);
    sources      [bs, b]: the cycle slot of path[d] (the KV compaction's sources: row path[d] moves to depth d)."""

    rows: torch.Tensor
    walked_rows: torch.Tensor
    sources: torch.Tensor


def walk_outputs(accepted: torch.Tensor, path: torch.Tensor, row_tokens: torch.Tensor, target_tokens: torch.Tensor,
                 slots: torch.Tensor, budget: int, zero: Optional[torch.Tensor] = None) -> WalkOutputs:
    """WalkOutputs from a walk's (accepted [bs, 1], path [bs, b]) in torch ops (greedy_walk_outputs' oracle and the
    simulated walk's path); `zero`, a [1, 1] int64 zero on the device that the padding expands (no fill launched)."""
    bs = path.shape[0]
    walked_rows = path.clamp(max=budget)
    padding = (zero if zero is not None else accepted.new_zeros((1, 1))).expand(bs, budget)
    rows = torch.cat([accepted, row_tokens.gather(1, walked_rows)[:, 1:], padding,
                      target_tokens.gather(1, walked_rows), padding], dim=1)
    return WalkOutputs(rows, walked_rows, slots.gather(1, path))
