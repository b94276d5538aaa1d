"""The DDTree cycle's draft and verify batches cut from its input batch (uniform_prefix, tree_batches.py) carry every
field that uniform_batch builds from rows, with the verify's positions replaced by kv_len + depth: for several batch
sizes, block sizes and budgets, with host seq_lens as eager planning reads them and as a graph's placeholders."""
from __future__ import annotations

import dataclasses
import pytest
import torch

from blockspec.batch import ForwardBatch, ForwardMode, uniform_batch, uniform_prefix
from blockspec.speculative.tree_batches import cycle_logits_rows, tree_draft_batch, tree_verify_batch
from blockspec.speculative.tree_build import build_tree

MASK = 3
HINT = 4096
TABLE_ROWS, TABLE_LEN = 9, 160


def table() -> torch.Tensor:
    """A req→token table of distinct slots in no order, so a wrong row or position reads a different slot."""
    generator = torch.Generator().manual_seed(0)
    return torch.randperm(TABLE_ROWS * TABLE_LEN, generator=generator).view(TABLE_ROWS, TABLE_LEN)


def cycle_batch(bs: int, n: int, eager: bool, seed: int) -> tuple[ForwardBatch, torch.Tensor]:
    """A cycle's input batch of n rows per request [bonus, mask x (n - 1)] (as the worker and the graphs build it)
    and its kv_len per request."""
    generator = torch.Generator().manual_seed(seed)
    kv_lens = torch.randint(0, TABLE_LEN - n, (bs,), generator=generator)
    req_rows = torch.randperm(TABLE_ROWS, generator=generator)[:bs]
    bonus = torch.randint(10, 1000, (bs, 1), generator=generator)
    rows = torch.cat([bonus, torch.full((bs, n - 1), MASK), req_rows[:, None], (kv_lens + n)[:, None]], 1)
    seq_lens_cpu = (kv_lens + n).tolist() if eager else [n] * bs  # NOTE: a graph's static batch: placeholders
    return uniform_batch(ForwardMode.VERIFY, rows, table(), seq_lens_cpu, (), HINT), kv_lens


def assert_same_batch(got: ForwardBatch, want: ForwardBatch) -> None:
    for field in dataclasses.fields(ForwardBatch):
        if field.name == "attn_meta":
            continue
        mine, theirs = getattr(got, field.name), getattr(want, field.name)
        if isinstance(theirs, torch.Tensor):
            assert isinstance(mine, torch.Tensor), field.name
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), field.name
            assert mine.is_contiguous(), field.name
        else:
            assert mine == theirs, field.name


@pytest.mark.parametrize("bs,n,q", [(1, 7, 3), (3, 7, 3), (3, 7, 7), (4, 48, 1), (2, 48, 33)])
@pytest.mark.parametrize("eager", [True, False])
def test_a_prefix_is_the_uniform_batch_of_its_rows(bs: int, n: int, q: int, eager: bool) -> None:
    batch, kv_lens = cycle_batch(bs, n, eager, seed=bs * 100 + n + q)
    rows = torch.cat([batch.input_ids.view(bs, n)[:, :q], batch.req_rows[:, None], (kv_lens + q)[:, None]], 1)
    want = uniform_batch(ForwardMode.DRAFT, rows, batch.req_to_token, [s - (n - q) for s in batch.seq_lens_cpu],
                         (1, 2), HINT)
    assert_same_batch(uniform_prefix(batch, ForwardMode.DRAFT, q, capture_layer_ids=(1, 2)), want)


def test_a_prefix_longer_than_the_batch_is_refused() -> None:
    batch, _ = cycle_batch(2, 5, True, seed=1)
    with pytest.raises(ValueError, match="prefix of 6 rows"):
        uniform_prefix(batch, ForwardMode.DRAFT, 6)


def rows_built(batch: ForwardBatch, kv_lens: torch.Tensor, b: int, budget: int, row_tokens: torch.Tensor,
               depths: torch.Tensor, ancestors: torch.Tensor, capture: tuple[int, ...], argmax_only: bool
               ) -> tuple[ForwardBatch, ForwardBatch]:
    """The draft and verify batches built from rows by uniform_batch, the verify's positions replaced by the depths'."""
    bs, n = batch.batch_size, b + budget
    req_rows = batch.req_rows[:, None]
    draft_rows = torch.cat([batch.input_ids.view(bs, n)[:, :b], req_rows, (kv_lens + b)[:, None]], 1)
    draft = uniform_batch(ForwardMode.DRAFT, draft_rows, batch.req_to_token,
                          [s - budget for s in batch.seq_lens_cpu], (), batch.max_seq_len_hint)
    verify_rows = torch.cat([row_tokens, req_rows, (kv_lens + budget + 1)[:, None]], 1)
    verify = uniform_batch(ForwardMode.VERIFY, verify_rows, batch.req_to_token,
                           [s - b + 1 for s in batch.seq_lens_cpu], capture, batch.max_seq_len_hint)
    verify = dataclasses.replace(verify, positions=(kv_lens[:, None] + depths).reshape(-1), tree_mask=ancestors,
                                 argmax_only=argmax_only)
    return draft, verify


@pytest.mark.parametrize("bs", [1, 2, 5])
@pytest.mark.parametrize("b,budget", [(16, 3), (16, 15), (16, 32), (4, 40)])
@pytest.mark.parametrize("eager", [True, False])
def test_tree_batches_equal_the_batches_built_from_rows(bs: int, b: int, budget: int, eager: bool) -> None:
    n = b + budget
    batch, kv_lens = cycle_batch(bs, n, eager, seed=bs * 1000 + b * 10 + budget)
    generator = torch.Generator().manual_seed(budget)
    tree = build_tree(torch.randn((bs, b - 1, 64), generator=generator) * 10, budget)
    assert int(tree.depths.max()) > 1  # NOTE: positions that differ from the rows' own (kv_len + i)
    row_tokens = torch.cat([batch.input_ids.view(bs, n)[:, :1], tree.tokens], 1)
    capture = (0, 2)
    want_draft, want_verify = rows_built(batch, kv_lens, b, budget, row_tokens, tree.depths, tree.ancestors, capture,
                                         argmax_only=eager)
    logits_rows = cycle_logits_rows(batch, b, budget)
    assert_same_batch(tree_draft_batch(batch, b, logits_rows), want_draft)
    assert_same_batch(tree_verify_batch(batch, tree, row_tokens, capture, eager, logits_rows), want_verify)
