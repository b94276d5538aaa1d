"""In-batch prefix caching (kv/prefix_cache.py InBatchPrefixes), CPU fp32, cache on vs off: a cold burst of requests
sharing an uncached prefix computes it once (the others wait a step, then read it from the cache), with outputs and
per-cycle DFlash acceptance equal to the cache-off run; prefixes shorter than the threshold do not wait."""
from __future__ import annotations

from pathlib import Path

import pytest

from blockspec.kv.prefix_cache import IN_BATCH_MIN_SHARED
from tests.support.radix_testing import (  # noqa: F401 (root, shared, distinct: fixtures)
    QUESTIONS, SYSTEM_LEN, assert_flushes_to_empty, distinct, engine_for, greedy, root, run_waves, shared, signature,
)

pytest.importorskip("dflash.model")


@pytest.fixture(scope="module")
def long_shared(root: Path, shared: list[list[int]]) -> list[list[int]]:
    """A system prompt of SYSTEM_LEN + 24 tokens (the target's own continuation: acceptance varies) + each question."""
    start = shared[0][:SYSTEM_LEN]
    more = engine_for(root, cache=False, spec=False).generate(input_ids=start, sampling_params=greedy(24))["output_ids"]
    system = start + more
    assert len(system) >= IN_BATCH_MIN_SHARED + 8
    return [system + q for q in QUESTIONS]


@pytest.mark.parametrize("page_size,chunk", [(1, 64), (4, 64), (8, 512)])
def test_cold_burst_computes_the_shared_prefix_once(root: Path, long_shared: list[list[int]], page_size: int,
                                                    chunk: int) -> None:
    want = run_waves(engine_for(root, cache=False, page_size=page_size, chunked_prefill_size=chunk), [long_shared])
    on = engine_for(root, cache=True, page_size=page_size, chunked_prefill_size=chunk)
    reqs, _ = on.make_requests(input_ids=long_shared, sampling_params=greedy())
    for req in reqs:
        on.scheduler.add_request(req)
    on.step()
    assert [r.rid for r in on.scheduler.running] == [reqs[0].rid]  # the others wait for the first one's prefix
    assert [r.rid for r in on.scheduler.waiting] == [r.rid for r in reqs[1:]]  # in arrival order
    while on.scheduler.has_work:
        on.step()
    got = [{**on.output_of(req), "accept_lengths": list(req.spec_accept_lengths)} for req in reqs]
    assert signature(got) == signature(want)
    system_pages = (len(long_shared[0]) - len(QUESTIONS[0])) // page_size * page_size
    assert got[0]["meta_info"]["cached_tokens"] == 0
    assert all(o["meta_info"]["cached_tokens"] >= system_pages for o in got[1:])
    assert_flushes_to_empty(on)


def test_short_shared_prefixes_do_not_wait(root: Path, shared: list[list[int]]) -> None:
    """SYSTEM_LEN (21) shared tokens are under the threshold: the burst is admitted together, as without the cache."""
    assert SYSTEM_LEN < IN_BATCH_MIN_SHARED
    on = engine_for(root, cache=True, chunked_prefill_size=512)
    reqs, _ = on.make_requests(input_ids=shared, sampling_params=greedy())
    for req in reqs:
        on.scheduler.add_request(req)
    on.step()
    assert len(on.scheduler.running) == len(reqs) and not on.scheduler.waiting
    while on.scheduler.has_work:
        on.step()
    want = run_waves(engine_for(root, cache=False, chunked_prefill_size=512), [shared])
    got = [{**on.output_of(req), "accept_lengths": list(req.spec_accept_lengths)} for req in reqs]
    assert signature(got) == signature(want)


def test_the_waiting_head_keeps_its_place_and_is_not_held_again(root: Path, long_shared: list[list[int]],
                                                                 distinct: list[list[int]]) -> None:
    """Behind a request waiting for a prefix, nothing is admitted (it would take the rows, KV and budget the waiter
    needs next step), and arrival batching (--max-prefill-wait-steps) does not hold it a second time: it is admitted
    the step after the request it waited for, with or without other requests decoding."""
    for flags in ({"max_running_requests": 3}, {"max_prefill_wait_steps": 6}):
        on = engine_for(root, cache=True, chunked_prefill_size=512, **flags)
        decoding, _ = on.make_requests(input_ids=[distinct[0]], sampling_params=greedy(40))
        on.scheduler.add_request(decoding[0])
        on.step()  # NOTE: one request decodes, so arrivals are cheap to hold
        reqs, _ = on.make_requests(input_ids=[long_shared[0], long_shared[1], distinct[1]], sampling_params=greedy())
        for req in reqs:
            on.scheduler.add_request(req)
        admitted_at: dict[str, int] = {}
        for step in range(1, 40):
            on.step()
            for req in on.scheduler.running:
                admitted_at.setdefault(req.rid, step)
            if len(admitted_at) == 4 or not on.scheduler.has_work:
                break
        leader, waiter, unrelated = (admitted_at.get(r.rid) for r in reqs)
        assert leader is not None and waiter == leader + 1, (flags, admitted_at)
        assert unrelated is None or unrelated >= waiter, (flags, admitted_at)
        assert waiter is not None and reqs[1].cached_tokens > 0
        while on.scheduler.has_work:
            on.step()
        assert_flushes_to_empty(on)
