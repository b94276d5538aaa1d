"""Tree-masked verify attention (DDTree): each new row sees the whole context and, among the new rows, its tree
ancestors and itself. The torch backend equals a dense masked softmax written here; Triton equals the torch backend
(on CPU under TRITON_INTERPRET=1, set by the root conftest; fp32/fp16)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from blockspec.attention.torch_backend import TorchAttentionBackend
from blockspec.batch import ForwardMode, build_batch
from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.kv.pool import KVPool
from blockspec.request import Req, SamplingParams
from blockspec.speculative.tree_build import build_tree

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def tree_case(prefix_lens: list[int], budget: int, page_size: int, dtype: torch.dtype) -> tuple:
    """A verify batch of [root, B nodes] per request on random context K/V, with a random draft tree's mask and
    depth positions; two identical pools (reference, backend under test) and q, k, v of the new rows."""
    torch.manual_seed(budget + page_size)
    q_len = budget + 1
    allocator = PageAllocator(sum(prefix_lens) // page_size + len(prefix_lens) * (q_len // page_size + 2) + 2,
                              page_size)
    table = ReqToTokenTable(len(prefix_lens) + 1, max(prefix_lens) + q_len + 1, DEVICE)
    reqs = []
    for p in prefix_lens:
        req = Req([1] * (p + q_len), SamplingParams())
        req.pool_row = table.acquire()
        allocator.grow(req, p + q_len, table)
        reqs.append(req)
    pools = [KVPool(allocator.num_pages * page_size, 1, KV_HEADS, HEAD_DIM, dtype, DEVICE) for _ in range(2)]
    pools[0].k[0].normal_()
    pools[0].v[0].normal_()
    pools[1].k[0].copy_(pools[0].k[0])
    pools[1].v[0].copy_(pools[0].v[0])
    batch = build_batch(ForwardMode.VERIFY, [[1] * q_len for _ in prefix_lens], prefix_lens,
                        [r.pool_row for r in reqs], table.table, [0])
    tree = build_tree(torch.randn(len(prefix_lens), 5, 40, device=DEVICE).log_softmax(-1), budget)
    positions = (torch.tensor(prefix_lens, device=DEVICE)[:, None] + tree.depths).reshape(-1)
    batch = dataclasses.replace(batch, positions=positions, tree_mask=tree.ancestors)
    t = batch.num_tokens
    q = torch.randn(t, HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    return batch, pools, q, k, v, tree


def dense_reference(pool: KVPool, batch, q, k, v, tree, prefix_lens: list[int]) -> torch.Tensor:
    """Per request and head: softmax over [context keys ; new rows' keys] with the ancestor mask, in float64."""
    q_len = tree.ancestors.shape[1]
    out = torch.empty(q.shape[0], HEADS, HEAD_DIM, dtype=torch.float64, device=q.device)
    for i, prefix in enumerate(prefix_lens):
        slots = batch.req_to_token[batch.req_rows[i], :prefix]
        rows = slice(i * q_len, (i + 1) * q_len)
        keys = torch.cat([pool.k[0][slots], k[rows]]).double()
        values = torch.cat([pool.v[0][slots], v[rows]]).double()
        visible = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=q.device), tree.ancestors[i]], 1)
        for h in range(HEADS):
            scores = q[rows, h].double() @ keys[:, h // (HEADS // KV_HEADS)].T * HEAD_DIM ** -0.5
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[rows, h] = weights @ values[:, h // (HEADS // KV_HEADS)]
    return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("prefix_lens,budget,page_size", [([5, 30], 6, 1), ([17, 3, 64], 12, 4), ([40], 20, 16)])
def test_torch_tree_attention_equals_dense_masked_softmax(prefix_lens, budget, page_size) -> None:
    batch, pools, q, k, v, tree = tree_case(prefix_lens, budget, page_size, torch.float32)
    backend = TorchAttentionBackend(pools[0], HEAD_DIM ** -0.5)
    batch.attn_meta = backend.plan(batch)
    got = backend.forward(q, k, v, 0, batch)
    expected = dense_reference(pools[0], batch, q, k, v, tree, prefix_lens)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # NOTE: the mask matters: without it the causal verify gives other values
    causal = dataclasses.replace(batch, tree_mask=None, attn_meta=None)
    causal.attn_meta = backend.plan(causal)
    assert not torch.allclose(backend.forward(q, k, v, 0, causal), got, atol=1e-3)


@pytest.mark.parametrize("prefix_lens,budget,page_size", [([5, 30], 6, 1), ([17, 3, 64], 12, 4), ([40], 20, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("max_splits", [1, 4])
def test_triton_tree_attention_equals_torch(prefix_lens, budget, page_size, dtype, max_splits) -> None:
    pytest.importorskip("triton")
    from blockspec.attention.triton_backend import KernelTiles, TritonAttentionBackend

    if dtype == torch.float16 and DEVICE.type == "cpu" and max_splits == 4:
        pytest.skip("one fp16 sweep on CPU is enough")
    batch, pools, q, k, v, _ = tree_case(prefix_lens, budget, page_size, dtype)
    reference = TorchAttentionBackend(pools[0], HEAD_DIM ** -0.5)
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q.float() if dtype == torch.float16 else q, k, v, 0, batch)
    backend = TritonAttentionBackend(pools[1], HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM, max_splits=max_splits)
    for tiles in (None, KernelTiles(16, 32, 4, 2, mask_edges_only=True)):
        meta = backend.plan(batch)
        if max_splits > 1:
            meta.num_splits = max_splits  # NOTE: force split-K even at these tiny lengths
        if tiles is not None:
            meta.tiles = tiles
        batch.attn_meta = meta
        got = backend.forward(q, k, v, 0, batch)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("prefix_lens,budget,page_size", [([70, 3], 40, 4), ([130], 39, 1), ([9, 200, 33], 35, 16)])
@pytest.mark.parametrize("splits", [1, 4])
def test_block_tiles_run_trees_past_64_query_rows(prefix_lens, budget, page_size, splits) -> None:
    """A verify block keeps the block policies up to MAX_BLOCK_ROWS query rows (a tree of 35-40 nodes is 72-82 rows
    at this GQA group of 2): the 64-row block tiles, and the wide ones with edge-only masks, over several row blocks
    with and without split-K, equal the torch backend."""
    pytest.importorskip("triton")
    from blockspec.attention.triton_backend import (
        BLOCK_POLICY, WIDE_BLOCK_POLICY, TritonAttentionBackend, launch_policy,
    )

    batch, pools, q, k, v, _ = tree_case(prefix_lens, budget, page_size, torch.float32)
    reference = TorchAttentionBackend(pools[0], HEAD_DIM ** -0.5)
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q, k, v, 0, batch)
    backend = TritonAttentionBackend(pools[1], HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM, max_splits=splits)
    rows = (budget + 1) * (HEADS // KV_HEADS)
    assert rows > 64 and backend.plan(batch).tiles == launch_policy(rows, len(prefix_lens), KV_HEADS, True).tiles
    for tiles in (BLOCK_POLICY.tiles, WIDE_BLOCK_POLICY.tiles):
        meta = backend.plan(batch)
        meta.num_splits, meta.tiles = splits, tiles
        batch.attn_meta = meta
        got = backend.forward(q, k, v, 0, batch)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
