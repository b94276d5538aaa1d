"""A stand-in engine for benchmarks/frontend_capacity.py: a process that speaks the engine's side of the wire protocol
(blockspec/engine/wire.py) and emits tokens at a fixed pace, with no model behind it, so what the server delivers
measures the HTTP server process alone (intake, routing, streaming) against a known ceiling.

Each step (every `cycle_ms`) it admits waiting requests up to `max_running` and gives every running request
`tokens_per_step` more ids (ignore_eos: up to its max_new_tokens), as a DFlash cycle or a decode step would; a request
admitted at a step gets its first token there (the stand-in has no prefill). Steps run on schedule while the stand-in
keeps up; `lag` in its report says by how much it fell behind."""
from __future__ import annotations

import multiprocessing
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from blockspec.engine import wire
from blockspec.engine.frontend_links import FrontendLinks
from blockspec.engine.process import EngineProcess


NO_CACHE = {"enabled": False, "cache_hit_rate": 0.0, "cached_tokens_total": 0, "prompt_tokens_total": 0,
            "evicted_tokens_total": 0, "tree_tokens": 0, "evictable_tokens": 0}  # Engine.radix_cache_stats, cache off


@dataclass(frozen=True)
class Pace:
    cycle_ms: float
    tokens_per_step: int
    max_running: int = 64
    stream_interval: int = 1  # as `blockspec serve --stream-interval`: a chunk once this many new tokens are ready
    vocab_size: int = 49152
    context_length: int = 8192
    block_size: int = 16  # NOTE: the statistics a DFlash engine reports each step (tokens_per_step > 1) are this size


@dataclass
class _Running:
    message: wire.AddRequest
    frontend: int
    max_new_tokens: int
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # ids already streamed
    steps: int = 0
    received: float = 0.0  # time.monotonic() when the stand-in took it from the socket
    admitted: float = 0.0  # ... when a step admitted it (its first tokens come at that step: no prefill)


@dataclass
class PaceReport:
    """What the stand-in did: steps run, mean running requests per step, how far behind schedule it fell."""

    steps: int = 0
    running_sum: int = 0
    busy_steps: int = 0
    lag_max_ms: float = 0.0
    lag_sum_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        busy = max(self.busy_steps, 1)
        return {"steps": self.steps, "busy_steps": self.busy_steps, "running_sum": self.running_sum,
                "mean_running": self.running_sum / busy,
                "lag_mean_ms": self.lag_sum_ms / busy, "lag_max_ms": self.lag_max_ms}


