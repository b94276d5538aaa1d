"""Start-up timing of DFlash cycles per (batch size, verify length): the cost model's first cycle times."""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

logger = logging.getLogger(__name__)


def measure_cycle_times(
    run_cycle: Callable[[int, int], None], batch_sizes: Sequence[int], lengths: Sequence[int], repeat: int = 9,
    warmup: int = 2,
) -> dict[tuple[int, int], float]:
    """Median ms of `run_cycle(batch_size, verify_length)` (which waits for its own result) for every pair.

    NOTE: the policy compares lengths of one batch size whose cycles differ by a few percent, so the samples are
    taken in rounds over every pair (a drift of clocks or power during the measurement shifts every length alike)
    and timed on the device with CUDA events where there is one (no host wake-up jitter).
    NOTE: run on padding rows, whose context is the few dummy-page slots: the live cycles of a served batch refine
    these figures with its real context (verify_length.CycleTimes.observe)."""
    start = time.perf_counter()
    pairs = [(bs, n) for bs in batch_sizes for n in lengths]
    samples: dict[tuple[int, int], list[float]] = {pair: [] for pair in pairs}
    for round_index in range(warmup + repeat):
        for pair in pairs:
            ms = _time_one(run_cycle, *pair)
            if round_index >= warmup:
                samples[pair].append(ms)
    times = {pair: sorted(values)[len(values) // 2] for pair, values in samples.items()}
    logger.info("timed DFlash cycles for bs %s x verify lengths %s in %.1f s", list(batch_sizes), list(lengths),
                time.perf_counter() - start)
    return times


def _time_one(run_cycle: Callable[[int, int], None], batch_size: int, length: int) -> float:
    if not torch.cuda.is_available():
        began = time.perf_counter()
        run_cycle(batch_size, length)
        return (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    began_event, ended_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began_event.record()
    run_cycle(batch_size, length)
    ended_event.record()
    ended_event.synchronize()
    return float(began_event.elapsed_time(ended_event))
