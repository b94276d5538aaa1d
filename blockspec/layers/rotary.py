"""Rotary position embedding (neox/rotate-half layout) with llama3 and linear scaling."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from blockspec.kv.pool import LayerKVStore
from blockspec.layers.norm import RMSNorm, rmsnorm_torch, use_triton


@dataclass
class RopeConfig:
    """A model's rotary scaling, from its config.json (models/config.py parses it)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorm weights applied to q and k before rope (q_weight is None when only k is rotated)."""

    q_weight: Optional[torch.Tensor]
    k_weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, q_norm: Optional[RMSNorm], k_norm: RMSNorm) -> "QKNorm":
        assert q_norm is None or q_norm.eps == k_norm.eps
        return cls(None if q_norm is None else q_norm.weight, k_norm.weight, k_norm.eps)


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds a cos/sin table for positions [0, max_positions); applies it to q and k by position."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)
        self.max_positions = max_positions

    def apply(
        self,
        positions: torch.Tensor,
        q: Optional[torch.Tensor],
        k: torch.Tensor,
        v: Optional[torch.Tensor] = None,
        qk_norm: Optional[QKNorm] = None,
        store: Optional[LayerKVStore] = None,
    ) -> tuple[Optional[torch.Tensor], torch.Tensor, bool]:
        """Optional per-head RMSNorm of q and k (Qwen3, the DFlash draft: norm before rope), then rope on q [T, Hq, D]
        and k [T, Hk, D]. On CUDA this is one Triton launch, in place, which also writes the rotated k and v into
        `store` when given. Returns (q, k, kv_stored); when kv_stored is False the caller still has to store."""
        if use_triton(k):
            from blockspec.layers.triton_ops import rope_norm_store

            half = k.shape[-1] // 2
            norm = None if qk_norm is None else (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps)
            cache = None if store is None else (store.k_cache, store.v_cache, store.slots)
            rope_norm_store(q, k, positions, self.cos_table[:, :half], self.sin_table[:, :half], norm, v, cache)
            return q, k, store is not None
        if qk_norm is not None:
            k = rmsnorm_torch(k, qk_norm.k_weight, qk_norm.eps)
            if q is not None:
                assert qk_norm.q_weight is not None
                q = rmsnorm_torch(q, qk_norm.q_weight, qk_norm.eps)
        cos = self.cos_table[positions].unsqueeze(1)
        sin = self.sin_table[positions].unsqueeze(1)
        return (None if q is None else _rotate(q, cos, sin)), _rotate(k, cos, sin), False

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T]. On CUDA q and k are rotated in place."""
        rotated_q, rotated_k, _ = self.apply(positions, q, k)
        assert rotated_q is not None
        return rotated_q, rotated_k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
