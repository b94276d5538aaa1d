"""Overlap schedule for greedy DFlash (speculative/pending.py): cycle N+1 is launched from cycle N's device outputs
before the host commits N. Output must equal the synchronous schedule's and target-only output, with requests finishing
mid-pipeline, arriving mid-decode, aborted, retracted, and mixed with sampled requests; acceptance stats equal the
synchronous schedule's when nothing is retracted (the slots reserved ahead shift when a small pool retracts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from blockspec import Engine
from blockspec.request import Req
from blockspec.scheduler import step_executor
from blockspec.scheduler.step_executor import GROW_AHEAD_SLOTS
from blockspec.speculative.dflash import next_cycle_rows
from blockspec.worker.inflight import InFlightStep
from blockspec.worker.target_worker import next_decode_rows
from tests.support.draft_training import save_trained_pair
from tests.support.engine_testing import assert_engine_idle

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("dflash.model")

PROMPTS = [[5 + i for i in range(n)] for n in (1, 3, 7, 12, 20, 33, 5, 9, 26)]
MAX_NEW = [48, 5, 17, 30, 2, 41, 9, 48, 23]  # finishes spread over many cycles


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_trained_pair(tmp_path_factory.mktemp("overlap"))


def engine_for(root: Path, draft: bool = True, **extra: Any) -> Engine:
    args: dict[str, Any] = dict(
        model_path=str(root / "target"), device="cpu", dtype="float32", page_size=4, max_total_tokens=4096,
        chunked_prefill_size=16, skip_tokenizer_init=True,
    )
    if draft:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
    args.update(extra)
    return Engine(**args)


def greedy(max_new: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def run(engine: Engine, prompts: list[list[int]], max_new: list[int]) -> tuple[list[Req], int]:
    """Adds the requests, steps to the end; returns them and how many steps left a cycle in flight."""
    reqs, _ = engine.make_requests(input_ids=prompts, sampling_params=[greedy(n) for n in max_new])
    for req in reqs:
        engine.scheduler.add_request(req)
    overlapped = 0
    while engine.scheduler.has_work:
        engine.step()
        overlapped += engine.scheduler.steps.in_flight is not None
    return reqs, overlapped


def test_overlap_equals_synchronous_and_target(root: Path) -> None:
    expected = [o["output_ids"] for o in engine_for(root, draft=False).generate(
        input_ids=PROMPTS, sampling_params=[greedy(n) for n in MAX_NEW])]
    sync_engine = engine_for(root, disable_overlap_schedule=True)
    sync_reqs, sync_overlapped = run(sync_engine, PROMPTS, MAX_NEW)
    engine = engine_for(root)
    reqs, overlapped = run(engine, PROMPTS, MAX_NEW)
    assert sync_overlapped == 0 and overlapped > 10
    assert [r.output_ids for r in reqs] == [r.output_ids for r in sync_reqs] == expected
    assert [r.spec_accept_lengths for r in reqs] == [r.spec_accept_lengths for r in sync_reqs]
    assert engine.scheduler.spec.as_dict() == sync_engine.scheduler.spec.as_dict()
    assert [r.finish.to_dict() for r in reqs] == [r.finish.to_dict() for r in sync_reqs]  # type: ignore[union-attr]
    assert_engine_idle(engine)


@pytest.mark.parametrize("draft", [True, False], ids=["dflash", "target"])
def test_arrivals_and_aborts_mid_pipeline(root: Path, draft: bool) -> None:
    """Requests join while a cycle is in flight (the extend step commits it while the extend runs, and launches the
    next cycle behind the extend for the old requests and the new ones, whose first tokens stay on the device), others
    are aborted with one in flight."""
    expected = engine_for(root, draft=False).generate(input_ids=PROMPTS, sampling_params=greedy(40))
    engine = engine_for(root, draft=draft)
    scheduler = engine.scheduler
    reqs, _ = engine.make_requests(input_ids=PROMPTS, sampling_params=greedy(40))
    for req in reqs[:3]:
        scheduler.add_request(req)
    later = list(reqs[3:])
    aborted: set[str] = set()
    step = committed_over_extend = launched_over_extend = 0
    while scheduler.has_work or later:
        before, extends = scheduler.steps.in_flight, scheduler.num_extend_steps
        admitted = {id(r) for r in scheduler.running if r.in_prefill} | {id(r) for r in scheduler.waiting}
        scheduler.step()
        step += 1
        after = scheduler.steps.in_flight
        if scheduler.num_extend_steps > extends and before is not None:
            assert after is not before and all(r.kv_len + 1 == len(r.all_ids) for r in before.reqs if not r.finished)
            committed_over_extend += 1
        if scheduler.num_extend_steps > extends and after is not None:
            # NOTE: launched behind the extend: its new requests' first tokens are committed, their next step in flight
            new = [r for r in after.reqs if id(r) in admitted]
            assert new and all(r.kv_len + 1 == len(r.all_ids) == r.prompt_len + 1 for r in new if not r.finished)
            launched_over_extend += 1
        if later and step % 4 == 0 and scheduler.steps.in_flight is not None:
            scheduler.add_request(later.pop(0))
        if step >= 9 and not aborted and scheduler.steps.in_flight is not None:
            victim = scheduler.steps.in_flight.reqs[0]
            assert scheduler.abort(victim.rid)
            aborted.add(victim.rid)
    assert committed_over_extend > 0 and launched_over_extend > 0
    assert aborted
    for req, want in zip(reqs, expected):
        if req.rid in aborted:
            assert req.finish is not None and req.finish.reason.value == "abort"
            assert req.output_ids == want["output_ids"][: len(req.output_ids)]
        else:
            assert req.output_ids == want["output_ids"]
    assert_engine_idle(engine)


def test_small_pool_falls_back_and_retracts(root: Path) -> None:
    """Too few free slots for two blocks ahead: the step drains and runs synchronously (and may retract)."""
    expected = engine_for(root, draft=False).generate(input_ids=PROMPTS, sampling_params=greedy(48))
    engine = engine_for(root, max_total_tokens=160)
    reqs, overlapped = run(engine, PROMPTS, [48] * len(PROMPTS))
    assert [r.output_ids for r in reqs] == [o["output_ids"] for o in expected]
    assert engine.scheduler.num_retractions > 0 and overlapped > 0
    assert_engine_idle(engine)


def test_sampled_request_drains_the_pipeline(root: Path) -> None:
    """A sampled request in the batch switches to the synchronous cycle; greedy ones stay lossless."""
    expected = engine_for(root, draft=False).generate(input_ids=PROMPTS[:4], sampling_params=greedy(30))
    engine = engine_for(root)
    params = [greedy(30)] * 4 + [{"temperature": 0.8, "max_new_tokens": 12, "seed": 1, "ignore_eos": True}]
    outputs = engine.generate(input_ids=PROMPTS[:5], sampling_params=params)
    assert [o["output_ids"] for o in outputs[:4]] == [o["output_ids"] for o in expected]
    assert len(outputs[4]["output_ids"]) == 12
    assert engine.scheduler.steps.in_flight is None or all(r.finished for r in engine.scheduler.steps.in_flight.reqs)
    assert_engine_idle(engine)


def test_next_cycle_rows_from_device_outputs() -> None:
    block = 4
    mask = 7
    rows = torch.tensor([[11, mask, mask, mask, 3, 20], [12, mask, mask, mask, 5, 30], [13, mask, mask, mask, 6, 40]])
    # [accepted | d_1..d_3 | target x 4]
    tokens = torch.tensor([
        [2, 21, 22, 23, 21, 22, 50, 51],
        [0, 31, 32, 33, 60, 61, 62, 63],
        [3, 41, 42, 43, 41, 42, 43, 70],
    ])
    cycle = InFlightStep([], rows, tokens, tokens, None)
    assert next_cycle_rows(cycle, None, block, mask).tolist() == [
        [50, mask, mask, mask, 3, 23], [60, mask, mask, mask, 5, 31], [70, mask, mask, mask, 6, 44],
    ]
    picked = next_cycle_rows(cycle, torch.tensor([2, 0]), block, mask).tolist()
    assert picked == [[70, mask, mask, mask, 6, 44], [50, mask, mask, mask, 3, 23]]
    # NOTE: the next cycle may verify another length: kv_len (seq_len - 4 here) + accepted + 1 + its own length
    assert next_cycle_rows(cycle, None, 1, mask).tolist() == [[50, 3, 20], [60, 5, 28], [70, 6, 41]]
    assert next_cycle_rows(cycle, None, 2, mask).tolist() == [[50, mask, 3, 21], [60, mask, 5, 29], [70, mask, 6, 42]]
    short = InFlightStep([], torch.tensor([[11, 3, 17]]), torch.tensor([[0, 40]]), torch.tensor([[0, 40]]), None)
    assert next_cycle_rows(short, None, 4, mask).tolist() == [[40, mask, mask, mask, 3, 21]]  # after a plain decode


def test_flag_turns_overlap_off(root: Path) -> None:
    assert engine_for(root).scheduler.steps.overlap
    assert not engine_for(root, disable_overlap_schedule=True).scheduler.steps.overlap
    assert engine_for(root, draft=False).scheduler.steps.overlap  # target-only greedy decode overlaps too
    with pytest.raises(ValueError, match="disable_overlap_schedule"):
        engine_for(root, disable_overlap_schedule="yes")


def test_target_only_overlap_equals_synchronous(root: Path) -> None:
    """Target-only greedy decode overlaps too (next token = the device argmax): same tokens and finishes."""
    sync_reqs, sync_overlapped = run(engine_for(root, draft=False, disable_overlap_schedule=True), PROMPTS, MAX_NEW)
    engine = engine_for(root, draft=False)
    reqs, overlapped = run(engine, PROMPTS, MAX_NEW)
    assert sync_overlapped == 0 and overlapped > 20
    assert [r.output_ids for r in reqs] == [r.output_ids for r in sync_reqs]
    assert [len(r.output_ids) for r in reqs] == MAX_NEW
    assert [r.finish.to_dict() for r in reqs] == [r.finish.to_dict() for r in sync_reqs]  # type: ignore[union-attr]
    assert engine.scheduler.spec.verify_ct == 0
    assert_engine_idle(engine)


def test_next_decode_rows_from_device_outputs() -> None:
    rows = torch.tensor([[11, 3, 20], [12, 5, 30]])
    tokens = torch.tensor([[40], [41]])
    cycle = InFlightStep([], rows, tokens, tokens, None)
    assert next_decode_rows(cycle, None).tolist() == [[40, 3, 21], [41, 5, 31]]
    assert next_decode_rows(cycle, torch.tensor([1])).tolist() == [[41, 5, 31]]
    # NOTE: a step whose graph computed the next rows (GraphKind.GREEDY_DECODE) hands them on as they are
    computed = torch.tensor([[40, 3, 21], [41, 5, 31]])
    step = InFlightStep([], rows, computed[:, :1], computed[:, :1], None, next_rows=computed)
    assert next_decode_rows(step, None) is computed
    assert next_decode_rows(step, torch.tensor([1])).tolist() == [[41, 5, 31]]


@pytest.mark.parametrize("draft", [True, False], ids=["dflash", "target"])
def test_first_token_that_finishes_a_request_discards_its_launched_step(root: Path, draft: bool) -> None:
    """A request whose first token ends it (max_new_tokens 1, or a stop token) had its first decode step launched
    behind the extend: that step is discarded, its slots come back, the other requests' outputs are unchanged."""
    first = [
        o["output_ids"][0] for o in engine_for(root, draft=False).generate(input_ids=PROMPTS, sampling_params=greedy(1))
    ]
    params = [greedy(1), greedy(6), {**greedy(6), "ignore_eos": False, "stop_token_ids": [first[2]]}, *[greedy(9)] * 6]
    expected = engine_for(root, draft=False).generate(input_ids=PROMPTS, sampling_params=params)
    engine = engine_for(root, draft=draft)
    reqs, _ = engine.make_requests(input_ids=PROMPTS, sampling_params=params)
    for req in reqs:
        engine.scheduler.add_request(req)
    launched_with_first = 0
    while engine.scheduler.has_work:
        extends = engine.scheduler.num_extend_steps
        engine.step()
        in_flight = engine.scheduler.steps.in_flight
        if engine.scheduler.num_extend_steps > extends and in_flight is not None:
            launched_with_first += any(r is reqs[0] or r is reqs[2] for r in in_flight.reqs)
    assert launched_with_first > 0
    assert [r.output_ids for r in reqs] == [o["output_ids"] for o in expected]
    assert reqs[0].output_ids == [first[0]] and reqs[2].output_ids == [first[2]]
    assert_engine_idle(engine)


