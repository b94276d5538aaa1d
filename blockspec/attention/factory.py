"""Picks the attention backend named by --attention-backend."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Optional

import torch

from blockspec.attention.base import AttentionBackend
from blockspec.attention.torch_backend import TorchAttentionBackend
from blockspec.kv.pool import KVPool

if TYPE_CHECKING:
    from blockspec.attention.batch_invariant_backend import BatchInvariantAttention


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"
    if name == "flashinfer":
        if importlib.util.find_spec("flashinfer") is None:
            raise ValueError(
                "attention backend flashinfer needs FlashInfer: pip install 'blockspec[flashinfer]' (CUDA only)"
            )
        if device.type != "cuda":
            raise ValueError(f"attention backend flashinfer needs a CUDA device, got {device}; use triton or torch")
    if name == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError("attention backend triton needs the triton package: pip install triton")
    return name


def make_backend(
    name: str,
    pool: KVPool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_windows: Optional[list[Optional[int]]] = None,
    draft_layer_causal: Optional[list[bool]] = None,
    batch_invariant: Optional[BatchInvariantAttention] = None,
) -> AttentionBackend:
    """`batch_invariant` (--enable-deterministic-inference, Triton only): the batch-invariant kernels with these
    settings in place of the default Triton kernels."""
    scale = head_dim ** -0.5
    if batch_invariant is not None:
        if name != "triton":
            raise ValueError(f"deterministic inference needs the triton attention backend, got {name}")
        from blockspec.attention.batch_invariant_backend import BatchInvariantAttentionBackend

        return BatchInvariantAttentionBackend(pool, scale, num_heads, num_kv_heads, head_dim, sliding_windows,
                                              draft_layer_causal, batch_invariant)
    if name == "flashinfer":
        from blockspec.attention.flashinfer_backend import FlashInferAttentionBackend  # NOTE: optional, CUDA only

        return FlashInferAttentionBackend(
            pool, scale, num_heads, num_kv_heads, head_dim, sliding_windows, draft_layer_causal
        )
    if name == "triton":
        from blockspec.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(
            pool, scale, num_heads, num_kv_heads, head_dim, sliding_windows, draft_layer_causal
        )
    return TorchAttentionBackend(pool, scale, sliding_windows, draft_layer_causal)
