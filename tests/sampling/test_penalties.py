"""Penalties and biases (CPU, fp32): frequency/presence/repetition penalties, min_new_tokens and logit_bias give the
tokens of a plain HF greedy loop that applies the same rules (tests/support/penalty_reference.py), for target-only
decoding and DFlash (per verify row, counting the block's earlier proposals), also in mixed batches; bad values are
clear errors."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.draft_training import cpu_engine
from tests.support.engine_testing import random_prompts
from tests.support.penalty_reference import CASES, hf_penalised_greedy

PROMPTS = random_prompts([6, 11, 4], seed=7)
BASE = {"temperature": 0, "max_new_tokens": 20}


@pytest.fixture(scope="module")
def models(trained_pair: dict[str, Any]) -> dict[str, Any]:
    return trained_pair


engine_for = cpu_engine


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spec", [False, True])
def test_penalties_equal_plain_greedy_loop(models: dict[str, Any], case: str, spec: bool) -> None:
    params = {**BASE, **CASES[case]}
    engine = engine_for(models["root"], spec)
    eos = set(engine.scheduler.eos_token_ids)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_penalised_greedy(models["target"], prompt, params, eos), case
    plain = engine.generate(input_ids=PROMPTS, sampling_params=BASE)
    assert [o["output_ids"] for o in plain] != [o["output_ids"] for o in outs]  # the penalty changed something


def test_min_new_tokens_holds_back_a_stop(models: dict[str, Any]) -> None:
    engine = engine_for(models["root"], True)
    params = {**BASE, "ignore_eos": True}
    first = engine.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"]
    stop = first[2]
    early = engine.generate(input_ids=PROMPTS[0], sampling_params={**params, "stop_token_ids": [stop]})["output_ids"]
    late = engine.generate(
        input_ids=PROMPTS[0], sampling_params={**params, "stop_token_ids": [stop], "min_new_tokens": 10}
    )
    assert early[-1] == stop and len(early) <= 3
    assert len(late["output_ids"]) >= 10 and stop not in late["output_ids"][:10]


def test_penalties_in_mixed_batches(models: dict[str, Any]) -> None:
    params = {**BASE, **CASES["frequency+presence"]}
    engine = engine_for(models["root"], True, enable_mixed_chunk=True)
    eos = set(engine.scheduler.eos_token_ids)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=[params, BASE, params])
    for index in (0, 2):
        assert outs[index]["output_ids"] == hf_penalised_greedy(models["target"], PROMPTS[index], params, eos)


def test_sampled_requests_with_penalties_run(models: dict[str, Any]) -> None:
    engine = engine_for(models["root"], True)
    params = {"temperature": 0.8, "seed": 5, "max_new_tokens": 16, "ignore_eos": True, "repetition_penalty": 1.5}
    first, second = (engine.generate(input_ids=PROMPTS, sampling_params=params) for _ in range(2))
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in second]  # seeded: reproducible
    assert all(len(o["output_ids"]) == 16 for o in first)


@pytest.mark.parametrize("params,message", [
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"presence_penalty": "x"}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"logit_bias": {"abc": 1}}, "logit_bias keys"), ({"logit_bias": {"5": 500}}, "logit_bias values"),
    ({"logit_bias": {"100000": 1}}, "outside the vocabulary"), ({"logit_bias": [1, 2]}, "logit_bias must map"),
])
def test_bad_penalties_are_clear_errors(models: dict[str, Any], params: dict[str, Any], message: str) -> None:
    engine = engine_for(models["root"], False)
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=PROMPTS[:1], sampling_params={**BASE, **params})


def test_verify_rows_count_the_proposals_before_them() -> None:
    """Row j of a verify block is penalised as if d_1..d_j were already output (what target-only decoding sees)."""
    from blockspec.sample.penalties import penalized
    from blockspec.request import Req, SamplingParams

    params = SamplingParams.from_dict({"frequency_penalty": 0.7, "presence_penalty": 0.3, "repetition_penalty": 1.3,
                                       "logit_bias": {"4": 1.5}})
    req = Req([1, 2, 3], params)
    req.all_ids += [5, 6, 5]  # output so far
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    drafted = [6, 7, 6]
    rows = penalized(logits, req, drafted)
    for j in range(4):
        alone = Req([1, 2, 3], params)
        alone.all_ids += [5, 6, 5, *drafted[:j]]
        torch.testing.assert_close(rows[j], penalized(logits[j:j + 1], alone)[0])
    assert not torch.equal(rows[3], penalized(logits[3:4], req)[0])
