"""PieceState: what flows between the pieces of a target forward (the model code between two attentions).

A model cut at its attentions exposes `num_pieces` and `run_piece(index, state)`; the caller runs the attention of
the layer a piece stopped at between that piece and the next. The eager forward and the piecewise CUDA graphs drive
the same pieces, the latter with static buffers (see `static_buffers`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from blockspec.kv.pool import KVPool


@dataclass
class PieceState:
    """One forward over T token rows, between pieces.

    The caller sets the inputs (input_ids, positions, kv_slots, kv_pool, capture_layer_ids). With `static_buffers`
    it also sets qkv, residual, mlp_out, attn_out, aux and hidden to fixed tensors of T rows, and every piece leaves
    its results in those very tensors (a piecewise CUDA graph replays the pieces at fixed addresses); without, the
    pieces assign fresh tensors. After a piece that stops at an attention, q, k, v hold that layer's attention
    inputs, with its new K/V already in the cache at kv_slots; the caller puts the attention output in attn_out
    (written into the buffer with static buffers, assigned otherwise) before running the next piece.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_slots: torch.Tensor  # [T] int64, the cache slot each token's new K/V goes to
    kv_pool: KVPool
    capture_layer_ids: tuple[int, ...] = ()  # layers whose outputs go to aux, side by side in this order
    static_buffers: bool = False
    qkv: Optional[torch.Tensor] = None  # [T, (Hq + 2 Hk) D] projection buffer (read only with static buffers)
    q: Optional[torch.Tensor] = None  # [T, Hq, D] normed (Qwen3) and rotated
    k: Optional[torch.Tensor] = None  # [T, Hk, D] normed (Qwen3) and rotated
    v: Optional[torch.Tensor] = None  # [T, Hk, D]
    attn_out: Optional[torch.Tensor] = None  # [T, Hq * D] output of the attention the last piece stopped at
    residual: Optional[torch.Tensor] = None  # [T, H] residual stream
    mlp_out: Optional[torch.Tensor] = None  # [T, H] MLP output of the last finished layer (its output: + residual)
    # [T, len(capture_layer_ids) * H] the captured layer outputs (for the last layer: the final-normed hidden)
    aux: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None  # [T, H] final-normed hidden, set by the last piece

    def buffer(self, static: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """`static` where an op may write its result straight into it (static buffers only), else None."""
        return static if self.static_buffers else None

    def place(self, produced: torch.Tensor, static: Optional[torch.Tensor]) -> torch.Tensor:
        """`produced`, left in `static` with static buffers. NOTE: on CUDA the ops already wrote in place (same
        data_ptr, nothing copied); on CPU they return new tensors, which are copied into the buffer."""
        if not self.static_buffers:
            return produced
        assert static is not None and static.shape == produced.shape
        if static.data_ptr() != produced.data_ptr():
            static.copy_(produced)
        return static
