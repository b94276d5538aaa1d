"""Reference attention in plain torch: gathers each request's paged K/V and runs masked SDPA (CPU or GPU)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from blockspec.attention.base import layer_is_causal, layer_window
from blockspec.batch import ForwardBatch
from blockspec.kv.pool import KVPool


@dataclass
class TorchAttentionMeta:
    kv_slots: torch.Tensor  # [bs, max_kv] slot of each key position (dummy slot 0 past seq_len)
    query_rows: torch.Tensor  # [bs, max_q] row of each query in the flat batch (-1 = padding)
    query_positions: torch.Tensor  # [bs, max_q]
    key_valid: torch.Tensor  # [bs, 1, 1, max_kv]
    key_positions: torch.Tensor  # [max_kv]
    tree_mask: Optional[torch.Tensor] = None  # [bs, 1, max_q, max_kv] of a tree verify (ForwardBatch.tree_mask)
    # NOTE: built by the first layer of each kind (causal, window) and shared by the others: on the CPU the mask of
    # an extend batch (bs x max_q x max_kv) cost more than a third of the forward when each layer rebuilt it.
    masks: dict[tuple[bool, Optional[int]], torch.Tensor] = field(default_factory=dict)


class TorchAttentionBackend:
    def __init__(
        self,
        pool: KVPool,
        scale: float,
        sliding_windows: Optional[list[Optional[int]]] = None,
        draft_layer_causal: Optional[list[bool]] = None,
    ) -> None:
        self.pool = pool
        self.scale = scale
        self.sliding_windows = sliding_windows
        self.draft_layer_causal = draft_layer_causal

    def plan(self, batch: ForwardBatch) -> TorchAttentionMeta:
        device = batch.input_ids.device
        bs = batch.batch_size
        max_kv = max(batch.seq_lens_cpu)
        max_q = max(batch.extend_lens_cpu)
        key_positions = torch.arange(max_kv, device=device)
        key_valid = key_positions[None, :] < batch.seq_lens[:, None]
        kv_slots = batch.req_to_token[batch.req_rows, :max_kv]
        kv_slots = torch.where(key_valid, kv_slots, torch.zeros_like(kv_slots))
        query_rows = torch.full((bs, max_q), -1, dtype=torch.int64)
        start = 0
        for i, n in enumerate(batch.extend_lens_cpu):
            query_rows[i, :n] = torch.arange(start, start + n)
            start += n
        query_rows = query_rows.to(device)
        query_positions = torch.where(query_rows >= 0, batch.positions[query_rows.clamp(min=0)], 0)
        tree = None if batch.tree_mask is None else self._tree_mask(batch, key_valid, key_positions)
        return TorchAttentionMeta(
            kv_slots, query_rows, query_positions, key_valid[:, None, None, :], key_positions, tree
        )

    @staticmethod
    def _tree_mask(batch: ForwardBatch, key_valid: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """[bs, 1, q, max_kv]: every context key, and among the new rows (keys from seq_len - q on) the ones the
        tree mask lets each query see."""
        assert batch.tree_mask is not None and batch.uniform_q_len is not None
        q = batch.uniform_q_len
        tree_key = key_positions[None, :] - (batch.seq_lens - q)[:, None]  # [bs, max_kv]: the key's new row
        index = tree_key.clamp(0, q - 1)[:, None, :].expand(-1, q, -1)
        sees = batch.tree_mask.gather(2, index)  # [bs, q, max_kv]
        return (key_valid[:, None, :] & ((tree_key < 0)[:, None, :] | sees))[:, None]

    def _mask(self, meta: TorchAttentionMeta, causal: bool, window: Optional[int]) -> torch.Tensor:
        mask = meta.masks.get((causal, window))
        if mask is None:
            mask = meta.masks[causal, window] = self._build_mask(meta, causal, window)
        return mask

    @staticmethod
    def _build_mask(meta: TorchAttentionMeta, causal: bool, window: Optional[int]) -> torch.Tensor:
        mask = meta.key_valid.expand(-1, 1, meta.query_rows.shape[1], -1)
        if window is None:  # NOTE: compared directly, not through an int64 distance tensor (≈ 8x cheaper on the CPU)
            return mask & (meta.query_positions[:, None, :, None] >= meta.key_positions) if causal else mask
        distance = meta.query_positions[:, None, :, None] - meta.key_positions[None, None, None, :]
        if causal:
            mask = mask & (distance >= 0)
        if window is not None:
            mask = mask & (distance < window) & (causal | (-distance < window))
        return mask

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        kv_stored: bool = False, out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        meta: TorchAttentionMeta = batch.attn_meta
        if not kv_stored:
            self.pool.store(layer_id, batch.out_cache_loc, k, v)
        keys = self.pool.k[layer_id][meta.kv_slots].transpose(1, 2)  # [bs, Hk, max_kv, D]
        values = self.pool.v[layer_id][meta.kv_slots].transpose(1, 2)
        queries = q[meta.query_rows.clamp(min=0)].transpose(1, 2)  # [bs, Hq, max_q, D]
        group = queries.shape[1] // keys.shape[1]
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        causal = layer_is_causal(batch.mode, self.draft_layer_causal, layer_id)
        window = layer_window(self.sliding_windows, layer_id)
        if meta.tree_mask is not None and window is not None:
            raise ValueError("a tree verify (speculative_tree_budget) cannot run sliding-window attention layers")
        mask = meta.tree_mask if meta.tree_mask is not None else self._mask(meta, causal, window)
        attended = F.scaled_dot_product_attention(
            queries, keys.to(queries.dtype), values.to(queries.dtype), attn_mask=mask, scale=self.scale
        )
        # NOTE: a padded query row may have no valid key (NaN); those rows are dropped below.
        attended = attended.transpose(1, 2)  # [bs, max_q, Hq, D]
        valid = meta.query_rows >= 0
        flat = torch.empty_like(q) if out is None else out.view(q.shape)
        flat[meta.query_rows[valid]] = attended[valid]
        return flat.reshape(q.shape[0], -1)
