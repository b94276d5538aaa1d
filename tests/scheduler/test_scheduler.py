"""Continuous batching: late arrivals, a tight KV pool (retraction), admission limits, aborts and finish reasons."""
from __future__ import annotations

import weakref

import pytest

from blockspec.request import FinishReason
from tests.support.engine_testing import VOCAB, hf_greedy, random_prompts, run_until_done

PROMPTS = random_prompts([5, 12, 1, 30, 9, 20, 3, 14], seed=2)
MAX_NEW = 24
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def test_arrivals_mid_decode_match_solo_runs(tiny, make_engine) -> None:
    ckpt = tiny("llama")
    engine = make_engine(ckpt.path, page_size=4, chunked_prefill_size=8)
    solo = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    assert solo == [hf_greedy(ckpt.model, p, MAX_NEW) for p in PROMPTS]

    reqs, _ = engine.make_requests(input_ids=PROMPTS, sampling_params=GREEDY)
    scheduler = engine.scheduler
    # Arrival schedule (step index → requests added before that step): later ones land while others decode.
    arrivals = {0: reqs[:1], 3: reqs[1:3], 7: reqs[3:4], 12: reqs[4:7], 20: reqs[7:]}
    saw_mixed = False
    step = 0
    while step <= max(arrivals) or scheduler.has_work:
        for req in arrivals.get(step, []):
            if any(len(r.output_ids) > 0 for r in scheduler.running):
                saw_mixed = True  # this request arrives while another is mid-decode
            scheduler.add_request(req)
        scheduler.step()
        step += 1
        assert step < 2000
    assert saw_mixed
    assert [r.output_ids for r in reqs] == solo
    assert all(r.finish is not None and r.finish.reason == FinishReason.LENGTH for r in reqs)


@pytest.mark.parametrize("page_size", [1, 4])
def test_small_kv_pool_retracts_and_matches(tiny, make_engine, page_size: int) -> None:
    ckpt = tiny("qwen3")
    reference = [hf_greedy(ckpt.model, p, MAX_NEW) for p in PROMPTS]
    # 64 slots: every request fits alone (≤ 54 tokens) but all eight together need ~250.
    engine = make_engine(ckpt.path, page_size=page_size, max_total_tokens=64, chunked_prefill_size=16)
    reqs, _ = engine.make_requests(input_ids=PROMPTS, sampling_params=GREEDY)
    for req in reqs:
        engine.scheduler.add_request(req)
    peak_running = 0
    for _ in range(5000):
        if not engine.scheduler.has_work:
            break
        engine.step()
        peak_running = max(peak_running, len(engine.scheduler.running))
        kv = engine.get_server_info()["kv_cache"]
        assert 0 <= kv["free_slots"] <= kv["total_slots"] == 64
    assert not engine.scheduler.has_work, "scheduler stalled"
    assert [r.output_ids for r in reqs] == reference
    assert all(r.finish.reason == FinishReason.LENGTH for r in reqs)
    assert peak_running > 1
    assert engine.get_server_info()["internal_states"][0]["num_retractions"] > 0


def test_small_kv_pool_via_generate(tiny, make_engine) -> None:
    ckpt = tiny("llama_tied")
    engine = make_engine(ckpt.path, page_size=2, max_total_tokens=72, chunked_prefill_size=-1)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outputs] == [hf_greedy(ckpt.model, p, MAX_NEW) for p in PROMPTS]


def test_max_running_requests_one(tiny, make_engine) -> None:
    ckpt = tiny("llama")
    engine = make_engine(ckpt.path, max_running_requests=1, page_size=16, chunked_prefill_size=8)
    reqs, _ = engine.make_requests(input_ids=PROMPTS, sampling_params=GREEDY)
    for req in reqs:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work:
        assert len(engine.scheduler.running) <= 1
        engine.step()
    assert [r.output_ids for r in reqs] == [hf_greedy(ckpt.model, p, MAX_NEW) for p in PROMPTS]


def test_prompt_that_never_fits_is_rejected_before_queueing(tiny, make_engine) -> None:
    engine = make_engine(tiny("llama").path, max_total_tokens=32, page_size=1)
    with pytest.raises(ValueError, match=r"40 tokens.*never fit the KV pool \(32 slots\)"):
        engine.generate(input_ids=[[5, 6, 7], [9] * 40], sampling_params=GREEDY)
    assert not engine.scheduler.waiting and not engine.scheduler.running
    # The boundary: a prompt of total_slots - 1 tokens is served (one slot for the first decode step); once the
    # sequence outgrows the whole pool it is aborted (finish "abort") and says why.
    out = engine.generate(
        input_ids=[9] * 31, sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    )
    assert len(out["output_ids"]) == 2
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "the sequence no longer fits the KV pool"}


