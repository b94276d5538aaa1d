"""Simulated acceptance for benchmarks (commits unverified tokens: output is not the model's).

`--speculative-simulate-accept-len X` accepts X - 1 proposals in every verify; `--speculative-simulate-accept-profile`
draws each row's accepted count from a per-position profile instead, so throughput against batch size is not
flattered by a constant:
- `geometric:M`: every proposal is accepted with probability (M - 1) / M given the ones before it (mean accept length
  M, bonus included, before truncation to the block);
- a JSON file: an accept-length histogram, `[count of verifies that committed c tokens for c = 0, 1, 2, ...]` or an
  object with that list under "spec_accept_length_histogram" (the layout of /server_info), measured with full blocks.
A verify of length n accepts min(drawn, n - 1): the full block's proposals are drawn first, as a real draft's are.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch


def accept_distribution(profile: str, block_size: int) -> list[float]:
    """P(accepted = a) for a = 0..B-1 (accepted proposals of a full block) from a profile spec; ValueError if bad."""
    if profile.startswith("geometric:"):
        try:
            mean = float(profile.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"speculative_simulate_accept_profile: {profile!r} is not geometric:MEAN") from None
        if mean < 1:
            raise ValueError(f"speculative_simulate_accept_profile: geometric mean must be >= 1, got {mean}")
        rate = (mean - 1) / mean
        probs = [rate ** a * (1 - rate) for a in range(block_size - 1)]
        return probs + [rate ** (block_size - 1)]
    path = Path(profile)
    if not path.is_file():
        raise ValueError(f"speculative_simulate_accept_profile: {profile!r} is neither geometric:MEAN nor a JSON file")
    data = json.loads(path.read_text())
    histogram = data.get("spec_accept_length_histogram") if isinstance(data, dict) else data
    if not isinstance(histogram, list) or not all(isinstance(c, (int, float)) and c >= 0 for c in histogram):
        raise ValueError(f"speculative_simulate_accept_profile: {profile} holds no list of counts per accept length")
    counts = [float(c) for c in histogram[1:]]  # NOTE: index c = verifies that committed c tokens; 0 never happens
    if sum(counts) <= 0:
        raise ValueError(f"speculative_simulate_accept_profile: {profile} has no verifies")
    folded = counts[: block_size - 1] + [sum(counts[block_size - 1:])]  # longer accepts stop at the block's end
    folded += [0.0] * (block_size - len(folded))
    return [c / sum(folded) for c in folded]


class SimulatedAcceptance:
    """Accepted proposals per verify row, on the device and graph-capturable (one uniform draw per row)."""

    def __init__(self, constant_len: Optional[float], profile: Optional[str], block_size: int, device: torch.device,
                 seed: int = 0) -> None:
        if (constant_len is None) == (profile is None):
            raise ValueError("SimulatedAcceptance takes exactly one of a constant accept length and a profile")
        self.constant = None if constant_len is None else max(0, min(block_size - 1, round(constant_len) - 1))
        self.block_size = block_size
        self.distribution = accept_distribution(profile, block_size) if profile is not None else None
        self.cdf = torch.tensor(_cdf(self.distribution or []), dtype=torch.float32, device=device)
        # NOTE: CUDA graphs replay draws from the default CUDA generator; on the CPU a seeded one keeps runs repeatable.
        self.generator = torch.Generator().manual_seed(seed) if device.type == "cpu" else None

    def set_profile(self, profile: str) -> None:
        """Switches to another profile in place (benchmarks: no graph recapture). NOTE: captured graphs read `cdf`."""
        if self.distribution is None:
            raise ValueError("a constant simulated accept length cannot switch to a profile")
        self.distribution = accept_distribution(profile, self.block_size)
        self.cdf.copy_(torch.tensor(_cdf(self.distribution), dtype=torch.float32))

    @property
    def mean_accept_length(self) -> float:
        """Committed tokens per full-block verify, bonus included."""
        if self.distribution is None:
            return float(self.constant or 0) + 1.0
        return 1.0 + sum(a * p for a, p in enumerate(self.distribution))

    def accepted(self, batch_size: int, num_draft_tokens: int, device: torch.device) -> torch.Tensor:
        """[bs, 1] int64 accepted proposals for a verify of `num_draft_tokens` block tokens."""
        if self.constant is not None:
            return torch.full((batch_size, 1), min(self.constant, num_draft_tokens - 1), dtype=torch.int64, device=device)
        uniform = torch.rand((batch_size, 1), generator=self.generator, device=self.cdf.device).to(device)
        drawn = (uniform > self.cdf[None, :]).sum(1, keepdim=True)
        return drawn.clamp(max=num_draft_tokens - 1)


def _cdf(distribution: list[float]) -> list[float]:
    """[B-1]: P(accepted <= a) for a < B-1 (the last, 1, is implied)."""
    cdf: list[float] = []
    for p in distribution:
        cdf.append((cdf[-1] if cdf else 0.0) + p)
    return cdf[:-1]
