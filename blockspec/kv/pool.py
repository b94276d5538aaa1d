"""Per-layer K/V storage indexed by slot."""
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

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.layer_store(layer_id, slots).write(k, v)

    def move(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copies every layer's K/V at slots `sources` to slots `destinations` (all sources are read before any
        destination is written, so the two may overlap). Graph-capturable."""
        for cache in (*self.k, *self.v):
            cache[destinations] = cache[sources]

    def layer_store(self, layer_id: int, slots: torch.Tensor) -> LayerKVStore:
        return LayerKVStore(self.k[layer_id], self.v[layer_id], slots)
