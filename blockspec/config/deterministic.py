"""--enable-deterministic-inference's flag checks: what it requires and which attention backend it resolves to.

With the flag every kernel with a reduction computes a row the same way whatever the batch (runner/deterministic.py
hands the model those kernel settings). Unsupported combinations are errors, never silently weaker guarantees."""
from __future__ import annotations

import importlib.util
from typing import Optional

SPLIT_TILE_MULTIPLE = 32  # NOTE: the batch-invariant attention's key block (BatchInvariantAttention.tiles.block_n)


def resolve_deterministic_backend(enable_deterministic_inference: bool, attention_backend: str, tp_size: int,
                                  split_tile_size: Optional[int]) -> str:
    """Validates the flag against the others; returns the attention backend to run: Triton when the flag is on
    (`auto` resolves to it), else `attention_backend` unchanged."""
    split = split_tile_size
    if not enable_deterministic_inference:
        if split is not None:
            raise ValueError("triton_attention_split_tile_size is the KV split of the batch-invariant attention: it "
                             "needs enable_deterministic_inference")
        return attention_backend
    if attention_backend in ("torch", "flashinfer"):
        raise ValueError(f"enable_deterministic_inference needs attention_backend triton (or auto), got "
                         f"{attention_backend}: the {attention_backend} backend's reduction order depends on the batch")
    if importlib.util.find_spec("triton") is None:
        raise ValueError("enable_deterministic_inference runs Triton kernels: pip install triton")
    if tp_size > 1:
        raise ValueError("enable_deterministic_inference supports tp_size 1 only: the tensor-parallel all-reduce "
                         "sums in an order that depends on the message size, i.e. on the batch")
    if split is not None and split % SPLIT_TILE_MULTIPLE:
        raise ValueError(f"triton_attention_split_tile_size must be a multiple of {SPLIT_TILE_MULTIPLE}, got {split}")
    return "triton"
