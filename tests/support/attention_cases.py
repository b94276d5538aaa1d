"""Attention test cases shared by the attention backend tests (Triton, FlashInfer, graph extend, batch-invariant):
one ragged batch of a given mode over random cached K/V in two identical pools, and the sweep of modes and shapes."""
from __future__ import annotations

from typing import Optional

import torch

from blockspec.batch import ForwardBatch, ForwardMode, build_batch
from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.kv.pool import KVPool
from blockspec.request import Req, SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_case(
    mode: ForwardMode, prefix_lens: list[int], new_lens: list[int], page_size: int, heads: int, kv_heads: int,
    head_dim: int, dtype: torch.dtype, seed: int = 0,
) -> tuple[ForwardBatch, KVPool, KVPool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, pool_a, pool_b, q, k, v): a `mode` batch of requests with `prefix_lens` cached and `new_lens` new
    tokens, two pools holding the same random cached K/V (one for the reference, one for the backend under test),
    and random q, k, v of the new tokens (their K/V are written by forward)."""
    torch.manual_seed(seed)
    total = sum(p + n for p, n in zip(prefix_lens, new_lens)) + 64
    allocator = PageAllocator(total // page_size + len(prefix_lens) + 2, page_size)
    table = ReqToTokenTable(len(prefix_lens) + 1, max(p + n for p, n in zip(prefix_lens, new_lens)) + 1, DEVICE)
    pool_a = KVPool(allocator.num_pages * page_size, 1, kv_heads, head_dim, dtype, DEVICE)
    reqs = []
    for p, n in zip(prefix_lens, new_lens):
        req = Req([1] * (p + n), SamplingParams())
        req.pool_row = table.acquire()
        allocator.grow(req, p + n, table)
        reqs.append(req)
    # Random cached prefix K/V everywhere; the new tokens' K/V are written by forward.
    pool_a.k[0].normal_()
    pool_a.v[0].normal_()
    pool_b = KVPool(pool_a.num_slots, 1, kv_heads, head_dim, dtype, DEVICE)
    pool_b.k[0].copy_(pool_a.k[0])
    pool_b.v[0].copy_(pool_a.v[0])
    batch = build_batch(mode, [[1] * n for n in new_lens], prefix_lens, [r.pool_row for r in reqs], table.table, [0])
    t = sum(new_lens)
    q = torch.randn(t, heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(t, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn(t, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    return batch, pool_a, pool_b, q, k, v


CASES: list[tuple[ForwardMode, list[int], list[int], int, Optional[int], Optional[bool]]] = [
    # mode, prefix lens, new lens, page size, window, draft causal
    (ForwardMode.EXTEND, [0, 5, 17, 0], [9, 3, 20, 1], 1, None, None),
    (ForwardMode.EXTEND, [16, 3], [40, 70], 16, None, None),
    (ForwardMode.DECODE, [0, 30, 300, 7], [1, 1, 1, 1], 16, None, None),
    (ForwardMode.VERIFY, [4, 90, 13], [8, 8, 8], 1, None, None),
    (ForwardMode.DRAFT, [4, 90, 13], [8, 8, 8], 4, None, None),
    (ForwardMode.DRAFT, [40, 90], [16, 16], 1, 24, True),
    (ForwardMode.DRAFT, [40, 90], [16, 16], 16, 24, False),
]
