"""A greedy decode step in flight: launched on the device now, committed on the host one engine step later.

The overlap schedule (scheduler/step_executor.py) launches step N+1 before it commits step N: N+1's input rows are
computed on the device from N's outputs (target-only decode: the argmax token, sequence length + 1; DFlash: the bonus
token target[accepted], sequence length + accepted + 1), so the host's bookkeeping for N (commit, finish checks, slot
release, stats) runs while the device works on N+1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from blockspec.host_tensors import int64_tensor, to_device
from blockspec.request import Req


@dataclass
class InFlightStep:
    """`reqs[i]` ran with input rows `rows[i]` (UniformRows layout: [q token ids | req→token row | seq_len]) and
    produced `tokens[i]` (the worker's layout; DFlash: [accepted | draft argmax x B | target argmax x B]), both on the
    device. `host_tokens` is the host copy of `tokens`, readable once `ready` has completed (None: no device).
    `started` (recorded before the step's kernels, with `ready` timing-enabled) or `eager_ms` (no device: the launch
    ran it) time the step for `elapsed_ms`. `next_rows`, when the step's forward computed them (target-only greedy
    decode), are the input rows of the step after it, on the device."""

    reqs: list[Req]
    rows: torch.Tensor
    tokens: torch.Tensor
    host_tokens: torch.Tensor
    ready: Optional[torch.cuda.Event]
    started: Optional[torch.cuda.Event] = None
    eager_ms: Optional[float] = None
    next_rows: Optional[torch.Tensor] = None
    _rows: Optional[list[list[int]]] = field(default=None, init=False, repr=False)

    def elapsed_ms(self) -> Optional[float]:
        """Device time of the step (call after `wait`); None when it was not timed."""
        if self.started is not None and self.ready is not None:
            return float(self.started.elapsed_time(self.ready))
        return self.eager_ms

    def wait(self) -> list[list[int]]:
        """The host rows of `tokens` (NOTE: read once, the same list after: `finish` and `commit` both ask)."""
        if self._rows is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._rows = self.host_tokens.tolist()
        return self._rows

    def commit(self, committed_tokens: Callable[[list[int]], list[int]]) -> list[Optional[list[int]]]:
        """Waits, then per request the tokens `committed_tokens(row)` picks from its output row, kv_len advanced
        past them; None for a request that finished since the launch (its step is discarded)."""
        committed: list[Optional[list[int]]] = []
        for req, row in zip(self.reqs, self.wait()):
            if req.finished:
                committed.append(None)
                continue
            tokens = committed_tokens(row)
            req.kv_len += len(tokens)
            committed.append(tokens)
        return committed


@dataclass
class FirstTokens:
    """An extend's first tokens still on the device: `tokens[i]` (shape [len(reqs)]) is the token of `reqs[i]`, not
    yet in its `all_ids` (the overlap schedule launches their first decode step before the host reads them)."""

    reqs: list[Req]
    tokens: torch.Tensor


def launch_rows(
    reqs: Sequence[Req],
    carry: Optional[InFlightStep],
    carried_rows: Callable[[InFlightStep, Optional[torch.Tensor]], torch.Tensor],
    fresh_rows: Callable[[list[Req]], torch.Tensor],
    device: torch.device,
    first: Optional[FirstTokens] = None,
) -> tuple[list[Req], torch.Tensor]:
    """The next step's requests (those of `carry` first, in the order of `reqs`) and device input rows: carried ones
    derived on the device from carry's outputs by `carried_rows(carry, index)`, the others from the host; the input
    token (column 0) of a request of `first` comes from `first.tokens` (its host row holds a placeholder there)."""
    if carry is not None and len(reqs) == len(carry.reqs) and all(a is b for a, b in zip(reqs, carry.reqs)):
        ordered, rows = list(reqs), carried_rows(carry, None)  # NOTE: the common step: the same batch as the last
    else:
        carried_at = {id(req): i for i, req in enumerate(carry.reqs)} if carry is not None else {}
        carried = [req for req in reqs if id(req) in carried_at]
        fresh = [req for req in reqs if id(req) not in carried_at]
        parts = []
        if carried:
            assert carry is not None
            index = device_index([carried_at[id(r)] for r in carried], len(carry.reqs), device)
            parts.append(carried_rows(carry, index))
        if fresh:
            parts.append(fresh_rows(fresh))
        ordered, rows = carried + fresh, parts[0] if len(parts) == 1 else torch.cat(parts)
    if first is not None and first.reqs:
        source = {id(req): i for i, req in enumerate(first.reqs)}
        at = [i for i, req in enumerate(ordered) if id(req) in source]
        assert len(at) == len(first.reqs), "every request of `first` runs in the step"
        index = device_index([source[id(ordered[i])] for i in at], len(first.reqs), device)
        tokens = first.tokens if index is None else first.tokens[index]
        rows[to_device(int64_tensor(at), device), 0] = tokens.to(rows.dtype)
    return ordered, rows


def host_copy(tokens: torch.Tensor, timed: bool = False) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
    """An asynchronous device→host copy of `tokens` into pinned memory and the event that marks it done (`timed`:
    an event that can end a device-time measurement)."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event(enable_timing=timed)
    ready.record()
    return host, ready


def device_index(positions: list[int], size: int, device: torch.device) -> Optional[torch.Tensor]:
    """`positions` as a device index without a synchronising copy; None when it is 0..size-1 (no gather needed)."""
    if positions == list(range(size)):
        return None
    return to_device(int64_tensor(positions), device)
