"""Radix prefix cache under the scheduler's harder paths (CPU fp32, cache on vs off): retraction, aborts with a
cycle in flight, mixed chunks, a prefill chunk that leaves one prompt token, two schedulers over one pool."""
from __future__ import annotations

from pathlib import Path

import pytest

from blockspec.request import Req
from tests.support.radix_testing import (  # noqa: F401 (root, shared, distinct: fixtures)
    assert_flushes_to_empty, distinct, engine_for, greedy, root, run_waves, shared, signature,
)

pytest.importorskip("dflash.model")


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_lossless(root: Path, distinct: list[list[int]], page_size: int) -> None:
    """Concurrent requests in a pool too small for all: retracted requests leave their KV in the cache and take it
    back on re-admission; outputs and verify counts equal the cache-off run, which retracts at the same steps.

    NOTE: without chunked prefill, so both runs admit at the same steps: with chunks, a cache hit needs fewer prefill
    steps, which moves later retractions (and a retraction moves its request's cycle boundaries)."""
    prompts = distinct
    flags = dict(page_size=page_size, max_total_tokens=160, chunked_prefill_size=-1)
    off = engine_for(root, cache=False, **flags)
    want = run_waves(off, [prompts], max_new=40)
    on = engine_for(root, cache=True, **flags)
    cache = on.scheduler.prefix_cache
    reused: list[int] = []  # cached tokens a retracted request found on re-admission
    admitted = cache.admitted
    cache.admitted = lambda req: (  # type: ignore[method-assign]
        reused.append(req.shared_len) if req.computed_len else None, admitted(req))[1]
    got = run_waves(on, [prompts], max_new=40)
    assert signature(got) == signature(want)
    assert on.scheduler.num_retractions == off.scheduler.num_retractions > 0
    assert len(reused) == on.scheduler.num_retractions
    if page_size == 1:
        assert sum(reused) > 0
    else:  # NOTE: here the running requests' growth evicts the retracted KV before the re-admission
        assert on.radix_cache_stats()["evicted_tokens_total"] > 0
    assert_flushes_to_empty(on)


def test_retraction_with_shared_prefixes_lossless(root: Path, shared: list[list[int]]) -> None:
    """Shared prefixes in a pool too small for all: outputs equal target-only. (Verify counts may differ from the
    cache-off run here: sharing leaves more room, so fewer or later retractions, and a retraction moves the cycle
    boundaries of its request: its re-prefill commits one token outside any verify.)"""
    flags = dict(max_total_tokens=96)
    want = run_waves(engine_for(root, cache=False, spec=False, **flags), [shared], max_new=40)
    on = engine_for(root, cache=True, **flags)
    got = run_waves(on, [shared], max_new=40)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert on.scheduler.num_retractions > 0
    assert_flushes_to_empty(on)


def test_aborts_leave_the_pool_consistent(root: Path, shared: list[list[int]]) -> None:
    """Requests aborted mid-prefill (chunked) and mid-decode with a cycle in flight give their valid KV to the cache;
    the others are unaffected and a later identical prompt reuses what the aborted ones computed."""
    engine = engine_for(root, cache=True, chunked_prefill_size=8)
    scheduler = engine.scheduler
    reqs, _ = engine.make_requests(input_ids=shared[:4], sampling_params=greedy(30))
    for req in reqs:
        scheduler.add_request(req)
    aborted: list[Req] = []
    while scheduler.has_work:
        scheduler.step()
        if not aborted and reqs[3].kv_len and reqs[3].pending_len > 1:
            assert scheduler.abort(reqs[3].rid)  # mid-prefill
            aborted.append(reqs[3])
        in_flight = scheduler.steps.in_flight
        if len(aborted) == 1 and in_flight is not None and reqs[1] in in_flight.reqs and reqs[1].num_output_tokens > 4:
            assert scheduler.abort(reqs[1].rid)  # mid-decode, a cycle in flight
            aborted.append(reqs[1])
    assert len(aborted) == 2 and all(r.finish is not None and r.finish.reason.value == "abort" for r in aborted)
    want = run_waves(engine_for(root, cache=False), [shared[:4]], max_new=30)
    for i in (0, 2):
        assert reqs[i].output_ids == want[i]["output_ids"]
    assert reqs[1].output_ids == want[1]["output_ids"][:reqs[1].num_output_tokens]
    again = engine.generate(input_ids=shared[1] + reqs[1].output_ids, sampling_params=greedy(8))
    assert again["meta_info"]["cached_tokens"] >= len(shared[1]) // 4 * 4
    assert_flushes_to_empty(engine)


