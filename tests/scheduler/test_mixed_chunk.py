"""--enable-mixed-chunk (CPU, fp32): one forward carries the arrivals' prefill chunks with the running requests'
decode tokens or DFlash verify blocks. Outputs equal HF greedy, and mixed and unmixed runs commit the same tokens
with the same per-cycle acceptance (greedy and seeded sampling), KV fully free after."""
from __future__ import annotations

from typing import Any, Optional

import pytest

from blockspec import Engine
from tests.support.engine_testing import assert_engine_idle, hf_greedy, random_prompts, run_until_done
from tests.support.staggered_arrivals import staggered_run

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
EARLY_PROMPTS = random_prompts([7, 9, 3], seed=3)
LATE_TAILS = random_prompts([30, 12, 41], seed=4)
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(trained_pair: dict[str, Any]) -> dict[str, Any]:
    return trained_pair


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_greedy_equals_hf_and_unmixed(models: dict[str, Any], spec: bool, page_size: int) -> None:
    runs = {mixed: staggered_run(models["root"], spec, mixed, GREEDY, page_size) for mixed in (False, True)}
    (plain, plain_reqs), (mixed, mixed_reqs) = runs[False], runs[True]
    assert mixed.scheduler.steps.mixed_steps > 0 and plain.scheduler.steps.mixed_steps == 0
    # NOTE: greedy target-only mixed steps go behind the decode step in flight; DFlash's drain it first
    assert (mixed.scheduler.steps.mixed_steps_ahead > 0) == (not spec)
    assert mixed.get_server_info()["internal_states"][0]["num_mixed_steps"] == mixed.scheduler.steps.mixed_steps
    for a, b in zip(plain_reqs, mixed_reqs):
        assert b.output_ids == hf_greedy(models["target"], b.all_ids[:b.prompt_len], GREEDY["max_new_tokens"])
        assert a.output_ids == b.output_ids
        assert a.spec_accept_lengths == b.spec_accept_lengths  # per-cycle acceptance unchanged by mixing
    if spec:
        assert sum(sum(r.spec_accept_lengths) - len(r.spec_accept_lengths) for r in mixed_reqs) > 0
    for engine, _ in runs.values():
        assert_engine_idle(engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_steps_ahead_after_requests_finish_in_flight(models: dict[str, Any], page_size: int) -> None:
    """Early requests end (their token limit) in the decode steps that run while the late prompts' chunks arrive, so
    a mixed step is launched behind a step in flight that finishes some of its decode rows: those commit nothing
    more, and every request's tokens equal HF greedy and the unmixed run's."""
    early = {**GREEDY, "max_new_tokens": 5}
    runs = {mixed: staggered_run(models["root"], False, mixed, GREEDY, page_size, early_params=early)
            for mixed in (False, True)}
    (plain, plain_reqs), (mixed, mixed_reqs) = runs[False], runs[True]
    assert mixed.scheduler.steps.mixed_steps_ahead > 0
    for a, b in zip(plain_reqs, mixed_reqs):
        limit = b.params.max_new_tokens
        assert b.output_ids == hf_greedy(models["target"], b.all_ids[:b.prompt_len], limit)
        assert a.output_ids == b.output_ids
    assert [len(r.output_ids) for r in mixed_reqs] == [5] * 3 + [GREEDY["max_new_tokens"]] * 4
    for engine, _ in runs.values():
        assert_engine_idle(engine)


def test_mixed_steps_ahead_with_aborts_stops_and_cached_prefixes(models: dict[str, Any]) -> None:
    """Mixed steps behind the step in flight while a running request is aborted, another stops on a stop token, and
    the late prompts extend an early one's prompt (radix cache hits): every other request's tokens equal the unmixed
    run's and HF greedy."""
    def run(mixed: bool, stop: Optional[int]) -> tuple[Engine, list[Any]]:
        engine = Engine(model_path=str(models["root"] / "target"), device="cpu", dtype="float32", page_size=1,
                        max_total_tokens=2048, chunked_prefill_size=16, skip_tokenizer_init=True,
                        enable_mixed_chunk=mixed)
        early_params = [dict(GREEDY), dict(GREEDY), dict(GREEDY)]
        if stop is not None:
            early_params[1]["stop_token_ids"] = [stop]
        early, _ = engine.make_requests(input_ids=[EARLY_PROMPTS[0] * 3, *EARLY_PROMPTS[1:]],
                                        sampling_params=early_params)
        for req in early:
            engine.scheduler.add_request(req)
        for _ in range(3):
            engine.step()
        late, _ = engine.make_requests(input_ids=[EARLY_PROMPTS[0] * 3 + tail for tail in LATE_TAILS],
                                       sampling_params=GREEDY)
        for req in late:
            engine.scheduler.add_request(req)
        engine.scheduler.abort(early[2].rid)
        run_until_done(engine, [req for req in early + late if not req.finished])
        return engine, early + late

    _, probe = run(False, None)
    ids = probe[1].output_ids
    # NOTE: request 1 then stops after the late arrivals (its 5th token comes in the 5th step), at the first token
    # from its 5th on not seen before it (the tiny target soon repeats itself)
    stop_at = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])
    stop = ids[stop_at]
    runs = {mixed: run(mixed, stop) for mixed in (False, True)}
    (plain, plain_reqs), (mixed, mixed_reqs) = runs[False], runs[True]
    assert mixed.scheduler.steps.mixed_steps_ahead > 0
    assert mixed_reqs[2].finish is not None and mixed_reqs[2].finish.reason.name == "ABORT"
    assert len(mixed_reqs[1].output_ids) == stop_at + 1 and mixed_reqs[1].output_ids[-1] == stop
    assert mixed.get_server_info()["internal_states"][0]["radix_cache"]["cached_tokens_total"] > 0
    for index, (a, b) in enumerate(zip(plain_reqs, mixed_reqs)):
        assert a.output_ids == b.output_ids, index
        if index not in (1, 2):
            assert b.output_ids == hf_greedy(models["target"], b.all_ids[:b.prompt_len], GREEDY["max_new_tokens"])
    for engine, _ in runs.values():
        assert_engine_idle(engine)


