"""Greedy tokens: the argmax over the vocabulary of each row of logits."""
from __future__ import annotations

import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) (first index on ties); on CUDA one Triton pass over many programs instead of torch's
    one-block-per-row reduction (10–30x slower at a 128k vocabulary)."""
    exact_in_fp32 = logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
    if not logits.is_cuda or not exact_in_fp32 or logits.shape[-1] == 0 or logits.stride(-1) != 1:
        return logits.argmax(-1)
    from blockspec.layers.triton_ops import argmax_rows

    return argmax_rows(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])
