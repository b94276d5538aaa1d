"""Checks of --enable-deterministic-inference shared by the CPU tests (TRITON_INTERPRET=1) and the GPU test: the
target's logits of the same tokens at the same positions computed as 1-token decode steps, as DFlash verify blocks
(at two batch sizes) and as one extend chunk, through the engine's own forward paths (graphs where it has them)."""
from __future__ import annotations

from typing import Sequence

import torch

from blockspec import Engine
from blockspec.batch import ForwardMode, UniformRows, build_batch
from blockspec.request import Req
from blockspec.runner.graph_kind import GraphKind
from tests.support.engine_testing import prefilled

GREEDY_OPEN = {"temperature": 0, "max_new_tokens": 10_000, "ignore_eos": True}


def continuations(reqs: Sequence[Req], length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Per request: its first token (from prefill), then length - 1 random tokens (the block's later inputs)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [req.all_ids[-1], *torch.randint(3, vocab - 1, (length - 1,), generator=generator).tolist()] for req in reqs
    ]


def open_requests(engine: Engine, prompts: list[list[int]], room: int) -> list[Req]:
    """The prompts prefilled (first token sampled), each with KV slots for `room` more positions."""
    reqs = prefilled(engine, prompts, GREEDY_OPEN)
    for req in reqs:
        engine.runner.allocator.grow(req, req.kv_len + room, engine.runner.req_to_token)
    return reqs


def close_requests(engine: Engine, reqs: Sequence[Req]) -> None:
    for req in reqs:
        engine.scheduler.abort(req.rid)
    engine.scheduler.collect_finished()


@torch.inference_mode()
def decode_logits(engine: Engine, reqs: Sequence[Req], tokens: list[list[int]]) -> torch.Tensor:
    """[bs, n, V]: token j of each request decoded alone at kv_len + j, all requests in one batch per step."""
    runner, steps = engine.runner, []
    for j in range(len(tokens[0])):
        rows = UniformRows.build(ForwardMode.DECODE, [[ids[j]] for ids in tokens], [r.pool_row for r in reqs],
                                 [r.kv_len + j + 1 for r in reqs], runner.device)
        steps.append(runner.forward_uniform(GraphKind.DECODE, rows).logits.float().cpu())
    return torch.stack(steps, dim=1)


@torch.inference_mode()
def verify_logits(engine: Engine, reqs: Sequence[Req], tokens: list[list[int]]) -> torch.Tensor:
    """[bs, n, V]: the n tokens of each request as one DFlash verify block at kv_len .. kv_len + n - 1."""
    proposals = torch.tensor([ids[1:] for ids in tokens], dtype=torch.int64, device=engine.runner.device)
    return engine.worker.verify(reqs, proposals).float().cpu()


@torch.inference_mode()
def extend_logits(engine: Engine, reqs: Sequence[Req], tokens: list[list[int]]) -> torch.Tensor:
    """[bs, n, V]: the n tokens of each request as one extend chunk, logits of every row."""
    runner, n = engine.runner, len(tokens[0])
    batch = build_batch(ForwardMode.EXTEND, tokens, [r.kv_len for r in reqs], [r.pool_row for r in reqs],
                        runner.req_to_token.table, list(range(n * len(reqs))),
                        runner.hidden_capture_layer_ids)
    return runner.forward_extend(batch).logits.float().cpu().view(len(reqs), n, -1)


def logits_by_path(target_only: Engine, dflash: Engine, prompts: list[list[int]], length: int,
                   vocab: int) -> dict[str, torch.Tensor]:
    """The same (prompt, block) logits [bs, n, V] by path: target-only decode, target-only extend chunk, DFlash
    verify of the whole batch, DFlash verify one request at a time."""
    paths: dict[str, torch.Tensor] = {}
    reqs = open_requests(target_only, prompts, length)
    tokens = continuations(reqs, length, vocab)
    paths["decode"] = decode_logits(target_only, reqs, tokens)
    paths["extend"] = extend_logits(target_only, reqs, tokens)
    close_requests(target_only, reqs)
    reqs = open_requests(dflash, prompts, length)
    assert [r.all_ids[-1] for r in reqs] == [ids[0] for ids in tokens]  # NOTE: the prefill's first tokens agree
    paths["verify"] = verify_logits(dflash, reqs, tokens)
    paths["verify_bs1"] = torch.cat([verify_logits(dflash, [req], [ids]) for req, ids in zip(reqs, tokens)])
    close_requests(dflash, reqs)
    return paths


def mismatched_rows(paths: dict[str, torch.Tensor], reference: str = "decode") -> dict[str, int]:
    """Per path, how many (request, position) logits rows are not bit-identical to the reference path's."""
    expected = paths[reference]
    return {name: int((got != expected).any(-1).sum()) for name, got in paths.items() if name != reference}
