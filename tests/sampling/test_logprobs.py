"""Logprobs (CPU, fp32): the target's log-probabilities of the output tokens and its top-k per position, equal to
HF's log_softmax over the same sequence, for target-only decoding, DFlash (from the verify forward: identical to
target-only), mixed batches and seeded sampling; requests that ask for them never run ahead (overlap)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from tests.support.draft_training import cpu_engine
from tests.support.engine_testing import random_prompts

PROMPTS = random_prompts([5, 12, 3, 30], seed=5)
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SAMPLED = {"temperature": 0.7, "top_k": 20, "seed": 3, "max_new_tokens": 24, "ignore_eos": True}
TOP_N = 3


@pytest.fixture(scope="module")
def models(trained_pair: dict[str, Any]) -> dict[str, Any]:
    return trained_pair


engine_for = cpu_engine


@torch.no_grad()
def hf_logprobs(model: PreTrainedModel, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: HF's log_softmax of the distribution each output token was chosen from."""
    ids = torch.tensor([prompt + output])
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def check_against_hf(model: PreTrainedModel, prompt: list[int], out: dict[str, Any]) -> None:
    meta, output = out["meta_info"], out["output_ids"]
    expected = hf_logprobs(model, prompt, output)
    assert [token for _, token, _ in meta["output_token_logprobs"]] == output
    got = torch.tensor([logprob for logprob, _, _ in meta["output_token_logprobs"]])
    torch.testing.assert_close(got, expected.gather(1, torch.tensor(output)[:, None])[:, 0], atol=1e-4, rtol=1e-4)
    assert len(meta["output_top_logprobs"]) == len(output)
    values, ids = expected.topk(TOP_N, dim=-1)
    for position, top in enumerate(meta["output_top_logprobs"]):
        assert [token for _, token, _ in top] == ids[position].tolist()
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in top]), values[position], atol=1e-4, rtol=1e-4)


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
