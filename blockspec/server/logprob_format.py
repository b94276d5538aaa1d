"""The target's log-probabilities in the OpenAI shapes: chat (`logprobs.content`) and legacy completions
(`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`). Token strings come from the tokenizer; without one
a token is written `token_id:<id>`."""
from __future__ import annotations

from typing import Any, Optional, Sequence

TopEntries = Sequence[Sequence[Any]]  # per token: (token id, logprob) pairs, most likely first


def token_text(tokenizer: Any, token: int) -> str:
    return f"token_id:{token}" if tokenizer is None else str(tokenizer.decode([token]))


def from_meta_info(meta: dict[str, Any]) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """(ids, logprobs, top pairs) from SGLang's meta_info layout ((logprob, id, text) tuples)."""
    chosen = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [[] for _ in chosen]
    ids = [int(entry[1]) for entry in chosen]
    return ids, [float(entry[0]) for entry in chosen], [[(int(t[1]), float(t[0])) for t in top] for top in tops]


def chat_content(
    tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float], tops: TopEntries
) -> list[dict[str, Any]]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        {**entry(token, logprob), "top_logprobs": [entry(int(t), float(lp)) for t, lp in top]}
        for token, logprob, top in zip(ids, logprobs, tops)
    ]


def completion_logprobs(
    tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float], tops: TopEntries, offset: int = 0,
    with_top: bool = True,
) -> dict[str, Any]:
    """Legacy completions logprobs; `offset`: characters of this choice's text before these tokens."""
    tokens = [token_text(tokenizer, token) for token in ids]
    offsets: list[int] = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top: Optional[list[dict[str, float]]] = None
    if with_top:
        top = [{token_text(tokenizer, int(t)): float(lp) for t, lp in pairs} for pairs in tops]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}
