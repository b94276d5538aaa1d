"""A verify-length policy for tests: cycles through a fixed sequence of lengths, one per cycle, at any batch size; and
SEQUENCE, the lengths the changing-verify-length tests cycle through."""
from __future__ import annotations

from typing import Any, Sequence

from blockspec.speculative.verify_length import AcceptanceStats, VerifyChoice

# NOTE: 1 twice in a row (the draft KV of plain decode steps must carry speculation on), every length, back to B.
SEQUENCE = [1, 3, 8, 2, 1, 1, 5, 8, 8, 4, 1, 7, 6, 8, 1]


class CyclingVerifyLength:
    def __init__(self, sequence: Sequence[int]) -> None:
        self.sequence = list(sequence)
        self.lengths = tuple(sorted(set(sequence)))
        self.used: list[int] = []
        self.last: dict[int, VerifyChoice] = {}

    def choose(self, batch_size: int, stats: AcceptanceStats) -> VerifyChoice:
        n = self.sequence[len(self.used) % len(self.sequence)]
        self.used.append(n)
        self.last[batch_size] = VerifyChoice(n, "test: cycling")
        return self.last[batch_size]

    def observe_cycle(self, batch_size: int, num_draft_tokens: int, ms: float) -> None:
        """Cycle times are not used."""

    def describe(self, stats: AcceptanceStats) -> dict[str, Any]:
        return {"mode": "test"}
