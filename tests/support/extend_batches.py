"""Extend batches built by hand on an engine's runner (requests given KV slots and random new tokens, for forwards
called directly), and their slots given back."""
from __future__ import annotations

import torch

from blockspec import Engine
from blockspec.batch import ForwardBatch, ForwardMode, build_batch
from blockspec.request import Req, SamplingParams


def extend_batch(
    engine: Engine, prefix_lens: list[int], new_lens: list[int], capture: tuple[int, ...]
) -> tuple[ForwardBatch, list[Req]]:
    """An EXTEND batch of one request per (prefix, new) length pair, KV slots allocated for both, the new tokens
    random (seeded by their total), logits at each request's last row, hidden states captured at layers `capture`."""
    runner = engine.runner
    reqs = []
    for p, n in zip(prefix_lens, new_lens):
        req = Req([7] * (p + n), SamplingParams())
        req.pool_row = runner.req_to_token.acquire()
        runner.allocator.grow(req, p + n, runner.req_to_token)
        reqs.append(req)
    generator = torch.Generator().manual_seed(sum(new_lens))
    tokens = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in new_lens]
    rows = torch.tensor(new_lens).cumsum(0).sub(1).tolist()
    batch = build_batch(
        ForwardMode.EXTEND, tokens, prefix_lens, [r.pool_row for r in reqs], runner.req_to_token.table, rows, capture
    )
    return batch, reqs


def release(engine: Engine, reqs: list[Req]) -> None:
    """Gives back the requests' KV slots and table rows (from `extend_batch`)."""
    for req in reqs:
        engine.runner.allocator.release(req)
        engine.runner.req_to_token.release(req.pool_row)
