"""The server side of the engine boundary: submits requests over ZeroMQ and routes the engine's deltas to their
Submissions from an asyncio task; notices when the engine is gone."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional, Union

import zmq

from blockspec.engine import wire
from blockspec.engine.engine import Engine
from blockspec.engine.process import EngineHandle, EngineThread, RemoteEngine
from blockspec.request import Req
from blockspec.server.detokenize import OutputTexts
from blockspec.server.engine_errors import DIED_MESSAGE, EngineLoadError, EngineStoppedError, QueueFullError
from blockspec.server.frontends import EngineAddresses
from blockspec.server.metrics import ServerMetrics
from blockspec.server.submission import Delta, Submission

logger = logging.getLogger(__name__)
WATCH_MS = 200


class EngineLoop:

    def __init__(
        self,
        engine: Union[Engine, EngineHandle],
        metrics: Optional[ServerMetrics] = None,
        max_queued_requests: int = 1024,
        addresses: Optional[EngineAddresses] = None,
        frontend: int = 0,
    ) -> None:
        """`addresses`: every HTTP server process's socket pair (default: one, made at launch); `frontend`: this
        process's index in them. A RemoteEngine handle means another server process launched the engine."""
        self.handle = EngineThread(engine) if isinstance(engine, Engine) else engine
        self.addresses = addresses
        self.frontend = frontend
        self.owns_engine = not isinstance(self.handle, RemoteEngine)
        self.before_stop: list[Callable[[], None]] = []  # NOTE: run (off the loop) before the engine is stopped
        self.info = self.handle.info
        self.metrics = metrics
        self._default_metrics()
        self.max_queued_requests = max_queued_requests
        self.on_death: list[Callable[[], None]] = []
        self._routes: dict[str, tuple[Submission, int]] = {}
        self.texts = OutputTexts(None)  # ServerState.build gives it the tokenizer
        self._outbox: list[wire.ToEngine] = []
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_call = 0
        # NOTE: _num_running/_num_waiting are the scheduler's counts in the engine's last StepStats; _fresh counts
        # requests sent since then (not in those counts yet).
        self._num_running = 0
        self._num_waiting = 0
        self._fresh = 0
        self._launched = False
        self._stopping = False
        self._event_loop: Optional[asyncio.AbstractEventLoop] = None  # where the socket is read (start)
        self._watch: Optional[asyncio.TimerHandle] = None
        self._stopped = asyncio.Event()
        self.draining = False
        self.alive = False
        self.died = False

    @property
    def max_running(self) -> int:
        return self.info.max_running_requests if self.info is not None else 0

    # ---- lifecycle -----------------------------------------------------------------------------
    def launch(self, startup_timeout: float = 3600.0) -> None:
        """Binds the sockets, starts the engine and waits for its Ready; raises EngineLoadError if it cannot load."""
        if self._launched:
            return
        self._launched = True
        if self.addresses is None:
            self.addresses = EngineAddresses.create(1)
        self._context = zmq.Context()
        self._to = self._context.socket(zmq.PUSH)
        self._to.setsockopt(zmq.SNDHWM, 0)
        self._from = self._context.socket(zmq.PULL)
        self._to.bind(self.addresses.to_engine[self.frontend])
        self._from.bind(self.addresses.from_engine[self.frontend])
        if not self.owns_engine:
            self.alive = True
            return
        self.handle.launch(self.addresses.to_engine, self.addresses.from_engine)
        deadline = time.monotonic() + startup_timeout
        while not self._from.poll(100):
            if not self.handle.is_alive() or time.monotonic() > deadline:
                raise EngineLoadError(
                    "the engine exited before it was ready"
                    if time.monotonic() <= deadline
                    else "the engine did not start"
                )
        message = wire.decode_from_engine(self._from.recv())
        if isinstance(message, wire.LoadFailed):
            raise EngineLoadError(message.message)
        assert isinstance(message, wire.Ready)
        self.info = message.info
        self._default_metrics()
        self.alive = True

    def _default_metrics(self) -> None:
        """A registry of its own once the engine's limits are known, unless one was given."""
        if self.metrics is None and self.info is not None:
            self.metrics = ServerMetrics(max_accept_length=max(self.info.decode_slots_per_req, 1))

    def start(self) -> None:
        """Launches if needed and starts routing on the running event loop."""
        self.launch()
        self._stopped = asyncio.Event()
        loop = self._event_loop = asyncio.get_running_loop()
        loop.add_reader(self._from.getsockopt(zmq.FD), self._read_ready)
        self._watch = loop.call_later(WATCH_MS / 1e3, self._watch_engine)
        self._read_ready()  # NOTE: what arrived before the reader was added raised no edge

    async def stop(self, timeout: float = 30.0) -> None:
        if not self._launched or self._stopping:
            return
        self._stopping = True
        for hook in self.before_stop:
            await asyncio.get_running_loop().run_in_executor(None, hook)
        if self.owns_engine and self.alive and self.handle.is_alive():
            self._send(wire.Stop())
            try:
                await asyncio.wait_for(self._stopped.wait(), timeout)
            except asyncio.TimeoutError:
                logger.error("the engine did not stop within %.0f s", timeout)
        self.alive = False
        await asyncio.get_running_loop().run_in_executor(None, self.handle.join, timeout)
        self._stop_reading()
        self._fail_routes("the server is shutting down", 503)
        self._flush_outbox()
        self._to.close(linger=0)
        self._from.close(linger=0)
        self._context.term()
        if self.owns_engine and self.addresses is not None:
            self.addresses.cleanup()

    # ---- HTTP side -----------------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests waiting for a running slot."""
        # NOTE: fresh requests take the running slots that were free at the last step, unless requests already
        # wait (then the pool or the prefill budget, not the slot count, is what holds them back).
        free = self.max_running - self._num_running if self._num_waiting == 0 else 0
        return self._num_waiting + max(0, self._fresh - free)

    @property
    def num_in_flight(self) -> int:
        """Requests of this HTTP process that the engine has not answered in full yet."""
        return len(self._routes)

    def begin_drain(self) -> None:
        """Shutdown has begun: new submissions get EngineStoppedError; what is in flight carries on."""
        self.draining = True

    def fail_in_flight(self, message: str) -> None:
        """Ends every request in flight with `message` (503) in the engine, freeing its KV."""
        if self.alive:
            self._send(wire.Fail(message, self.frontend))

    def _send(self, message: wire.ToEngine) -> None:
        """Queues `message`; everything queued in one event-loop pass goes to the engine as one frame."""
        self._outbox.append(message)
        if len(self._outbox) > 1:
            return
        try:
            asyncio.get_running_loop().call_soon(self._flush_outbox)
        except RuntimeError:  # NOTE: no loop running (start-up, tests): send now
            self._flush_outbox()

    def _flush_outbox(self) -> None:
        if self._outbox and not self._to.closed:
            self._to.send(wire.encode(self._outbox))
        self._outbox = []

    def submit(self, reqs: list[Req], stream: bool) -> Submission:
        """Queues validated requests; raises QueueFullError beyond the queue limit. Call on the event loop."""
        submission = Submission(reqs, stream, asyncio.get_running_loop())
        if self._stopping or not self.alive:
            raise EngineStoppedError("the engine is not running")
        if self.draining:
            raise EngineStoppedError("the server is shutting down")
        queued = self.num_queued
        fresh = [i for i, req in enumerate(reqs) if req.rid not in self._routes]
        self._fresh += len(fresh)
        if self.num_queued > self.max_queued_requests:
            self._fresh -= len(fresh)
            raise QueueFullError(f"{queued} requests are waiting (limit {self.max_queued_requests}); retry later")
        now = time.monotonic()
        for index, req in enumerate(reqs):
            if index not in fresh:
                submission.push(Delta(index, "", [], None, f"rid {req.rid!r} is already in flight", 400))
                continue
            self._routes[req.rid] = (submission, index)
            params = req.params.to_dict()
            self._send(wire.AddRequest(
                req.rid, list(req.all_ids[:req.prompt_len]), params, stream, now, req.top_logprobs_num, self.frontend
            ))
        # NOTE: now, not at the end of this loop pass (on a busy loop, every stream's chunk write long)
        self._flush_outbox()
        return submission

    def abort(self, rid: str) -> None:
        if self.alive:
            self._send(wire.Abort(rid))

    async def call(self, name: str) -> Any:
        """Runs the Engine method `name` in the engine between two steps; returns its (msgpack-able) result."""
        if self._stopping or not self.alive:
            raise EngineStoppedError("the engine is not running")
        self._next_call += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[self._next_call] = future
        self._send(wire.Call(self._next_call, name, self.frontend))
        return await future

    # ---- routing -------------------------------------------------------------------------------
    def _read_ready(self) -> None:
        """Takes every message waiting on the socket, then routes them (a server that fell behind catches up in one
        pass, and each stream then sends one merged chunk: Submission.next). Runs as the socket's reader callback."""
        # NOTE: a ZeroMQ socket's FD is edge-triggered: read until EVENTS has no POLLIN, or a wake-up is lost.
        sock = self._from
        frames: list[bytes] = []
        while not sock.closed and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames.append(sock.recv(zmq.NOBLOCK))
        for frame in frames:
            try:
                self._handle(wire.decode_from_engine(frame))
            except Exception:  # NOTE: one bad frame must not cost the frames after it
                logger.exception("dropped a message from the engine")

    def _watch_engine(self) -> None:
        """Every WATCH_MS: is the engine still there? (Reads the socket too: a guard against a lost edge.)"""
        gone = not self.handle.is_alive() and not self._stopping
        try:
            self._read_ready()
        finally:
            if gone:
                self._stop_reading()
                self._on_death()
            elif self._event_loop is not None:
                self._watch = self._event_loop.call_later(WATCH_MS / 1e3, self._watch_engine)

    def _stop_reading(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._event_loop is not None and not self._from.closed:
            self._event_loop.remove_reader(self._from.getsockopt(zmq.FD))
        self._event_loop = None

    def _handle(self, message: wire.FromEngine) -> None:
        if isinstance(message, wire.Outputs):
            self._route(message)
        elif isinstance(message, wire.CallResult):
            future = self._calls.pop(message.call_id, None)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.result)
                else:
                    future.set_exception(RuntimeError(message.error))
        elif isinstance(message, wire.Stopped):
            self.alive = False
            self._fail_calls(EngineStoppedError("the engine is not running"))
            self._stopped.set()

    def _route(self, message: wire.Outputs) -> None:
        for out in message.deltas:
            route = self._routes.get(out.rid)
            if route is None:
                continue
            submission, index = route
            final = out.output is not None or out.error is not None
            text = out.text
            if text is None:
                text = self.texts.push(out.rid, out.ids, submission.reqs[index].params.skip_special_tokens, final)
            if final:
                del self._routes[out.rid]
                whole = self.texts.finish(out.rid)
                if out.output is not None and out.text is None:
                    out.output["text"] = whole
            submission.push(
                Delta(index, text, out.ids, out.output, out.error, out.status, out.logprobs, out.top_logprobs)
            )
        stats = message.stats
        if stats is None or self.metrics is None:
            return
        self._num_running, self._num_waiting = stats.num_running, stats.num_waiting
        self._fresh -= stats.handled
        for finish in stats.finished:
            self.metrics.on_finish(finish)
        self.metrics.on_step(stats, self.num_queued)

    def _fail_routes(self, message: str, status: int) -> None:
        for rid, (submission, index) in self._routes.items():
            self.texts.finish(rid)
            submission.push(Delta(index, "", [], None, message, status))
        self._routes.clear()

    def _fail_calls(self, exc: Exception) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(exc)
        self._calls.clear()

    def _on_death(self) -> None:
        logger.error("%s; failing %d request(s) in flight", DIED_MESSAGE, len(self._routes))
        self.alive = False
        self.died = True
        self._fail_routes(DIED_MESSAGE, 503)
        self._fail_calls(EngineStoppedError(DIED_MESSAGE))
        for callback in self.on_death:
            callback()
