"""The engine's output contract besides generated tokens: one snapshot of its state (EngineSnapshot), read by
`Engine.get_server_info` and by the engine process's statistics (engine/core.py), so neither reaches into the
runner, the worker or the scheduler."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from blockspec.scheduler.stats import SchedulerStats
from blockspec.worker.protocol import SpeculativeState


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now: requests and KV slots (cheap: the engine process reads it every step)."""

    num_running: int
    num_waiting: int
    kv_total_slots: int
    kv_free_slots: int  # NOTE: counts the slots of cached pages no request reads (they are evicted on demand)
    kv_unused_slots: int  # slots on the free list (cached pages not counted)


@dataclass(frozen=True)
class EngineSnapshot:
    """Everything /server_info and the engine process's detailed statistics report about a running engine."""

    load: EngineLoad
    scheduler: SchedulerStats
    forward_counts: dict[str, int]  # forwards by how they ran (full graph, eager, piecewise, piecewise fallback)
    cuda_graph: bool  # full graphs captured and on
    radix_cache: dict[str, Any]  # hit rate, token counts, evictions since start (PrefixCache.stats)
    kernel_compiles_after_startup: Optional[int]  # None where Triton compiles cannot be counted
    kernel_compiles_after_startup_by_kernel: dict[str, int]
    speculative: Optional[SpeculativeState]  # None without speculative decoding
