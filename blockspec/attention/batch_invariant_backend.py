"""BatchInvariantAttentionBackend (--enable-deterministic-inference): paged attention whose result for a query row
depends only on that row's query, position and keys, never on the batch, the request's query count or the mode.

The kernels (batch_invariant_kernels.py) fix the numerics: one tile shape for every mode, keys accumulated in lanes
of fixed size at fixed absolute positions, lanes folded in a fixed order. What stays free per batch is only where
the lanes run (one program per lane plus a merge, or all lanes in one program: the same bits), so planning may use
the batch size and query length as the default backend does, device tensors only for uniform batches (CUDA graphs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import triton

from blockspec.attention.base import PagedBackendBase, layer_is_causal, layer_window, split_partials
from blockspec.attention.batch_invariant_kernels import batch_invariant_attention_kernel, merge_lanes_kernel
from blockspec.attention.triton_backend import KernelTiles, query_layout
from blockspec.attention.triton_kernels import LOG2E
from blockspec.batch import ForwardBatch, ForwardMode
from blockspec.kv.pool import KVPool
from blockspec.pdl import pdl_launch

DEFAULT_LANE_KEYS = 256  # NOTE: the default --triton-attention-split-tile-size, the default policy's min_split_keys


@dataclass(frozen=True)
class BatchInvariantAttention:
    """`lane_keys` (keys per lane unit, a multiple of tiles.block_n), `lanes` and `tiles` define the numerics and are
    fixed per engine; `max_split_programs` is launch policy only: lanes get a program each while the batch needs at
    most this many programs in all, else every lane runs in one program."""

    lane_keys: int = DEFAULT_LANE_KEYS
    lanes: int = 16
    tiles: KernelTiles = field(default_factory=lambda: KernelTiles(64, 32, 4, 2))
    max_split_programs: int = 2048

    def __post_init__(self) -> None:
        if self.lane_keys < 1 or self.lane_keys % self.tiles.block_n:
            raise ValueError(f"the attention split tile size must be a positive multiple of {self.tiles.block_n} "
                             f"keys, got {self.lane_keys}")
        if self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")


@dataclass
class BatchInvariantMeta:
    q_starts: torch.Tensor  # [bs] int32 (uniform batches) or int64 (built batches)
    q_lens: torch.Tensor  # [bs]
    max_q_len: int
    split_lanes: bool


class BatchInvariantAttentionBackend(PagedBackendBase):
    def __init__(
        self,
        pool: KVPool,
        scale: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_windows: Optional[list[Optional[int]]] = None,
        draft_layer_causal: Optional[list[bool]] = None,
        settings: BatchInvariantAttention = BatchInvariantAttention(),
    ) -> None:
        super().__init__(pool, scale, num_heads, num_kv_heads, head_dim, sliding_windows, draft_layer_causal)
        self.block_d = max(16, triton.next_power_of_2(head_dim))
        self.settings = settings

    def splits_lanes(self, batch_size: int, max_q_len: int, max_seq_len: int) -> bool:
        """Whether lanes get a program each (the batch alone has few programs and keys span several lane units)."""
        settings = self.settings
        rows = max_q_len * (self.num_heads // self.num_kv_heads)
        programs = triton.cdiv(rows, settings.tiles.block_m) * batch_size * self.num_kv_heads
        return max_seq_len > settings.lane_keys and programs * settings.lanes <= settings.max_split_programs

    def plan(self, batch: ForwardBatch) -> BatchInvariantMeta:
        if batch.tree_mask is not None:  # NOTE: EngineConfig refuses the combination first
            raise ValueError("the batch-invariant attention cannot run a tree verify (speculative_tree_budget)")
        q_starts, q_lens, max_q = query_layout(batch)
        max_seq = batch.max_seq_len_hint if batch.max_seq_len_hint is not None else max(batch.seq_lens_cpu)
        return BatchInvariantMeta(q_starts, q_lens, max_q, self.splits_lanes(batch.batch_size, max_q, max_seq))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        kv_stored: bool = False, out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        meta: BatchInvariantMeta = batch.attn_meta
        q, k_cache, v_cache, out = self.stored_query_and_output(q, k, v, layer_id, batch, kv_stored, out)
        num_tokens = q.shape[0]
        settings, tiles = self.settings, self.settings.tiles
        lanes = settings.lanes
        part_acc, part_max, part_sum = split_partials(out, self.num_heads, lanes, self.block_d, meta.split_lanes)
        group = self.num_heads // self.num_kv_heads
        window = layer_window(self.sliding_windows, layer_id)
        table = batch.req_to_token
        grid = (triton.cdiv(meta.max_q_len * group, tiles.block_m), batch.batch_size * self.num_kv_heads,
                lanes if meta.split_lanes else 1)
        # NOTE: no FMA contraction, so the lane fold rounds the same in both kernels (and in both variants).
        batch_invariant_attention_kernel[grid](
            q, k_cache, v_cache, out, part_acc, part_max, part_sum,
            table, batch.req_rows, meta.q_starts, meta.q_lens, batch.seq_lens,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
            out.stride(0), out.stride(1), self.num_heads * lanes, lanes,
            self.scale * LOG2E, window or 0,
            NUM_KV_HEADS=self.num_kv_heads, GROUP=group, HEAD_DIM=self.head_dim, BLOCK_D=self.block_d,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, LANES=lanes, LANE_KEYS=settings.lane_keys,
            SPLIT_LANES=meta.split_lanes, CAUSAL=layer_is_causal(batch.mode, self.draft_layer_causal, layer_id),
            USE_WINDOW=window is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=False,
            **pdl_launch(q, batch_invariant_attention_kernel),
        )
        if meta.split_lanes:
            heads_per_program = min(triton.next_power_of_2(self.num_heads), 8)
            merge_lanes_kernel[(num_tokens, triton.cdiv(self.num_heads, heads_per_program))](
                out, part_acc, part_max, part_sum, out.stride(0), out.stride(1), self.num_heads * lanes, lanes,
                self.num_heads, HEAD_DIM=self.head_dim, BLOCK_D=self.block_d, LANES=lanes, BLOCK_H=heads_per_program,
                enable_fp_fusion=False, **pdl_launch(q, merge_lanes_kernel),
            )
        return out.reshape(num_tokens, -1)

    def warm_up(self, mode: ForwardMode, layer_ids: list[int], req_to_token: torch.Tensor, dummy_row: int) -> int:
        """Compiles every variant `mode` can launch (lanes split or not, per layer class in `layer_ids`) by a
        one-token launch over the dummy req→token row (it reads and writes only the dummy page); returns how many."""
        k_cache = self.pool.k[0]
        device, dtype = k_cache.device, k_cache.dtype
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = torch.zeros((1, (hq + 2 * hk) * d), dtype=dtype, device=device)
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        # NOTE: the index arrays are int64 from build_batch (extends), int32 from query_layout (uniform batches).
        index_dtype = torch.int64 if mode is ForwardMode.EXTEND else torch.int32
        one = torch.ones(1, dtype=torch.int64, device=device)
        launched = 0
        for split_lanes in (False, True):
            for layer_id in layer_ids:
                batch = ForwardBatch(
                    mode=mode, input_ids=one * 0, positions=one * 0, out_cache_loc=one * 0, req_rows=one * dummy_row,
                    seq_lens=one, seq_lens_cpu=[1], extend_lens_cpu=[1], logits_rows=one * 0, req_to_token=req_to_token,
                    uniform_q_len=None if mode is ForwardMode.EXTEND else 1,
                )
                batch.attn_meta = BatchInvariantMeta(torch.zeros(1, dtype=index_dtype, device=device),
                                                     torch.ones(1, dtype=index_dtype, device=device), 1, split_lanes)
                self.forward(q.view(1, hq, d), k.view(1, hk, d), v.view(1, hk, d), layer_id, batch, kv_stored=True)
                launched += 1
        return launched
