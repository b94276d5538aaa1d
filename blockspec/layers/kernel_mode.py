"""KernelMode: which kernels the layers of a model run, fixed when the model is built (passed to every layer)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelMode:
    """By default the fused Triton kernels run on CUDA (torch on CPU) and GEMMs are torch's (cuBLAS on CUDA).

    With `batch_invariant` (--enable-deterministic-inference) every GEMM is the batch-invariant Triton matmul
    (layers/batch_invariant_matmul.py) and the fused Triton kernels run on any device (on CPU only under
    TRITON_INTERPRET=1, for tests), so every row of a forward is computed the same way whatever else is in it."""

    batch_invariant: bool = False

    def use_triton(self, x: torch.Tensor) -> bool:
        return x.is_cuda or self.batch_invariant


DEFAULT_KERNELS = KernelMode()
