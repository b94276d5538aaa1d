"""What an HTTP call gets back from the engine: a Submission of requests, fed with Deltas on the event loop."""
from __future__ import annotations

import asyncio
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


class Submission:
    """The requests of one HTTP call; their Deltas arrive on one asyncio queue, tagged by index."""

    def __init__(self, reqs: list[Req], stream: bool, loop: asyncio.AbstractEventLoop) -> None:
        self.reqs = reqs
        self.stream = stream
        self.loop = loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.pending = set(range(len(reqs)))

    def push(self, delta: Delta) -> None:
        """Call on `loop` (the engine's deltas are routed there)."""
        self.queue.put_nowait(delta)

    async def next(self) -> Delta:
        delta = await self.queue.get()
        if delta.final:
            self.pending.discard(delta.index)
        return delta

    @property
    def done(self) -> bool:
        return not self.pending
