"""Helpers shared by the engine tests (HF greedy oracle, idle checks, stepping the scheduler)."""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Optional, Sequence

import torch
from transformers import PreTrainedModel

from blockspec import Engine
from blockspec.request import Req

VOCAB = 96  # tiny_models.TINY["vocab_size"]


_HF_CACHE: "weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[tuple[int, ...], int, Optional[int]], list[int]]]" = (
    weakref.WeakKeyDictionary()
)


@torch.no_grad()
def hf_greedy(
    model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int, eos: Optional[int] = None
) -> list[int]:
    """HF `generate` greedy continuation of one prompt (fp32, attention_mask passed). eos=None: never stops early."""
    cache = _HF_CACHE.setdefault(model, {})
    key = (tuple(prompt), max_new_tokens, eos)
    if key not in cache:
        ids = torch.tensor([list(prompt)])
        saved = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None  # NOTE: otherwise eos_token_id=None falls back to the config's
        try:
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=eos, pad_token_id=0,
            )
        finally:
            model.generation_config.eos_token_id = saved
        tokens = out[0, len(prompt):].tolist()
        if eos is None:
            assert len(tokens) == max_new_tokens
        cache[key] = tokens
    return list(cache[key])


def assert_engine_idle(engine: Engine) -> None:
    """Every slot back in the pool, no request left queued or running, every table row released (an engine shut
    down has let go of all of them)."""
    if engine.is_shut_down:
        return
    scheduler = engine.scheduler
    assert not scheduler.waiting, [r.rid for r in scheduler.waiting]
    assert not scheduler.running, [r.rid for r in scheduler.running]
    allocator = engine.runner.allocator
    assert allocator.free_slots == allocator.total_slots
    info = engine.get_server_info()["kv_cache"]
    assert info["free_slots"] == info["total_slots"]
    assert engine.runner.req_to_token.free_rows == engine.config.max_running_requests
    assert not scheduler.detokenizers


def run_until_done(engine: Engine, reqs: Sequence[Req], max_steps: int = 10_000) -> list[Req]:
    """Steps the scheduler until the given requests have finished (guards against a stalled scheduler)."""
    pending = {req.rid for req in reqs}
    for _ in range(max_steps):
        if not pending:
            return list(reqs)
        for req in engine.step():
            pending.discard(req.rid)
    raise AssertionError(f"scheduler made no progress on {sorted(pending)} within {max_steps} steps")


def random_prompts(lengths: Sequence[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def prefilled(engine: Engine, prompts: list[list[int]], sampling_params: dict) -> list[Req]:
    """Queues the prompts and steps until every request has its prompt in the KV cache (ready to decode), with
    nothing in flight: the overlap schedule is off meanwhile (with it, an extend step also launches a decode step)."""
    reqs, _ = engine.make_requests(input_ids=prompts, sampling_params=sampling_params)
    for req in reqs:
        engine.scheduler.add_request(req)
    steps, overlap = engine.scheduler.steps, engine.scheduler.steps.overlap
    steps.overlap = False
    try:
        while any(r.pending_len != 1 for r in reqs):
            engine.step()
    finally:
        steps.overlap = overlap
    return reqs


@contextlib.contextmanager
def ready_for_one_cycle(engine: Engine, prompts: list[list[int]], sampling_params: dict) -> Iterator[list[Req]]:
    """`prefilled` requests given KV slots for one more cycle (kv_len + the worker's decode slots per request); on
    leaving they are aborted and a step frees their slots."""
    reqs = prefilled(engine, prompts, sampling_params)
    runner = engine.runner
    for req in reqs:
        runner.allocator.grow(req, req.kv_len + engine.worker.decode_slots_per_req, runner.req_to_token)
    try:
        yield reqs
    finally:
        for req in reqs:
            engine.scheduler.abort(req.rid)
        engine.step()


def graphed_and_eager_cycle(engine: Engine, reqs: Sequence[Req]) -> tuple[list[list[int]], list[list[int]]]:
    """One greedy cycle of `reqs` replayed from its captured graph, then the same cycle eagerly (nothing committed):
    DFlashWorker.greedy_cycle_tokens both times."""
    worker, graphs = engine.worker, engine.runner.graphs
    graphed = worker.greedy_cycle_tokens(reqs)  # type: ignore[attr-defined]
    graphs.enabled = False
    try:
        eager = worker.greedy_cycle_tokens(reqs)  # type: ignore[attr-defined]
    finally:
        graphs.enabled = True
    return graphed, eager


def overlapped_run_checking_syncs(
    engine: Engine, prompts: list[list[int]], sampling_params: dict
) -> tuple[list[Req], int]:
    """Runs `prompts` to the end step by step; every steady overlapped step (the next cycle launched from the last
    one's device outputs, nothing waiting, one pending token per request) runs under CUDA's sync debug mode 'error',
    so a synchronising device call there raises. Returns the requests and how many steps were checked."""
    scheduler = engine.scheduler
    reqs, _ = engine.make_requests(input_ids=prompts, sampling_params=sampling_params)
    for req in reqs:
        scheduler.add_request(req)
    checked = 0
    while scheduler.has_work:
        steady = scheduler.steps.in_flight is not None and not scheduler.waiting and all(
            r.pending_len == 1 for r in scheduler.running)
        if steady:
            torch.cuda.set_sync_debug_mode("error")
        try:
            scheduler.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked += steady
    return reqs, checked
