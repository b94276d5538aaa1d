"""Extend attention that can live inside a CUDA graph (Triton backend): a whole extend forward, attention included,
becomes one graph replay per token bucket instead of one replay per piece plus an eager attention launch per layer
(≈ 100 µs of host per layer on an H200 host: a 30-layer model's small extend spent 3 ms launching attention).

A ragged extend batch's launch shape depends on its requests (query blocks per request), which a graph cannot
follow. Here the grid is fixed per bucket — as many tiles as the bucket's tokens could need — and a tile table
made on the device, inside the graph, maps tile t to (request, query-row block); programs past the batch's tile
count return at once. Per-request metadata lives in static buffers loaded before each replay (`load`).

Split-K (`max_splits` > 1): a bucket whose grid is small splits each program's keys S ways (`splits_for`), the
splits' fp32 partials going to static buffers and a merge launch over the bucket's rows combining them. The
cache-hit extend is the case: e.g. 31 requests x 22 new tokens behind 4,110 cached tokens each is a few hundred
programs, each streaming a whole prefix (latency-bound) unsplit. The split count is fixed per captured bucket; the
keys each split covers follow the batch at run time (in the kernel, with a floor of `min_split_keys`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from blockspec.attention.base import layer_window
from blockspec.attention.triton_backend import (
    EXTEND_POLICY, SMALL_EXTEND_POLICY, TWO_WAVES, KernelTiles, TritonAttentionBackend, merge_heads_per_program,
)
from blockspec.attention.triton_kernels import LOG2E, merge_real_rows_kernel, tiled_extend_attention_kernel
from blockspec.batch import ForwardBatch, ForwardMode
from blockspec.pdl import pdl_launch

# NOTE: a splitting bucket's full rows on wide tiles, times its splits, make at most SPLIT_PROGRAMS programs (8 waves
# of an H200's 132 SMs); a split reads at least DEFAULT_MIN_SPLIT_KEYS keys, so a batch of short prefixes leaves its
# later splits empty. Measured with max_splits 4 (profile_prefill.py --graph-extend-splits, H200, 2026-12-03).
SPLIT_PROGRAMS = 1056
DEFAULT_MIN_SPLIT_KEYS = 256


@dataclass(frozen=True)
class TilePlan:
    """A bucket's launch: the tiles, how many tile slots its grid has (an upper bound on the batch's tiles), and
    how many ways each program's keys are split (1: unsplit, no partials, no merge)."""

    tiles: KernelTiles
    num_tiles: int
    splits: int = 1


