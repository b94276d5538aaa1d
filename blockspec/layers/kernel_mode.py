"""KernelMode: how the GEMMs of a model compute, fixed when the model is built (passed to every linear layer)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelMode:
    """By default GEMMs are torch's (cuBLAS on CUDA, whose algorithm follows M). With `batch_invariant`
    (--enable-deterministic-inference) every GEMM is the batch-invariant Triton matmul
    (layers/batch_invariant_matmul.py; on CPU only under TRITON_INTERPRET=1, for tests).

    NOTE: the other reductions need no mode: RMSNorm / q-k norm, rope and SiLU·mul are one program per row on CUDA
    (Triton) and row-wise torch ops on CPU, argmax is exact; all batch-invariant already
    (tests/test_batch_invariant_rows.py)."""

    batch_invariant: bool = False


DEFAULT_KERNELS = KernelMode()
