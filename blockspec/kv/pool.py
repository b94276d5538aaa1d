"""Per-layer K/V storage indexed by slot.

NOTE: every layer's K (and V) cache is a view into one [layers, slots, Hk, D] tensor, so an operation over all layers
at the same slots (`move`, the DDTree compaction) is one launch inside the cycle's graph on CUDA (move_kernel.py), not
two per layer and cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKVStore:
    """Where one layer's new K/V go: that layer's cache tensors [slots, Hk, D] and one slot per new token."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_cache[self.slots] = k.to(self.k_cache.dtype)
        self.v_cache[self.slots] = v.to(self.v_cache.dtype)


class KVPool:
    """K/V caches of `num_layers` layers, `num_slots` slots each: `k[layer]`, `v[layer]` [slots, Hk, D], contiguous
    views of the stacked `k_layers` / `v_layers` [layers, slots, Hk, D]."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k_layers = torch.zeros(shape, dtype=dtype, device=device)
        self.v_layers = torch.zeros(shape, dtype=dtype, device=device)
        self.k: list[torch.Tensor] = list(self.k_layers.unbind(0))
        self.v: list[torch.Tensor] = list(self.v_layers.unbind(0))
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.layer_store(layer_id, slots).write(k, v)

    def move(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copies every layer's K/V at slots `sources` [G, P] to slots `destinations` [G, P], group by group (a
        request's block): within a group all sources are read before any destination is written, so the two may
        overlap; different groups must touch different slots. Graph-capturable: on CUDA one Triton launch
        (move_kernel.py), elsewhere one gather and one scatter per stack."""
        if self.k_layers.is_cuda:
            from blockspec.kv.move_kernel import move_slot_groups  # NOTE: needs Triton, which CUDA installs have

            move_slot_groups(self.k_layers, self.v_layers, sources, destinations)
            return
        flat_sources, flat_destinations = sources.reshape(-1), destinations.reshape(-1)
        for stacked in (self.k_layers, self.v_layers):
            stacked[:, flat_destinations] = stacked[:, flat_sources]

    def layer_store(self, layer_id: int, slots: torch.Tensor) -> LayerKVStore:
        return LayerKVStore(self.k[layer_id], self.v[layer_id], slots)
