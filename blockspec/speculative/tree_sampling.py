"""The target's token at every row of a verified draft tree, for a request that needs more than the argmax (sampling,
penalties, a grammar): each row's logits penalised and masked as of its path from the root, then the argmax or one
draw from the request's sampling distribution. The walk (tree_walk.py) follows these tokens, so every committed token
is the target's own choice given the tokens before it: greedy output equals target-only decoding with the same
penalties and grammar, and sampled output is distributed as the target's (rows are drawn independently and the walk
reads one row per depth).

NOTE: a row with nothing to choose from (sampling_faults.py) gets NO_TOKEN, which matches no child, so a walk that
reaches it stops there; only then does the request fail (TreeTokens.fault_at): a faulty row off the walk is never read,
as target-only decoding would never have reached it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from blockspec.layers.argmax import greedy_tokens
from blockspec.request import Req
from blockspec.sample.penalties import penalized_tree
from blockspec.sample.sampling import sampling_probs
from blockspec.sample.sampling_faults import choice_faults, distribution_faults

NO_TOKEN = -1


@dataclass(frozen=True)
class TreeTokens:
    """One request's chosen token per tree row [R] and why each row could not be chosen from (None where it could)."""

    tokens: torch.Tensor
    faults: list[Optional[str]]

    def fault_at(self, row: int) -> Optional[str]:
        return self.faults[row]


def needs_tree_tokens(req: Req) -> bool:
    """Whether the request's token at a tree row is more than the target's argmax."""
    return not req.params.is_greedy or req.params.has_penalties or req.grammar is not None


def tree_row_tokens(req: Req, logits: torch.Tensor, row_tokens: torch.Tensor, parents: torch.Tensor,
                    depths: torch.Tensor, ancestors: torch.Tensor) -> TreeTokens:
    """The request's token at each of its tree's rows from their target logits [R, V] (row 0 the root, whose token
    `row_tokens[0]` is the last committed one; `parents`, `depths` [R] and `ancestors` [R, R] as in DraftTree)."""
    if req.params.has_penalties:
        logits = penalized_tree(logits, req, row_tokens, ancestors, depths)
    if req.grammar is not None:
        logits = req.grammar.masked_tree(logits, row_tokens.tolist(), parents.tolist())
    if req.params.is_greedy:
        faults = choice_faults(logits)
        bad = [row for row, fault in enumerate(faults) if fault is not None]
        tokens = greedy_tokens(logits)
    else:
        probs = sampling_probs(logits, req.params)
        faults = distribution_faults(probs)
        bad = [row for row, fault in enumerate(faults) if fault is not None]
        if bad:  # NOTE: a placeholder torch.multinomial accepts; NO_TOKEN replaces the draw below
            probs[bad] = 1.0
        tokens = torch.multinomial(probs, 1, generator=req.generator).view(-1)
    if bad:
        tokens[bad] = NO_TOKEN
    return TreeTokens(tokens, faults)
