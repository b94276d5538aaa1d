"""Radix prefix cache, end to end on CPU fp32: outputs and per-cycle DFlash acceptance identical with the cache on
and off (and equal to target-only greedy) for shared-prefix batches, repeated prompts, prefixes ending mid-page,
multi-turn reuse, prompts shared right after their prefill, eviction under a tiny pool; a control that the cached
draft KV is what the first cycles read; every KV page free after flush_cache."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.radix_testing import (  # noqa: F401 (root, shared, distinct: fixtures)
    QUESTIONS, SYSTEM_LEN, assert_flushes_to_empty, distinct, engine_for, greedy, root, run_waves, shared, signature,
)

pytest.importorskip("dflash.model")


@pytest.mark.parametrize("page_size", [1, 4, 8])
def test_shared_prefix_waves_lossless(root: Path, shared: list[list[int]], page_size: int) -> None:
    """A first request, then a batch sharing its system prompt, then the same prompts again (fully cached: the last
    token is still computed), then a multi-turn follow-up: all equal to the cache-off run, cycle by cycle."""
    first = [shared[0]]
    waves = [first, shared[1:], shared, [shared[2] + QUESTIONS[0]]]
    off = engine_for(root, cache=False, page_size=page_size)
    want = run_waves(off, waves)
    target = run_waves(engine_for(root, cache=False, spec=False, page_size=page_size), waves)
    assert [o["output_ids"] for o in want] == [o["output_ids"] for o in target]
    on = engine_for(root, cache=True, page_size=page_size)
    got = run_waves(on, waves)
    assert signature(got) == signature(want)
    cached = [o["meta_info"]["cached_tokens"] for o in got]
    assert cached[0] == 0 and all(o["meta_info"]["cached_tokens"] == 0 for o in want)
    mid_page = SYSTEM_LEN // page_size * page_size
    assert all(n >= mid_page for n in cached[1:len(shared)])
    repeats = cached[len(shared):2 * len(shared)]
    assert repeats == [(len(p) - 1) // page_size * page_size for p in shared]  # everything but the last token
    assert cached[-1] >= len(shared[2]) // page_size * page_size  # the follow-up reuses the earlier turn's prompt
    stats = on.radix_cache_stats()
    assert 0.0 < stats["cache_hit_rate"] < 1.0 and stats["cached_tokens_total"] == sum(cached)
    assert_flushes_to_empty(on)


def test_cached_draft_kv_is_what_the_first_cycles_read(root: Path, shared: list[list[int]]) -> None:
    """Control for the tests above: wiping the draft KV of the cached pages changes the acceptance of a request that
    hits them, so equal acceptance means the draft KV was kept with the target KV."""
    on = engine_for(root, cache=True)
    want = run_waves(on, [[shared[0]], [shared[0]]])
    assert want[0]["accept_lengths"] == want[1]["accept_lengths"] and sum(want[1]["accept_lengths"]) > len(
        want[1]["accept_lengths"]
    )
    tree = on.scheduler.prefix_cache.tree
    assert tree is not None
    pages, _ = tree.match(shared[0][:-1])
    slots = [page * 4 + offset for page in pages for offset in range(4)]
    draft_pool = on.worker.draft_pool  # type: ignore[attr-defined]
    for layer in range(len(draft_pool.k)):
        draft_pool.k[layer][slots] = 0.0
        draft_pool.v[layer][slots] = 0.0
    wiped = run_waves(on, [[shared[0]]])
    assert wiped[0]["output_ids"] == want[0]["output_ids"]  # the target's KV is intact: lossless still
    assert wiped[0]["accept_lengths"] != want[0]["accept_lengths"]
    assert_flushes_to_empty(on)


def test_multi_turn_reuses_prompt_and_output(root: Path, shared: list[list[int]]) -> None:
    """Turn 2 = turn 1's prompt + its output + a new question: the output's KV (and draft KV, from the verify
    forwards) is reused, and turn 2 still equals the cache-off run cycle by cycle."""
    turn1 = shared[3]
    on, off = engine_for(root, cache=True), engine_for(root, cache=False)
    (out1,) = run_waves(on, [[turn1]], max_new=30)
    assert signature([out1]) == signature(run_waves(off, [[turn1]], max_new=30))
    turn2 = turn1 + out1["output_ids"] + QUESTIONS[1]
    (got,), (want,) = (run_waves(e, [[turn2]], max_new=30) for e in (on, off))
    assert signature([got]) == signature([want])
    assert got["meta_info"]["cached_tokens"] >= (len(turn1) + len(out1["output_ids"]) - 1) // 4 * 4
    assert_flushes_to_empty(on)


@pytest.mark.parametrize("overlap", [True, False])
def test_concurrent_identical_prompts_share_after_prefill(root: Path, shared: list[list[int]], overlap: bool) -> None:
    """Several requests with one prompt, admitted over several steps (small prefill chunks): the later ones reuse
    the KV the first one cached after its prefill; duplicates computed in the same step are freed."""
    prompts = [shared[1]] * 4 + [shared[4]] * 2
    flags = dict(chunked_prefill_size=12, disable_overlap_schedule=not overlap)
    want = run_waves(engine_for(root, cache=False, **flags), [prompts])
    on = engine_for(root, cache=True, **flags)
    got = run_waves(on, [prompts])
    assert signature(got) == signature(want)
    assert sum(o["meta_info"]["cached_tokens"] for o in got) > 0
    assert_flushes_to_empty(on)


def test_tiny_pool_evicts_lossless(root: Path, distinct: list[list[int]]) -> None:
    """A pool a few prompts large: cached prefixes are evicted (least recently used first) to admit new ones."""
    prompts = distinct[3:]
    waves = [[p] for p in prompts] + [[prompts[-1]], [prompts[0]]]
    want = run_waves(engine_for(root, cache=False, max_total_tokens=128), waves)
    on = engine_for(root, cache=True, max_total_tokens=128)
    got = run_waves(on, waves)
    assert signature(got) == signature(want)
    stats = on.radix_cache_stats()
    assert stats["evicted_tokens_total"] > 0
    assert got[-2]["meta_info"]["cached_tokens"] > 0  # the most recent prompt survived the evictions
    assert got[-1]["meta_info"]["cached_tokens"] == 0  # the oldest did not
    assert_flushes_to_empty(on)


def test_flush_refused_while_busy_and_disabled_cache(root: Path, shared: list[list[int]]) -> None:
    engine = engine_for(root, cache=True, spec=False)
    engine.generate(input_ids=shared[0], sampling_params=greedy(4))
    assert engine.runner.allocator.unused_slots < engine.runner.allocator.total_slots  # the prompt stays cached
    reqs, _ = engine.make_requests(input_ids=[shared[1]], sampling_params=greedy(4))
    engine.scheduler.add_request(reqs[0])
    assert not engine.flush_cache()
    engine.step()
    assert not engine.flush_cache()
    while engine.scheduler.has_work:
        engine.step()
    assert_flushes_to_empty(engine)
    info = engine.get_server_info()
    assert info["disable_radix_cache"] is False and info["internal_states"][0]["radix_cache"]["enabled"] is True

    off = engine_for(root, cache=False, spec=False)
    outs = run_waves(off, [[shared[0]], [shared[0]]], max_new=4)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]
    assert off.runner.allocator.unused_slots == off.runner.allocator.total_slots
    assert off.flush_cache() and off.radix_cache_stats()["enabled"] is False
