"""Verify-side acceptance for one request: greedy prefix match or speculative rejection sampling."""
from __future__ import annotations

from typing import Optional

import torch

from blockspec.request import SamplingParams
from blockspec.sampling import sampling_probs


def greedy_accept(proposals: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """proposals: d_1..d_{B-1}; target_argmax[j]: target's choice after block token j.

    Returns (number accepted, bonus token)."""
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted, target_argmax[accepted]


def rejection_accept(
    proposals: list[int],
    draft_probs: torch.Tensor,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: Optional[torch.Generator],
) -> tuple[int, int]:
    """Standard speculative sampling: accept d_j with prob min(1, p_j(d_j) / q_j(d_j)); on the first rejection
    sample from norm(max(p_j - q_j, 0)); if all are accepted sample the bonus from p_B.

    draft_probs: [B-1, V] (q_j, the distribution d_j was drawn from); target_logits: [B, V].
    The committed tokens are distributed exactly as sampling the target alone."""
    target_probs = sampling_probs(target_logits, params)
    device = target_probs.device
    uniforms = torch.rand(len(proposals), generator=generator, device=device).tolist()
    for j, token in enumerate(proposals):
        p = float(target_probs[j, token])
        q = float(draft_probs[j, token])
        if q > 0 and uniforms[j] * q < p:
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp(min=0)
        if float(residual.sum()) <= 0:
            residual = target_probs[j]
        bonus = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        return j, int(bonus.item())
    bonus = torch.multinomial(target_probs[len(proposals)], 1, generator=generator)
    return len(proposals), int(bonus.item())
