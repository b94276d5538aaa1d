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
  per held request that has a free row (the row idles), an extend step costs every decoding request its duration in
  decode steps (they stall; one step less when the extend step decodes too, `--enable-mixed-chunk`). Releasing when
  the first reaches the second is the ski-rental rule: within 2x of the best release in hindsight while the extend
  cost and the arrival rate hold still (they drift here, and the cap still applies). Step durations are running
  averages of this scheduler's own step wall times (an extend step's includes committing the decode step in flight;
  the tail of a prompt chunk nobody waits for lands in the next decode step; long chunked prompts raise the extend
  average): rough, and rough towards holding longer, i.e. towards `fixed`. Before both kinds of step were timed it
  behaves as `fixed`. DFlash needs this more than target-only decoding: its requests finish in different cycles
  (acceptance differs per request), so replacements trickle in one or two per cycle.
"""
from __future__ import annotations

from typing import Optional

from blockspec.config.engine_config import WAIT_POLICIES

_SMOOTHING = 0.1  # weight of the newest step in the running averages of step durations


class ArrivalBatching:
    def __init__(self, max_wait_steps: int, policy: str = "fixed", extend_decodes: bool = False) -> None:
        if policy not in WAIT_POLICIES:
            raise ValueError(f"prefill wait policy must be one of {WAIT_POLICIES}, got {policy!r}")
        self.max_wait_steps = max_wait_steps
        self.policy = policy
        self.extend_decodes = extend_decodes  # --enable-mixed-chunk: an extend step advances the decoding requests too
        self.held_steps = 0  # decode steps that ran while arrivals were held back
        self.extend_seconds: Optional[float] = None  # running averages of step durations (wall, host + device)
        self.decode_seconds: Optional[float] = None
        self._held_since: Optional[int] = None  # the step at which the oldest held arrival was first held
        self._held_cost = 0  # request-steps the held arrivals have waited so far
        self._release_next = False

    def observe(self, seconds: float, extended: bool) -> None:
        """One engine step's duration: an extend step (prefill chunks, with or without decode) or a decode step."""
        last = self.extend_seconds if extended else self.decode_seconds
        average = seconds if last is None else last + _SMOOTHING * (seconds - last)
        if extended:
            self.extend_seconds = average
        else:
            self.decode_seconds = average

    def extend_cost(self, decoding: int) -> Optional[float]:
        """What one extend step costs, in request-steps: `decoding` requests stall for its duration in decode steps."""
        if not self.extend_seconds or not self.decode_seconds or self.extend_seconds <= 0 or self.decode_seconds <= 0:
            return None
        stall = self.extend_seconds / self.decode_seconds - (1.0 if self.extend_decodes else 0.0)
        return decoding * max(stall, 0.0)

    def hold(self, step: int, waiting_tokens: int, step_tokens: int, decoding: bool, extending: bool,
             num_decoding: int = 0, admissible: int = 1) -> bool:
        """Whether the waiting requests stay queued at scheduler step `step` (`waiting_tokens`: their prompt tokens
        still to prefill; `step_tokens`: what one extend step takes; `decoding`: some request decodes this step;
        `extending`: this step extends some prompt anyway; `num_decoding`: how many decode; `admissible`: waiting
        requests that have a free row)."""
        cheap_to_wait = decoding and not extending and 0 < waiting_tokens < step_tokens
        if self.max_wait_steps == 0 or not cheap_to_wait or self._release_next:
            return self._release()
        if self._held_since is None:
            self._held_since = step
        if step - self._held_since >= self.max_wait_steps:
            return self._release()
        if self.policy == "cost":
            cost = self.extend_cost(num_decoding)
            if cost is not None and self._held_cost >= cost:
                return self._release()
        self._held_cost += admissible
        self.held_steps += 1
        return True

    def release_next(self) -> None:
        """The queue's head was released and then waited a step for a prefix computed in that step (in-batch prefix
        caching): the next call admits without holding, so it does not wait twice."""
        self._release_next = True

    def _release(self) -> bool:
        self._held_since, self._held_cost, self._release_next = None, 0, False
        return False
