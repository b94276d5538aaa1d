"""Simulated acceptance for benchmarks (commits unverified tokens: output is not the model's).

`--speculative-simulate-accept-len X` accepts X - 1 proposals in every verify; `--speculative-simulate-accept-profile`
draws each row's accepted count from a per-position profile instead, so throughput against batch size is not
flattered by a constant:
- `geometric:M`: every proposal is accepted with probability (M - 1) / M given the ones before it (mean accept length
  M, bonus included, before truncation to the block);
- a JSON file: an accept-length histogram, `[count of verifies that committed c tokens for c = 0, 1, 2, ...]` or an
  object with that list under "spec_accept_length_histogram" (the layout of /server_info), measured with full blocks.
A verify of length n accepts min(drawn, n - 1): the full block's proposals are drawn first, as a real draft's are.
DDTree cycles draw from their own `--speculative-simulate-tree-accept-len` / `-profile` (tree_walk.simulated_tree_walk),
so adaptive verify weighs a stated tree acceptance against the chain's with measured cycle times.
"""
from __future__ import annotations

from typing import Optional

import torch

from blockspec.config.speculative_flags import accept_distribution


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
            return torch.full(
                (batch_size, 1), min(self.constant, num_draft_tokens - 1), dtype=torch.int64, device=device
            )
        uniform = torch.rand((batch_size, 1), generator=self.generator, device=self.cdf.device).to(device)
        drawn = (uniform > self.cdf[None, :]).sum(1, keepdim=True)
        return drawn.clamp(max=num_draft_tokens - 1)


def _cdf(distribution: list[float]) -> list[float]:
    """[B-1]: P(accepted <= a) for a < B-1 (the last, 1, is implied)."""
    cdf: list[float] = []
    for p in distribution:
        cdf.append((cdf[-1] if cdf else 0.0) + p)
    return cdf[:-1]