def test_context_length(tiny, make_engine) -> None:
    engine = make_engine(tiny("llama").path, context_length=32)
    assert engine.get_server_info()["context_length"] == 32
    with pytest.raises(ValueError, match=r"32 tokens; the context length is 32"):
        engine.generate(input_ids=[[3] * 4, [4] * 32], sampling_params=GREEDY)
    assert not engine.scheduler.waiting and not engine.scheduler.running
    # A request that reaches the context length while decoding stops there with finish "length".
    out = engine.generate(
        input_ids=[3] * 28, sampling_params={"temperature": 0, "max_new_tokens": 100, "ignore_eos": True}
    )
    assert len(out["output_ids"]) == 4
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_running_request_frees_kv(tiny, make_engine) -> None:
    engine = make_engine(tiny("llama").path, page_size=4)
    scheduler = engine.scheduler
    total = engine.runner.allocator.total_slots
    reqs, _ = engine.make_requests(input_ids=PROMPTS[:3], sampling_params=GREEDY)
    for req in reqs:
        scheduler.add_request(req)
    while len(reqs[1].output_ids) < 3:
        scheduler.step()
    assert reqs[1] in scheduler.running and reqs[1].pages
    used_by_victim = len(reqs[1].pages) * 4
    free_before = engine.runner.allocator.free_slots
    assert scheduler.abort(reqs[1].rid)
    assert not scheduler.abort("no-such-request")
    done = scheduler.step()
    assert reqs[1] in done
    assert reqs[1] not in scheduler.running and not reqs[1].pages and reqs[1].pool_row is None
    # The step also decoded the other two; their growth is at most one page each.
    assert engine.runner.allocator.free_slots >= free_before + used_by_victim - 2 * 4
    meta = engine.output_of(reqs[1])["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 3 <= meta["completion_tokens"] < MAX_NEW
    run_until_done(engine, [reqs[0], reqs[2]])
    assert engine.runner.allocator.free_slots == total
    assert reqs[0].finish.reason == reqs[2].finish.reason == FinishReason.LENGTH


def test_abort_waiting_request(tiny, make_engine) -> None:
    engine = make_engine(tiny("llama").path, max_running_requests=1)
    reqs, _ = engine.make_requests(input_ids=PROMPTS[:2], sampling_params=GREEDY)
    for req in reqs:
        engine.scheduler.add_request(req)
    engine.step()
    assert reqs[1] in engine.scheduler.waiting
    assert engine.scheduler.abort(reqs[1].rid)
    run_until_done(engine, reqs)
    assert reqs[1].finish.reason == FinishReason.ABORT and reqs[1].output_ids == []
    assert reqs[0].finish.reason == FinishReason.LENGTH


def test_max_new_tokens_finish_length(tiny, make_engine) -> None:
    engine = make_engine(tiny("qwen3").path)
    outputs = engine.generate(
        input_ids=PROMPTS[:3],
        sampling_params=[{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (1, 7, 0)],
    )
    assert [len(o["output_ids"]) for o in outputs] == [1, 7, 0]
    assert [o["meta_info"]["finish_reason"] for o in outputs] == [
        {"type": "length", "length": 1}, {"type": "length", "length": 7}, {"type": "length", "length": 0}
    ]


def test_stop_token_ids_finish_stop(tiny, make_engine) -> None:
    ckpt = tiny("qwen3")
    engine = make_engine(ckpt.path)
    prompt = PROMPTS[3]
    ref = hf_greedy(ckpt.model, prompt, MAX_NEW)
    stop = ref[5]
    cut = ref.index(stop) + 1
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "stop_token_ids": [stop, VOCAB + 7]})
    assert out["output_ids"] == ref[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # A stop id on the prompt only does not stop anything.
    out = engine.generate(
        input_ids=[stop] * 3, sampling_params={**GREEDY, "stop_token_ids": [stop], "max_new_tokens": 1}
    )
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_config_eos_honoured_by_default(tiny, make_engine) -> None:
    ckpt = tiny("llama")
    engine = make_engine(ckpt.path)
    eos = 2  # tiny_models.TINY["eos_token_id"], also the checkpoint's config eos
    prompt = PROMPTS[0]
    ref = hf_greedy(ckpt.model, prompt, MAX_NEW, eos=eos)
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
    assert out["output_ids"] == ref


@pytest.mark.parametrize("bad", [VOCAB, -1, 10_000])
def test_out_of_vocab_token_rejected(tiny, make_engine, bad: int) -> None:
    engine = make_engine(tiny("llama").path)
    with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, {VOCAB}\)"):
        engine.generate(input_ids=[[3, 4], [5, bad, 6]], sampling_params=GREEDY)
    assert not engine.scheduler.waiting


