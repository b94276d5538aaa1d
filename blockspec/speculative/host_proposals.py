"""Proposals of a sampled or grammar-constrained request, walked over its draft rows (models/proposal_rows.py), with
the draft distributions the proposals were drawn from.

Row j offers choices (the whole vocabulary for DFlash, the selector's candidates after row j-1's choice for DFlash2);
a grammar masks them to what it allows after d_1..d_{j-1} (sample/grammar.py; when it allows none of a row's
candidates the row stays unmasked: the proposal only costs acceptance, the target's masked verify keeps the output
right). Greedy requests take the best choice; sampled ones draw with their own generator from q_j: the request's
sampling distribution over the vocabulary, or over the candidates the softmax of their scores at the request's
temperature (as the DFlash2 reference draws). Rejection sampling reads that same q_j, dense over the vocabulary."""
from __future__ import annotations

from typing import Optional

import torch

from blockspec.models.proposal_rows import ProposalRows
from blockspec.request import Req, SamplingParams
from blockspec.sample.sampling import sampling_probs
from blockspec.sample.sampling_faults import distribution_faults, draw, pick, raise_first


def host_proposals(rows: ProposalRows, req: Req) -> tuple[list[int], Optional[torch.Tensor]]:
    """d_1..d_P for `req` and, when it samples, q [P, V] (row j: the distribution d_j was drawn from). SamplingFault
    (sample/sampling_faults.py) when a row the request's own parameters shape has nothing to choose from.

    NOTE: the unconstrained sampled chain over DFlash2 candidates is not checked row by row (that would read the
    device at every row): its q is a softmax of finite candidate scores at a temperature the door keeps in range."""
    params, generator, grammar = req.params, req.generator, req.grammar
    if grammar is None and not params.is_greedy:
        independent = rows.independent_scores()
        if independent is not None:
            # NOTE: every row at once, one draw per row from the request's generator (no row depends on another's)
            probs = sampling_probs(independent, params)
            raise_first(distribution_faults(probs))
            return torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist(), probs
        return _sampled_chain(rows, params, generator)
    drawn_from: list[torch.Tensor] = []
    previous = 0

    def choose(row: int, allowed: Optional[torch.Tensor]) -> int:
        nonlocal previous
        ids, scores = rows.choices(row, previous)
        if allowed is not None:
            permitted = allowed.to(scores.device)
            permitted = permitted if ids is None else permitted[ids]
            if bool(permitted.any()):
                scores = scores.float().masked_fill(~permitted, float("-inf"))
        if params.is_greedy:
            previous = pick(scores)
        else:
            q = _choice_probs(ids, scores, params)
            previous = draw(q, generator)
            drawn_from.append(_dense(q, ids, rows.vocab_width))
        return previous if ids is None else int(ids[previous])

    if grammar is not None:
        tokens = grammar.walk(rows.length, choose, rows.vocab_width)
    else:
        tokens = [choose(row, None) for row in range(rows.length)]
    return tokens, torch.stack(drawn_from) if drawn_from else None


def _sampled_chain(
    rows: ProposalRows, params: SamplingParams, generator: Optional[torch.Generator]
) -> tuple[list[int], torch.Tensor]:
    """An unconstrained sampled walk over rows that depend on the choice before them, kept on the device: each draw
    indexes the next row's scores without a host read (one read of all the tokens at the end)."""
    previous: int | torch.Tensor = 0
    picked: list[torch.Tensor] = []
    drawn_from: list[torch.Tensor] = []
    for row in range(rows.length):
        ids, scores = rows.choices(row, previous)
        q = _choice_probs(ids, scores, params)
        index = torch.multinomial(q, 1, generator=generator)[0]
        picked.append(index if ids is None else ids[index])
        drawn_from.append(_dense(q, ids, rows.vocab_width))
        previous = index
    return [int(t) for t in torch.stack(picked).tolist()], torch.stack(drawn_from)


def _choice_probs(ids: Optional[torch.Tensor], scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The request's sampling distribution over the whole vocabulary; over candidates, their softmax at its
    temperature."""
    if ids is None:
        return sampling_probs(scores, params)
    return torch.softmax(scores.float() / params.temperature, dim=-1)


def _dense(q: torch.Tensor, ids: Optional[torch.Tensor], vocab_width: int) -> torch.Tensor:
    return q if ids is None else torch.zeros(vocab_width, device=q.device).scatter(0, ids, q)
