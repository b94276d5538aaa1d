"""Speculative decoding statistics of a scheduler: verifies, committed tokens, and the accept-length histogram."""
from __future__ import annotations


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
