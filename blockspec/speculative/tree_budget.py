"""The bounds of a DDTree budget B, shared by the tree's torch form (tree_build.py) and its fused top-B
(top_candidates_kernel.py): each depth's top-B are distinct tokens, so 1 <= B <= the vocabulary."""
from __future__ import annotations


def check_budget(budget: int, vocab: int) -> None:
    """A tree of `budget` nodes needs 1 <= budget <= the vocabulary (each depth's top-B are distinct tokens)."""
    if not 1 <= budget <= vocab:
        raise ValueError(f"a draft tree needs 1 <= budget <= vocabulary size ({vocab}), got {budget}")
