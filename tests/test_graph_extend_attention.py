"""GraphExtendAttention (attention of extend batches inside CUDA graphs): for ragged extend batches (cached prefixes,
one-token chunks, sliding windows) it equals the torch reference and the Triton backend's eager launch, for a bucket
larger than the batch (padding rows untouched) and with the tile table made from the loaded metadata alone.

On CPU under TRITON_INTERPRET=1 (root conftest); natively on CUDA."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

pytest.importorskip("triton")

from blockspec.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from blockspec.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from blockspec.attention.triton_graph_extend import GraphExtendAttention  # noqa: E402
from blockspec.batch import ForwardMode  # noqa: E402
from test_triton_attention import DEVICE, make_case  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16


@pytest.mark.parametrize("prefix,new,page,window,bucket,max_requests", [
    ([0, 5, 17, 0], [9, 3, 20, 1], 1, None, 40, 4),
    ([16, 3], [40, 70], 16, None, 128, 4),
    ([30, 0, 2], [1, 1, 1], 4, None, 4, 4),
    ([40, 7], [12, 30], 1, 8, 48, 4),
    ([3] * 5, [0, 0, 0, 0, 2], 1, None, 4, 8),  # more requests than the bucket has tokens: the last one has rows
])
def test_tiled_extend_matches_torch_and_eager_triton(prefix: list[int], new: list[int], page: int,
                                                     window: Optional[int], bucket: int, max_requests: int) -> None:
    batch, pool_a, pool_b, q, k, v = make_case(ForwardMode.EXTEND, prefix, new, page, HEADS, KV_HEADS, HEAD_DIM,
                                               torch.float32)
    reference = TorchAttentionBackend(pool_a, HEAD_DIM ** -0.5, [window])
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q, k, v, 0, batch)
    backend = TritonAttentionBackend(pool_b, HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM, [window])
    batch.attn_meta = backend.plan(batch)
    eager = backend.forward(q, k, v, 0, batch)  # stores this batch's K/V in pool_b, as the graph's pieces do

    attention = GraphExtendAttention(backend, batch.req_to_token, max_requests=max_requests, max_tokens=bucket)
    attention.q_lens.fill_(5)  # NOTE: stale metadata from an earlier batch must not leak into this one
    attention.load(batch)
    plan = attention.make_tile_table(bucket)
    tokens = q.shape[0]
    padded_q = torch.zeros(bucket, HEADS, HEAD_DIM, device=DEVICE)
    padded_q[:tokens] = q
    out = torch.full((bucket, HEADS * HEAD_DIM), 7.0, device=DEVICE)
    attention.forward(padded_q, 0, out, plan)
    torch.testing.assert_close(out[:tokens], expected.reshape(tokens, -1), atol=1e-4, rtol=1e-4)
    assert torch.equal(out[:tokens], eager.reshape(tokens, -1)) or plan.tiles != backend.plan(batch).tiles
    assert bool((out[tokens:] == 7.0).all())  # padding rows belong to no request
    assert int(attention.tile_count.item()) == sum(-(-n * (HEADS // KV_HEADS) // plan.tiles.block_m) for n in new)


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
