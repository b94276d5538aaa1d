"""GraphExtendAttention (attention of extend batches inside CUDA graphs): for ragged extend batches (cached prefixes,
one-token chunks, sliding windows) it equals the torch reference and the Triton backend's eager launch, for a bucket
larger than the batch (padding rows untouched) and with the tile table made from the loaded metadata alone; split
over keys too (`max_splits`), including the cache-hit shape (long cached prefixes, few new tokens) and empty splits.

On CPU under TRITON_INTERPRET=1 (root conftest); natively on CUDA."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from blockspec.attention.triton_backend import EXTEND_POLICY, TWO_WAVES, TritonAttentionBackend  # noqa: E402
from blockspec.attention.triton_graph_extend import GraphExtendAttention, TilePlan  # noqa: E402
from blockspec.batch import ForwardBatch, ForwardMode  # noqa: E402
from tests.support.attention_cases import DEVICE, make_case  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16


@pytest.mark.parametrize("max_splits", [1, 4])
@pytest.mark.parametrize("prefix,new,page,window,bucket,max_requests", [
    ([0, 5, 17, 0], [9, 3, 20, 1], 1, None, 40, 4),
    ([16, 3], [40, 70], 16, None, 128, 4),
    ([30, 0, 2], [1, 1, 1], 4, None, 4, 4),
    ([40, 7], [12, 30], 1, 8, 48, 4),
    ([3] * 5, [0, 0, 0, 0, 2], 1, None, 4, 8),  # more requests than the bucket has tokens: the last one has rows
])
def test_tiled_extend_matches_torch_and_eager_triton(prefix: list[int], new: list[int], page: int,
                                                     window: Optional[int], bucket: int, max_requests: int,
                                                     max_splits: int) -> None:
    batch, q, backend, expected, eager = reference_and_eager(prefix, new, page, window)
    attention = GraphExtendAttention(backend, batch.req_to_token, max_requests=max_requests, max_tokens=bucket,
                                     max_splits=max_splits, min_split_keys=0)
    plan, out = run_graph_attention(attention, batch, q, bucket, expected)
    assert plan.splits == max_splits  # NOTE: tiny buckets: far below two waves of programs
    unsplit_like_eager = plan.splits == 1 and plan.tiles == backend.plan(batch).tiles
    assert torch.equal(out[:batch.num_tokens], eager.reshape(batch.num_tokens, -1)) or not unsplit_like_eager


@pytest.mark.parametrize("prefix,new,page,window,max_splits,min_split_keys", [
    ([200, 257, 300, 231], [1, 3, 2, 1], 1, None, 4, 0),
    ([256, 211, 290], [2, 1, 3], 16, None, 8, 0),
    ([280, 203, 260], [3, 3, 1], 16, 40, 4, 0),  # a window of 40 keys: 2 of the 4 splits read keys
    ([220, 300], [2, 1], 1, None, 8, 128),  # >= 128 keys a split: 2-3 of the 8 splits read keys
])
def test_split_extend_after_long_cached_prefixes(prefix: list[int], new: list[int], page: int, window: Optional[int],
                                                 max_splits: int, min_split_keys: int) -> None:
    """The cache-hit shape: few new tokens behind long cached prefixes, each program's keys split max_splits ways."""
    batch, q, backend, expected, _ = reference_and_eager(prefix, new, page, window)
    bucket = 16
    attention = GraphExtendAttention(backend, batch.req_to_token, max_requests=8, max_tokens=bucket,
                                     max_splits=max_splits, min_split_keys=min_split_keys)
    plan, _ = run_graph_attention(attention, batch, q, bucket, expected)
    assert plan.splits == max_splits
    maxes = attention.part_max[:bucket * HEADS * plan.splits].view(bucket, HEADS, plan.splits)[:batch.num_tokens]
    read_keys = (maxes > float("-inf")).sum(dim=2)  # per real (row, head): the splits that read some key
    assert int(read_keys.min()) >= 1 and int(read_keys.max()) > 1  # every row sees keys, spread over splits
    assert int(read_keys.min()) < max_splits  # NOTE: spans rounded up to key blocks leave the last splits empty
    if min_split_keys:
        assert int(read_keys.max()) <= -(-max(p + n for p, n in zip(prefix, new)) // min_split_keys)


def reference_and_eager(prefix: list[int], new: list[int], page: int, window: Optional[int]) -> tuple:
    """(batch, its queries, a Triton backend whose pool holds the batch's K/V, the torch reference's output, the
    eager Triton output)."""
    batch, pool_a, pool_b, q, k, v = make_case(ForwardMode.EXTEND, prefix, new, page, HEADS, KV_HEADS, HEAD_DIM,
                                               torch.float32)
    reference = TorchAttentionBackend(pool_a, HEAD_DIM ** -0.5, [window])
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q, k, v, 0, batch)
    backend = TritonAttentionBackend(pool_b, HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM, [window])
    batch.attn_meta = backend.plan(batch)
    eager = backend.forward(q, k, v, 0, batch)  # stores this batch's K/V in pool_b, as the graph's pieces do
    return batch, q, backend, expected, eager


