"""Triton's CPU interpreter runs `tl.sort` as written: a bitonic network of log²(n) / 2 compare-and-swap steps, each a
few nested jit calls that the interpreter re-patches one by one (and an XOR reduction it does element by element in
Python). A kernel that sorts a few hundred keys per program (the fused tree build's pairs, the fused top-B's groups
and tokens) then takes about a second a program. `numpy_sort` gives the same result at once: a sort's output is
determined by its input (equal elements are equal bits for the integer keys the engine's kernels sort), so only the
path differs; the native GPU run (make gpu-test) keeps covering Triton's own network."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from tests.support.interpreter_dot import interpreted


def numpy_sort() -> Iterator[None]:
    """Patches `tl.sort` for the duration under the interpreter (a no-op on CUDA, where kernels run natively)."""
    if not interpreted():
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = tl.sort

    def sort(x: Any, dim: Any = None, descending: Any = 0) -> Any:
        dim, descending = getattr(dim, "value", dim), getattr(descending, "value", descending)
        data = x.handle.data
        axis = data.ndim - 1 if dim is None else dim
        # NOTE: Triton sorts along the last dimension only
        assert axis in (-1, data.ndim - 1), f"tl.sort sorts the last dimension, got dim={dim}"
        if data.dtype.kind == "f":
            assert not np.isnan(data).any(), "the numpy stand-in does not order NaN as Triton's network does"
        ordered = np.sort(data, axis=-1)
        if descending:
            ordered = np.flip(ordered, axis=-1)
        return tl.core.tensor(interpreter.TensorHandle(np.ascontiguousarray(ordered), x.dtype.scalar), x.type)

    tl.sort = sort
    try:
        yield
    finally:
        tl.sort = original
