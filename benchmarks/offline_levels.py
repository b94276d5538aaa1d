"""The offline engine's side of a closed-loop level (serving_vs_engine.py): the same prompts, no HTTP.

- `closed_loop_tok_s`: what the server's clients do, minus the server: `concurrency` requests in flight, and the next
  prompt queued in the step its predecessor finishes (a client sends its next request once its last one is answered).
  The rows' `engine_tok_s` for a closed-loop level.
- `waves_tok_s`: the level's prompts in waves of `concurrency` (each wave a `generate` call that waits for its last
  request). Before 2026-12-03 this was the rows' comparison; kept as `engine_waves_tok_s`. With real acceptance a
  wave's last requests decode at a shrinking batch, so it understates DFlash (the demo pair at 64 clients: server ÷
  waves 1.29).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

Sync = Callable[[], None]


def closed_loop_tok_s(engine: Any, prompts: list[list[int]], concurrency: int, params: dict[str, Any], sync: Sync) -> float:
    """Output tokens per second with `concurrency` requests kept in flight over `prompts` (greedy, fixed lengths)."""
    reqs, _ = engine.make_requests(input_ids=prompts, sampling_params=params)
    queued, in_flight, tokens = deque(reqs), set(), 0
    start = time.perf_counter()
    while queued or in_flight:
        while queued and len(in_flight) < concurrency:
            req = queued.popleft()
            engine.scheduler.add_request(req)
            in_flight.add(req.rid)
        for req in engine.scheduler.step():
            if req.rid in in_flight:
                in_flight.discard(req.rid)
                tokens += len(req.output_ids)
    sync()
    return tokens / (time.perf_counter() - start)


def waves_tok_s(engine: Any, prompts: list[list[int]], concurrency: int, params: dict[str, Any], sync: Sync) -> float:
    """Output tokens per second over `prompts` in waves of `concurrency`, each run to its end before the next."""
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(prompts), concurrency):
        wave = engine.generate(input_ids=prompts[first:first + concurrency], sampling_params=params)
        assert isinstance(wave, list)
        tokens += sum(len(out["output_ids"]) for out in wave)
    sync()
    return tokens / (time.perf_counter() - start)
