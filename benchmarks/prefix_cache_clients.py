"""The prefix-cache benchmark's closed-loop clients spread over processes: one Python event loop that sends 32
bodies of 4k token ids and parses their streams adds tens of ms to every TTFT (≈ 40 ms p50 against a server that
answers at once, on a 2-core CPU), which is the client's time, not the server's."""
from __future__ import annotations

import asyncio
import multiprocessing
import time
from queue import Empty
from typing import Any

from prefix_cache_workloads import Result, closed_loop


def _client_process(index: int, base_url: str, prompts: list[list[int]], params: dict[str, Any], concurrency: int,
                    timeout: float, barrier: Any, queue: Any) -> None:
    barrier.wait()
    start = time.monotonic()
    results, _ = asyncio.run(closed_loop(base_url, prompts, params, concurrency, timeout))
    queue.put((index, start, time.monotonic(), results))


def closed_loop_procs(base_url: str, prompts: list[list[int]], params: dict[str, Any], concurrency: int,
                      timeout: float, procs: int) -> tuple[list[Result], float]:
    """`closed_loop` with process i taking prompts i::n and its share of the clients; results in prompt order, wall
    time from the first process's start to the last one's end (time.monotonic is one clock for all processes)."""
    n = max(1, min(procs, len(prompts), concurrency))
    if n == 1:
        return asyncio.run(closed_loop(base_url, prompts, params, concurrency, timeout))
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(n + 1), ctx.Queue()
    shares = [concurrency // n + (i < concurrency % n) for i in range(n)]
    workers = [ctx.Process(target=_client_process, daemon=True,
                           args=(i, base_url, prompts[i::n], params, shares[i], timeout, barrier, queue))
               for i in range(n)]
    for worker in workers:
        worker.start()
    barrier.wait(timeout=300)
    outs: dict[int, tuple[float, float, list[Result]]] = {}
    while len(outs) < n:
        try:
            index, start, end, results = queue.get(timeout=1.0)
            outs[index] = (start, end, results)
        except Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                raise RuntimeError("a client process died") from None
    for worker in workers:
        worker.join()
    ordered: list[Result] = [outs[0][2][0]] * len(prompts)
    for i, (_, _, results) in outs.items():
        ordered[i::n] = results
    return ordered, max(o[1] for o in outs.values()) - min(o[0] for o in outs.values())