def test_bad_inputs_rejected(tiny, make_engine) -> None:
    engine = make_engine(tiny("llama").path)
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[[3], []])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.generate(input_ids=[3, 4], sampling_params={"stop": "x"})
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        engine.generate(prompt="hello")
    with pytest.raises(ValueError, match="exactly one of prompt or input_ids"):
        engine.generate()
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        engine.generate(input_ids=[[3], [4]], sampling_params=[GREEDY])
    assert not engine.scheduler.waiting


def test_rid_in_flight_rejected(tiny, make_engine) -> None:
    engine = make_engine(tiny("llama").path)
    first, _ = engine.make_requests(input_ids=[3, 4], sampling_params=GREEDY, rid="same")
    engine.scheduler.add_request(first[0])
    second, _ = engine.make_requests(input_ids=[5], sampling_params=GREEDY, rid="same")
    with pytest.raises(ValueError, match="request id 'same' is already in use"):
        engine.scheduler.add_request(second[0])
    engine.step()
    assert engine.scheduler.running == first  # running now, still taken
    with pytest.raises(ValueError, match="request id 'same' is already in use"):
        engine.scheduler.add_request(second[0])
    assert not engine.scheduler.abort("unknown")
    run_until_done(engine, first)
    assert not engine.scheduler.requests_by_rid and not engine.scheduler.abort("same")  # finished: free again
    assert engine.generate(input_ids=[5], sampling_params=GREEDY, rid="same")["meta_info"]["id"] == "same"
    queued, _ = engine.make_requests(input_ids=[6], sampling_params=GREEDY, rid="queued")
    engine.scheduler.add_request(queued[0])
    assert engine.scheduler.abort("queued") and not engine.scheduler.abort("queued")  # aborted once, while queued
    engine.step()
    assert queued[0].finish is not None and not engine.scheduler.requests_by_rid and not engine.scheduler.waiting


def test_duplicate_rids_in_one_batch_rejected(tiny, make_engine) -> None:
    engine = make_engine(tiny("llama").path)
    with pytest.raises(ValueError, match="rid"):
        engine.generate(input_ids=[[3], [4]], sampling_params=GREEDY, rid=["a", "a"])
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_shutdown_aborts_everything(tiny, make_engine) -> None:
    engine = make_engine(tiny("llama").path, max_running_requests=2)
    reqs, _ = engine.make_requests(input_ids=PROMPTS[:4], sampling_params=GREEDY)
    for req in reqs:
        engine.scheduler.add_request(req)
    for _ in range(4):
        engine.step()
    assert engine.scheduler.running and engine.scheduler.waiting
    pool = weakref.ref(engine.runner.kv_pool)
    engine.shutdown()
    assert all(r.finish is not None and r.finish.reason == FinishReason.ABORT for r in reqs)
    assert pool() is None  # NOTE: the KV pool (and with it the device memory) is gone while `engine` is still held
    engine.shutdown()  # a second call does nothing
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=[3], sampling_params=GREEDY)


@pytest.mark.parametrize("page_size", [1, 4])
def test_grow_many_equals_grow_one_by_one(page_size: int) -> None:
    """The decode batch's one-copy table write gives the same pages and req→token rows as per-request grows."""
    import torch

    from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
    from blockspec.request import Req, SamplingParams

    results = []
    for batched in (False, True):
        allocator = PageAllocator(200, page_size)
        table = ReqToTokenTable(3, 64, torch.device("cpu"))
        reqs = [Req([1] * n, SamplingParams()) for n in (3, 9, 1)]
        for req in reqs:
            req.pool_row = table.acquire()
            allocator.grow(req, len(req.all_ids), table)
        for step, extra in enumerate([4, 6, 2]):
            new_lens = [req.allocated_len + extra + i for i, req in enumerate(reqs)]
            if batched:
                allocator.grow_many(reqs, new_lens, table)
            else:
                for req, n in zip(reqs, new_lens):
                    allocator.grow(req, n, table)
            allocator.shrink(reqs[step % 3], reqs[step % 3].allocated_len - 3)
        results.append((table.table.clone(), [list(r.pages) for r in reqs], [r.allocated_len for r in reqs]))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1:] == results[1][1:]


def test_grow_many_refuses_before_changing_anything() -> None:
    """A batch that does not fit leaves every request's pages, length and table row as they were."""
    import torch

    from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
    from blockspec.request import Req, SamplingParams

    allocator = PageAllocator(5, 4)
    table = ReqToTokenTable(3, 16, torch.device("cpu"))
    reqs = [Req([1, 2], SamplingParams()) for _ in range(3)]
    for req in reqs:
        req.pool_row = table.acquire()
        allocator.grow(req, 2, table)
    before = (table.table.clone(), [list(r.pages) for r in reqs], [r.allocated_len for r in reqs], allocator.free_slots)
    with pytest.raises(MemoryError):
        allocator.grow_many(reqs, [8, 8, 8], table)
    after = (table.table.clone(), [list(r.pages) for r in reqs], [r.allocated_len for r in reqs], allocator.free_slots)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
