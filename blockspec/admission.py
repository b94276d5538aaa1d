"""Arrival batching (`--max-prefill-wait-steps`): newly arrived requests may wait a few decode steps so that one
extend step admits several of them.

Under closed-loop load every finished request is replaced by a new one a moment later, so without batching nearly
every decode step is followed by an extend step of one or two prompts: a full forward (a weight read on a large
model, host work on a small one) that stalls every running request. Holding arrivals for up to N steps turns N small
extends into one (the rows of finished requests stay free meanwhile; the batch runs a few requests short). They are
held only while that is cheap: requests are decoding, no prompt work runs this step anyway, and the held prompts are
fewer tokens than one extend step takes (a full step is admitted at once). The oldest held arrival waits at most N
decode steps.
"""
from __future__ import annotations

from typing import Optional


class ArrivalBatching:
    def __init__(self, max_wait_steps: int) -> None:
        self.max_wait_steps = max_wait_steps
        self.held_steps = 0  # decode steps that ran while arrivals were held back
        self._held_since: Optional[int] = None  # the step at which the oldest held arrival was first held

    def hold(self, step: int, waiting_tokens: int, step_tokens: int, decoding: bool, extending: bool) -> bool:
        """Whether the waiting requests stay queued at scheduler step `step` (`waiting_tokens`: their prompt tokens
        still to prefill; `step_tokens`: what one extend step takes; `decoding`: some request decodes this step;
        `extending`: this step extends some prompt anyway)."""
        cheap_to_wait = decoding and not extending and 0 < waiting_tokens < step_tokens
        if self.max_wait_steps == 0 or not cheap_to_wait:
            self._held_since = None
            return False
        if self._held_since is None:
            self._held_since = step
        if step - self._held_since >= self.max_wait_steps:
            self._held_since = None
            return False
        self.held_steps += 1
        return True
