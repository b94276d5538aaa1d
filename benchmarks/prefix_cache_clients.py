"""The prefix-cache benchmark's clients: a workload's turns, each by closed-loop clients spread over processes. One
Python event loop that sends 32 bodies of 4k token ids and parses their streams adds tens of ms to every TTFT
(≈ 40 ms p50 against a server that answers at once, on a 2-core CPU), which is the client's time, not the server's."""
from __future__ import annotations

import asyncio
from typing import Any

from blockspec.bench.processes import run_in_processes
from blockspec.bench.report import percentile
from prefix_cache_workloads import Result, Workload, closed_loop


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
    per_process, wall, _ = run_in_processes(
        _closed_loop_results, [(base_url, prompts[i::n], params, shares[i], timeout) for i in range(n)])
    return [per_process[j % n][j // n] for j in range(len(prompts))], wall  # NOTE: process i had prompts i::n


def run_workload(base_url: str, workload: Workload, params: dict[str, Any], eos_id: int, timeout: float,
                 procs: int = 1) -> dict[str, Any]:
    """Warm-up requests (untimed), then every turn in order: tok/s over the turns' wall time, TTFT percentiles. The
    clients of a turn are spread over `procs` processes."""
    if workload.warmup:
        asyncio.run(closed_loop(base_url, workload.warmup, dict(params, max_new_tokens=4), len(workload.warmup), timeout))
    prompts, results, duration = workload.prompts, [], 0.0
    for turn in range(1 + len(workload.follow_ups)):
        turn_results, seconds = closed_loop_procs(base_url, prompts, params, workload.concurrency, timeout, procs)
        results += turn_results
        duration += seconds
        if turn < len(workload.follow_ups):
            prompts = [prompt + reply.output_ids + ([] if reply.output_ids[-1:] == [eos_id] else [eos_id]) + follow
                       for prompt, reply, follow in zip(prompts, turn_results, workload.follow_ups[turn])]
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    output_tokens = sum(len(r.output_ids) for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok), "output_tokens": output_tokens,
        "duration_s": duration, "tok_s": output_tokens / max(duration, 1e-9),
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "e2e_p50_ms": percentile([r.latency for r in ok], 50) * 1e3,
        "first_error": next((r.error for r in results if not r.ok), ""),
        "prompt_tokens": sum(len(p) for p in workload.prompts),
    }
