"""Per-row containment of sampling faults: one request whose own parameters leave its row of a batch with nothing to
sample from (NaN or overflowed logits after its penalties, a grammar and min_new_tokens that together allow no token,
a temperature so large that masked logits become NaN) ends with a clear error of its own, and every other row of the
batch goes on unchanged.

NOTE: the rows of a step are computed independently (softmax, top-k/top-p/min-p, penalties and masks are per row), so
a bad row cannot change another row's numbers; what used to spread a fault was torch.multinomial raising for the whole
step, after which the engine failed every request in flight. Rows are checked here before anything draws from them.
"""
from __future__ import annotations

from typing import Optional

import torch

from blockspec.request import Finish, FinishReason, Req

FAULT_STATUS = 400  # NOTE: the request's own parameters caused it (the same values alone fail the same way)


class SamplingFault(Exception):
    """One request's row cannot be sampled from; the message says why."""


def distribution_faults(probs: torch.Tensor) -> list[Optional[str]]:
    """Per row of `probs` [n, V]: None when torch.multinomial can draw from it (finite, no negative entry, some mass),
    else why not. One device→host read for all rows."""
    if probs.shape[0] == 0:
        return []
    checks = torch.stack([torch.isfinite(probs).all(-1), (probs >= 0).all(-1), probs.sum(-1) > 0], dim=-1)
    return [_distribution_fault(finite, non_negative, mass) for finite, non_negative, mass in checks.tolist()]


def _distribution_fault(finite: bool, non_negative: bool, mass: bool) -> Optional[str]:
    if not finite:
        return "its sampling distribution is not finite (NaN or inf: its penalties or temperature overflowed float32)"
    if not non_negative:
        return "its sampling distribution has negative probabilities"
    if not mass:
        return "every token has probability 0 (its grammar, min_new_tokens and filters leave no token)"
    return None


def choice_faults(logits: torch.Tensor) -> list[Optional[str]]:
    """Per row of `logits` [n, V] a greedy choice is made from: None when its argmax is meaningful (no NaN, nothing
    overflowed to +inf, some token above -inf), else why not. One device→host read for all rows."""
    if logits.shape[0] == 0:
        return []
    checks = torch.stack([torch.isnan(logits).any(-1), (logits == float("inf")).any(-1),
                          (logits == float("-inf")).all(-1)], dim=-1)
    return [_choice_fault(nan, overflow, none_allowed) for nan, overflow, none_allowed in checks.tolist()]


def _choice_fault(nan: bool, overflow: bool, none_allowed: bool) -> Optional[str]:
    if nan:
        return "its logits became NaN (its penalties overflowed float32)"
    if overflow:
        return "its logits overflowed to +inf (its repetition_penalty is too small for float32)"
    if none_allowed:
        return "no token is allowed (its grammar and min_new_tokens together rule out every token)"
    return None


def raise_first(faults: list[Optional[str]]) -> None:
    """SamplingFault for the first row of `faults` that has one (rows of one request: any fails it)."""
    fault = next((fault for fault in faults if fault is not None), None)
    if fault is not None:
        raise SamplingFault(fault)


def draw(probs: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    """One token drawn from the distribution `probs` [V]; SamplingFault (not torch's error) when it has none."""
    (fault,) = distribution_faults(probs[None])
    if fault is not None:
        raise SamplingFault(fault)
    return int(torch.multinomial(probs, 1, generator=generator))


def pick(logits: torch.Tensor) -> int:
    """The greedy choice (argmax) of `logits` [V]; SamplingFault when there is none."""
    (fault,) = choice_faults(logits[None])
    if fault is not None:
        raise SamplingFault(fault)
    return int(logits.argmax())


def fail_request(req: Req, reason: str) -> None:
    """Ends `req` with its own error (its tokens of this step are dropped at the commit: it is finished)."""
    req.finish = Finish(FinishReason.ABORT, message=f"sampling failed for this request: {reason}",
                        error_status=FAULT_STATUS)