def run_graph_attention(attention: GraphExtendAttention, batch: ForwardBatch, q: torch.Tensor, bucket: int,
                        expected: torch.Tensor) -> tuple[TilePlan, torch.Tensor]:
    """Loads the batch over stale metadata and partials, runs the bucket's attention and checks it against
    `expected`, the padding rows untouched and the tile count; returns the plan and the bucket's output."""
    attention.q_lens.fill_(5)  # NOTE: stale metadata from an earlier batch must not leak into this one
    for partial in (attention.part_acc, attention.part_max, attention.part_sum):
        partial.fill_(float("nan"))  # NOTE: the merge must read only partials this batch wrote
    attention.load(batch)
    plan = attention.make_tile_table(bucket)
    tokens = q.shape[0]
    padded_q = torch.zeros(bucket, HEADS, HEAD_DIM, device=DEVICE)
    padded_q[:tokens] = q
    out = torch.full((bucket, HEADS * HEAD_DIM), 7.0, device=DEVICE)
    attention.forward(padded_q, 0, out, plan)
    torch.testing.assert_close(out[:tokens], expected.reshape(tokens, -1), atol=1e-4, rtol=1e-4)
    assert bool((out[tokens:] == 7.0).all())  # padding rows belong to no request
    new = batch.extend_lens_cpu
    assert int(attention.tile_count.item()) == sum(-(-n * (HEADS // KV_HEADS) // plan.tiles.block_m) for n in new)
    return plan, out


@pytest.mark.parametrize("heads,kv_heads,max_tokens", [(32, 8, 768), (16, 8, 1792), (9, 3, 3328), (16, 4, 1792),
                                                       (8, 4, 3840), (4, 1, 7936), (32, 8, 8192)])
def test_the_tile_table_holds_every_bucket(heads: int, kv_heads: int, max_tokens: int) -> None:
    """A middle bucket on the narrow small-extend tiles can need more tiles than the largest bucket on wide ones:
    the table is sized for the narrowest tiles, and every bucket's grid fits it."""
    from blockspec.runner.piecewise_graph import default_buckets

    backend = TritonAttentionBackend(None, 1.0, heads, kv_heads, 64)  # type: ignore[arg-type]
    attention = GraphExtendAttention(backend, torch.zeros(65, 16, dtype=torch.int64), 64, max_tokens)
    assert max(attention.plan_for(n).num_tiles for n in default_buckets(max_tokens)) <= attention.tile_ids.numel()


def test_plan_bounds_the_tiles_of_any_batch_in_the_bucket() -> None:
    backend = TritonAttentionBackend(None, 1.0, 32, 8, 128)  # type: ignore[arg-type]
    table = torch.zeros(65, 512, dtype=torch.int64)
    attention = GraphExtendAttention(backend, table, max_requests=64, max_tokens=8192)
    for bucket in (4, 128, 1024, 8192):
        plan = attention.plan_for(bucket)
        block_m = plan.tiles.block_m
        for lens in ([bucket], [1] * min(bucket, 64), [bucket - min(bucket, 63) + 1] + [1] * (min(bucket, 64) - 1)):
            assert sum(-(-n * 4 // block_m) for n in lens) <= plan.num_tiles


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_split_rule_splits_small_buckets_only(heads: int, kv_heads: int, head_dim: int) -> None:
    """Buckets below two waves of wide programs split (on the wide tiles), the others keep today's unsplit plan; with
    max_splits 1 every plan is today's; the static partials hold every bucket's."""
    from blockspec.runner.piecewise_graph import default_buckets

    backend = TritonAttentionBackend(None, 1.0, heads, kv_heads, head_dim)  # type: ignore[arg-type]
    table = torch.zeros(65, 16, dtype=torch.int64)
    unsplit = GraphExtendAttention(backend, table, 64, 8192)
    split = GraphExtendAttention(backend, table, 64, 8192, max_splits=8)
    assert unsplit.part_acc.numel() == 0
    for n in default_buckets(8192):
        today, plan = unsplit.plan_for(n), split.plan_for(n)
        assert today.splits == 1
        if split.wide_programs(n) >= TWO_WAVES:
            assert plan == today and today.tiles == EXTEND_POLICY.tiles
        else:
            assert plan.splits >= 4 and plan.tiles == EXTEND_POLICY.tiles
            assert plan.num_tiles * kv_heads <= today.num_tiles * kv_heads  # wide tiles: no more programs per split
            assert n * heads * plan.splits * backend.block_d <= split.part_acc.numel()
    if heads == 9:
        assert split.plan_for(704).splits == 8  # the cache-hit extend of 31 x 22 new tokens (bucket 704)
