"""Penalties and biases on the target's logits (SGLang / OpenAI semantics), applied before temperature and top-k/p.

- frequency_penalty f, presence_penalty p: logit[t] -= f * count(t) + p * (count(t) > 0), counts over the output.
- repetition_penalty r: every token of the prompt or output: logit / r if positive, logit * r if not (HF's rule).
- min_new_tokens m: EOS and stop_token_ids are impossible until the output holds m tokens.
- logit_bias {token id: b}: logit[t] += b.
Under DFlash a verify block's row j is the distribution of the block's token j+1, so its counts include the block's
proposals d_1..d_j: the result equals target-only decoding with the same penalties. Under DDTree a tree row is the
distribution after the tokens of its path from the root, so its counts include those tokens and min_new_tokens reads
its depth.
"""
from __future__ import annotations

from typing import Sequence

import torch

from blockspec.request import Req


def penalized(logits: torch.Tensor, req: Req, drafted: Sequence[int] = ()) -> torch.Tensor:
    """Penalised float32 copy of `logits` [k, V]: row j with the output as of `req.output_ids + drafted[:j]`."""
    rows, vocab = logits.shape
    device = logits.device
    drafted_counts = torch.zeros((rows, vocab), dtype=torch.float32, device=device)
    if drafted:
        extra = torch.nn.functional.one_hot(torch.tensor(list(drafted[:rows - 1]), device=device), vocab).float()
        drafted_counts[1:1 + extra.shape[0]] = extra.cumsum(0)
    return _penalized(logits, req, drafted_counts, torch.arange(rows, device=device))


def penalized_tree(logits: torch.Tensor, req: Req, row_tokens: torch.Tensor, ancestors: torch.Tensor,
                   depths: torch.Tensor) -> torch.Tensor:
    """Penalised float32 copy of a draft tree's rows `logits` [R, V] (row 0 the root, the last committed token): row r
    with the output as of `req.output_ids` + the tokens of r's path below the root (`row_tokens` [R], `ancestors`
    [R, R] bool: [r, s] when row s is r or one of its ancestors; `depths` [R]: that path's length)."""
    vocab = logits.shape[1]
    below_root = torch.nn.functional.one_hot(row_tokens[1:], vocab).float()  # [R - 1, V]
    drafted_counts = ancestors[:, 1:].float() @ below_root
    return _penalized(logits, req, drafted_counts, depths)


def _penalized(logits: torch.Tensor, req: Req, drafted_counts: torch.Tensor, drafted_lengths: torch.Tensor
               ) -> torch.Tensor:
    """`logits` [k, V] penalised per row with the output counts plus `drafted_counts` [k, V], row j standing
    `drafted_lengths[j]` tokens past the committed output (min_new_tokens)."""
    params = req.params
    rows, vocab = logits.shape
    out = logits.float().clone()
    device = out.device
    output = torch.tensor(req.output_ids, dtype=torch.int64, device=device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(torch.float32) + drafted_counts
    if params.frequency_penalty or params.presence_penalty:
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = torch.tensor(req.all_ids[:req.prompt_len], dtype=torch.int64, device=device)
        seen[:, prompt] = True
        scaled = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        out = torch.where(seen, scaled, out)
    if params.logit_bias:
        ids = torch.tensor([int(t) for t in params.logit_bias], device=device)
        out[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
    if params.min_new_tokens and req.min_tokens_blocked_ids:
        lengths = req.num_output_tokens + drafted_lengths
        blocked = torch.tensor(sorted(req.min_tokens_blocked_ids), device=device)
        early = (lengths < params.min_new_tokens)[:, None]
        out[:, blocked] = torch.where(early, torch.full_like(out[:, blocked], float("-inf")), out[:, blocked])
    return out


def penalize_rows(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """`logits` [n, V] with row i penalised for reqs[i] where it asks for penalties (a copy only then)."""
    if not any(req.params.has_penalties for req in reqs):
        return logits
    out = logits.float().clone()
    for i, req in enumerate(reqs):
        if req.params.has_penalties:
            out[i] = penalized(logits[i:i + 1], req)[0]
    return out