@pytest.mark.parametrize("draft", [True, False], ids=["dflash", "target"])
def test_decoding_runs_ahead_of_a_prompt_still_in_chunks(root: Path, draft: bool) -> None:
    """A long prompt arrives while others decode: its extend steps complete no prompt, yet the decoding requests' next
    step is queued behind each chunk; every output equals target-only."""
    prompts = [[5, 6, 7], [9, 8, 7, 6], [(11 + 7 * i) % 90 + 3 for i in range(50)]]
    expected = engine_for(root, draft=False).generate(input_ids=prompts, sampling_params=greedy(24))
    engine = engine_for(root, draft=draft, disable_radix_cache=True)
    scheduler = engine.scheduler
    reqs, _ = engine.make_requests(input_ids=prompts, sampling_params=greedy(24))
    scheduler.add_request(reqs[0])
    scheduler.add_request(reqs[1])
    for _ in range(3):
        scheduler.step()
    scheduler.add_request(reqs[2])
    behind_chunks = 0
    while scheduler.has_work:
        extends = scheduler.num_extend_steps
        chunked = reqs[2].in_prefill
        scheduler.step()
        in_flight = scheduler.steps.in_flight
        if scheduler.num_extend_steps > extends and reqs[2].in_prefill and chunked and in_flight is not None:
            assert reqs[2] not in in_flight.reqs and {id(reqs[0]), id(reqs[1])} <= {id(r) for r in in_flight.reqs}
            behind_chunks += 1
    assert behind_chunks >= 2  # NOTE: 50 tokens in chunks of 16: three chunks complete no prompt
    assert [r.output_ids for r in reqs] == [o["output_ids"] for o in expected]
    assert_engine_idle(engine)


