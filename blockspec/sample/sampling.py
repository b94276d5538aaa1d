"""Token sampling: greedy, temperature, top-k, top-p, min-p with per-request seeded generators."""
from __future__ import annotations

import random
from typing import Sequence

import torch

from blockspec.layers.argmax import greedy_tokens
from blockspec.request import Req, SamplingParams
from blockspec.sample.grammar import constrain_rows
from blockspec.sample.penalties import penalize_rows
from blockspec.sample.sampling_faults import choice_faults, distribution_faults, fail_request

_FLOAT32_MAX = torch.finfo(torch.float32).max


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) restricted by top-k, top-p, min-p.

    logits: [..., V] float32. Greedy params give a one-hot on the argmax.
    """
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    rows = logits.reshape(-1, logits.shape[-1])
    return sampling_probs_rows(rows, [params] * rows.shape[0]).view(logits.shape)


def sampling_probs_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`sampling_probs(logits[i], params[i])` for every row of `logits` [n, V] at once (no greedy params): one pass
    over the batch, with each row's temperature, top-k, top-p and min-p as columns where the rows differ."""
    n, vocab = logits.shape
    if n == 0:
        return logits.float()
    device = logits.device
    # NOTE: a temperature beyond float32's range would become inf, and a masked logit (-inf) / inf is NaN; at the
    # largest finite float32 every allowed token is as likely, the limit the huge temperature means
    temperatures = [min(p.temperature, _FLOAT32_MAX) for p in params]
    probs = torch.softmax(logits.float() / _per_row(temperatures, device), dim=-1)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        largest = torch.topk(probs, max(top_k), dim=-1).values
        if min(top_k) == max(top_k):
            kth = largest[..., -1:]
        else:  # NOTE: each row's k-th largest value; a row without top-k keeps every token (threshold 0)
            picked = torch.tensor([max(k, 1) - 1 for k in top_k], device=device)[:, None]
            kth = torch.where(
                _column(top_k, device) > 0, largest.gather(-1, picked), torch.zeros((n, 1), device=device)
            )
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        total = cumulative[..., -1:]
        row_top_p = _per_row(top_p, device)
        # NOTE: a token is kept when the mass strictly before it is below top_p (the top token always stays)
        keep_sorted = (cumulative - sorted_probs) < row_top_p * total
        # NOTE: also when top_p * total rounds to 0 in float32 (top_p 1e-300): else the row keeps no token at all
        keep_sorted[..., 0] = True
        if isinstance(row_top_p, torch.Tensor):
            keep_sorted |= row_top_p >= 1.0  # a row with top_p 1 keeps every token
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    min_p = [p.min_p for p in params]
    if max(min_p) > 0.0:
        threshold = _per_row(min_p, device) * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _per_row(values: Sequence[float], device: torch.device) -> float | torch.Tensor:
    """One value for every row: a Python number when the rows agree (no host→device copy: `sampling_probs` runs per
    row in DFlash's sampled cycle), else a column."""
    first = values[0]
    return float(first) if all(v == first for v in values) else _column(values, device)


def sample_next_tokens(logits: torch.Tensor, reqs: Sequence[Req]) -> list[int]:
    """One token per row of `logits` [n, V], row i sampled for reqs[i] (penalised, then masked by its grammar).
    A request whose row has nothing to sample from is failed on its own (sampling_faults.py); its entry is then a
    placeholder (the row's argmax, a valid id) that the commit drops, as it drops a finished request's tokens.
    NOTE: the sampled rows' distributions come from one batched pass and their draws are read back together: a
    row at a time with a host sync per draw took ≈ 115 ms a step at 256 rows on an H200 (generation_rate.py)."""
    logits = constrain_rows(penalize_rows(logits, reqs), [req.grammar for req in reqs])
    tokens = [int(t) for t in greedy_tokens(logits).tolist()]
    # NOTE: only greedy rows a request's penalties or grammar changed can lose their argmax; the model's own rows
    # (every row of a plain greedy batch, the hot path) are not checked
    altered = [i for i, req in enumerate(reqs)
               if req.params.is_greedy and (req.params.has_penalties or req.grammar is not None)]
    if altered:
        for i, fault in zip(altered, choice_faults(logits[altered])):
            if fault is not None:
                fail_request(reqs[i], fault)
    sampled = [i for i, req in enumerate(reqs) if not req.params.is_greedy]
    if not sampled:
        return tokens
    probs = sampling_probs_rows(logits[sampled], [reqs[i].params for i in sampled])
    draws = {}
    for row, (i, fault) in enumerate(zip(sampled, distribution_faults(probs))):
        if fault is not None:
            fail_request(reqs[i], fault)
            continue
        assert reqs[i].generator is not None
        # NOTE: each request's own generator, row by row, so its draws do not depend on the other rows' requests
        # (the batched reductions above may round a row's last bit differently from the row alone at a large
        # vocabulary; a flipped draw needs a probability boundary within that bit)
        draws[i] = torch.multinomial(probs[row], 1, generator=reqs[i].generator)
    if draws:
        for i, token in zip(draws, torch.cat(list(draws.values())).tolist()):
            tokens[i] = int(token)
    return tokens


def append_logprobs(req: Req, logits: torch.Tensor, tokens: Sequence[int]) -> None:
    """Records the target's log-probabilities of `tokens` for `req`: row i of `logits` [len(tokens), V] is the
    distribution token i was chosen from. The raw model distribution (log_softmax of the logits, before temperature,
    top-k/top-p), as SGLang and vLLM report by default; with the request's top_logprobs_num most likely tokens."""
    assert req.top_logprobs_num is not None and logits.shape[0] == len(tokens)
    # NOTE: one fresh row at a time, as target-only decoding computes them: a row's log-probs then depend neither on
    # how many (verify) rows came with it nor on where it sat in memory (torch may pick its kernel by alignment).
    logprobs = torch.cat([torch.log_softmax(logits[i:i + 1].float().clone(), dim=-1) for i in range(len(tokens))])
    chosen = logprobs.gather(1, torch.tensor(list(tokens), device=logits.device)[:, None])[:, 0].tolist()
    req.output_token_logprobs.extend(chosen)
    top_n = min(req.top_logprobs_num, logits.shape[-1])
    if top_n == 0:
        req.output_top_logprobs.extend([] for _ in tokens)
        return
    values, ids = logprobs.topk(top_n, dim=-1)
    req.output_top_logprobs.extend(
        list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())
    )
