"""finish.append_tokens: the counted path of a plain request (no grammar, no text stream) finishes exactly where the
token-by-token checks do, with the same reason, over random lengths, stop tokens, EOS and context limits."""
from __future__ import annotations

import random

from blockspec.request import Req, SamplingParams
from blockspec.scheduler.finish import _check_finish, append_tokens


def token_by_token(req: Req, tokens: list[int], eos: set[int], context_length: int) -> int:
    appended = 0
    for token in tokens:
        req.all_ids.append(token)
        appended += 1
        req.finish = _check_finish(req, token, eos, context_length, None)
        if req.finish is not None:
            break
    return appended


def test_counted_commit_matches_token_by_token() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        params = SamplingParams(max_new_tokens=rng.randint(0, 12), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.sample(range(8), rng.randint(0, 2)))
        prompt = [rng.randrange(8) for _ in range(rng.randint(1, 6))]
        done = rng.randint(0, 10)
        eos, context_length = {rng.randrange(8)}, rng.randint(2, 24)
        tokens = [rng.randrange(8) for _ in range(rng.randint(0, 6))]
        fast, slow = Req(prompt + [5] * done, params), Req(prompt + [5] * done, params)
        fast.prompt_len = slow.prompt_len = len(prompt)
        assert append_tokens(fast, tokens, eos, context_length, None) == token_by_token(
            slow, tokens, eos, context_length
        )
        assert fast.all_ids == slow.all_ids
        assert (fast.finish and fast.finish.to_dict()) == (slow.finish and slow.finish.to_dict())
