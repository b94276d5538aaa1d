"""Per-prompt request arguments of the generate APIs: one value for all prompts or one each, logprob fields."""
from __future__ import annotations

from typing import Any, Optional


# NOTE: OpenAI's chat bound (completions: 5) and vLLM's default max_logprobs. Unbounded, one /generate request asked
# for the whole vocabulary per token: a 51 MB answer for 32 tokens, built on the engine thread every other request
# waits on.
MAX_TOP_LOGPROBS_NUM = 20


def logprob_request(return_logprob: Any, top_logprobs_num: Any) -> Optional[int]:
    """Req.top_logprobs_num from the request fields (None: no logprobs)."""
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob must be true or false, got {return_logprob!r}")
    if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) or top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be a non-negative integer, got {top_logprobs_num!r}")
    if top_logprobs_num > MAX_TOP_LOGPROBS_NUM:
        raise ValueError(f"top_logprobs_num must be at most {MAX_TOP_LOGPROBS_NUM}, got {top_logprobs_num}")
    if top_logprobs_num and not return_logprob:
        raise ValueError("top_logprobs_num needs return_logprob")
    return top_logprobs_num if return_logprob else None


def per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """One value for every prompt, or a list (or tuple) of one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"got {len(value)} {name} for {count} prompts")
        return list(value)
    return [value] * count
