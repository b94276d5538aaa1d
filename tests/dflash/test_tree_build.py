"""DDTree's device tree build equals the paper's heap (top-B prefixes), is ancestor-closed with parents first, and the
device walk equals the host walk."""
from __future__ import annotations

import pytest
import torch

from blockspec.speculative.tree_build import ancestor_mask, build_tree
from blockspec.speculative.tree_walk import greedy_tree_walk
from tests.support.ddtree_reference import greedy_walk, heap_tree


def prefixes_of(tokens: torch.Tensor, parents: torch.Tensor) -> list[tuple[int, ...]]:
    """Each node's token path from the root (tree rows 1..B) of one request."""
    paths: list[tuple[int, ...]] = [()]
    for row in range(1, parents.shape[0]):
        assert int(parents[row]) < row  # NOTE: parents precede children
        paths.append(paths[int(parents[row])] + (int(tokens[row - 1]),))
    return paths[1:]


@pytest.mark.parametrize("depths,vocab,budget,temperature", [
    (3, 12, 5, 1.0), (7, 40, 32, 2.0), (15, 96, 64, 0.5), (4, 8, 8, 3.0), (6, 50, 1, 1.0),
])
def test_tree_is_the_heaps_top_prefixes(depths: int, vocab: int, budget: int, temperature: float) -> None:
    torch.manual_seed(depths * vocab + budget)
    log_probs = (torch.randn(3, depths, vocab) * temperature).log_softmax(-1)
    tree = build_tree(log_probs, budget)
    assert tree.tokens.shape == (3, budget) and tree.ancestors.shape == (3, budget + 1, budget + 1)
    for i in range(3):
        got = prefixes_of(tree.tokens[i], tree.parents[i])
        assert got == heap_tree(log_probs[i], budget)  # same prefixes, same (descending score) order
        assert all(p[:-1] in set(got) | {()} for p in got)  # ancestor-closed
        assert tree.depths[i, 1:].tolist() == [len(p) for p in got]
        for row, prefix in enumerate([()] + got):
            seen = {len(q) and got.index(q) + 1 for q in [prefix[:k] for k in range(len(prefix) + 1)]}
            assert set(torch.nonzero(tree.ancestors[i, row]).flatten().tolist()) == seen


def test_ties_keep_the_tree_ancestor_closed() -> None:
    """A certain position (q = 1 at one token) ties every child with its parent: the parent still comes first."""
    log_probs = torch.full((1, 4, 10), -30.0)
    log_probs[0, :, 3] = 0.0
    log_probs[0, 2, 5] = -0.5
    tree = build_tree(log_probs, 6)
    got = prefixes_of(tree.tokens[0], tree.parents[0])
    assert got[:4] == [(3,), (3, 3), (3, 3, 3), (3, 3, 3, 3)]
    assert all(p[:-1] in set(got) | {()} for p in got)


def test_ancestor_mask_of_a_chain_is_causal() -> None:
    parents = torch.tensor([[0, 0, 1, 2, 3]])
    assert torch.equal(ancestor_mask(parents, 4)[0], torch.tril(torch.ones(5, 5, dtype=torch.bool)))


def test_device_walk_equals_the_host_walk() -> None:
    deepest = max(walk_case(seed) for seed in range(6))
    assert deepest >= 2  # NOTE: the cases cover walks past the first node


def walk_case(seed: int) -> int:
    """One batch of random trees and target tokens: the device walk equals the host walk; returns the deepest."""
    torch.manual_seed(seed)
    depths, vocab, budget = 6, 8, 8  # NOTE: a small vocabulary, so the target often agrees with some child
    log_probs = (torch.randn(4, depths, vocab) * 4).log_softmax(-1)  # NOTE: peaked: deep branches
    tree = build_tree(log_probs, budget)
    target = torch.randint(0, vocab, (4, budget + 1))
    for i in range(4):
        # NOTE: the target agrees with the draft's best child most of the time, as with a good draft
        prefixes = prefixes_of(tree.tokens[i], tree.parents[i])
        for row, prefix in enumerate([()] + prefixes):
            children = [p for p in prefixes if p[:-1] == prefix and len(p) == len(prefix) + 1]
            if children and (row == 0 or (row + seed) % 4):
                target[i, row] = children[(row + seed) % len(children)][-1]
    accepted, path = greedy_tree_walk(tree, target, depths)
    for i in range(4):
        prefixes = prefixes_of(tree.tokens[i], tree.parents[i])
        rows = {prefix: row for row, prefix in enumerate([()] + prefixes)}
        next_token = {prefix: int(target[i, row]) for prefix, row in rows.items()}
        walked, bonus = greedy_walk(prefixes, next_token)
        assert int(accepted[i]) == len(walked)
        assert [rows[tuple(walked[:d])] for d in range(len(walked) + 1)] == path[i, :len(walked) + 1].tolist()
        assert path[i, len(walked) + 1:].tolist() == list(range(len(walked) + 1, depths + 1))
        assert int(target[i, path[i, len(walked)]]) == bonus
    return int(accepted.max())
