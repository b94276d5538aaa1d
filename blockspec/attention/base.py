"""The attention backend protocol: plan once per forward from the batch, then forward per layer."""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch

from blockspec.batch import ForwardBatch, ForwardMode
from blockspec.kv.pool import KVPool


class AttentionBackend(Protocol):
    pool: KVPool

    def plan(self, batch: ForwardBatch) -> Any:
        """Returns metadata for this batch; the caller stores it in `batch.attn_meta`."""
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        kv_stored: bool = False, out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] of the new tokens. Unless `kv_stored` (the caller's rope kernel already
        wrote them, see RotaryEmbedding.apply), the backend first stores k, v at batch.out_cache_loc.

        Returns [T, Hq * D], written into `out` (contiguous [T, Hq * D]) when given. Causal over prefix + new
        tokens unless the mode is DRAFT; layers with a sliding window only see keys within the window behind the
        query.
        """
        ...


class PagedBackendBase:
    """The state the Triton and FlashInfer backends share: the KV pool, softmax scale, head layout, and per layer
    the sliding window and (draft) causality that `layer_window` / `layer_is_causal` read."""

    def __init__(
        self,
        pool: KVPool,
        scale: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_windows: Optional[list[Optional[int]]] = None,
        draft_layer_causal: Optional[list[bool]] = None,
    ) -> None:
        self.pool = pool
        self.scale = scale
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_windows = sliding_windows
        self.draft_layer_causal = draft_layer_causal

    def stored_query_and_output(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_stored: bool,
        out: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The paged kernels' inputs: this forward's k/v stored (unless the caller did), q with a unit last stride,
        the layer's K and V caches, and the output [T, Hq, D] (`out` viewed so, or a new one).

        NOTE: q may be a strided view of qkv; the output is always contiguous."""
        if not kv_stored:
            self.pool.store(layer_id, batch.out_cache_loc, k, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out.view(q.shape)
        return q, self.pool.k[layer_id], self.pool.v[layer_id], out


def split_partials(
    out: torch.Tensor, num_heads: int, splits: int, block_d: int, split: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(acc, max, sum) fp32 buffers for `splits` partial softmaxes per (token, head) when `split`; else `out` three
    times (the kernels take the pointers but write only the output)."""
    if not split:
        return out, out, out
    num_tokens = out.shape[0]
    part_acc = torch.empty((num_tokens, num_heads, splits, block_d), dtype=torch.float32, device=out.device)
    part_max = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=out.device)
    return part_acc, part_max, torch.empty_like(part_max)


GraphPlanner = Callable[[ForwardBatch], Any]


def graph_planner(backend: AttentionBackend) -> Optional[GraphPlanner]:
    """A backend whose plan is host-side (FlashInfer) has `plan_for_graph(static_batch) -> meta`: CUDA graphs call
    it outside the graph, before capture and before every replay. Backends that plan on the device have none."""
    return getattr(backend, "plan_for_graph", None)


def layer_window(windows: Optional[list[Optional[int]]], layer_id: int) -> Optional[int]:
    return None if windows is None else windows[layer_id]


def layer_is_causal(mode: ForwardMode, draft_layer_causal: Optional[list[bool]], layer_id: int) -> bool:
    """Target forwards are causal; draft layers are non-causal unless the draft marks them causal (sliding)."""
    if mode is not ForwardMode.DRAFT:
        return True
    return bool(draft_layer_causal[layer_id]) if draft_layer_causal is not None else False
