"""A linear layer that stores several checkpoint matrices stacked along the output dim (q|k|v, gate|up)."""
from __future__ import annotations

from torch import nn


class StackedLinear(nn.Linear):
    """One GEMM for several projections; `shard_names` are the checkpoint's names of the stacked parts."""

    def __init__(self, in_features: int, shard_sizes: list[int], shard_names: list[str], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes
        self.shard_names = shard_names

    def shard_offset(self, shard_name: str) -> tuple[int, int]:
        index = self.shard_names.index(shard_name)
        return sum(self.shard_sizes[:index]), self.shard_sizes[index]
