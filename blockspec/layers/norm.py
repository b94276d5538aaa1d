"""RMSNorm, computed in fp32 like HF; a fused Triton kernel on CUDA."""
from __future__ import annotations

import torch
from torch import nn


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF order: normalise in fp32, cast back to the input dtype, then multiply by the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from blockspec.layers.triton_ops import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        return rmsnorm_torch(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); on CUDA the residual buffer is updated in place."""
        if use_triton(x):
            from blockspec.layers.triton_ops import rmsnorm

            return rmsnorm(x, self.weight, self.eps, residual=residual), residual
        residual = residual + x
        return self.forward(residual), residual
