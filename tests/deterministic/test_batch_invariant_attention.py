"""The batch-invariant attention backend (--enable-deterministic-inference): correct against the torch reference, and
a query row's output bit-identical whether it is a 1-query decode, a row of a verify block or of an extend chunk, at
any batch size, with its lanes split over programs or not. The same check catches the default Triton kernels (their
tiles and splits follow the batch) and a different KV lane size.

On CPU under TRITON_INTERPRET=1 (root conftest), fp32 and fp16; natively on CUDA."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.attention.batch_invariant_backend import (
    BatchInvariantAttention,
    BatchInvariantAttentionBackend,
)  # noqa: E402
from blockspec.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from blockspec.attention.triton_backend import KernelTiles, TritonAttentionBackend  # noqa: E402
from blockspec.batch import ForwardMode, build_batch  # noqa: E402
from tests.support.attention_cases import CASES, make_case  # noqa: E402
from tests.support.batch_invariant_rows import (  # noqa: E402
    HEAD_DIM, HEADS, KV_HEADS, SETTINGS, Sequences, backend_for, mismatches, paths_of_one_position,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 24])
def test_a_row_is_the_same_in_decode_verify_and_extend(dtype: torch.dtype, window: Optional[int]) -> None:
    seqs = Sequences([70, 45, 33], dtype)
    reference, others = paths_of_one_position(seqs, backend_for(seqs, window))
    assert sum(len(rows) for rows in others) == 9
    assert mismatches(reference, *others) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_and_unsplit_lanes_give_the_same_bits(dtype: torch.dtype) -> None:
    seqs = Sequences([70, 45, 33], dtype)
    backend = backend_for(seqs)
    parts = [(0, 60, 8), (1, 30, 8), (2, 25, 8)]
    split = seqs.attend(backend, ForwardMode.VERIFY, parts, split_lanes=True)
    assert mismatches(split, seqs.attend(backend, ForwardMode.VERIFY, parts, split_lanes=False)) == 0
    # NOTE: the policy itself splits a lone decode and not a batch of three (both are covered above)
    batch = build_batch(ForwardMode.DECODE, [[1]], [61], [seqs.rows[0]], seqs.table.table, [0])
    assert backend.plan(batch).split_lanes
    batch = build_batch(ForwardMode.DECODE, [[1]] * 3, [61, 30, 7], seqs.rows, seqs.table.table, [0])
    assert not backend.plan(batch).split_lanes


def test_draft_rows_do_not_depend_on_the_batch() -> None:
    """Non-causal draft blocks (sliding and full layers): a request's block alone or among others."""
    seqs = Sequences([70, 45, 33], torch.float32)
    for window, causal in ((None, False), (24, True)):
        backend = backend_for(seqs, window, causal=causal)
        alone = seqs.attend(backend, ForwardMode.DRAFT, [(0, 58, 8)])
        among = seqs.attend(backend, ForwardMode.DRAFT, [(1, 20, 8), (0, 58, 8), (2, 9, 8)])
        assert mismatches(alone, {key: among[key] for key in alone}) == 0


def test_the_check_catches_the_default_kernels() -> None:
    """The default Triton backend picks tiles and splits from the batch: the same rows differ between paths."""
    seqs = Sequences([300, 45, 40], torch.float32)
    default = TritonAttentionBackend(seqs.pool, HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM, [None])
    reference, others = paths_of_one_position(seqs, default, position=261, block=16)
    assert mismatches(reference, *others) > 0
    reference, others = paths_of_one_position(seqs, backend_for(seqs), position=261, block=16)
    assert mismatches(reference, *others) == 0


def test_the_check_catches_a_different_lane_size() -> None:
    """Two lane sizes (as if the split size followed the batch): the same decode row differs."""
    seqs = Sequences([70, 45, 33], torch.float32)
    wider = BatchInvariantAttention(lane_keys=64, lanes=4, tiles=SETTINGS.tiles)
    one = seqs.attend(backend_for(seqs), ForwardMode.DECODE, [(0, 69, 1)])
    other = seqs.attend(backend_for(seqs, settings=wider), ForwardMode.DECODE, [(0, 69, 1)])
    assert mismatches(one, other) == 1


@pytest.mark.parametrize("mode,prefix,new,page,window,draft_causal", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_torch_reference(mode, prefix, new, page, window, draft_causal, dtype) -> None:
    batch, pool_a, pool_b, q, k, v = make_case(mode, prefix, new, page, HEADS, KV_HEADS, HEAD_DIM, dtype)
    causal = [draft_causal] if draft_causal is not None else None
    reference = TorchAttentionBackend(pool_a, HEAD_DIM ** -0.5, [window], causal)
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q.float() if dtype == torch.float16 else q, k, v, 0, batch)
    backend = BatchInvariantAttentionBackend(pool_b, HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM, [window], causal,
                                             SETTINGS)
    batch.attn_meta = backend.plan(batch)
    got = backend.forward(q, k, v, 0, batch)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(pool_b.k[0], pool_a.k[0])


def test_lane_size_must_be_a_multiple_of_the_key_block() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        BatchInvariantAttention(lane_keys=40, tiles=KernelTiles(16, 16, 4, 1))
