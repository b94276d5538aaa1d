"""What an HTTP call gets back from the engine: a Submission of requests, fed with Deltas on the event loop."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from blockspec.request import Req


@dataclass
class Delta:
    """New output of request `index` of a submission since the previous Delta; `output` is set on the last one."""

    index: int
    text: str
    ids: list[int]
    output: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    status: int = 500  # HTTP status that goes with `error`
    logprobs: Optional[list[float]] = None  # one per id (requests that asked for logprobs)
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None

    @property
    def final(self) -> bool:
        return self.output is not None or self.error is not None

    def merge(self, later: "Delta") -> None:
        """Appends `later` (the same request's next Delta) to this one."""
        self.text += later.text
        self.ids = self.ids + later.ids
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs = self.logprobs + later.logprobs
        if self.top_logprobs is not None and later.top_logprobs is not None:
            self.top_logprobs = self.top_logprobs + later.top_logprobs
        self.output, self.error, self.status = later.output, later.error, later.status


def coalesce(deltas: list[Delta]) -> list[Delta]:
    """Consecutive Deltas of one request merged (each request's order kept): one chunk per request per wake-up."""
    merged: list[Delta] = []
    open_by_index: dict[int, Delta] = {}
    for delta in deltas:
        head = open_by_index.get(delta.index)
        if head is None:
            merged.append(delta)
            open_by_index[delta.index] = delta
        else:
            head.merge(delta)
        if delta.final:
            open_by_index.pop(delta.index, None)
    return merged


class Submission:
    """The requests of one HTTP call; their Deltas arrive in one queue, tagged by index."""

    def __init__(self, reqs: list[Req], stream: bool, loop: asyncio.AbstractEventLoop) -> None:
        self.reqs = reqs
        self.stream = stream
        self.loop = loop
        self.pending = set(range(len(reqs)))
        self._queued: deque[Delta] = deque()  # pushed, not merged yet
        self._ready: deque[Delta] = deque()  # merged, not handed out yet
        self._waiter: Optional[asyncio.Future[None]] = None  # NOTE: set while a consumer waits on an empty queue

    def push(self, delta: Delta) -> None:
        """Call on `loop` (the engine's deltas are routed there)."""
        self._queued.append(delta)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def has_ready(self) -> bool:
        return bool(self._ready) or bool(self._queued)

    async def next(self) -> Delta:
        """The next Delta; every Delta already queued for the same request is merged into it."""
        while not self.has_ready:
            await self._wait(None)
        return self._take()

    async def next_within(self, timeout: float) -> Optional[Delta]:
        """`next()`, or None when nothing arrived within `timeout` seconds (one timer, no task: this runs per chunk)."""
        if not self.has_ready:
            await self._wait(timeout)
            if not self.has_ready:
                return None
        return self._take()

    async def _wait(self, timeout: Optional[float]) -> None:
        waiter = self._waiter = self.loop.create_future()
        timer = None if timeout is None else self.loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _take(self) -> Delta:
        if not self._ready:
            self._ready.extend(coalesce(list(self._queued)))
            self._queued.clear()
        delta = self._ready.popleft()
        if delta.final:
            self.pending.discard(delta.index)
        return delta

    @property
    def done(self) -> bool:
        return not self.pending


def _wake(waiter: "asyncio.Future[None]") -> None:
    if not waiter.done():
        waiter.set_result(None)
