"""Triton's CPU interpreter computes `tl.dot` with numpy's matmul, i.e. with the machine's BLAS. Some BLAS kernels
(OpenBLAS's AVX-512 sgemm, seen on an AMD EPYC) round a row differently depending on where it sits in the tile,
which a GPU's matrix units never do for a fixed tile shape. The batch-invariance tests compare rows bit for bit
across batch layouts, so under the interpreter they need a dot whose rows depend only on their own inputs: each
product is summed in float64 and rounded once to the accumulator's dtype (`exact_interpreter_dot`)."""
from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def exact_interpreter_dot() -> Iterator[None]:
    """Patches the interpreter's dot for the duration (a no-op on CUDA, where kernels run natively)."""
    if not interpreted():
        yield
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8 or not a.dtype.is_floating():
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        # NOTE: the accumulator is added after rounding the product, as the interpreter does.
        return interpreter.TensorHandle(product.astype(d.data.dtype) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original
