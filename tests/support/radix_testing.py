"""Shared by the radix prefix cache tests: engines cache on/off on the trained tiny pair, prompts whose acceptance
varies (the draft's training distribution), running waves of requests and comparing them cycle by cycle."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from blockspec import Engine
from tests.support.engine_testing import assert_engine_idle, random_prompts

QUESTIONS = random_prompts([3, 7, 1, 12, 5, 9], seed=12)
SYSTEM_LEN = 21  # NOTE: the shared prefix ends mid-page for page sizes 4 and 8


def shared_prompts(root: Path) -> list[list[int]]:
    """A system prompt + each question. The system prompt is 6 tokens and the target's own continuation, as in the
    draft's training data, so acceptance varies from 1 to the whole block (a sensitive check of the draft KV)."""
    start = [3 + t for t in random_prompts([6], seed=0, vocab=90)[0]]
    continuation = engine_for(root, cache=False, spec=False).generate(input_ids=start, sampling_params=greedy(16))
    system = start + continuation["output_ids"][:SYSTEM_LEN - len(start)]
    return [system + q for q in QUESTIONS]


def distinct_prompts(root: Path) -> list[list[int]]:
    """Eight prompts sharing no prefix (first tokens differ) of 6 random tokens + 0..28 tokens of the target's own
    continuation."""
    starts = [
        [3 + 11 * i] + [3 + t for t in start] for i, start in enumerate(random_prompts([5] * 8, seed=5, vocab=90))
    ]
    target = engine_for(root, cache=False, spec=False)
    continuations = target.generate(input_ids=starts, sampling_params=greedy(28))
    assert isinstance(continuations, list)
    return [start + out["output_ids"][:4 * i] for i, (start, out) in enumerate(zip(starts, continuations))]


def engine_for(root: Path, cache: bool, spec: bool = True, **extra: Any) -> Engine:
    args: dict[str, Any] = dict(
        model_path=str(root / "target"), device="cpu", dtype="float32", page_size=4, max_total_tokens=4096,
        chunked_prefill_size=16, skip_tokenizer_init=True, disable_radix_cache=not cache,
    )
    if spec:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
    return Engine(**{**args, **extra})


def greedy(max_new: int = 24) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def run_waves(engine: Engine, waves: list[list[list[int]]], max_new: int = 24) -> list[dict[str, Any]]:
    """One batch per wave, run to the end before the next; every output, with the request's per-cycle acceptance
    under "accept_lengths"."""
    outputs: list[dict[str, Any]] = []
    for wave in waves:
        reqs, _ = engine.make_requests(input_ids=wave, sampling_params=greedy(max_new))
        for req in reqs:
            engine.scheduler.add_request(req)
        while engine.scheduler.has_work:
            engine.step()
        outputs += [{**engine.output_of(req), "accept_lengths": list(req.spec_accept_lengths)} for req in reqs]
    return outputs


def signature(outputs: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """Output ids and tokens committed by each verify (DFlash), per request."""
    return [(o["output_ids"], o["accept_lengths"]) for o in outputs]


def assert_flushes_to_empty(engine: Engine) -> None:
    assert_engine_idle(engine)
    assert engine.flush_cache()
    allocator = engine.runner.allocator
    assert allocator.unused_slots == allocator.total_slots
    assert engine.radix_cache_stats()["tree_tokens"] == 0


# ---- fixtures (imported by the radix test modules) -------------------------------------------------

@pytest.fixture(scope="module")
def root(trained_pair: dict[str, Any]) -> Path:
    return Path(trained_pair["root"])


@pytest.fixture(scope="module")
def shared(root: Path) -> list[list[int]]:
    return shared_prompts(root)


@pytest.fixture(scope="module")
def distinct(root: Path) -> list[list[int]]:
    return distinct_prompts(root)
