"""RMSNorm, computed in fp32 like HF; a fused Triton kernel where the model's KernelMode runs Triton (CUDA)."""
from __future__ import annotations

import torch
from torch import nn

from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF order: normalise in fp32, cast back to the input dtype, then multiply by the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """NOTE: the Triton kernel reduces each row in one program over the whole row: batch-invariant by construction."""

    def __init__(self, dim: int, eps: float, kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.use_triton(x):
            from blockspec.layers.triton_ops import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        return rmsnorm_torch(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with the Triton kernel the residual buffer is updated in place."""
        if self.kernels.use_triton(x):
            from blockspec.layers.triton_ops import rmsnorm

            return rmsnorm(x, self.weight, self.eps, residual=residual), residual
        residual = residual + x
        return self.forward(residual), residual
