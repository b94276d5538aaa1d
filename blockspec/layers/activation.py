"""Gated SiLU MLP used by Llama, Qwen3 and the DFlash draft (gate and up in one GEMM)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.linear import StackedLinear, linear_into


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = StackedLinear(hidden_size, [intermediate_size] * 2, ["gate_proj", "up_proj"], bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`out`: optional buffer the down projection writes into (2-D x only)."""
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda and gate_up.dim() == 2:
            from blockspec.layers.triton_ops import silu_mul

            return linear_into(self.down_proj, silu_mul(gate_up), out)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return linear_into(self.down_proj, F.silu(gate) * up, out)
