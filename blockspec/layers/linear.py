"""Linear layers: `Linear` (nn.Linear whose GEMM follows the model's KernelMode) and `StackedLinear`, which stores
several checkpoint matrices stacked along the output dim (q|k|v, gate|up); linear_into writes into a given buffer."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names); with `kernels.batch_invariant` its GEMM is the
    batch-invariant Triton matmul instead of torch's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_rows(x, 0, self.out_features)

    def forward_rows(self, x: torch.Tensor, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The outputs [start, stop) of the layer (one GEMM over those rows of the weight), into `out` when given."""
        weight = self.weight if (start, stop) == (0, self.out_features) else self.weight[start:stop]
        bias = None if self.bias is None else self.bias[start:stop]
        if self.kernels.batch_invariant:
            from blockspec.layers.batch_invariant_matmul import batch_invariant_linear  # NOTE: needs Triton

            return batch_invariant_linear(x, weight, bias, out)
        if out is None:
            return F.linear(x, weight, bias)
        if bias is None:
            return torch.matmul(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)


def linear_into(layer: nn.Linear, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """layer(x), written into `out` [.., out_features] when given (a static buffer of a piecewise graph)."""
    if isinstance(layer, Linear):
        return layer.forward_rows(x, 0, layer.out_features, out)
    if out is None:
        return layer(x)
    if layer.bias is None:
        return torch.matmul(x, layer.weight.t(), out=out)
    return torch.addmm(layer.bias, x, layer.weight.t(), out=out)


class StackedLinear(Linear):
    """One GEMM for several projections; `shard_names` are the checkpoint's names of the stacked parts."""

    def __init__(self, in_features: int, shard_sizes: list[int], shard_names: list[str], bias: bool = False,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias, kernels=kernels)
        self.shard_sizes = shard_sizes
        self.shard_names = shard_names

    def shard_offset(self, shard_name: str) -> tuple[int, int]:
        index = self.shard_names.index(shard_name)
        return sum(self.shard_sizes[:index]), self.shard_sizes[index]
