"""StepExecutor: runs each engine step's plan on the worker; owns the decode step's KV slots and the overlap schedule.

Overlap schedule (greedy decode, target-only or DFlash): `run_ahead` launches step N+1 on the device before it
commits step N, whose host bookkeeping (commit, finish checks, slot release, statistics) then runs while the device
works. Step N+1's inputs are derived on the device from N's outputs (worker/inflight.py), so a request in flight has
a kv_len that lags one uncommitted step (<= B tokens), and N+1 writes up to B slots past that: requests in flight
hold slots to kv_len + 2B at least (GROW_AHEAD_SLOTS more where they had to grow). `drain` commits the step in
flight when the next step cannot overlap. An extend step (`launch_extend`) queues its forward behind the step in
flight and, through `extend_run_ahead`, the next decode step behind the extend, for the decoding requests and those
whose prompt the extend completes (their first token, the extend's argmax, goes into that step's rows on the
device). With --enable-mixed-chunk a greedy target-only step's extend chunks and decode rows share one forward that
goes behind the step in flight the same way (`launch_mixed_ahead`): its decode rows take their tokens from that
step's outputs on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.layers.argmax import greedy_tokens
from blockspec.outputs import Committed, StepPlan
from blockspec.request import Req
from blockspec.worker.inflight import FirstTokens, InFlightStep, device_index, host_copy
from blockspec.worker.protocol import Worker


@dataclass
class MixedLaunch:
    """A mixed step launched ahead (`StepExecutor.launch_mixed_ahead`): the commits of the step that was in flight,
    the mixed forward's decode part and first tokens (on the device, `host_first` once `first_ready` is done)."""

    in_flight_commits: list[Committed]
    mixed: InFlightStep
    first: Optional[FirstTokens]
    host_first: Optional[torch.Tensor]
    first_ready: Optional[torch.cuda.Event]


# NOTE: a decode step grows every request by its new tokens' slots, and giving slots is host work (pages off the free
# list, a req→token table write on the device) that bounds a small target's step. A request that must grow takes this
# many slots beyond its need (and so does every request that would need slots soon), so most steps give none. Only
# while the free pool holds ROOMY_POOL_FACTOR times what the batch could take that way, so admission and retraction in
# a tight pool see what they saw without it; `drain` and a request's release free the rest.
GROW_AHEAD_SLOTS = 16
ROOMY_POOL_FACTOR = 4


