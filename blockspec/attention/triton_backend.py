"""Triton attention backend: planning (device-only for uniform batches, so it can live inside CUDA graphs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton

from blockspec.attention.base import PagedBackendBase, layer_is_causal, layer_window, split_partials
from blockspec.attention.triton_kernels import LOG2E, merge_splits_kernel, paged_attention_kernel
from blockspec.batch import ForwardBatch, ForwardMode
from blockspec.kv.pool import KVPool
from blockspec.pdl import pdl_launch


@dataclass(frozen=True)
class KernelTiles:
    """Launch shape of paged_attention_kernel: (token, head) rows and keys per step, warps, pipeline stages, and
    whether scores are masked only in the key blocks that need it (see the kernel)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    mask_edges_only: bool = False


@dataclass(frozen=True)
class LaunchPolicy:
    """Tiles, and how far split-K goes: the most splits keeping programs <= `max_programs` (but at least
    `min_splits`), each split reading >= `min_split_keys` keys."""

    tiles: KernelTiles
    max_programs: int
    min_split_keys: int
    min_splits: int = 1


# NOTE: measured on an H200 with 8B shapes (the former tune_attention.py, results/tune_attention_*.json): decode
# (<= 16 rows per request) wants narrow tiles, verify/draft blocks wide tiles; both want >= 2 splits (bs 16..64)
# and up to 16 at batch 1 (down to 32 keys per split); long extends wide tiles, deeper pipelining, no split. From
# 256 (request, KV head) pairs on, verify/draft blocks run 64 keys per step with edge-only masks, unsplit
# (bs 32 x 512: 27 vs 32 us; x 4096: 149 vs 157; tune_attention_2026-12-01_0be37a2_*).
DECODE_POLICY = LaunchPolicy(KernelTiles(16, 128, 4, 3), 512, 256, min_splits=2)
BLOCK_POLICY = LaunchPolicy(KernelTiles(64, 32, 4, 2), 256, 32, min_splits=2)
WIDE_BLOCK_POLICY = LaunchPolicy(KernelTiles(64, 64, 4, 3, mask_edges_only=True), 256, 64)
WIDE_BLOCK_PAIRS = 256  # batch size x KV heads from which WIDE_BLOCK_POLICY applies
EXTEND_POLICY = LaunchPolicy(KernelTiles(64, 32, 4, 3, mask_edges_only=True), 528, 1024)
SMALL_EXTEND_POLICY = LaunchPolicy(KernelTiles(32, 128, 4, 2), 528, 1024)  # < 2 waves of 64-row programs
# NOTE: a DDTree verify of B = 32 on SmolLM2-135M (33 tokens x group 3 = 99 rows) fell to SMALL_EXTEND_POLICY, whose
# 1024-key split floor suits long prompts, not a short query over the context: its attention and merge took 3.3x the
# chain verify's (results/cycle_profile_2026-12-06_868b807.json). Verify and draft blocks keep the block policies up
# to a tree of 64 nodes at a GQA group of 4 (65 x 4 = 260 rows).
MAX_BLOCK_ROWS = 320
TWO_WAVES = 264  # programs: two waves of an H200's 132 SMs
MERGE_TILE = 8192  # fp32 partials one merge program holds: heads x splits x head dim


