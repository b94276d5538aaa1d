"""A draft's logit scaling (DFlash config fields `output_multiplier` and `final_logit_softcapping`, which Gemma drafts
use): logits = softcap · tanh(multiplier · raw / softcap) from the lm_head's raw outputs, in fp32. Both maps are
monotonic, so a row's order (its argmax and top-k) is the raw one's; its log-probabilities are not."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class LogitScale:
    multiplier: float = 1.0
    softcap: Optional[float] = None  # NOTE: None or 0: no softcap

    @property
    def is_identity(self) -> bool:
        return self.multiplier == 1.0 and not self.softcap

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """float32 logits from raw lm_head outputs (no multiply launched for a multiplier of 1)."""
        logits = raw.float()
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits


UNSCALED = LogitScale()
