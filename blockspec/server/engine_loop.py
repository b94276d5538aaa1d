"""The engine thread: the only thread that touches the Engine once serving starts.

HTTP handlers talk to it through an inbox (add / abort / fail / call) and get results back on per-submission asyncio
queues, fed with `loop.call_soon_threadsafe` after every scheduler step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from blockspec.engine import Engine
from blockspec.request import FinishReason, Req
from blockspec.server.metrics import ServerMetrics
from blockspec.server.submission import Delta, Submission

logger = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFullError(RuntimeError):
    pass


class EngineStoppedError(RuntimeError):
    pass


@dataclass
class _Tracked:
    req: Req
    submission: Submission
    index: int
    sent_ids: int = 0
    sent_text: int = 0
    stops: list[str] = field(default_factory=list)
    client_aborted: bool = False


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queued_requests: int = 1024) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self._inbox: "queue.SimpleQueue[tuple[Any, ...]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self.max_running = engine.config.max_running_requests
        # NOTE: guarded by _lock. _num_running/_num_waiting are the scheduler's counts after the last step;
        # _fresh counts requests submitted since that step's inbox drain (not in those counts yet).
        self._num_running = 0
        self._num_waiting = 0
        self._fresh = 0
        self._handled = 0  # NOTE: engine thread only: requests taken from the inbox since the last snapshot
        self._stopped = False
        self.draining = False
        self.alive = False

    # ---- HTTP side ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="blockspec-engine", daemon=True)
        self.alive = True
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            if self._thread is None or self._stopped:
                return
            self._stopped = True
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    @property
    def num_queued(self) -> int:
        with self._lock:
            return self._queued()

    def _queued(self) -> int:
        """Requests waiting for a running slot (call with _lock held)."""
        # NOTE: fresh requests take the running slots that were free at the last step, unless requests already
        # wait (then the pool or the prefill budget, not the slot count, is what holds them back).
        free = self.max_running - self._num_running if self._num_waiting == 0 else 0
        return self._num_waiting + max(0, self._fresh - free)

    def begin_drain(self) -> None:
        """Shutdown has begun: new submissions get EngineStoppedError; what is in flight carries on."""
        with self._lock:
            self.draining = True

    def fail_in_flight(self, message: str) -> None:
        """Ends every request in flight with `message` (503) on the engine thread, freeing its KV."""
        self._inbox.put(("fail", message))

    def submit(self, reqs: list[Req], stream: bool) -> Submission:
        """Queues validated requests (see Engine.make_requests); raises QueueFullError beyond the queue limit."""
        submission = Submission(reqs, stream, asyncio.get_running_loop())
        # NOTE: checked and enqueued under the lock, so nothing lands in the inbox after the engine thread's
        # final drain (it clears `alive` under the same lock first).
        with self._lock:
            if self._stopped or not self.alive:
                raise EngineStoppedError("the engine is not running")
            if self.draining:
                raise EngineStoppedError("the server is shutting down")
            queued = self._queued()
            self._fresh += len(reqs)
            if self._queued() > self.max_queued_requests:
                self._fresh -= len(reqs)
                raise QueueFullError(f"{queued} requests are waiting (limit {self.max_queued_requests}); retry later")
            self._inbox.put(("add", submission))
        return submission

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between two steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._stopped or not self.alive:
                raise EngineStoppedError("the engine is not running")
            self._inbox.put(("call", fn, future))
        return await asyncio.wrap_future(future)

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        scheduler = self.engine.scheduler
        try:
            while True:
                if not self._drain(block=not scheduler.has_work):
                    break
                if not scheduler.has_work:
                    continue
                try:
                    self._publish(scheduler.step())
                except Exception as exc:  # keep serving: fail what was in flight, free its KV
                    logger.exception("engine step failed")
                    self._fail_all(f"engine error: {exc}", drain_inbox=False)
        finally:
            with self._lock:
                self.alive = False
            self._fail_all("the server is shutting down", drain_inbox=True, status=503)

    def _drain(self, block: bool) -> bool:
        """Handles inbox messages; returns False on stop."""
        try:
            message = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if message[0] == "stop":
                return False
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "add":
            submission: Submission = message[1]
            self._handled += len(submission.reqs)
            for index, req in enumerate(submission.reqs):
                tracked = _Tracked(req, submission, index, stops=list(req.params.stop))
                if req.rid in self._tracked:
                    self._finish(tracked, error=f"rid {req.rid!r} is already in flight", status=400)
                    continue
                try:
                    self.engine.scheduler.add_request(req)
                except Exception as exc:
                    self._finish(tracked, error=str(exc), status=400)
                    continue
                self._tracked[req.rid] = tracked
            if not self.engine.scheduler.has_work:  # NOTE: all refused: no step follows to take the snapshot
                self._snapshot()
        elif kind == "abort":
            tracked = self._tracked.get(message[1])
            if tracked is not None:
                tracked.client_aborted = True
            self.engine.scheduler.abort(message[1])
        elif kind == "fail":
            self._fail_all(message[1], drain_inbox=False, status=503)
        elif kind == "call":
            fn, future = message[1], message[2]
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:
                    future.set_exception(exc)

    def _publish(self, finished: list[Req]) -> None:
        now = time.monotonic()
        for req in finished:
            tracked = self._tracked.pop(req.rid, None)
            if tracked is not None:
                self._finish(tracked, now=now)
        for tracked in self._tracked.values():
            if tracked.submission.stream:
                self._push_delta(tracked, final=False)
        self._snapshot()
        self.metrics.on_step(self.engine, self.num_queued)

    def _snapshot(self) -> None:
        scheduler = self.engine.scheduler
        with self._lock:
            self._num_running = len(scheduler.running)
            self._num_waiting = len(scheduler.waiting)
            self._fresh -= self._handled
            self._handled = 0

    def _push_delta(
        self, tracked: _Tracked, final: bool, output: Optional[dict[str, Any]] = None, error: Optional[str] = None, status: int = 500
    ) -> None:
        req = tracked.req
        ids = req.output_ids
        text_end = len(req.text) if final else len(req.text) - _held_back(req.text, tracked.stops)
        if not final and len(ids) == tracked.sent_ids and text_end <= tracked.sent_text:
            return
        # NOTE: req.text only grows, except the stop-string cut on finish; the held-back suffix keeps the
        # streamed text a prefix of the final text.
        new_text = req.text[tracked.sent_text:text_end] if text_end > tracked.sent_text else ""
        delta = Delta(tracked.index, new_text, ids[tracked.sent_ids:], output, error, status)
        tracked.sent_ids = len(ids)
        tracked.sent_text = max(tracked.sent_text, text_end)
        tracked.submission.push(delta)

    def _finish(self, tracked: _Tracked, now: Optional[float] = None, error: Optional[str] = None, status: int = 500) -> None:
        req = tracked.req
        if error is not None:
            self._push_delta(tracked, final=True, error=error, status=status)
            return
        output = Engine.output_of(req)
        output["meta_info"]["e2e_latency"] = (now or time.monotonic()) - req.arrival_time
        self.metrics.on_finish(req, now or time.monotonic())
        # NOTE: an abort the engine decided (the KV pool ran out) is an answer: finish_reason {"type": "abort",
        # "message": ...}; only the client's own abort becomes an error.
        if req.finish is not None and req.finish.reason == FinishReason.ABORT and tracked.client_aborted:
            self._push_delta(tracked, final=True, output=output, error=req.finish.message or "aborted", status=400)
        else:
            self._push_delta(tracked, final=True, output=output)

    def _fail_all(self, message: str, drain_inbox: bool, status: int = 500) -> None:
        scheduler = self.engine.scheduler
        for rid in list(self._tracked):
            scheduler.abort(rid)
        try:
            scheduler.collect_finished()
        except Exception:
            logger.exception("could not release the KV of failed requests")
        for rid in list(self._tracked):
            self._finish(self._tracked.pop(rid), error=message, status=status)
        self._snapshot()
        try:  # requests still in the inbox never reached the scheduler
            while drain_inbox:
                message_ = self._inbox.get_nowait()
                if message_[0] == "add":
                    for index, req in enumerate(message_[1].reqs):
                        self._finish(_Tracked(req, message_[1], index), error=message, status=status)
                elif message_[0] == "call" and message_[2].set_running_or_notify_cancel():
                    message_[2].set_exception(EngineStoppedError(message))
        except queue.Empty:
            pass