def test_mixed_chunk_and_target_only(root: Path, shared: list[list[int]]) -> None:
    """--enable-mixed-chunk (prefill chunks with the running verify blocks in one forward) and target-only decoding
    with the overlap schedule, cache on vs off."""
    waves = [[shared[0]], shared[1:4], shared[:3]]
    for spec, flags in ((True, {"enable_mixed_chunk": True}), (False, {})):
        want = run_waves(engine_for(root, cache=False, spec=spec, **flags), waves)
        on = engine_for(root, cache=True, spec=spec, **flags)
        got = run_waves(on, waves)
        assert signature(got) == signature(want)
        assert sum(o["meta_info"]["cached_tokens"] for o in got) > 0
        assert_flushes_to_empty(on)


@pytest.mark.parametrize("spec", [True, False])
def test_mixed_chunk_extends_last_token_chunks(root: Path, shared: list[list[int]], spec: bool) -> None:
    """--enable-mixed-chunk: requests whose only pending token is their prompt's last (a fully cached prompt, a
    1-token prompt) arrive while another decodes; they are extended in that step, not also decoded."""
    engine = engine_for(root, cache=True, spec=spec, enable_mixed_chunk=True, page_size=1)
    engine.generate(input_ids=shared[0], sampling_params=greedy(4))
    reqs, _ = engine.make_requests(
        input_ids=[shared[1], shared[0], [7]], sampling_params=[greedy(30), greedy(), greedy()]
    )
    engine.scheduler.add_request(reqs[0])
    for _ in range(3):
        engine.step()
    for req in reqs[1:]:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work:
        engine.step()
    assert reqs[1].cached_tokens == len(shared[0]) - 1 and engine.scheduler.steps.mixed_steps > 0
    target = engine_for(root, cache=False, spec=False)
    for req, max_new in zip(reqs, (30, 24, 24)):
        assert (
            req.output_ids
            == target.generate(input_ids=req.all_ids[: req.prompt_len], sampling_params=greedy(max_new))["output_ids"]
        )
    assert_flushes_to_empty(engine)


def test_prefill_chunk_leaving_the_last_token_still_prefills_it(root: Path, shared: list[list[int]]) -> None:
    """A chunk boundary one token before a prompt's end (here: 16-token chunks, a 17-token prompt, or a cache hit
    that leaves one token): the last token is extended, so the first token comes from the prefill and the cycles
    are the ones of an unchunked, uncached run."""
    prompt = shared[0][:17]
    want = run_waves(engine_for(root, cache=False, chunked_prefill_size=-1), [[prompt]])
    for flags in ({"cache": False}, {"cache": True, "page_size": 1}):
        engine = engine_for(root, chunked_prefill_size=16, **flags)  # type: ignore[arg-type]
        assert signature(run_waves(engine, [[prompt], [prompt]])) == signature(want * 2)


def test_schedulers_over_one_pool_share_its_tree(root: Path, shared: list[list[int]]) -> None:
    """A second scheduler over the engine's pool (the start-up warm-up's) uses the same radix tree, so the engine's
    cached pages stay evictable; only the hit counters are its own."""
    engine = engine_for(root, cache=True, spec=False)
    engine.generate(input_ids=shared[0], sampling_params=greedy(4))
    other = engine.new_scheduler()
    assert other.prefix_cache.tree is engine.scheduler.prefix_cache.tree is engine.runner.allocator.reclaimer
    assert other.prefix_cache.stats()["cached_tokens_total"] == 0
    again = engine.generate(input_ids=shared[0], sampling_params=greedy(4))
    assert again["meta_info"]["cached_tokens"] > 0
    assert_flushes_to_empty(engine)
