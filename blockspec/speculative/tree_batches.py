"""The DDTree cycle's two forward batches, cut from the cycle's input batch (tree_cycle.py's module docstring: rows
[bonus, mask x (b + B - 1)] at positions kv_len .. kv_len + b + B - 1): the draft over the block, its first b rows,
and the tree-masked verify over [root, nodes], its first B + 1 rows' slots at the tree depths' positions. Both keep
the input's host seq_lens (less the rows they drop) and max_seq_len_hint, so eager planning and a captured graph see
what a batch built from rows would carry."""
from __future__ import annotations

import dataclasses

import torch

from blockspec.batch import ForwardBatch, ForwardMode, uniform_prefix
from blockspec.speculative.tree_build import DraftTree


def cycle_logits_rows(batch: ForwardBatch, block_size: int, budget: int) -> torch.Tensor:
    """One arange whose leading slices are both batches' logits rows (every row of each)."""
    return torch.arange(batch.batch_size * max(block_size, budget + 1), device=batch.input_ids.device)


def tree_draft_batch(batch: ForwardBatch, block_size: int, logits_rows: torch.Tensor) -> ForwardBatch:
    """The draft's batch: the block [bonus, mask x (b - 1)] at positions kv_len .. kv_len + b - 1 and their slots."""
    return uniform_prefix(batch, ForwardMode.DRAFT, block_size, logits_rows=logits_rows[:batch.batch_size * block_size])


def tree_verify_batch(batch: ForwardBatch, tree: DraftTree, row_tokens: torch.Tensor,
                      capture_layer_ids: tuple[int, ...], argmax_only: bool, logits_rows: torch.Tensor
                      ) -> ForwardBatch:
    """The target's tree-masked batch over `row_tokens` [bs, B + 1] ([root, nodes]): tree row i is written at the slot
    of position kv_len + i and runs at position kv_len + depth(i)."""
    bs, rows = row_tokens.shape
    n = batch.uniform_q_len
    assert n is not None
    kv_lens = batch.positions.view(bs, n)[:, :1]  # NOTE: a uniform batch's first position per request is kv_len
    prefix = uniform_prefix(batch, ForwardMode.VERIFY, rows, row_tokens.reshape(-1),
                            (kv_lens + tree.depths).reshape(-1), capture_layer_ids, logits_rows[:bs * rows])
    return dataclasses.replace(prefix, tree_mask=tree.ancestors, argmax_only=argmax_only)
