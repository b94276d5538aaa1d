"""Rows of batch-invariant attention (--enable-deterministic-inference), shared by the CPU test and the GPU test:
requests with random cached K/V and queries, one forward's output rows by (request, position), and one position's
rows along every path (decode, verify, extend at several batch sizes) to compare bit for bit."""
from __future__ import annotations

from typing import Optional

import torch

from blockspec.attention.batch_invariant_backend import BatchInvariantAttention, BatchInvariantAttentionBackend
from blockspec.attention.triton_backend import KernelTiles
from blockspec.batch import ForwardMode, build_batch
from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.kv.pool import KVPool
from blockspec.request import Req, SamplingParams
from tests.support.attention_cases import DEVICE

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# NOTE: small tiles and lanes so that a few dozen keys span several lanes and lane units; a decode of one request
# has few programs (its lanes split), a batch of several does not.
SETTINGS = BatchInvariantAttention(lane_keys=32, lanes=4, tiles=KernelTiles(16, 16, 4, 1), max_split_programs=16)
Part = tuple[int, int, int]  # (request, first position, query tokens)


class Sequences:
    """Requests with random cached K/V for every position and a random query per (position, head)."""

    def __init__(self, lengths: list[int], dtype: torch.dtype, page_size: int = 4, seed: int = 0,
                 heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM)) -> None:
        torch.manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads
        allocator = PageAllocator(sum(lengths) // page_size + len(lengths) + 2, page_size)
        self.table = ReqToTokenTable(len(lengths) + 1, max(lengths) + 1, DEVICE)
        self.pool = KVPool(allocator.num_pages * page_size, 1, self.kv_heads, self.head_dim, dtype, DEVICE)
        self.pool.k[0].normal_()
        self.pool.v[0].normal_()
        self.rows: list[int] = []
        for n in lengths:
            req = Req([1] * n, SamplingParams())
            req.pool_row = self.table.acquire()
            allocator.grow(req, n, self.table)
            self.rows.append(req.pool_row)
        self.queries = [torch.randn(n, self.heads, self.head_dim, dtype=dtype, device=DEVICE) for n in lengths]

    def attend(self, backend: object, mode: ForwardMode, parts: list[Part],
               split_lanes: Optional[bool] = None) -> dict[tuple[int, int], torch.Tensor]:
        """Output rows by (request, position) of one forward over `parts` (their K/V already cached)."""
        batch = build_batch(mode, [[1] * n for _, _, n in parts], [start for _, start, _ in parts],
                            [self.rows[r] for r, _, _ in parts], self.table.table, [0])
        q = torch.cat([self.queries[r][start:start + n] for r, start, n in parts])
        meta = backend.plan(batch)  # type: ignore[attr-defined]
        if split_lanes is not None:
            meta.split_lanes = split_lanes
        batch.attn_meta = meta
        kv = q[:, :self.kv_heads]  # NOTE: unused (kv_stored): every key is already in the pool
        out = backend.forward(q, kv, kv, 0, batch, kv_stored=True)  # type: ignore[attr-defined]
        rows, offset = {}, 0
        for r, start, n in parts:
            for j in range(n):
                rows[(r, start + j)] = out[offset + j]
            offset += n
        return rows


def backend_for(seqs: Sequences, window: Optional[int] = None, settings: BatchInvariantAttention = SETTINGS,
                causal: Optional[bool] = None) -> BatchInvariantAttentionBackend:
    return BatchInvariantAttentionBackend(seqs.pool, seqs.head_dim ** -0.5, seqs.heads, seqs.kv_heads, seqs.head_dim,
                                          [window], None if causal is None else [causal], settings)


def mismatches(reference: dict[tuple[int, int], torch.Tensor], *others: dict[tuple[int, int], torch.Tensor]) -> int:
    """Rows of the other forwards that are not bit-identical to the reference's row at the same (request, position)."""
    return sum(int(not torch.equal(rows[key], reference[key])) for rows in others for key in rows)


def paths_of_one_position(seqs: Sequences, backend: object, position: int = 61,
                          block: int = 8) -> tuple[dict, list[dict]]:
    """`position` of request 0 (and the one 3 later) as: a bs-1 decode (reference), a decode among 3 requests, row
    3 of a verify block (bs 1 and bs 3), rows inside a 23-token extend chunk next to another request's chunk, and
    the first row of a chunk that starts there."""
    start = position - 3
    reference = {**seqs.attend(backend, ForwardMode.DECODE, [(0, position, 1)]),
                 **seqs.attend(backend, ForwardMode.DECODE, [(0, position + 3, 1)])}
    others = [
        seqs.attend(backend, ForwardMode.DECODE, [(1, 30, 1), (0, position, 1), (2, 7, 1)]),
        seqs.attend(backend, ForwardMode.VERIFY, [(0, start, block)]),
        seqs.attend(backend, ForwardMode.VERIFY, [(2, 20, block), (0, start, block), (1, 3, block)]),
        seqs.attend(backend, ForwardMode.EXTEND, [(1, 0, 40), (0, position - 16, 23)]),
        seqs.attend(backend, ForwardMode.EXTEND, [(0, position, 4)]),
    ]
    return reference, [{key: rows[key] for key in rows if key in reference} for rows in others]
