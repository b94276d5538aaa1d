"""The engine's side of its links to the HTTP server processes (`--api-server-count`): one PULL socket connected to
every server's address (ZeroMQ fair-queues them) and one PUSH socket per server, with what each is owed this step."""
from __future__ import annotations

import zmq

from blockspec.engine import wire

# NOTE: how long closing waits to hand queued frames (Stopped, the last deltas) to a server process. Over ipc to a live
# peer that takes microseconds; to a server process that has already exited (--api-server-count: the extra ones stop
# first) ZeroMQ would wait the whole linger in Context.term, which held the engine process 5 s past shutdown.
CLOSE_LINGER_MS = 500


class FrontendLinks:
    def __init__(self, context: zmq.Context, to_engine: list[str], from_engine: list[str]) -> None:
        if not to_engine or len(to_engine) != len(from_engine):
            raise ValueError("one (to_engine, from_engine) address pair per HTTP server process")
        self.to_engine = to_engine
        self.from_engine = from_engine
        self.pull = context.socket(zmq.PULL)
        self._pushes = [context.socket(zmq.PUSH) for _ in from_engine]
        for push in self._pushes:
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)  # NOTE: also for a close that does not pass linger
        self.deltas: list[list[wire.DeltaOut]] = [[] for _ in from_engine]
        self.handled = [0] * len(from_engine)  # NOTE: requests taken from each server since its last StepStats

    @property
    def count(self) -> int:
        return len(self._pushes)

    def connect(self) -> None:
        for address in self.to_engine:
            self.pull.connect(address)
        for push, address in zip(self._pushes, self.from_engine):
            push.connect(address)

    def frontend_of(self, index: int) -> int:
        """A message's frontend index, checked (an out-of-range one would have nowhere to go)."""
        if not 0 <= index < self.count:
            raise ValueError(f"frontend {index} does not exist ({self.count} HTTP server processes)")
        return index

    def send(self, frontend: int, message: wire.FromEngine) -> None:
        self._pushes[frontend].send(wire.encode(message))  # NOTE: copied: zero-copy costs more below ~64 KiB

    def send_all(self, message: wire.FromEngine) -> None:
        frame = wire.encode(message)
        for push in self._pushes:
            push.send(frame)

    @property
    def has_pending(self) -> bool:
        return any(self.deltas) or any(self.handled)

    def close(self) -> None:
        self.pull.close(linger=0)
        for push in self._pushes:
            push.close(linger=CLOSE_LINGER_MS)