@pytest.mark.parametrize("spec", [False, True])
def test_mixed_seeded_sampling_equals_unmixed(models: dict[str, Any], spec: bool) -> None:
    outputs: dict[bool, list[tuple[list[int], list[int]]]] = {}
    for mixed in (False, True):
        engine, reqs = staggered_run(models["root"], spec, mixed, SAMPLED, 1)
        outputs[mixed] = [(r.output_ids, r.spec_accept_lengths) for r in reqs]
        assert_engine_idle(engine)
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("params", [GREEDY, {**GREEDY, "frequency_penalty": 0.5}], ids=["greedy", "penalised"])
def test_mixed_steps_beside_a_draft_tree_stay_lossless(models: dict[str, Any], params: dict[str, Any]) -> None:
    """With a tree budget a mixed step verifies the full block's chain inside the extend forward, the decode steps
    between verify trees: the same tokens as unmixed, HF's where greedy."""
    runs = {mixed: staggered_run(models["root"], True, mixed, params, 4, speculative_tree_budget=8)
            for mixed in (False, True)}
    (plain, plain_reqs), (mixed, mixed_reqs) = runs[False], runs[True]
    assert mixed.scheduler.steps.mixed_steps > 0
    assert [r.output_ids for r in mixed_reqs] == [r.output_ids for r in plain_reqs]
    if params is GREEDY:
        for req in mixed_reqs:
            assert req.output_ids == hf_greedy(models["target"], req.all_ids[:req.prompt_len], GREEDY["max_new_tokens"])
    assert max(max(r.spec_accept_lengths) for r in mixed_reqs) > 2
    for engine, _ in runs.values():
        assert_engine_idle(engine)


def test_mixed_flag_validated(models: dict[str, Any]) -> None:
    bad: Optional[str] = "yes"
    with pytest.raises(ValueError, match="enable_mixed_chunk"):
        Engine(model_path=str(models["root"] / "target"), device="cpu", enable_mixed_chunk=bad)
