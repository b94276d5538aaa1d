"""Committing a step's tokens to a request: appended up to the first finish condition (grammar, stop string,
max_new_tokens, stop token, context length, checked in that order after each token)."""
from __future__ import annotations

import time
from typing import AbstractSet, Optional

from blockspec.request import Finish, FinishReason, Req
from blockspec.tokenizer import TextStream, find_stop


def commit_tokens(req: Req, tokens: list[int], eos_token_ids: AbstractSet[int], context_length: int,
                  detok: Optional[TextStream]) -> int:
    """A step's tokens for `req`: appended up to the first finish condition (none once finished); the first one
    stamps the request's first-token time; logprobs past the kept tokens are dropped. Returns how many were kept."""
    if req.finished:
        return 0
    if req.first_token_time is None and tokens:
        req.first_token_time = time.monotonic()
    appended = append_tokens(req, tokens, eos_token_ids, context_length, detok)
    if req.wants_logprobs:
        del req.output_token_logprobs[req.num_output_tokens:]
        del req.output_top_logprobs[req.num_output_tokens:]
    return appended


def append_tokens(req: Req, tokens: list[int], eos_token_ids: AbstractSet[int], context_length: int,
                  detok: Optional[TextStream]) -> int:
    """Appends `tokens` to an unfinished request up to its first finish condition (setting `req.finish`); returns
    how many were appended. `detok`: the request's text stream, if the scheduler makes its text."""
    if req.grammar is None and detok is None:
        return _append_plain(req, tokens, eos_token_ids, context_length)
    appended = 0
    for token in tokens:
        req.all_ids.append(token)
        appended += 1
        req.finish = _grammar_finish(req, token) or _check_finish(req, token, eos_token_ids, context_length, detok)
        if req.finish is None and req.grammar is not None and req.grammar.terminated:
            req.finish = Finish(FinishReason.STOP, matched=token)
        if req.finish is not None:
            break
    return appended


def _append_plain(req: Req, tokens: list[int], eos_token_ids: AbstractSet[int], context_length: int) -> int:
    """The token-by-token checks of `_check_finish` without a text stream, from counts and one scan for stop tokens:
    the tokens up to the first finish are appended at once (the same finish as the per-token loop)."""
    params = req.params
    length_at = max(1, params.max_new_tokens - req.num_output_tokens)  # NOTE: in appended tokens, like context_at
    context_at = max(1, context_length - len(req.all_ids))
    stop_at = len(tokens) + 1
    eos: AbstractSet[int] = frozenset() if params.ignore_eos else eos_token_ids
    stop_ids = params.stop_token_ids
    if eos or stop_ids:
        for i, token in enumerate(tokens):
            if token in eos or token in stop_ids:
                stop_at = i + 1
                break
    appended = min(len(tokens), length_at, stop_at, context_at)
    req.all_ids.extend(tokens[:appended] if appended < len(tokens) else tokens)
    if appended == length_at:
        req.finish = Finish(FinishReason.LENGTH, length=req.num_output_tokens)
    elif appended == stop_at:
        req.finish = Finish(FinishReason.STOP, matched=tokens[appended - 1])
    elif appended == context_at:
        req.finish = Finish(FinishReason.LENGTH, length=req.num_output_tokens)
    return appended


def _grammar_finish(req: Req, token: int) -> Optional[Finish]:
    """Advances a constrained request's matcher; an abort if its grammar refuses the token (NOTE: never expected)."""
    if req.grammar is None or req.grammar.accept(token):
        return None
    return Finish(FinishReason.ABORT, message=f"token {token} does not match the request's {req.grammar.spec.kind}")


def _check_finish(req: Req, token: int, eos_token_ids: AbstractSet[int], context_length: int,
                  detok: Optional[TextStream]) -> Optional[Finish]:
    params = req.params
    if detok is not None:
        before = len(req.text)
        req.text += detok.push([token])
        if params.stop:
            hit = find_stop(req.text, params.stop, before)
            if hit is not None:
                req.text = req.text[:hit[0]]
                return Finish(FinishReason.STOP, matched=hit[1])
    if req.num_output_tokens >= params.max_new_tokens:
        return Finish(FinishReason.LENGTH, length=req.num_output_tokens)
    if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
        return Finish(FinishReason.STOP, matched=token)
    if len(req.all_ids) >= context_length:
        return Finish(FinishReason.LENGTH, length=req.num_output_tokens)
    return None
