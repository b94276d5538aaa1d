"""Gated SiLU MLP used by Llama, Qwen3 and the DFlash draft (gate and up in one GEMM)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.distributed.group import TensorParallel
from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode
from blockspec.layers.linear import Linear, StackedLinear, linear_into


class GatedMLP(nn.Module):
    """With `tp`: this rank's slice of the intermediate size (gate|up column-parallel, down row-parallel), the
    down projection summed over ranks in place."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, tp: Optional[TensorParallel] = None,
        kernels: KernelMode = DEFAULT_KERNELS,
    ) -> None:
        super().__init__()
        if tp is not None:
            intermediate_size = tp.split(intermediate_size, "intermediate_size")
        self.tp = tp
        self.intermediate_size = intermediate_size
        self.gate_up_proj = StackedLinear(hidden_size, [intermediate_size] * 2, ["gate_proj", "up_proj"], bias, kernels)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, kernels)

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`out`: optional buffer the down projection writes into (2-D x only)."""
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda and gate_up.dim() == 2:
            from blockspec.layers.triton_ops import silu_mul

            down = linear_into(self.down_proj, silu_mul(gate_up), out)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            down = linear_into(self.down_proj, F.silu(gate) * up, out)
        return down if self.tp is None else self.tp.all_reduce(down)