class StepExecutor:
    def __init__(self, worker: Worker, allocator: PageAllocator, table: ReqToTokenTable, overlap: bool) -> None:
        """`overlap`: the overlap schedule's public switch (benchmarks time the synchronous loop with it off)."""
        self.worker = worker
        self.allocator = allocator
        self.table = table
        self.overlap = overlap
        self.in_flight: Optional[InFlightStep] = None
        self.mixed_steps = 0  # steps whose one forward carried prefill chunks and decode/verify together
        self.mixed_steps_ahead = 0  # those of them launched on the overlap schedule (launch_mixed_ahead)

    @property
    def slots_per_decode(self) -> int:
        """KV slots one request writes in a decode step (1, or the DFlash block size)."""
        return self.worker.decode_slots_per_req

    @property
    def is_speculative(self) -> bool:
        return self.worker.is_speculative

    def fits(self, reqs: Sequence[Req], ahead: Optional[int] = None) -> bool:
        """Whether the free pool can give every request slots up to kv_len + ahead (default: one decode step)."""
        ahead = self.slots_per_decode if ahead is None else ahead
        needed = sum(self.allocator.extra_pages_needed(r, r.kv_len + ahead) for r in reqs)
        return needed * self.allocator.page_size <= self.allocator.free_slots

    def run(self, plan: StepPlan) -> list[Committed]:
        """Runs the plan synchronously, in one forward when it has both parts (`Worker.mixed`): its extend chunks
        and one decode step of its decode requests (slots for it are given here; the scheduler made room with
        `fits`). Nothing of the plan may be in flight (an extend-only plan may also go through `launch_extend`)."""
        reqs, lens = [c.req for c in plan.extend], [c.length for c in plan.extend]
        decode_reqs = plan.decode
        if decode_reqs:
            assert self.in_flight is None, "drain the step in flight before a synchronous decode step"
            grown = [req.kv_len + self.slots_per_decode for req in decode_reqs]
            self.allocator.grow_many(decode_reqs, grown, self.table)
        if reqs and decode_reqs:
            first, decoded = self.worker.mixed(reqs, lens, decode_reqs)
            self.mixed_steps += 1
        else:
            first = self.worker.extend(reqs, lens) if reqs else []
            decoded = self.worker.decode(decode_reqs) if decode_reqs else []
        committed = first_token_commits(reqs, first)
        for req, tokens in zip(decode_reqs, decoded):
            if req.finished:  # NOTE: its sampling failed in this step (sampling_faults.py): no verify cycle to count
                continue
            self.allocator.shrink(req, req.kv_len)
            committed.append(Committed(req, tokens, verified=True))
        return committed

    def launch_extend(self, plan: StepPlan) -> torch.Tensor:
        """Launches an extend-only plan's forward without waiting for it (a decode step may stay in flight ahead of
        it); its last-token logits [bs, V], for `extend_commits`."""
        return self.worker.extend_logits([c.req for c in plan.extend], [c.length for c in plan.extend])

    def extend_commits(self, plan: StepPlan, logits: torch.Tensor) -> list[Committed]:
        """The first tokens of an extend launched by `launch_extend` (waits for its logits)."""
        reqs = [c.req for c in plan.extend]
        return first_token_commits(reqs, self.worker.first_tokens(reqs, logits))

    def extend_run_ahead(self, plan: StepPlan, logits: torch.Tensor, decoding: list[Req]) -> Optional[list[Committed]]:
        """After `launch_extend`: launches the next decode step behind the extend, for the decoding requests and the
        plan's requests whose prompt it completes (their first token, the extend's argmax, stays on the device), then
        commits the step in flight and the first tokens while the device runs both. None (nothing done) where
        `run_ahead` would decline (then `drain` and `extend_commits`)."""
        ready_at = [i for i, chunk in enumerate(plan.extend) if chunk.req.pending_len == 0]
        ready = [plan.extend[i].req for i in ready_at]
        if not self._can_run_ahead(decoding + ready):
            return None
        first, host_first, first_ready = None, None, None
        if ready:
            index = device_index(ready_at, len(plan.extend), logits.device)
            first = FirstTokens(ready, greedy_tokens(logits if index is None else logits[index]))
            host_first, first_ready = host_copy(first.tokens)
        previous, self.in_flight = self.in_flight, self.worker.launch(decoding + ready, self.in_flight, first)
        committed = [] if previous is None else self._commit(previous, keep_ahead=None)
        if first_ready is not None:
            first_ready.synchronize()
        return committed + ([] if host_first is None else first_token_commits(ready, host_first.tolist()))

    def launch_mixed_ahead(self, plan: StepPlan, decoding: list[Req]) -> Optional[MixedLaunch]:
        """A mixed step on the overlap schedule: one forward of the plan's extend chunks and a decode step of
        `decoding` goes behind the step in flight (a request it runs decodes the token it produces), the next decode
        step behind that one; the step in flight is committed while the device runs them. The caller applies those
        commits, then takes the mixed step's from `mixed_commits` (after them: a request the step in flight finished
        commits nothing more). None (nothing done) for a speculative worker (its mixed step verifies blocks proposed
        from committed tokens), a batch that cannot run ahead, or no slots for it (then `drain` and `run`)."""
        ready = [c.req for c in plan.extend if c.req.pending_len == c.length]  # NOTE: the chunk ends the prompt
        if self.is_speculative or not (self.overlap and decoding and self.worker.can_run_ahead(decoding + ready)):
            return None
        carry = self.in_flight
        in_carry = {id(req) for req in carry.reqs} if carry is not None else set()
        # NOTE: slots through the next decode step's position: a request the step in flight runs writes at kv_len
        # there, kv_len + 1 in the mixed step, kv_len + 2 in the next; the others one fewer; a prompt the chunk ends
        # writes its first token's position in the next step
        needs = [req.kv_len + 2 + (id(req) in in_carry) for req in decoding]
        needs += [req.kv_len + req.pending_len + 1 for req in ready]
        if max(needs) > self.table.max_context_len or not self.allocator.try_grow_many(
                decoding + ready, needs, self.table):
            return None
        mixed, first = self.worker.launch_mixed([c.req for c in plan.extend], [c.length for c in plan.extend],
                                                decoding, carry)
        self.mixed_steps += 1
        self.mixed_steps_ahead += 1
        host_first, first_ready = host_copy(first.tokens) if first is not None else (None, None)
        # NOTE: requests the step in flight finishes run on in the next step too; its commit discards them
        following = decoding + (first.reqs if first is not None else [])
        previous, self.in_flight = carry, self.worker.launch(following, mixed, first)
        in_flight_commits = [] if previous is None else self._commit(previous, keep_ahead=None)
        return MixedLaunch(in_flight_commits, mixed, first, host_first, first_ready)

    def mixed_commits(self, launch: MixedLaunch) -> list[Committed]:
        """The tokens of a mixed step from `launch_mixed_ahead` (waits for its forward, not for the step behind it)."""
        committed = self._commit(launch.mixed, keep_ahead=None)
        if launch.first is not None:
            assert launch.host_first is not None
            if launch.first_ready is not None:
                launch.first_ready.synchronize()
            committed += first_token_commits(launch.first.reqs, launch.host_first.tolist())
        return committed

    def run_ahead(self, reqs: list[Req]) -> Optional[list[Committed]]:
        """Launches a decode step for `reqs`, then commits the step in flight (if any) while the device runs it.

        None (nothing done) when the batch cannot overlap: the schedule is off, sampled requests, a host-planned
        graph, or no room for slots two steps ahead (the synchronous step, after `drain`, may then retract)."""
        if not self._can_run_ahead(reqs):
            return None
        previous, self.in_flight = self.in_flight, self.worker.launch(reqs, self.in_flight)
        # NOTE: nothing shrinks: each request keeps its slots to (pre-commit kv_len) + 2B or more, which the next launch
        # grows from (by what this commit advanced, not by B + that), and `drain` or its release frees the rest
        return [] if previous is None else self._commit(previous, keep_ahead=None)

    def _can_run_ahead(self, reqs: list[Req]) -> bool:
        """Whether `reqs` can be launched ahead of the host's commit; if so, each now has slots two steps ahead (a
        request that had to grow: GROW_AHEAD_SLOTS more, while the pool is roomy)."""
        if not (self.overlap and reqs and self.worker.can_run_ahead(reqs)):
            return False
        ahead = 2 * self.slots_per_decode
        lengths = [r.kv_len + ahead for r in reqs]
        cap = self.table.max_context_len
        if max(lengths) > cap:
            return False
        if all(length <= r.allocated_len for r, length in zip(reqs, lengths)):
            return True  # NOTE: the common step: every request has its slots from an earlier step's growth
        allocator = self.allocator
        if allocator.free_slots >= ROOMY_POOL_FACTOR * GROW_AHEAD_SLOTS * len(reqs):
            # NOTE: with it, every request that would need slots within half the slack grows too: the batch grows
            # together, in one table write every GROW_AHEAD_SLOTS / 2 steps or more
            soon = GROW_AHEAD_SLOTS // 2
            grown = [min(length + GROW_AHEAD_SLOTS, cap) if r.allocated_len < length + soon else length
                     for r, length in zip(reqs, lengths)]
            if allocator.try_grow_many(reqs, grown, self.table):
                return True
        return allocator.try_grow_many(reqs, lengths, self.table)

    def drain(self) -> list[Committed]:
        """Commits the step in flight, if any (nothing runs after it, so its rejected slots are released)."""
        if self.in_flight is None:
            return []
        step, self.in_flight = self.in_flight, None
        return self._commit(step, keep_ahead=0)

    def _commit(self, step: InFlightStep, keep_ahead: Optional[int]) -> list[Committed]:
        """A launched step's tokens; each request keeps slots to kv_len + keep_ahead (every slot it has: None)."""
        committed: list[Committed] = []
        shrink = self.allocator.shrink
        for req, tokens in zip(step.reqs, self.worker.finish(step)):
            if tokens is None:  # finished or aborted since the launch
                continue
            if keep_ahead is not None:
                shrink(req, req.kv_len + keep_ahead)
            committed.append(Committed(req, tokens, verified=True))
        return committed


def first_token_commits(reqs: Sequence[Req], first: Sequence[Optional[int]]) -> list[Committed]:
    """An extend's first tokens as commits (none for a request still mid-prompt)."""
    return [Committed(req, [token], verified=False) for req, token in zip(reqs, first) if token is not None]
