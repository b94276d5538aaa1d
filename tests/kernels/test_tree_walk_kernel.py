"""DDTree's fused greedy walk (speculative/tree_walk_kernel.py) equals the torch form (tree_walk.reference_tree_walk,
itself checked against the host walk in tests/dflash/test_tree_build.py): the same accepted counts and paths, for
walks that stop at the root, part-way and at the deepest node. Under Triton's interpreter on CPU (root conftest),
natively on CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.speculative.tree_build import top_candidates, tree_from_candidates  # noqa: E402
from blockspec.speculative.tree_walk import reference_tree_walk  # noqa: E402
from blockspec.speculative.tree_walk_kernel import fused_tree_walk, fused_walk_outputs  # noqa: E402
from blockspec.speculative.walk_outputs import walk_outputs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("bs,depths,vocab,budget,follow", [
    (4, 6, 8, 8, 0.9),  # a small vocabulary and a peaked draft: deep branches, long walks
    (3, 15, 80, 64, 0.8),  # the demo draft's depth at a budget of 64
    (5, 15, 40, 32, 0.0),  # the target never agrees: every walk stops at the root
    (2, 4, 12, 5, 1.0),  # the target always takes the first child: walks to a leaf
    (3, 1, 20, 16, 0.7),  # one depth
    (3, 15, 30, 4, 0.9),  # more depths than tree rows: the path past the walk names rows the tree lacks (clamped)
])
def test_fused_walk_equals_the_torch_walk(bs: int, depths: int, vocab: int, budget: int, follow: float) -> None:
    torch.manual_seed(bs * 100 + depths + budget)
    logits = (torch.randn(bs, depths, vocab) * 4).to(DEVICE)
    tree = tree_from_candidates(*top_candidates(logits, budget))
    # NOTE: with follow 0 the target's tokens are outside the vocabulary: no child ever matches
    target = torch.randint(0, vocab, (bs, budget + 1), device=DEVICE) + (vocab if follow == 0.0 else 0)
    for i in range(bs):
        for row in range(budget + 1):
            children = [c for c in range(1, budget + 1) if int(tree.parents[i, c]) == row and c != row]
            if children and float(torch.rand(())) < follow:
                target[i, row] = tree.tokens[i, children[row % len(children)] - 1]
    accepted, path = fused_tree_walk(tree.tokens, tree.parents, tree.depths, tree.ancestors, target, depths)
    expected_accepted, expected_path = reference_tree_walk(tree, target, depths)
    assert torch.equal(accepted, expected_accepted)
    assert torch.equal(path, expected_path)
    if follow == 1.0:
        assert int(accepted.min()) >= 1
    if follow == 0.0:
        assert int(accepted.max()) == 0

    # NOTE: the cycle's outputs from the same launch equal the torch form's gathers of the torch walk, for a block
    # of depths + 1 rows (the walk's path length) whose slots are distinct and scattered
    row_tokens = torch.cat([torch.randint(0, vocab, (bs, 1), device=DEVICE), tree.tokens], 1)
    slots = torch.randperm(1000, device=DEVICE)[:bs * (depths + 1 + budget)].view(bs, -1)
    outputs = fused_walk_outputs(tree, row_tokens, target, slots, depths + 1)
    expected = walk_outputs(expected_accepted, expected_path, row_tokens, target, slots, budget)
    assert torch.equal(outputs.rows, expected.rows)
    assert torch.equal(outputs.walked_rows, expected.walked_rows)
    assert torch.equal(outputs.sources, expected.sources)


def test_fused_walk_outputs_refuse_mismatched_shapes() -> None:
    """The kernel reads row tokens and slots by the tree's shapes: a mismatch is an error, not a read past them."""
    torch.manual_seed(3)
    tree = tree_from_candidates(*top_candidates(torch.randn(2, 4, 20, device=DEVICE), 6))
    target = torch.zeros((2, 7), dtype=torch.int64, device=DEVICE)
    row_tokens = torch.zeros((2, 7), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="slots"):
        fused_walk_outputs(tree, row_tokens, target, torch.zeros((2, 8), dtype=torch.int64, device=DEVICE), 5)
    with pytest.raises(ValueError, match="row tokens"):
        fused_walk_outputs(tree, row_tokens[:, :6], target, torch.zeros((2, 11), dtype=torch.int64, device=DEVICE), 5)
