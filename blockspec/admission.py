"""Arrival batching (`--max-prefill-wait-steps`, `--prefill-wait-policy`): newly arrived requests may wait a few
decode steps so that one extend step admits several of them.

Under closed-loop load every finished request is replaced by a new one a moment later, so without batching nearly
every decode step is followed by an extend step of one or two prompts: a full forward (a weight read on a large
model, host work on a small one) that stalls every running request. Holding arrivals for up to N steps turns N small
extends into one (the rows of finished requests stay free meanwhile; the batch runs a few requests short). They are
held only while that is cheap: requests are decoding, no prompt work runs this step anyway, and the held prompts are
fewer tokens than one extend step takes (a full step is admitted at once). The oldest held arrival waits at most N
decode steps.

Policies:
- `fixed`: the held arrivals go after N steps.
- `cost`: they go sooner, once holding has cost as much as an extend step does: each held step costs one request-step
  per held request (its row idles), an extend step costs every running request its duration in decode steps (they
  stall). Releasing when the first reaches the second (the ski-rental rule) is within 2x of the best release time
  in hindsight, whatever the arrivals. Step durations are live averages of this engine's own steps; before both kinds
  were seen, it behaves as `fixed`. DFlash needs this more than target-only decoding: its requests finish in
  different cycles (acceptance differs per request), so replacements trickle in one or two per cycle.
"""
from __future__ import annotations

from typing import Optional

WAIT_POLICIES = ("fixed", "cost")
_SMOOTHING = 0.1  # weight of the newest step in the running averages of step durations


class ArrivalBatching:
    def __init__(self, max_wait_steps: int, policy: str = "fixed") -> None:
        if policy not in WAIT_POLICIES:
            raise ValueError(f"prefill wait policy must be one of {WAIT_POLICIES}, got {policy!r}")
        self.max_wait_steps = max_wait_steps
        self.policy = policy
        self.held_steps = 0  # decode steps that ran while arrivals were held back
        self.extend_seconds: Optional[float] = None  # running averages of step durations (wall, host + device)
        self.decode_seconds: Optional[float] = None
        self._held_since: Optional[int] = None  # the step at which the oldest held arrival was first held
        self._held_cost = 0  # request-steps the held arrivals have waited so far

    def observe(self, seconds: float, extended: bool) -> None:
        """One engine step's duration: an extend step (prefill chunks, with or without decode) or a decode step."""
        last = self.extend_seconds if extended else self.decode_seconds
        average = seconds if last is None else last + _SMOOTHING * (seconds - last)
        if extended:
            self.extend_seconds = average
        else:
            self.decode_seconds = average

    def extend_cost(self, running: int) -> Optional[float]:
        """What one extend step costs, in request-steps: `running` requests stall for its duration in decode steps."""
        if self.extend_seconds is None or not self.decode_seconds:
            return None
        return running * self.extend_seconds / self.decode_seconds

    def hold(self, step: int, waiting_tokens: int, step_tokens: int, decoding: bool, extending: bool,
             running: int = 0, admissible: int = 1) -> bool:
        """Whether the waiting requests stay queued at scheduler step `step` (`waiting_tokens`: their prompt tokens
        still to prefill; `step_tokens`: what one extend step takes; `decoding`: some request decodes this step;
        `extending`: this step extends some prompt anyway; `running`: requests decoding; `admissible`: waiting
        requests that have a free row)."""
        cheap_to_wait = decoding and not extending and 0 < waiting_tokens < step_tokens
        if self.max_wait_steps == 0 or not cheap_to_wait or admissible <= 0:
            return self._release()
        if self._held_since is None:
            self._held_since = step
        if step - self._held_since >= self.max_wait_steps:
            return self._release()
        if self.policy == "cost":
            cost = self.extend_cost(running)
            if cost is not None and self._held_cost >= cost:
                return self._release()
        self._held_cost += admissible
        self.held_steps += 1
        return True

    def _release(self) -> bool:
        self._held_since, self._held_cost = None, 0
        return False
