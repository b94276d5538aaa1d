"""Start-up timing of DFlash cycles per (batch size, verify length): the cost model's first cycle times."""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

logger = logging.getLogger(__name__)


def measure_cycle_times(
    run_cycle: Callable[[int, int], None], batch_sizes: Sequence[int], lengths: Sequence[int], repeat: int = 5,
    warmup: int = 2,
) -> dict[tuple[int, int], float]:
    """Median ms of `run_cycle(batch_size, verify_length)` (which waits for its own result) for every pair.

    NOTE: run on padding rows, whose context is the few dummy-page slots: the live cycles of a served batch refine
    these figures with its real context (verify_length.CycleTimes.observe)."""
    start = time.perf_counter()
    times: dict[tuple[int, int], float] = {}
    for bs in batch_sizes:
        for n in lengths:
            for _ in range(warmup):
                run_cycle(bs, n)
            samples = []
            for _ in range(repeat):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                began = time.perf_counter()
                run_cycle(bs, n)
                samples.append((time.perf_counter() - began) * 1e3)
            times[(bs, n)] = sorted(samples)[len(samples) // 2]
    logger.info("timed DFlash cycles for bs %s x verify lengths %s in %.1f s", list(batch_sizes), list(lengths),
                time.perf_counter() - start)
    return times