class GraphExtendAttention:
    def __init__(self, backend: TritonAttentionBackend, req_to_token: torch.Tensor, max_requests: int,
                 max_tokens: int, max_splits: int = 1, min_split_keys: int = DEFAULT_MIN_SPLIT_KEYS) -> None:
        """`req_to_token`: the runner's req→token table (its address is baked into the graphs); at most
        `max_requests` requests and `max_tokens` tokens per batch; key splits per program at most `max_splits`
        (1: never split), each split at least `min_split_keys` keys."""
        if max_splits < 1 or min_split_keys < 0:
            raise ValueError(f"max_splits must be >= 1 and min_split_keys >= 0, got {max_splits}, {min_split_keys}")
        self.backend = backend
        self.req_to_token = req_to_token
        self.max_requests = max_requests
        self.max_splits = max_splits
        self.min_split_keys = min_split_keys
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
        self.tile_req, self.tile_m, self.tile_count = (
            index_buffer(most_tiles),
            index_buffer(most_tiles),
            index_buffer(1),
        )
        self.tile_ids = torch.arange(most_tiles, dtype=torch.int64, device=device)
        self.token_count = index_buffer(1)
        partial_rows = self.most_split_rows(max_tokens) * backend.num_heads
        self.part_acc = torch.empty(partial_rows * backend.block_d, dtype=torch.float32, device=device)
        self.part_max = torch.empty(partial_rows, dtype=torch.float32, device=device)
        self.part_sum = torch.empty(partial_rows, dtype=torch.float32, device=device)

    def wide_programs(self, num_tokens: int) -> int:
        """Programs of the bucket's full rows (one request's worth) on the wide extend tiles."""
        return triton.cdiv(num_tokens * self.group, EXTEND_POLICY.tiles.block_m) * self.backend.num_kv_heads

    def splits_for(self, num_tokens: int) -> int:
        """Key splits of a bucket. A bucket filling two waves of wide programs (a long prefill) is unsplit: its grid
        is full already. A smaller one (today's small-extend tiles) splits into the most ways, a power of two up to
        max_splits, keeping its full rows' wide programs x splits <= SPLIT_PROGRAMS: at least 4 ways where
        max_splits allows, as such a bucket has < TWO_WAVES programs."""
        programs = self.wide_programs(num_tokens)
        splits = 1
        if programs >= TWO_WAVES:
            return splits
        while splits * 2 <= self.max_splits and programs * splits * 2 <= SPLIT_PROGRAMS:
            splits *= 2
        return splits

    def most_split_rows(self, max_tokens: int) -> int:
        """The most (token, split) pairs of a splitting bucket up to max_tokens tokens: the partial buffers' size
        per head. NOTE: partials are laid out [token, head, split, BLOCK_D] with the bucket's own split count."""
        most, n = 0, 1
        while n <= max_tokens and (splits := self.splits_for(n)) > 1:  # NOTE: splits_for never grows with n
            most, n = max(most, n * splits), n + 1
        return most

    def plan_for(self, num_tokens: int) -> TilePlan:
        """Wide tiles once the bucket's full rows fill two waves of programs; below that the small-extend tiles
        unsplit, or the wide tiles split (`splits_for`): fewer row blocks per request, so fewer reads of its keys."""
        splits = self.splits_for(num_tokens)
        wide = splits > 1 or self.wide_programs(num_tokens) >= TWO_WAVES
        tiles = (EXTEND_POLICY if wide else SMALL_EXTEND_POLICY).tiles
        # NOTE: every request with new tokens (at most one per token) wastes at most one partly filled row block.
        requests = min(num_tokens, self.max_requests)
        return TilePlan(tiles, triton.cdiv(num_tokens * self.group, tiles.block_m) + requests, splits)

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
        if plan.splits > 1 and num_tokens * self.backend.num_heads * plan.splits > self.part_max.numel():
            raise ValueError(f"a {num_tokens}-token bucket split {plan.splits} ways needs more partials than the "
                             f"{self.part_max.numel()} rows held (built for fewer tokens)")
        block_m = plan.tiles.block_m
        # NOTE: every request slot, not the bucket's count: requests without new tokens (no tiles) may sit anywhere.
        per_request = (self.q_lens * self.group + block_m - 1) // block_m
        ends = torch.cumsum(per_request, 0)
        ids = self.tile_ids[:plan.num_tiles]
        owner = torch.searchsorted(ends, ids, right=True).clamp_(max=self.max_requests - 1)
        self.tile_req[:plan.num_tiles].copy_(owner)
        self.tile_m[:plan.num_tiles].copy_(ids - (ends[owner] - per_request[owner]))
        self.tile_count.copy_(ends[-1:])
        if plan.splits > 1:
            # NOTE: a batch's query rows are the bucket's first sum(q_lens) rows (build_batch packs them from row 0,
            # the piecewise runner copies them to the first rows); the merge writes those rows only.
            self.token_count.copy_(self.q_lens.sum(0, keepdim=True))
        return plan

    def forward(self, q: torch.Tensor, layer_id: int, out: torch.Tensor, plan: TilePlan) -> None:
        """Attention of layer `layer_id` for the loaded batch's query rows of q [T, Hq, D] (K/V already stored)
        into out [T, Hq * D]; rows of no request are left as they are."""
        backend = self.backend
        k_cache, v_cache = backend.pool.k[layer_id], backend.pool.v[layer_id]
        out = out.view(q.shape)
        window = layer_window(backend.sliding_windows, layer_id)
        table = self.req_to_token
        heads, splits = backend.num_heads, plan.splits
        num_tokens = q.shape[0]
        partials = (out, out, out)
        if splits > 1:
            used = num_tokens * heads * splits
            partials = (self.part_acc[:used * backend.block_d], self.part_max[:used], self.part_sum[:used])
        tiled_extend_attention_kernel[(plan.num_tiles, backend.num_kv_heads, splits)](
            q, k_cache, v_cache, out, *partials, table, self.req_rows, self.q_starts, self.q_lens, self.seq_lens,
            self.tile_req, self.tile_m, self.tile_count,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0), out.stride(0),
            out.stride(1), heads * splits, splits, backend.scale * LOG2E, window or 0, GROUP=self.group,
            NUM_SPLITS=splits, MIN_SPLIT_KEYS=self.min_split_keys if splits > 1 else 0,
            **backend.tile_options(q, plan.tiles, ForwardMode.EXTEND, layer_id, tiled_extend_attention_kernel),
        )
        if splits == 1:
            return
        heads_per_program = merge_heads_per_program(splits, backend.block_d, heads)
        merge_real_rows_kernel[(num_tokens, triton.cdiv(heads, heads_per_program))](
            out, *partials, self.token_count, out.stride(0), out.stride(1), heads * splits, splits, 1, heads,
            HEAD_DIM=backend.head_dim, BLOCK_D=backend.block_d, NUM_SPLITS=splits, BLOCK_H=heads_per_program,
            **pdl_launch(q, merge_real_rows_kernel),
        )
