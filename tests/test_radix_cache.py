"""Radix prefix cache, end to end on CPU fp32: outputs and per-cycle DFlash acceptance identical with the cache on
and off (and equal to target-only greedy) for shared-prefix batches, repeated prompts, prefixes ending mid-page,
multi-turn reuse, eviction under a tiny pool, retraction, aborts, chunked prefill, mixed chunks and the overlap
schedule; every KV page free after flush_cache."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from blockspec import Engine
from blockspec.request import Req
from draft_training import save_trained_pair
from engine_testing import assert_engine_idle, random_prompts

pytest.importorskip("dflash.model")

QUESTIONS = random_prompts([3, 7, 1, 12, 5, 9], seed=12)
SYSTEM_LEN = 21  # NOTE: the shared prefix ends mid-page for page sizes 4 and 8


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_trained_pair(tmp_path_factory.mktemp("radix"))


@pytest.fixture(scope="module")
def shared(root: Path) -> list[list[int]]:
    """A system prompt + each question. The system prompt is 6 tokens and the target's own continuation, as in the
    draft's training data, so acceptance varies from 1 to the whole block (a sensitive check of the draft KV)."""
    start = [3 + t for t in random_prompts([6], seed=0, vocab=90)[0]]
    continuation = engine_for(root, cache=False, spec=False).generate(input_ids=start, sampling_params=greedy(16))
    system = start + continuation["output_ids"][:SYSTEM_LEN - len(start)]
    return [system + q for q in QUESTIONS]


@pytest.fixture(scope="module")
def distinct(root: Path) -> list[list[int]]:
    """Eight prompts sharing no prefix (first tokens differ) of 6 random tokens + 0..28 tokens of the target's own
    continuation."""
    starts = [[3 + 11 * i] + [3 + t for t in start] for i, start in enumerate(random_prompts([5] * 8, seed=5, vocab=90))]
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
            engine.scheduler.step()
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
    assert want[0]["accept_lengths"] == want[1]["accept_lengths"] and sum(want[1]["accept_lengths"]) > len(want[1]["accept_lengths"])
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
    cache.admitted = lambda req: (reused.append(req.shared_len) if req.computed_len else None, admitted(req))[1]  # type: ignore[method-assign]
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
    reqs, _ = engine.make_requests(input_ids=[shared[1], shared[0], [7]], sampling_params=[greedy(30), greedy(), greedy()])
    engine.scheduler.add_request(reqs[0])
    for _ in range(3):
        engine.scheduler.step()
    for req in reqs[1:]:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work:
        engine.scheduler.step()
    assert reqs[1].cached_tokens == len(shared[0]) - 1 and engine.scheduler.steps.mixed_steps > 0
    target = engine_for(root, cache=False, spec=False)
    for req, max_new in zip(reqs, (30, 24, 24)):
        assert req.output_ids == target.generate(input_ids=req.all_ids[:req.prompt_len], sampling_params=greedy(max_new))["output_ids"]
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


def test_flush_refused_while_busy_and_disabled_cache(root: Path, shared: list[list[int]]) -> None:
    engine = engine_for(root, cache=True, spec=False)
    engine.generate(input_ids=shared[0], sampling_params=greedy(4))
    assert engine.runner.allocator.unused_slots < engine.runner.allocator.total_slots  # the prompt stays cached
    reqs, _ = engine.make_requests(input_ids=[shared[1]], sampling_params=greedy(4))
    engine.scheduler.add_request(reqs[0])
    assert not engine.flush_cache()
    engine.scheduler.step()
    assert not engine.flush_cache()
    while engine.scheduler.has_work:
        engine.scheduler.step()
    assert_flushes_to_empty(engine)
    info = engine.get_server_info()
    assert info["disable_radix_cache"] is False and info["internal_states"][0]["radix_cache"]["enabled"] is True

    off = engine_for(root, cache=False, spec=False)
    outs = run_waves(off, [[shared[0]], [shared[0]]], max_new=4)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]
    assert off.runner.allocator.unused_slots == off.runner.allocator.total_slots
    assert off.flush_cache() and off.radix_cache_stats()["enabled"] is False