def merge_heads_per_program(splits: int, block_d: int, num_heads: int) -> int:
    """The heads one merge program takes: the largest power of two whose partials fit MERGE_TILE (at least 1), at
    most num_heads' power of two. NOTE: smaller programs that fill the GPU for short blocks at batch 1 (1 or 2 heads
    each) ran slower under PDL, not faster (results/cycle_profile_2026-12-06_85f733e.json)."""
    fit = max(1, MERGE_TILE // (splits * block_d))
    return min(1 << (fit.bit_length() - 1), triton.next_power_of_2(num_heads))


def block_mode(mode: ForwardMode) -> bool:
    """Whether a forward of `mode` runs a short block of query rows per request over a long context (a verify, a
    DDTree's [root, nodes] included, or a draft block), which keeps the block policies up to MAX_BLOCK_ROWS rows."""
    return mode in (ForwardMode.VERIFY, ForwardMode.DRAFT)


def launch_policy(rows_per_request: int, batch_size: int, num_kv_heads: int, block: bool = False) -> LaunchPolicy:
    """rows_per_request = query tokens x GQA group (decode 1 x group, verify/draft block x group); `block`: the
    batch is a verify or draft block (block_mode), whose rows keep the block policies up to MAX_BLOCK_ROWS."""
    if rows_per_request <= 16:
        return DECODE_POLICY
    if rows_per_request <= (MAX_BLOCK_ROWS if block else 64):
        return WIDE_BLOCK_POLICY if batch_size * num_kv_heads >= WIDE_BLOCK_PAIRS else BLOCK_POLICY
    wide_programs = batch_size * num_kv_heads * triton.cdiv(rows_per_request, EXTEND_POLICY.tiles.block_m)
    return EXTEND_POLICY if wide_programs >= TWO_WAVES else SMALL_EXTEND_POLICY


@dataclass
class TritonAttentionMeta:
    q_starts: torch.Tensor  # [bs] int32 or int64
    q_lens: torch.Tensor  # [bs] int32 or int64
    max_q_len: int
    num_splits: int
    tiles: KernelTiles


def query_layout(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(first query row [bs], query tokens [bs], most query tokens of a request) of a batch; for uniform batches from
    device tensors only (int32), so planning can live inside a CUDA graph."""
    bs = batch.batch_size
    uniform = batch.uniform_q_len
    if uniform is not None:
        device = batch.input_ids.device
        q_lens = torch.full((bs,), uniform, dtype=torch.int32, device=device)
        q_starts = torch.arange(0, bs * uniform, uniform, dtype=torch.int32, device=device)
        return q_starts, q_lens, uniform
    # NOTE: build_batch, the only maker of non-uniform batches, puts both on the device with the batch.
    assert batch.extend_starts is not None and batch.extend_lens is not None and batch.extend_lens.shape[0] == bs
    return batch.extend_starts, batch.extend_lens, max(batch.extend_lens_cpu)


@dataclass(frozen=True)
class AttentionKernels:
    """The two kernels TritonAttentionBackend launches: `attention` with paged_attention_kernel's signature, and
    `merge` (combines split-K partials) with merge_splits_kernel's. One without the PDL constexpr launches plainly."""

    attention: triton.JITFunction
    merge: triton.JITFunction


DEFAULT_ATTENTION_KERNELS = AttentionKernels(paged_attention_kernel, merge_splits_kernel)


class TritonAttentionBackend(PagedBackendBase):
    """Paged attention with the Triton kernels of triton_kernels.py, launch shapes from `launch_policy`, split-K
    up to `max_splits`. `kernels` replaces the launched kernels by candidate kernels with the same signature, e.g.
    for a benchmark's candidate kernels (default: DEFAULT_ATTENTION_KERNELS); the backend keeps it as `self.kernels`.
    benchmarks/verify_attention.py times a verify block's split counts and tiles through `TritonAttentionMeta`."""

    def __init__(
        self,
        pool: KVPool,
        scale: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_windows: Optional[list[Optional[int]]] = None,
        draft_layer_causal: Optional[list[bool]] = None,
        max_splits: int = 16,
        *,
        kernels: AttentionKernels = DEFAULT_ATTENTION_KERNELS,
    ) -> None:
        super().__init__(pool, scale, num_heads, num_kv_heads, head_dim, sliding_windows, draft_layer_causal)
        self.block_d = max(16, triton.next_power_of_2(head_dim))
        self.max_splits = max_splits
        self.kernels = kernels

    def choose_splits(self, batch_size: int, rows_per_request: int, policy: LaunchPolicy, max_seq_len: int) -> int:
        programs = batch_size * self.num_kv_heads * triton.cdiv(rows_per_request, policy.tiles.block_m)
        splits = 1
        while splits < self.max_splits and max_seq_len >= splits * 2 * policy.min_split_keys and (
            programs * splits * 2 <= policy.max_programs or splits < policy.min_splits
        ):
            splits *= 2
        return splits

    def plan(self, batch: ForwardBatch) -> TritonAttentionMeta:
        """Uniform batches (decode/verify/draft) plan from device tensors only; `batch.max_seq_len_hint` fixes the
        split count (a CUDA graph bakes it in)."""
        bs = batch.batch_size
        q_starts, q_lens, max_q = query_layout(batch)
        max_seq = batch.max_seq_len_hint if batch.max_seq_len_hint is not None else max(batch.seq_lens_cpu)
        rows = max_q * (self.num_heads // self.num_kv_heads)
        policy = launch_policy(rows, bs, self.num_kv_heads, block_mode(batch.mode))
        return TritonAttentionMeta(q_starts, q_lens, max_q, self.choose_splits(bs, rows, policy, max_seq), policy.tiles)

    def tile_options(
        self, q: torch.Tensor, tiles: KernelTiles, mode: ForwardMode, layer_id: int, kernel: Any
    ) -> dict[str, Any]:
        """The launch options every attention kernel of this backend takes alike (the paged kernel here, the tiled
        extend kernel of triton_graph_extend.py): head and tile sizes, masks, dot precision, warps, stages, PDL."""
        window = layer_window(self.sliding_windows, layer_id)
        return dict(
            HEAD_DIM=self.head_dim, BLOCK_D=self.block_d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            CAUSAL=layer_is_causal(mode, self.draft_layer_causal, layer_id), USE_WINDOW=window is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", MASK_EDGES_ONLY=tiles.mask_edges_only,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(q, kernel),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        kv_stored: bool = False, out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        meta: TritonAttentionMeta = batch.attn_meta
        q, k_cache, v_cache, out = self.stored_query_and_output(q, k, v, layer_id, batch, kv_stored, out)
        num_tokens = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        window = layer_window(self.sliding_windows, layer_id)
        splits = meta.num_splits
        part_acc, part_max, part_sum = split_partials(out, self.num_heads, splits, self.block_d, splits > 1)
        table = batch.req_to_token
        tiles = meta.tiles
        grid = (triton.cdiv(meta.max_q_len * group, tiles.block_m), batch.batch_size * self.num_kv_heads, splits)
        tree = batch.tree_mask
        if tree is not None and window is not None:
            raise ValueError("a tree verify (speculative_tree_budget) cannot run sliding-window attention layers")
        # NOTE: without a tree the kernel never reads the mask pointer (TREE is a constexpr); q stands in for it
        tree_mask = q if tree is None else tree.contiguous().view(torch.uint8)
        self.kernels.attention[grid](
            q, k_cache, v_cache, out, part_acc, part_max, part_sum,
            table, batch.req_rows, meta.q_starts, meta.q_lens, batch.seq_lens, tree_mask,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
            out.stride(0), out.stride(1), self.num_heads * splits, splits, 1,
            0 if tree is None else tree.stride(0), 0 if tree is None else tree.stride(1),
            self.scale * LOG2E, window or 0, NUM_KV_HEADS=self.num_kv_heads, GROUP=group, NUM_SPLITS=splits,
            TREE=tree is not None, **self.tile_options(q, tiles, batch.mode, layer_id, self.kernels.attention),
        )
        if splits > 1:
            heads_per_program = merge_heads_per_program(splits, self.block_d, self.num_heads)
            self.kernels.merge[(num_tokens, triton.cdiv(self.num_heads, heads_per_program))](
                out, part_acc, part_max, part_sum,
                out.stride(0), out.stride(1), self.num_heads * splits, splits, 1, self.num_heads,
                HEAD_DIM=self.head_dim, BLOCK_D=self.block_d, NUM_SPLITS=splits, BLOCK_H=heads_per_program,
                **pdl_launch(q, self.kernels.merge),
            )
        return out.reshape(num_tokens, -1)
