"""What a scheduler counts: its steps (SchedulerStats, read through `Scheduler.stats()`) and, under speculative
decoding, its verifies, committed tokens and accept-length histogram (SpecStatistics)."""
from __future__ import annotations

from dataclasses import dataclass


class SpecStatistics:
    def __init__(self, max_committed: int) -> None:
        self.verify_ct = 0  # (request, verify forward) pairs
        self.committed_tokens = 0  # tokens committed by those verifies, bonus included
        self.accept_histogram = [0] * (max_committed + 1)  # verifies by tokens committed

    def record(self, committed: int) -> None:
        self.verify_ct += 1
        self.committed_tokens += committed
        self.accept_histogram[committed] += 1

    def as_dict(self) -> dict[str, object]:
        avg = self.committed_tokens / self.verify_ct if self.verify_ct else 0.0
        return {"avg_spec_accept_length": avg, "spec_verify_ct": self.verify_ct,
                "spec_accept_length_histogram": list(self.accept_histogram)}


@dataclass(frozen=True)
class SchedulerStats:
    """A scheduler's counters since start (the engine's server info reads them)."""

    num_running: int
    num_waiting: int
    num_retractions: int
    num_steps: int
    num_extend_steps: int  # steps that ran prefill chunks (with or without decode in the same forward)
    step_seconds: float  # wall time of all steps (host work and device waits)
    extend_step_seconds: float  # of those, the extend steps'
    num_mixed_steps: int  # --enable-mixed-chunk: steps whose one forward ran chunks and decodes together
    num_steps_arrivals_held: int  # --max-prefill-wait-steps: decode steps that ran while arrivals were held
    spec: dict[str, object]  # SpecStatistics.as_dict() (meaningful under speculative decoding)
    accept_histogram: list[int]  # verifies by tokens committed
