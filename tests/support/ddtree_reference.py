"""A plain reference of DDTree for tests: the paper's Algorithm 1 (best-first with a heap over the per-position draft
distributions) and the greedy walk, on host lists, written independently of blockspec's device formulation."""
from __future__ import annotations

import heapq

import torch


def heap_tree(log_probs: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """The `budget` most likely prefixes (token tuples, best first) of one block's log-probabilities [L, V].

    Best-first: a popped prefix (its last token the r-th best of its depth) pushes its next sibling (rank r + 1)
    and its first child (the best token of the next depth); every prefix is reached once, in score order."""
    depth_count = log_probs.shape[0]
    ranked = [sorted(range(log_probs.shape[1]), key=lambda t: -float(log_probs[d, t])) for d in range(depth_count)]
    score = [[float(log_probs[d, t]) for t in ranked[d]] for d in range(depth_count)]
    heap: list[tuple[float, tuple[int, ...]]] = [(-score[0][0], (0,))]  # prefixes as ranks per depth
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < budget:
        negative, ranks = heapq.heappop(heap)
        chosen.append(tuple(ranked[d][r] for d, r in enumerate(ranks)))
        depth, last = len(ranks) - 1, ranks[-1]
        if last + 1 < len(ranked[depth]):
            heapq.heappush(heap, (negative + score[depth][last] - score[depth][last + 1], ranks[:-1] + (last + 1,)))
        if depth + 1 < depth_count:
            heapq.heappush(heap, (negative - score[depth + 1][0], ranks + (0,)))
    return chosen


def greedy_walk(prefixes: list[tuple[int, ...]], next_token: dict[tuple[int, ...], int]) -> tuple[list[int], int]:
    """(accepted tokens, bonus): from the empty prefix, extend by the target's token `next_token[prefix]` while the
    extension is one of `prefixes`."""
    tree, walked = set(prefixes), ()
    while walked + (next_token[walked],) in tree:
        walked = walked + (next_token[walked],)
    return list(walked), next_token[walked]
