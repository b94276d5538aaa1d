"""DDTree's fused tree build (speculative/tree_build_kernel.py) equals the torch form (tree_build.tree_from_candidates,
itself checked against the paper's heap in tests/dflash/test_tree_build.py): tokens, parents, depths and the ancestor
mask, for budgets below, at and above a power of two, one node, and many requests. Under Triton's interpreter on CPU
(root conftest), natively on CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.speculative.tree_build import (  # noqa: E402
    DraftTree, ancestor_mask, build_tree, top_candidates, tree_from_candidates,
)
from tests.support.tree_checks import assert_same_tree_up_to_ties  # noqa: E402
from blockspec.speculative.tree_build_kernel import fused_tree_build, staircase_pairs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("bs,depths,vocab,budget,temperature", [
    (3, 15, 96, 64, 0.5),  # the demo draft's depth (block 16) at a budget of 64
    (2, 15, 80, 32, 2.0),
    (4, 7, 40, 24, 1.0),  # a budget that is not a power of two
    (1, 3, 12, 5, 1.0),
    (5, 6, 50, 1, 1.0),  # one node: the best first token
    (2, 4, 8, 8, 3.0),  # the budget is the whole vocabulary
    (1, 1, 30, 16, 1.0),  # one depth: the top tokens alone
])
def test_fused_tree_equals_the_torch_form(bs: int, depths: int, vocab: int, budget: int, temperature: float) -> None:
    torch.manual_seed(bs * 1000 + depths * vocab + budget)
    logits = torch.randn(bs, depths, vocab, device=DEVICE) * temperature
    scores, tokens = top_candidates(logits, budget)
    expected = tree_from_candidates(scores, tokens)
    got_tokens, got_parents, got_depths, got_ancestors = fused_tree_build(scores, tokens)
    assert torch.equal(got_tokens, expected.tokens)
    assert torch.equal(got_parents, expected.parents)
    assert torch.equal(got_depths, expected.depths)
    assert torch.equal(got_ancestors, expected.ancestors)


def test_ties_keep_the_fused_tree_ancestor_closed() -> None:
    """A certain position (q = 1 at one token) ties every child with its parent, and the other tokens tie each other:
    parents still come first, the chain of certain tokens leads, and the tree holds the best scores."""
    log_probs = torch.full((1, 4, 10), -30.0, device=DEVICE)
    log_probs[0, :, 3] = 0.0
    log_probs[0, 2, 5] = -0.5
    scores, tokens = top_candidates(log_probs, 6)
    got_tokens, got_parents, got_depths, got_ancestors = fused_tree_build(scores, tokens)
    expected = tree_from_candidates(scores, tokens)
    paths: list[tuple[int, ...]] = [()]
    for row in range(1, 7):
        parent = int(got_parents[0, row])
        assert parent < row and int(got_depths[0, row]) == int(got_depths[0, parent]) + 1
        paths.append(paths[parent] + (int(got_tokens[0, row - 1]),))
    assert paths[1:5] == [(3,), (3, 3), (3, 3, 3), (3, 3, 3, 3)]
    assert torch.equal(got_tokens[0, :5], expected.tokens[0, :5])  # NOTE: the tied -30 nodes may differ in order
    assert_same_tree_up_to_ties(DraftTree(got_tokens, got_parents, got_depths, got_ancestors), expected, scores, tokens)
    for row in range(7):
        on_walk, at = {row}, row
        while at:
            at = int(got_parents[0, at])
            on_walk.add(at)
        assert set(torch.nonzero(got_ancestors[0, row]).flatten().tolist()) == on_walk


def test_trees_up_to_ties_still_differ_where_scores_do() -> None:
    """The tie-insensitive comparison (the native-vocabulary test's) refuses a node hung under another parent."""
    # NOTE: drawn on the CPU whatever DEVICE is (CUDA's generator draws other logits: a tree without depth 2)
    logits = torch.randn(1, 4, 30, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    scores, tokens = top_candidates(logits, 8)
    tree = tree_from_candidates(scores, tokens)
    assert_same_tree_up_to_ties(tree, tree, scores, tokens)
    depth_one = torch.nonzero(tree.depths[0] == 1).flatten().tolist()
    depth_two = torch.nonzero(tree.depths[0] == 2).flatten().tolist()
    assert len(depth_one) >= 2 and depth_two, "the drawn tree needs a depth-2 node and a second depth-1 parent"
    row = depth_two[0]
    other_parent = next(r for r in depth_one if r != int(tree.parents[0, row]))
    parents = tree.parents.clone()
    parents[0, row] = other_parent
    moved = DraftTree(tree.tokens, parents, tree.depths, ancestor_mask(parents, 4))
    with pytest.raises(AssertionError):
        assert_same_tree_up_to_ties(moved, tree, scores, tokens)


def test_nan_draft_keeps_parents_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN in a draft row (its log-softmax row all NaN) puts children above their parents (NaN sorts first): a
    node whose parent is left out of the tree gets the root, as in the torch form, not the kernel's scratch content
    (here poisoned to row -1: on the second request the walk's loads stay inside the batch's parents)."""
    budget = 4
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(-1) if tensor.dtype == torch.int32 else tensor

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 20, device=DEVICE)
    logits[1, 1, 7] = float("nan")
    scores, tokens = top_candidates(logits, budget)
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    got_tokens, got_parents, got_depths, got_ancestors = fused_tree_build(scores, tokens)
    monkeypatch.undo()
    assert bool(((got_parents >= 0) & (got_parents <= budget)).all()), got_parents
    expected = tree_from_candidates(scores[:1], tokens[:1])  # NOTE: the request without NaN is still exact
    assert torch.equal(got_parents[:1], expected.parents) and torch.equal(got_ancestors[:1], expected.ancestors)


def test_build_tree_on_the_device_takes_the_kernel() -> None:
    """build_tree on CUDA gives the fused build's tree (on the CPU it is the torch form, which the tests compare)."""
    if DEVICE.type != "cuda":
        pytest.skip("build_tree takes the kernel on CUDA only")
    torch.manual_seed(0)
    logits = torch.randn(2, 15, 1000, device=DEVICE)
    tree = build_tree(logits, 32)
    expected = tree_from_candidates(*top_candidates(logits, 32))
    assert torch.equal(tree.tokens, expected.tokens) and torch.equal(tree.ancestors, expected.ancestors)


def test_build_tree_above_the_fused_top_b_takes_the_torch_candidates() -> None:
    """Past MAX_FUSED_BUDGET build_tree on CUDA takes the torch form's candidates (the fused top-B refuses them)."""
    if DEVICE.type != "cuda":
        pytest.skip("build_tree takes the kernels on CUDA only")
    from blockspec.speculative.top_candidates_kernel import MAX_FUSED_BUDGET

    torch.manual_seed(1)
    logits = torch.randn(1, 4, 1000, device=DEVICE)
    tree = build_tree(logits, MAX_FUSED_BUDGET + 1)
    expected = tree_from_candidates(*top_candidates(logits, MAX_FUSED_BUDGET + 1))
    assert torch.equal(tree.tokens, expected.tokens) and torch.equal(tree.ancestors, expected.ancestors)


def test_staircase_counts_the_pairs_that_can_win() -> None:
    """Pairs (i, j) with (i + 1)(j + 1) <= B, by brute force: a pair outside is beaten by that many others."""
    for budget in (1, 5, 16, 64):
        brute = sum((i + 1) * (j + 1) <= budget for i in range(budget) for j in range(budget))
        assert staircase_pairs(budget) == brute
