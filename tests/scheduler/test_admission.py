"""--max-prefill-wait-steps (admission.py; CPU, fp32): arrivals that come one per step while others decode are held
and admitted together in one extend step, at most N steps after the first of them; greedy outputs equal HF greedy
and the unbatched run, with the same per-cycle acceptance under DFlash; KV fully free after."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from blockspec import Engine
from blockspec.request import Req
from blockspec.scheduler.admission import ArrivalBatching
from blockspec.server.args import parse_serve_args
from tests.support.engine_testing import assert_engine_idle, hf_greedy, random_prompts, run_until_done
from tests.support.tiny_models import save_tiny_model

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
EARLY = random_prompts([5, 9, 3], seed=1)
LATE = random_prompts([17, 6, 11], seed=2)
WAIT = 4


def test_hold_policy() -> None:
    arrivals = ArrivalBatching(3)
    assert [arrivals.hold(step, 10, 100, decoding=True, extending=False) for step in range(1, 6)] == \
        [True, True, True, False, True]  # NOTE: released 3 steps after the first hold, then a new window
    assert arrivals.held_steps == 4
    cases = [dict(waiting_tokens=0, step_tokens=100, decoding=True, extending=False),  # nothing to hold
             dict(waiting_tokens=100, step_tokens=100, decoding=True, extending=False),  # a full extend step
             dict(waiting_tokens=10, step_tokens=100, decoding=False, extending=False),  # nothing decodes
             dict(waiting_tokens=10, step_tokens=100, decoding=True, extending=True)]  # an extend step runs anyway
    for case in cases:
        assert not ArrivalBatching(3).hold(1, **case), case
    assert not ArrivalBatching(0).hold(1, 10, 100, decoding=True, extending=False)
    owed = ArrivalBatching(3)
    assert owed.hold(1, 10, 100, decoding=True, extending=False)
    owed.release_next()  # NOTE: the head waited a step for an in-batch prefix: admitted next, not held again
    assert [owed.hold(step, 10, 100, decoding=True, extending=False) for step in range(2, 5)] == [False, True, True]


def test_cost_policy_releases_once_holding_cost_an_extend_step() -> None:
    arrivals = ArrivalBatching(10, "cost")
    assert arrivals.extend_cost(4) is None  # NOTE: no step timed yet: held as `fixed` holds
    assert [arrivals.hold(step, 10, 100, True, False, num_decoding=4, admissible=2) for step in range(1, 13)] == \
        [True] * 10 + [False, True]
    arrivals = ArrivalBatching(10, "cost")
    arrivals.observe(0.003, extended=True)
    arrivals.observe(0.001, extended=False)
    arrivals.observe(0.001, extended=False)
    assert arrivals.extend_cost(4) == pytest.approx(12.0)  # 4 running requests stall for 3 decode steps
    # NOTE: 2 held requests a step: held cost 0, 2, .., 10 before each hold; at 12 they go, then a new window
    assert [arrivals.hold(step, 10, 100, True, False, num_decoding=4, admissible=2) for step in range(1, 9)] == \
        [True] * 6 + [False, True]
    assert arrivals.held_steps == 7
    capped = ArrivalBatching(3, "cost")
    capped.observe(1.0, extended=True)
    capped.observe(0.001, extended=False)
    assert [capped.hold(step, 10, 100, True, False, num_decoding=64, admissible=1) for step in range(1, 5)] == \
        [True, True, True, False]  # NOTE: never past --max-prefill-wait-steps, however dear an extend step is
    full = ArrivalBatching(3, "cost")
    full.observe(0.003, extended=True)
    full.observe(0.001, extended=False)
    # NOTE: no free row: holding costs nothing, and the window runs on as under `fixed`
    assert [full.hold(step, 10, 100, True, False, num_decoding=4, admissible=0) for step in range(1, 5)] == \
        [True, True, True, False]
    mixed = ArrivalBatching(8, "cost", extend_decodes=True)
    mixed.observe(0.003, extended=True)
    mixed.observe(0.001, extended=False)
    assert mixed.extend_cost(4) == pytest.approx(8.0)  # the extend step decodes too: 2 steps of stall, not 3
    free = ArrivalBatching(8, "cost")
    free.observe(0.0, extended=True)
    free.observe(0.001, extended=False)
    assert free.extend_cost(4) is None  # NOTE: an untimed (zero) extend step is no reason never to hold
    capped.observe(2.0, extended=True)
    assert capped.extend_seconds == pytest.approx(1.1)  # a running average, not the last step
    with pytest.raises(ValueError, match="policy"):
        ArrivalBatching(1, "adaptive")


def test_flag_validated(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path / "target")
    with pytest.raises(ValueError, match="max_prefill_wait_steps"):
        Engine(model_path=str(tmp_path / "target"), device="cpu", max_prefill_wait_steps=-1)
    with pytest.raises(ValueError, match="prefill_wait_policy"):
        Engine(model_path=str(tmp_path / "target"), device="cpu", prefill_wait_policy="soon")


def test_serve_default_waits_one_step_under_dflash() -> None:
    plain = ["--model-path", "/m"]
    spec = [*plain, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/d"]
    assert parse_serve_args(plain).engine["max_prefill_wait_steps"] == 0
    assert parse_serve_args(spec).engine["max_prefill_wait_steps"] == 1
    assert parse_serve_args([*spec, "--max-prefill-wait-steps", "0"]).engine["max_prefill_wait_steps"] == 0
    assert parse_serve_args([*plain, "--max-prefill-wait-steps", "3"]).engine["max_prefill_wait_steps"] == 3


@pytest.fixture(scope="module")
def models(trained_pair: dict[str, Any]) -> dict[str, Any]:
    return trained_pair


def trickle_run(root: Path, spec: bool, wait_steps: int, policy: str = "fixed") -> tuple[Engine, list[Req], list[int]]:
    """Early requests decode; the late ones arrive one per step. Returns the waiting-queue length after each step."""
    args: dict[str, Any] = dict(model_path=str(root / "target"), device="cpu", dtype="float32", max_total_tokens=2048,
                                skip_tokenizer_init=True, max_prefill_wait_steps=wait_steps,
                                prefill_wait_policy=policy)
    if spec:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
    engine = Engine(**args)
    early, _ = engine.make_requests(input_ids=EARLY, sampling_params=GREEDY)
    late, _ = engine.make_requests(input_ids=LATE, sampling_params=GREEDY)
    for req in early:
        engine.scheduler.add_request(req)
    queue_lengths = []
    for step in range(2 + len(late) + WAIT):
        if 2 <= step < 2 + len(late):
            engine.scheduler.add_request(late[step - 2])
        engine.step()
        queue_lengths.append(len(engine.scheduler.waiting))
    return engine, run_until_done(engine, early + late), queue_lengths


@pytest.mark.parametrize("spec", [False, True])
def test_trickled_arrivals_are_admitted_together_and_lossless(models: dict[str, Any], spec: bool) -> None:
    plain, plain_reqs, plain_queue = trickle_run(models["root"], spec, 0)
    held, held_reqs, held_queue = trickle_run(models["root"], spec, WAIT)
    assert max(plain_queue) == 0 and plain.scheduler.arrivals.held_steps == 0
    # NOTE: steps 2, 3, 4 bring one arrival each; the first is held in WAIT steps (2..5), and the step after them
    # admits the three together.
    assert held_queue[2:2 + len(LATE)] == [1, 2, 3] and max(held_queue) == len(LATE)
    assert held_queue.index(0, 2) - 2 <= WAIT + 1
    assert held.get_server_info()["internal_states"][0]["num_steps_arrivals_held"] == WAIT
    assert held.get_server_info()["max_prefill_wait_steps"] == WAIT
    for a, b in zip(plain_reqs, held_reqs):
        assert b.output_ids == hf_greedy(models["target"], b.all_ids[:b.prompt_len], GREEDY["max_new_tokens"])
        assert a.output_ids == b.output_ids
        assert a.spec_accept_lengths == b.spec_accept_lengths  # NOTE: the draft context does not depend on batching
    if spec:
        assert sum(sum(r.spec_accept_lengths) - len(r.spec_accept_lengths) for r in held_reqs) > 0
    for engine in (plain, held):
        assert_engine_idle(engine)


def test_cost_policy_is_lossless(models: dict[str, Any]) -> None:
    """The cost policy releases on this machine's own step timings, so when is not fixed here; outputs and per-cycle
    acceptance are, whatever it decides."""
    plain, plain_reqs, _ = trickle_run(models["root"], True, 0)
    costed, costed_reqs, costed_queue = trickle_run(models["root"], True, WAIT, "cost")
    assert max(costed_queue) >= 1 and 1 <= costed.scheduler.arrivals.held_steps <= WAIT
    assert costed.get_server_info()["prefill_wait_policy"] == "cost"
    for a, b in zip(plain_reqs, costed_reqs):
        assert a.output_ids == b.output_ids and a.spec_accept_lengths == b.spec_accept_lengths
    for engine in (plain, costed):
        assert_engine_idle(engine)


def test_a_deep_queue_is_held_by_what_the_free_rows_admit(models: dict[str, Any]) -> None:
    """Every request submitted at once (the offline engine, a saturated server), two rows: the two running requests
    finish a step apart, and the queue behind them holds more prompt tokens than an extend step takes. The first freed
    row could admit one prompt only, so it is held a step and the second row's prompt joins it: one extend step per
    pair (before, the whole queue's tokens read as a full step, and each freed row ran an extend step of its own).
    Outputs equal the run without holding and HF greedy."""
    prompts = random_prompts([9, 12, 7, 10, 8, 11], seed=5)
    lengths = [10, 11] * 3

    def run(wait_steps: int) -> tuple[Engine, list[Req], int]:
        engine = Engine(model_path=str(models["root"] / "target"), device="cpu", dtype="float32",
                        max_total_tokens=2048, skip_tokenizer_init=True, max_running_requests=2,
                        chunked_prefill_size=24, max_prefill_wait_steps=wait_steps)
        reqs = [engine.make_requests(input_ids=[ids], sampling_params=dict(GREEDY, max_new_tokens=n))[0][0]
                for ids, n in zip(prompts, lengths)]
        for req in reqs:
            engine.scheduler.add_request(req)
        admissions, queue, pending = 0, len(reqs), {req.rid for req in reqs}
        for _ in range(1000):
            pending -= {req.rid for req in engine.step()}
            admissions += len(engine.scheduler.waiting) < queue
            queue = len(engine.scheduler.waiting)
            if not pending:
                break
        assert not pending
        return engine, reqs, admissions

    plain, plain_reqs, plain_admissions = run(0)
    held, held_reqs, held_admissions = run(2)
    assert plain_admissions == 5 and held_admissions == 3  # NOTE: the first pair, then 2 pairs in 4 steps or 2
    for a, b in zip(plain_reqs, held_reqs):
        assert a.output_ids == b.output_ids
        assert b.output_ids == hf_greedy(models["target"], b.all_ids[:b.prompt_len], len(b.output_ids))
    for engine in (plain, held):
        assert_engine_idle(engine)
