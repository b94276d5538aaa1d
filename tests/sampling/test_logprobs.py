"""Logprobs (CPU, fp32): the target's log-probabilities of the output tokens and its top-k per position, equal to
HF's log_softmax over the same sequence, for target-only decoding, DFlash (from the verify forward: identical to
target-only), mixed batches and seeded sampling; requests that ask for them never run ahead (overlap)."""
from __future__ import annotations

from typing import Any

import pytest

from tests.support.draft_training import cpu_engine
from tests.support.engine_testing import random_prompts
from tests.support.logprob_reference import TOP_N, check_against_hf

PROMPTS = random_prompts([5, 12, 3, 30], seed=5)
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SAMPLED = {"temperature": 0.7, "top_k": 20, "seed": 3, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(trained_pair: dict[str, Any]) -> dict[str, Any]:
    return trained_pair


engine_for = cpu_engine


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_logprobs_equal_hf(models: dict[str, Any], spec: bool, params: dict[str, Any]) -> None:
    engine = engine_for(models["root"], spec)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True, top_logprobs_num=TOP_N)
    for prompt, out in zip(PROMPTS, outs):
        check_against_hf(models["target"], prompt, out)
    plain = engine_for(models["root"], spec).generate(input_ids=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]  # asking for logprobs changes nothing
    assert all("output_token_logprobs" not in o["meta_info"] for o in plain)
    if spec and params is GREEDY:
        assert max(o["meta_info"]["spec_accept_length"] for o in outs) > 1.5  # blocks of several tokens were scored


def test_logprobs_in_mixed_batches_and_with_stops(models: dict[str, Any]) -> None:
    engine = engine_for(models["root"], True, enable_mixed_chunk=True)
    first = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    stop_at = first[7]  # NOTE: a stop token inside a verified block cuts the logprobs with the tokens
    params = [{**GREEDY, "stop_token_ids": [stop_at]}, GREEDY, GREEDY, GREEDY]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=[True, False, True, True],
                           top_logprobs_num=[TOP_N, 0, TOP_N, TOP_N])
    assert outs[0]["output_ids"][-1] == stop_at and len(outs[0]["output_ids"]) <= 8
    assert "output_token_logprobs" not in outs[1]["meta_info"]
    for index in (0, 2, 3):
        check_against_hf(models["target"], PROMPTS[index], outs[index])


def test_logprob_requests_do_not_run_ahead(models: dict[str, Any]) -> None:
    engine = engine_for(models["root"], True)
    reqs, _ = engine.make_requests(input_ids=PROMPTS[:2], sampling_params=GREEDY, return_logprob=True)
    assert not engine.worker.can_run_ahead(reqs)
    plain, _ = engine.make_requests(input_ids=PROMPTS[:2], sampling_params=GREEDY)
    assert engine.worker.can_run_ahead(plain)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"return_logprob": "yes"}, "return_logprob must be"),
        ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"top_logprobs_num": 2}, "needs return_logprob"),
        ({"return_logprob": [True]}, "got 1 return_logprob for 2 prompts"),
        ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num must be at most 20"),
    ],
)
def test_bad_logprob_arguments(models: dict[str, Any], kwargs: dict[str, Any], message: str) -> None:
    engine = engine_for(models["root"], False)
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY, **kwargs)
    assert not engine.scheduler.waiting