@pytest.mark.parametrize("roomy", [True, False], ids=["roomy", "tight"])
def test_a_request_short_of_slots_grows_ahead_while_the_pool_is_roomy(root: Path, roomy: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ahead, a target-only request that must grow takes GROW_AHEAD_SLOTS more slots (so most steps write no
    req→token row) while the free pool is roomy, exactly what the next two steps need otherwise; the tokens are the
    synchronous schedule's either way, and every slot comes back."""
    prompts, max_new = PROMPTS[:4], [64] * 4
    expected = [r.output_ids for r in run(engine_for(root, draft=False, disable_overlap_schedule=True), prompts,
                                          max_new)[0]]
    engine = engine_for(root, draft=False, page_size=1)
    if not roomy:  # NOTE: no pool is roomy enough
        monkeypatch.setattr(step_executor, "ROOMY_POOL_FACTOR", engine.scheduler.steps.allocator.total_slots + 1)
    table, growths, write_runs = engine.scheduler.steps.table, [], engine.scheduler.steps.table.write_runs
    monkeypatch.setattr(table, "write_runs", lambda rows, *args: (growths.append(len(rows)), write_runs(rows, *args)))
    reqs, overlapped = run(engine, prompts, max_new)
    assert [r.output_ids for r in reqs] == expected and overlapped > 50
    # NOTE: a decode step without the slack grows every request by one slot; with it the batch grows together
    if roomy:
        assert sum(growths) <= len(prompts) * (64 // (GROW_AHEAD_SLOTS // 2) + 2) and len(growths) <= 64 // 4, growths
    else:
        assert sum(growths) > len(prompts) * 60
    assert_engine_idle(engine)
