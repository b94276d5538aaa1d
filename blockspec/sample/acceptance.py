"""Verify-side acceptance: greedy prefix match (batched, on the device) or speculative rejection sampling
(simulated acceptance for benchmarks: simulated_accept.py)."""
from __future__ import annotations

from typing import Optional

import torch

from blockspec.request import SamplingParams
from blockspec.sample.sampling import sampling_probs
from blockspec.sample.sampling_faults import SamplingFault, distribution_faults, draw


def greedy_accept_counts(proposals: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """[bs, 1] int64: per row the leading proposals d_1..d_{n-1} [bs, n-1] equal to the target's choice before them
    (target_argmax [bs, n]); greedy_accept on the device, graph-capturable (0 for every row when n = 1)."""
    return (proposals == target_argmax[:, :-1]).to(torch.int64).cumprod(1).sum(1, keepdim=True)


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
    The committed tokens are distributed exactly as sampling the target alone. SamplingFault when a target row it
    reads has nothing to sample from (the draft rows were checked as they were drawn from)."""
    target_probs = sampling_probs(target_logits, params)
    device = target_probs.device
    faults = distribution_faults(target_probs)
    uniforms = torch.rand(len(proposals), generator=generator, device=device).tolist()
    for j, token in enumerate(proposals):
        if faults[j] is not None:  # NOTE: checked as each row is reached: rows past the first rejection go unread
            raise SamplingFault(faults[j])
        p = float(target_probs[j, token])
        q = float(draft_probs[j, token])
        if q > 0 and uniforms[j] * q < p:
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp(min=0)
        if float(residual.sum()) <= 0:
            residual = target_probs[j]
        return j, draw(residual / residual.sum(), generator)
    if faults[len(proposals)] is not None:
        raise SamplingFault(faults[len(proposals)])
    return len(proposals), draw(target_probs[len(proposals)], generator)
