"""Benchmark clients spread over processes: one Python event loop cannot send and parse streams at engine speed,
and its own queueing would land in every TTFT it measures."""
from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from queue import Empty
from typing import Any, Callable, NamedTuple, Optional, Sequence


class ProcessRuns(NamedTuple):
    results: list[Any]  # in the order of the argument tuples
    wall_s: float  # first start to last end
    cpu_s: float  # the processes' own CPU time while running (user + system, summed), start-up left out


def _worker(index: int, run: Callable[..., Any], args: tuple[Any, ...], barrier: Any, queue: Any) -> None:
    barrier.wait()
    start, cpu = time.monotonic(), time.process_time()
    result = run(*args)
    queue.put((index, start, time.monotonic(), time.process_time() - cpu, result))


def run_in_processes(run: Callable[..., Any], args_per_process: Sequence[tuple[Any, ...]]) -> ProcessRuns:
    """`run(*args)` in one spawned process per entry of `args_per_process` (`run` and its arguments picklable), all
    started together behind a barrier; their results in the order of `args_per_process`, the wall time from the
    first start to the last end (time.monotonic is one clock for every process of a host) and the CPU time they
    spent in `run`. A process that dies is a RuntimeError."""
    ctx = multiprocessing.get_context("spawn")
    n = len(args_per_process)
    barrier, queue = ctx.Barrier(n + 1), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(i, run, args, barrier, queue), daemon=True)
               for i, args in enumerate(args_per_process)]
    for worker in workers:
        worker.start()
    barrier.wait(timeout=300)
    outs: dict[int, tuple[float, float, float, Any]] = {}
    while len(outs) < n:
        try:
            index, start, end, cpu, result = queue.get(timeout=1.0)
            outs[index] = (start, end, cpu, result)
        except Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                raise RuntimeError("a client process died") from None
    for worker in workers:
        worker.join()
    wall = max(out[1] for out in outs.values()) - min(out[0] for out in outs.values())
    return ProcessRuns([outs[i][3] for i in range(n)], wall, sum(out[2] for out in outs.values()))


def process_cpu_s(pid: int) -> Optional[float]:
    """User + system CPU seconds of process `pid` so far, exited threads included; None when it cannot be read
    (another host, gone, not Linux). A benchmark's view of a server it started: the HTTP and engine processes' busy
    shares."""
    try:
        # NOTE: Linux's CPU-time clock of another process: id (~pid << 3) | 2 (CPUCLOCK_SCHED), nanosecond-exact.
        # /proc/<pid>/stat counts whole clock ticks (10 ms), so a short level of a light process reads as 0.
        return time.clock_gettime((~pid << 3) | 2)
    except (OSError, OverflowError, AttributeError):
        pass
    fields = stat_fields(Path(f"/proc/{pid}/stat"))
    # NOTE: after the ")" that closes the command name, utime and stime are the 12th and 13th fields
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stat_fields(path: Path) -> Optional[list[str]]:
    """The fields of a /proc/<pid>/stat after the command name (None when it cannot be read)."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc (empty where there is none)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat)
        if fields is not None:
            parents[int(stat.parent.name)] = int(fields[1])  # NOTE: after ")": state, then ppid
    return parents


def http_server_pids(engine_pid: int) -> list[int]:
    """Every HTTP server process of a `blockspec serve` (--api-server-count N: all N): the engine process's parent
    (the first server process, which launched it) and that parent's other descendants, the engine's own excluded."""
    parents = parent_pids()
    main = parents.get(engine_pid)
    if main is None:
        return []
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, stack = [main], list(children.get(main, []))
    while stack:
        pid = stack.pop()
        if pid == engine_pid:
            continue
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found
