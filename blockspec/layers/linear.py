"""A linear layer that stores several checkpoint matrices stacked along the output dim (q|k|v, gate|up)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def linear_into(layer: nn.Linear, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """layer(x), written into `out` [.., out_features] when given (a static buffer of a piecewise graph)."""
    if out is None:
        return layer(x)
    if layer.bias is None:
        return torch.matmul(x, layer.weight.t(), out=out)
    return torch.addmm(layer.bias, x, layer.weight.t(), out=out)


class StackedLinear(nn.Linear):
    """One GEMM for several projections; `shard_names` are the checkpoint's names of the stacked parts."""

    def __init__(self, in_features: int, shard_sizes: list[int], shard_names: list[str], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes
        self.shard_names = shard_names

    def shard_offset(self, shard_name: str) -> tuple[int, int]:
        index = self.shard_names.index(shard_name)
        return sum(self.shard_sizes[:index]), self.shard_sizes[index]