class PacedLoop:
    def __init__(self, pace: Pace, to_engine: list[str], from_engine: list[str], parent_pid: int) -> None:
        self.pace = pace
        self.parent_pid = parent_pid  # NOTE: the stand-in ends with the server process that launched it
        self._context = zmq.Context()
        self.links = FrontendLinks(self._context, to_engine, from_engine)
        self.running: dict[str, _Running] = {}
        self.waiting: deque[_Running] = deque()
        self.report = PaceReport()
        self.stopped = False
        self.speculative = pace.tokens_per_step > 1
        if pace.tokens_per_step > pace.block_size:
            raise ValueError(f"tokens_per_step {pace.tokens_per_step} > block_size {pace.block_size}")
        self._slots = pace.block_size if self.speculative else 1  # NOTE: a DFlash request writes a block per cycle
        self._histogram = [0] * (pace.block_size + 1)
        self._finished: list[wire.FinishStat] = []

    def info(self) -> wire.EngineInfo:
        pace = self.pace
        return wire.EngineInfo(model_path="paced-stand-in", tokenizer_path="", trust_remote_code=False, has_tokenizer=False,
                               context_length=pace.context_length, vocab_size=pace.vocab_size, total_slots=1 << 24,
                               slots_per_decode=self._slots, decode_slots_per_req=self._slots,
                               max_running_requests=pace.max_running, pid=os.getpid())

    def run(self) -> None:
        self.links.connect()
        self.links.send(0, wire.Ready(self.info()))
        cycle_s = self.pace.cycle_ms / 1e3
        due = time.monotonic()
        while not self.stopped and os.getppid() == self.parent_pid:
            idle = not self.running and not self.waiting
            self._drain(timeout_ms=200 if idle else 0)
            if not self.running and not self.waiting:
                if self.links.has_pending:  # NOTE: an abort's final answer, or `handled` counts, owed now
                    self._flush()
                due = time.monotonic()
                continue
            now = time.monotonic()
            if now < due:
                time.sleep(due - now)
                self._drain(timeout_ms=0)  # NOTE: as the engine core, what arrived during a step joins the next one
            lag = max(0.0, time.monotonic() - due)
            self._step(lag)
            due = max(due + cycle_s, time.monotonic() - cycle_s)  # NOTE: behind by more than a step: do not sprint
        self.links.send_all(wire.Stopped())
        self.links.close()
        self._context.term()

    def _drain(self, timeout_ms: int) -> None:
        if timeout_ms and not self.links.pull.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.links.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            for message in wire.decode_to_engine(frame):
                self._handle(message)

    def _handle(self, message: wire.ToEngine) -> None:
        if isinstance(message, wire.AddRequest):
            frontend = self.links.frontend_of(message.frontend)
            self.links.handled[frontend] += 1
            self.waiting.append(_Running(message, frontend, int(message.params.get("max_new_tokens", 128)),
                                         received=time.monotonic()))
        elif isinstance(message, wire.Abort):
            for run in [self.running.pop(message.rid, None)] + [r for r in self.waiting if r.message.rid == message.rid]:
                if run is not None:
                    self._final(run, "abort", error="aborted", status=400)
            self.waiting = deque(r for r in self.waiting if r.message.rid != message.rid)
        elif isinstance(message, wire.Fail):
            failed = [r for r in [*self.running.values(), *self.waiting]
                      if message.frontend is None or r.frontend == message.frontend]
            for run in failed:
                self.running.pop(run.message.rid, None)
                self._final(run, "abort", error=message.message, status=503)
            self.waiting = deque(r for r in self.waiting if r not in failed)
        elif isinstance(message, wire.Call):
            answers = {"get_server_info": lambda: {"stand_in": True, **self.report.as_dict()},
                       "radix_cache_stats": lambda: dict(NO_CACHE)}
            answer = answers.get(message.name)
            result = wire.CallResult(message.call_id, answer()) if answer is not None else \
                wire.CallResult(message.call_id, error=f"{message.name} is not served by the stand-in engine")
            self.links.send(self.links.frontend_of(message.frontend), result)
        elif isinstance(message, wire.Stop):
            self.stopped = True

    def _step(self, lag: float) -> None:
        while self.waiting and len(self.running) < self.pace.max_running:
            admitted = self.waiting.popleft()
            admitted.admitted = time.monotonic()
            self.running[admitted.message.rid] = admitted
        report = self.report
        report.steps += 1
        report.busy_steps += 1
        report.running_sum += len(self.running)
        report.lag_sum_ms += lag * 1e3
        report.lag_max_ms = max(report.lag_max_ms, lag * 1e3)
        done: list[_Running] = []
        for run in self.running.values():
            fresh = [5 + (len(run.ids) + i) % 1000 for i in range(min(self.pace.tokens_per_step, run.max_new_tokens - len(run.ids)))]
            run.ids += fresh
            run.steps += 1
            if len(run.ids) >= run.max_new_tokens:
                done.append(run)
            elif run.message.stream and len(run.ids) - run.sent >= self.pace.stream_interval:
                self.links.deltas[run.frontend].append(wire.DeltaOut(run.message.rid, None, run.ids[run.sent:]))
                run.sent = len(run.ids)
        if self.speculative:
            self._histogram[self.pace.tokens_per_step] += len(self.running)
        now = time.monotonic()
        for run in done:
            del self.running[run.message.rid]
            self._final(run, "length")
            arrival = run.message.arrival_time
            self._finished.append(wire.FinishStat(
                "length", len(run.message.input_ids), len(run.ids), now - arrival, run.admitted - arrival,
                now - run.admitted, [self.pace.tokens_per_step] * run.steps if self.speculative else [],
                receive_s=run.received - arrival, queue_s=run.admitted - run.received, prefill_s=0.0))
        self._flush()

    def _final(self, run: _Running, reason: str, error: Optional[str] = None, status: int = 500) -> None:
        """The request's last DeltaOut: its output, and for an abort the error the engine core would send."""
        message = run.message
        meta = {"id": message.rid, "prompt_tokens": len(message.input_ids), "completion_tokens": len(run.ids),
                "cached_tokens": 0, "finish_reason": {"type": reason, "length": len(run.ids)} if reason == "length"
                else {"type": reason}, "spec_verify_ct": run.steps}
        output = {"text": None, "output_ids": list(run.ids), "meta_info": meta}
        self.links.deltas[run.frontend].append(wire.DeltaOut(message.rid, None, run.ids[run.sent:], output, error, status))

    def _flush(self) -> None:
        """Every server gets the step's statistics as the engine core sends them (DFlash: the accept histogram, the
        verify length per batch size and the per-position rates; every finished request's FinishStat)."""
        links = self.links
        spec: dict[str, Any] = {}
        if self.speculative:
            block = self.pace.block_size
            spec = {"verify_lengths": [wire.VerifyLengthStat(len(self.running), block, float(self.pace.tokens_per_step),
                                                             self.pace.cycle_ms)],
                    "position_rates": [1.0 if j < self.pace.tokens_per_step else 0.0 for j in range(1, block)]}
        finished, self._finished = self._finished, []
        for frontend in range(links.count):
            stats = wire.StepStats(len(self.running), len(self.waiting), links.handled[frontend], 1 << 24, 1 << 24,
                                   list(self._histogram) if self.speculative else None, finished, **spec)
            links.send(frontend, wire.Outputs(links.deltas[frontend], stats))
            links.deltas[frontend] = []
            links.handled[frontend] = 0


def _paced_main(pace: Pace, to_engine: list[str], from_engine: list[str], parent_pid: int) -> None:
    PacedLoop(pace, to_engine, from_engine, parent_pid).run()


class PacedEngine(EngineProcess):
    """An engine handle (blockspec.engine.process) whose engine is a PacedLoop in a process of its own."""

    def __init__(self, pace: Pace) -> None:
        super().__init__({})
        self.pace = pace

    def launch(self, to_engine: list[str], from_engine: list[str]) -> None:
        self.process = multiprocessing.get_context("spawn").Process(
            target=_paced_main, args=(self.pace, to_engine, from_engine, os.getpid()), name="paced-engine", daemon=True)
        self.process.start()


__all__ = ["Pace", "PacedEngine", "PacedLoop", "PaceReport"]
