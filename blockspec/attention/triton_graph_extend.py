"""Extend attention that can live inside a CUDA graph (Triton backend): a whole extend forward, attention included,
becomes one graph replay per token bucket instead of one replay per piece plus an eager attention launch per layer
(≈ 100 µs of host per layer on an H200 host: a 30-layer model's small extend spent 3 ms launching attention).

A ragged extend batch's launch shape depends on its requests (query blocks per request), which a graph cannot
follow. Here the grid is fixed per bucket — as many tiles as the bucket's tokens could need — and a tile table
made on the device, inside the graph, maps tile t to (request, query-row block); programs past the batch's tile
count return at once. Per-request metadata lives in static buffers loaded before each replay (`load`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from blockspec.attention.base import layer_window
from blockspec.attention.triton_backend import (
    EXTEND_POLICY, SMALL_EXTEND_POLICY, TWO_WAVES, KernelTiles, TritonAttentionBackend,
)
from blockspec.attention.triton_kernels import LOG2E, tiled_extend_attention_kernel
from blockspec.batch import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class TilePlan:
    """A bucket's launch: the tiles, and how many tile slots its grid has (an upper bound on the batch's tiles)."""

    tiles: KernelTiles
    num_tiles: int


class GraphExtendAttention:
    def __init__(self, backend: TritonAttentionBackend, req_to_token: torch.Tensor, max_requests: int,
                 max_tokens: int) -> None:
        """`req_to_token`: the runner's req→token table (its address is baked into the graphs); at most
        `max_requests` requests and `max_tokens` tokens per batch."""
        self.backend = backend
        self.req_to_token = req_to_token
        self.max_requests = max_requests
        self.group = backend.num_heads // backend.num_kv_heads
        device = req_to_token.device

        def index_buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        self.q_starts, self.q_lens = index_buffer(max_requests), index_buffer(max_requests)
        self.req_rows, self.seq_lens = index_buffer(max_requests), index_buffer(max_requests)
        # NOTE: the bound of the narrowest tiles, not the largest bucket's plan: a middle bucket on narrow tiles can
        # need more tiles than the largest bucket on wide ones.
        narrowest = min(EXTEND_POLICY.tiles.block_m, SMALL_EXTEND_POLICY.tiles.block_m)
        most_tiles = triton.cdiv(max_tokens * self.group, narrowest) + min(max_tokens, max_requests)
        self.tile_req, self.tile_m, self.tile_count = index_buffer(most_tiles), index_buffer(most_tiles), index_buffer(1)
        self.tile_ids = torch.arange(most_tiles, dtype=torch.int64, device=device)

    def plan_for(self, num_tokens: int) -> TilePlan:
        """Wide tiles once the bucket's full rows fill two waves of programs, else the small-extend tiles."""
        kv_heads = self.backend.num_kv_heads
        wide = triton.cdiv(num_tokens * self.group, EXTEND_POLICY.tiles.block_m) * kv_heads >= TWO_WAVES
        tiles = (EXTEND_POLICY if wide else SMALL_EXTEND_POLICY).tiles
        # NOTE: every request with new tokens (at most one per token) wastes at most one partly filled row block.
        requests = min(num_tokens, self.max_requests)
        return TilePlan(tiles, triton.cdiv(num_tokens * self.group, tiles.block_m) + requests)

    def can_take(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.EXTEND and batch.extend_starts is not None and \
            batch.batch_size <= self.max_requests

    def load(self, batch: ForwardBatch) -> None:
        """The batch's per-request metadata into the static buffers (outside the graph, before its replay)."""
        assert batch.extend_starts is not None and batch.extend_lens is not None
        bs = batch.batch_size
        self.q_starts[:bs].copy_(batch.extend_starts)
        self.q_lens[:bs].copy_(batch.extend_lens)
        self.req_rows[:bs].copy_(batch.req_rows)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        self.q_lens[bs:].zero_()  # NOTE: requests past the batch have no query rows, so no tiles

    def make_tile_table(self, num_tokens: int) -> TilePlan:
        """The tile table of the loaded batch, on the device (graph-safe: fixed shapes, no host sync)."""
        plan = self.plan_for(num_tokens)
        if plan.num_tiles > self.tile_ids.numel():
            raise ValueError(f"a {num_tokens}-token bucket needs {plan.num_tiles} tiles; the table holds "
                             f"{self.tile_ids.numel()} (built for fewer tokens)")
        block_m = plan.tiles.block_m
        # NOTE: every request slot, not the bucket's count: requests without new tokens (no tiles) may sit anywhere.
        per_request = (self.q_lens * self.group + block_m - 1) // block_m
        ends = torch.cumsum(per_request, 0)
        ids = self.tile_ids[:plan.num_tiles]
        owner = torch.searchsorted(ends, ids, right=True).clamp_(max=self.max_requests - 1)
        self.tile_req[:plan.num_tiles].copy_(owner)
        self.tile_m[:plan.num_tiles].copy_(ids - (ends[owner] - per_request[owner]))
        self.tile_count.copy_(ends[-1:])
        return plan

    def forward(self, q: torch.Tensor, layer_id: int, out: torch.Tensor, plan: TilePlan) -> None:
        """Attention of layer `layer_id` for the loaded batch's query rows of q [T, Hq, D] (K/V already stored)
        into out [T, Hq * D]; rows of no request are left as they are."""
        backend = self.backend
        k_cache, v_cache = backend.pool.k[layer_id], backend.pool.v[layer_id]
        out = out.view(q.shape)
        window = layer_window(backend.sliding_windows, layer_id)
        table = self.req_to_token
        tiled_extend_attention_kernel[(plan.num_tiles, backend.num_kv_heads)](
            q, k_cache, v_cache, out, table, self.req_rows, self.q_starts, self.q_lens, self.seq_lens,
            self.tile_req, self.tile_m, self.tile_count,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0), out.stride(0),
            out.stride(1), backend.scale * LOG2E, window or 0, GROUP=self.group,
            **backend.tile_options(q, plan.tiles, ForwardMode.EXTEND, layer_id, tiled_extend_attention_kernel),
        )
