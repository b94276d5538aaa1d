"""The prefix-cache benchmark's closed-loop clients spread over processes: one Python event loop that sends 32
bodies of 4k token ids and parses their streams adds tens of ms to every TTFT (≈ 40 ms p50 against a server that
answers at once, on a 2-core CPU), which is the client's time, not the server's."""
from __future__ import annotations

import asyncio
from typing import Any

from blockspec.bench.processes import run_in_processes
from prefix_cache_workloads import Result, closed_loop


def _closed_loop_results(base_url: str, prompts: list[list[int]], params: dict[str, Any], concurrency: int,
                         timeout: float) -> list[Result]:
    results, _ = asyncio.run(closed_loop(base_url, prompts, params, concurrency, timeout))
    return results


def closed_loop_procs(base_url: str, prompts: list[list[int]], params: dict[str, Any], concurrency: int,
                      timeout: float, procs: int) -> tuple[list[Result], float]:
    """`closed_loop` with process i taking prompts i::n and its share of the clients; results in prompt order, wall
    time from the first process's start to the last one's end."""
    n = max(1, min(procs, len(prompts), concurrency))
    if n == 1:
        return asyncio.run(closed_loop(base_url, prompts, params, concurrency, timeout))
    shares = [concurrency // n + (i < concurrency % n) for i in range(n)]
    per_process, wall = run_in_processes(
        _closed_loop_results, [(base_url, prompts[i::n], params, shares[i], timeout) for i in range(n)])
    return [per_process[j % n][j // n] for j in range(len(prompts))], wall  # NOTE: process i had prompts i::n
