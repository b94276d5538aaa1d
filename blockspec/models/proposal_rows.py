"""One request's draft rows d_1..d_P as the host sees them when it proposes for a sampled or grammar-constrained
request: what each row may propose and the scores of those choices, given the choice made on the row before.

A DFlash draft's rows are independent full-vocabulary logits; a DFlash2 draft's row j chooses among its selector
candidates with scores that depend on row j-1's choice. The speculative worker walks either the same way
(speculative/host_proposals.py)."""
from __future__ import annotations

from typing import Optional, Protocol

import torch


class ProposalRows(Protocol):
    @property
    def length(self) -> int:
        """P, the number of draft rows."""
        ...

    @property
    def vocab_width(self) -> int:
        """The width of a dense distribution over the rows' tokens (the lm_head's output rows)."""
        ...

    def choices(self, row: int, previous: int | torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(token ids [k], or None for the whole vocabulary (score i is token i's); scores [k] float32) of `row`,
        `previous` the index row-1's proposal had among row-1's choices (0 for row 0; a 0-d device tensor keeps a
        sampled walk on the device)."""
        ...

    def independent_scores(self) -> Optional[torch.Tensor]:
        """[P, V] scores of every row over the whole vocabulary when no row depends on the choice before it, else
        None."""
        ...


class VocabularyRows:
    """A DFlash draft's rows: the draft logits [P, V], each row on its own."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    @property
    def length(self) -> int:
        return int(self.logits.shape[0])

    @property
    def vocab_width(self) -> int:
        return int(self.logits.shape[-1])

    def choices(self, row: int, previous: int | torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        return None, self.logits[row]

    def independent_scores(self) -> Optional[torch.Tensor]:
        return self.logits


class CandidateRows:
    """A DFlash2 draft's rows: candidate ids [P, k], unary scores [P, k] and the selector's transition scores
    [P, k, k] (models/candidate_selector.py)."""

    def __init__(self, unary: torch.Tensor, ids: torch.Tensor, transitions: torch.Tensor, vocab_width: int) -> None:
        self.unary, self.ids, self.transitions = unary, ids, transitions
        self._vocab_width = vocab_width

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    @property
    def vocab_width(self) -> int:
        return self._vocab_width

    def choices(self, row: int, previous: int | torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        return self.ids[row], self.unary[row] + self.transitions[row, previous]

    def independent_scores(self) -> Optional[torch.Tensor]:
        return None
