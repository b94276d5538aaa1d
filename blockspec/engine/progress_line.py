"""The serving console's heartbeat: while the engine has work, one line every few seconds with its requests, its
generation throughput over the interval, DFlash's accept length over the interval and the KV pool's use (SGLang's
"#running-req, #queue-req, gen throughput, accept len" line). Printed at any --log-level: it is the console's
answer to "is it working?", not a debug log."""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from blockspec.engine.engine import Engine
from blockspec.request import Req

PROGRESS_INTERVAL_S = 5.0


def _write_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ProgressLine:
    """`after_step(finished, now)` once per engine step that ran; prints when `interval_s` has passed since the last
    line, and when the engine runs out of work (so a single request on a quiet server gets its line)."""

    def __init__(self, engine: Engine, interval_s: float = PROGRESS_INTERVAL_S,
                 write: Callable[[str], None] = _write_stderr) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.write = write
        self._since: Optional[float] = None  # NOTE: start of the interval; None while idle
        self._finished_tokens = 0  # output tokens of requests that finished in the interval
        self._counted_running = 0  # output tokens the running requests had at the interval's start
        self._verifies = 0
        self._committed = 0

    def _running_tokens(self) -> int:
        return sum(len(req.output_ids) for req in self.engine.scheduler.running)

    def _spec_counts(self) -> tuple[int, float]:
        """(verifies, tokens they committed) since start-up."""
        spec = self.engine.scheduler.stats().spec
        verifies = int(spec.get("spec_verify_ct", 0))  # type: ignore[call-overload]
        return verifies, float(spec.get("avg_spec_accept_length", 0.0)) * verifies  # type: ignore[arg-type]

    def _start(self, now: float) -> None:
        """A new interval from `now`: the counters as they stand."""
        self._since = now
        self._finished_tokens = 0
        self._counted_running = self._running_tokens()
        self._verifies, self._committed = self._spec_counts()

    def after_step(self, finished: Sequence[Req], now: float) -> None:
        if self._since is None:
            self._start(now)
            return
        self._finished_tokens += sum(len(req.output_ids) for req in finished)
        busy = self.engine.scheduler.has_work
        if busy and now - self._since < self.interval_s:
            return
        self.write(self.line(now))
        if busy:
            self._start(now)
        else:
            self._since = None

    def line(self, now: float) -> str:
        assert self._since is not None
        load = self.engine.load()
        generated = self._finished_tokens + self._running_tokens() - self._counted_running
        throughput = max(generated, 0) / max(now - self._since, 1e-9)
        verifies, committed = self._spec_counts()
        text = (f"blockspec: #running-req {load.num_running}, #queue-req {load.num_waiting}, "
                f"gen throughput (token/s) {throughput:.1f}")
        if verifies > self._verifies:
            text += f", accept len {(committed - self._committed) / (verifies - self._verifies):.2f}"
        used = 1 - load.kv_free_slots / load.kv_total_slots if load.kv_total_slots else 0.0
        return text + f", token usage {used:.2f}"
