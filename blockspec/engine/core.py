"""The engine side of the server: a loop that owns the Engine, takes messages from a ZeroMQ PULL socket between
scheduler steps (never waiting on them while there is work) and PUSHes every step's output deltas back.

The same loop runs in the engine process (`blockspec serve`) or, for tests, on a thread of the server process."""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import msgspec
import zmq

from blockspec.engine import wire
from blockspec.engine.engine import Engine
from blockspec.engine.frontend_links import FrontendLinks
from blockspec.engine.progress_line import ProgressLine
from blockspec.engine.reports import LoopTimes, engine_info, finish_stat
from blockspec.engine.server_info import EngineLoad
from blockspec.engine.tracked import TrackedRequest
from blockspec.request import FinishReason, Req, SamplingParams
from blockspec.tokenizer import held_back

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 500
DETAIL_INTERVAL_S = 0.05  # the StepStats fields that cost a read of the engine's statistics, at most this often


class EngineCore:

    def __init__(
        self, engine: Engine, to_engine: list[str], from_engine: list[str], parent_pid: Optional[int] = None,
        progress: Optional[ProgressLine] = None,
    ) -> None:
        """`to_engine[i]` / `from_engine[i]`: the addresses HTTP server process i bound; `progress`: the console's
        periodic line (the engine process of `blockspec serve` has one)."""
        self.engine = engine
        self.progress = progress
        self.parent_pid = parent_pid
        self._tracked: dict[str, TrackedRequest] = {}
        # NOTE: the streams of _tracked by kind: ids-only ones take _publish's short path once per step
        self._ids_streams: dict[str, TrackedRequest] = {}
        self._other_streams: dict[str, TrackedRequest] = {}
        self._detail_sent = float("-inf")
        self._context = zmq.Context()
        self.links = FrontendLinks(self._context, to_engine, from_engine)
        # NOTE: per server, the running and waiting counts of the last StepStats it was sent
        self._counts_sent = [(-1, -1)] * self.links.count
        # NOTE: every server gets every request's FinishStat (complete metrics in each), with its next message
        self._finished: list[list[wire.FinishStat]] = [[] for _ in range(self.links.count)]
        self._pull = self.links.pull
        # NOTE: intake asks this poller (registered once) whether a frame waits before it receives one: a receive that
        # finds none raises zmq.Again, and that exception cost more than the poll in every step without arrivals.
        self._intake = zmq.Poller()
        self._intake.register(self._pull, zmq.POLLIN)
        self.stream_interval = engine.config.stream_interval
        self.loop_times = LoopTimes()

    def run(self) -> None:
        self.links.connect()
        self.links.send(0, wire.Ready(engine_info(self.engine)))
        scheduler = self.engine.scheduler
        scheduler.detokenize_all = False  # NOTE: the server process detokenises (server/detokenize.py)
        try:
            times, clock = self.loop_times, time.perf_counter
            while True:
                if not scheduler.has_work:
                    waiting = clock()
                    woken = self._pull.poll(IDLE_POLL_MS)
                    times.idle_seconds += clock() - waiting
                    if not woken and self._parent_gone():
                        break
                taking = clock()
                if not self._drain():
                    break
                times.intake_seconds += clock() - taking
                stepped = scheduler.has_work
                if stepped:
                    try:
                        finished = scheduler.step()
                        stepped_at = clock()
                        self._publish(finished)
                        times.publish_seconds += clock() - stepped_at
                        if self.progress is not None:
                            self.progress.after_step(finished, stepped_at)
                    except Exception as exc:  # keep serving: fail what was in flight, free its KV
                        logger.exception("engine step failed")
                        self._fail_all(f"engine error: {exc}")
                flushing = clock()
                self._flush(stats=stepped or self.links.has_pending, detail=not scheduler.has_work)
                times.flush_seconds += clock() - flushing
                times.loops += 1
        finally:
            scheduler.detokenize_all = True
            self._fail_all("the server is shutting down", status=503)
            self._drain_refused("the server is shutting down")
            self._flush(stats=True, detail=True)
            self.links.send_all(wire.Stopped())
            self.links.close()
            self._context.term()

    def _parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _drain(self) -> bool:
        """Handles every message that is waiting, without waiting for one; returns False on stop."""
        while self._intake.poll(0):
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            for message in wire.decode_to_engine(frame):
                if isinstance(message, wire.Stop):
                    return False
                try:
                    self._handle(message)
                except ValueError:  # NOTE: a message naming no server (frontend_of): nowhere to answer it
                    logger.exception("dropped a message from the server")
        return True

    def _handle(self, message: wire.ToEngine) -> None:
        if isinstance(message, wire.AddRequest):
            self._add(message)
        elif isinstance(message, wire.Abort):
            tracked = self._tracked.get(message.rid)
            if tracked is not None:
                tracked.client_aborted = True
            self.engine.scheduler.abort(message.rid)
        elif isinstance(message, wire.Fail):
            self._fail_all(message.message, status=503, frontend=message.frontend)
        elif isinstance(message, wire.Call):
            try:
                if message.name.startswith("_"):
                    raise AttributeError(f"{message.name} is not an engine call")
                result = wire.CallResult(message.call_id, self._call(message.name))
            except Exception as exc:
                result = wire.CallResult(message.call_id, error=f"{type(exc).__name__}: {exc}")
            self.links.send(self.links.frontend_of(message.frontend), result)

    def _call(self, name: str) -> object:
        """An Engine method's answer; /server_info's also carries this loop's `LoopTimes`."""
        result = getattr(self.engine, name)()
        if name == "get_server_info":
            result["internal_states"][0]["serving_loop"] = self.loop_times.as_dict()
        return result

    def _add(self, message: wire.AddRequest) -> None:
        frontend = self.links.frontend_of(message.frontend)
        self.links.handled[frontend] += 1
        # NOTE: not Engine.make_requests: msgspec decoded input_ids as a list of ints already (bools refused), so its
        # per-token type check is skipped, and add_request checks the limits once (vocabulary range, lengths).
        try:
            req = Req(message.input_ids, SamplingParams.from_dict(message.params), message.rid)
        except ValueError as exc:
            self.links.deltas[frontend].append(wire.DeltaOut(message.rid, "", [], error=str(exc), status=400))
            return
        req.arrival_time = message.arrival_time
        req.top_logprobs_num = message.top_logprobs_num
        tracked = TrackedRequest(req, message.stream, frontend, stops=list(req.params.stop))
        if req.rid in self._tracked:
            self._finish(tracked, error=f"rid {req.rid!r} is already in flight", status=400)
            return
        try:
            self.engine.scheduler.add_request(req)
        except Exception as exc:
            self._finish(tracked, error=str(exc), status=400)
            return
        self._tracked[req.rid] = tracked
        if tracked.stream:
            (self._ids_streams if tracked.ids_only else self._other_streams)[req.rid] = tracked

    def _untrack(self, rid: str) -> Optional[TrackedRequest]:
        self._ids_streams.pop(rid, None)
        self._other_streams.pop(rid, None)
        return self._tracked.pop(rid, None)

    def _publish(self, finished: list[Req]) -> None:
        now = time.monotonic()
        for req in finished:
            tracked = self._untrack(req.rid)
            if tracked is not None:
                self._finish(tracked, now=now)
        interval, deltas, delta = self.stream_interval, self.links.deltas, wire.DeltaOut
        for tracked in self._ids_streams.values():
            # NOTE: _push_delta's ids-only case inlined (once per stream per step)
            ids, sent = tracked.ids, tracked.sent_end
            if len(ids) - sent >= interval:
                deltas[tracked.frontend].append(delta(tracked.req.rid, None, ids[sent:]))
                tracked.sent_end = len(ids)
        for tracked in self._other_streams.values():
            self._push_delta(tracked, final=False)

    def _flush(self, stats: bool, detail: bool = False) -> None:
        """Sends each server its deltas and, with `stats`, the step's statistics (the detailed fields when `detail`
        or DETAIL_INTERVAL_S has passed since they were last sent).

        NOTE: a server with no deltas and no newly taken requests gets statistics only with the detailed fields (at
        most every DETAIL_INTERVAL_S, and whenever the engine goes idle): one message per server per step cost the
        engine a send per server per step under load. Its gauges and finish statistics lag by that much at most.
        A server's deltas carry statistics only when they tell it something new: requests it sent were taken, finish
        statistics wait for it, the running or waiting counts differ from the last it got, or the detailed fields
        are due (its KV gauges lag that long)."""
        links = self.links
        if not stats and not any(links.deltas):
            return
        base: Optional[wire.StepStats] = None
        load = self.engine.load()
        counts = (load.num_running, load.num_waiting)
        if stats:
            detail = detail or time.monotonic() - self._detail_sent >= DETAIL_INTERVAL_S
        for frontend in range(links.count):
            deltas, handled = links.deltas[frontend], links.handled[frontend]
            owed = stats and (
                handled or detail or bool(self._finished[frontend]) or counts != self._counts_sent[frontend]
            )
            with_stats = owed and bool(deltas or handled or detail)
            if not deltas and not with_stats:
                continue
            step_stats = None
            if with_stats:
                base = base or self._step_stats(load, detail)
                step_stats = msgspec.structs.replace(base, handled=handled, finished=self._finished[frontend])
                self._finished[frontend] = []
                links.handled[frontend] = 0
                self._counts_sent[frontend] = counts
            links.send(frontend, wire.Outputs(deltas, step_stats))
            links.deltas[frontend] = []

    def _step_stats(self, load: EngineLoad, detail: bool) -> wire.StepStats:
        base = wire.StepStats(load.num_running, load.num_waiting, 0, load.kv_total_slots, load.kv_free_slots, None, [],
                              detailed=detail)
        if detail:
            self._detail_sent = time.monotonic()
            snapshot = self.engine.snapshot()
            speculative = snapshot.speculative
            base.spec_histogram = snapshot.scheduler.accept_histogram if speculative is not None else None
            base.kernel_compiles_after_startup = snapshot.kernel_compiles_after_startup
            if speculative is not None:
                # NOTE: DFlash's verify length per batch size (and what it was chosen on), per-position acceptance
                base.verify_lengths = [wire.VerifyLengthStat(c.batch_size, c.num_draft_tokens, c.expected_tokens,
                                                             c.cycle_ms) for c in speculative.choices]
                base.position_rates = speculative.position_rates
        return base

    def _push_delta(
        self,
        tracked: TrackedRequest,
        final: bool,
        output: Optional[dict] = None,
        error: Optional[str] = None,
        status: int = 500,
    ) -> None:
        req = tracked.req
        if not final and len(tracked.ids) - tracked.sent_end < self.stream_interval:
            return
        if not req.detokenized:
            self._append_delta(tracked, None, output, error, status)
            return
        text_end = len(req.text) if final else len(req.text) - held_back(req.text, tracked.stops)
        # NOTE: req.text only grows, except the stop-string cut on finish; the held-back suffix keeps the
        # streamed text a prefix of the final text.
        self._append_delta(
            tracked,
            req.text[tracked.sent_text : text_end] if text_end > tracked.sent_text else "",
            output,
            error,
            status,
        )
        tracked.sent_text = max(tracked.sent_text, text_end)

    def _append_delta(
        self, tracked: TrackedRequest, text: Optional[str], output: Optional[dict], error: Optional[str], status: int
    ) -> None:
        req, end = tracked.req, len(tracked.ids)
        delta = wire.DeltaOut(req.rid, text, tracked.ids[tracked.sent_end:], output, error, status)
        if req.wants_logprobs:
            sent, count = tracked.sent_end - req.prompt_len, end - req.prompt_len
            delta.logprobs = req.output_token_logprobs[sent:count]
            delta.top_logprobs = req.output_top_logprobs[sent:count]
        self.links.deltas[tracked.frontend].append(delta)
        tracked.sent_end = end

    def _finish(
        self, tracked: TrackedRequest, now: Optional[float] = None, error: Optional[str] = None, status: int = 500
    ) -> None:
        req = tracked.req
        if error is not None:
            self._push_delta(tracked, final=True, error=error, status=status)
            return
        now = now or time.monotonic()
        output = Engine.output_of(req)
        output["meta_info"]["e2e_latency"] = now - req.arrival_time
        stat = finish_stat(req, now)
        for pending in self._finished:
            pending.append(stat)
        # NOTE: an abort the engine decided (the KV pool ran out) is an answer: finish_reason {"type": "abort",
        # "message": ...}; only the client's own abort becomes an error. A request's own error (its sampling failed,
        # sampling_faults.py) is an error with the status it carries and no output, like a failed step's.
        finish = req.finish
        if finish is not None and finish.error_status is not None:
            self._push_delta(tracked, final=True, error=finish.message or "failed", status=finish.error_status)
        elif finish is not None and finish.reason == FinishReason.ABORT and tracked.client_aborted:
            self._push_delta(tracked, final=True, output=output, error=finish.message or "aborted", status=400)
        else:
            self._push_delta(tracked, final=True, output=output)

    def _fail_all(self, message: str, status: int = 500, frontend: Optional[int] = None) -> None:
        """Ends the requests in flight (those of `frontend` only, when given) with an error; frees their KV."""
        scheduler = self.engine.scheduler
        failing = [rid for rid, t in self._tracked.items() if frontend is None or t.frontend == frontend]
        for rid in failing:
            scheduler.abort(rid)
        try:
            finished = scheduler.collect_finished()
        except Exception:
            logger.exception("could not release the KV of failed requests")
            finished = []
        for rid in failing:
            tracked = self._untrack(rid)
            if tracked is not None:
                self._finish(tracked, error=message, status=status)
        self._publish([req for req in finished if req.rid in self._tracked])

    def _drain_refused(self, message: str) -> None:
        """Requests still on the socket never reached the scheduler; calls there stay unanswered (the client fails
        them itself once it sees Stopped)."""
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            for request in wire.decode_to_engine(frame):
                if isinstance(request, wire.AddRequest) and 0 <= request.frontend < self.links.count:
                    self.links.handled[request.frontend] += 1
                    self.links.deltas[request.frontend].append(
                        wire.DeltaOut(request.rid, "", [], error=message, status=503)
                    )
