"""The log-probabilities oracle of the logprobs tests: HF's log_softmax over the same sequence, checked against a
response's output token logprobs and its top TOP_N per position."""
from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

TOP_N = 3


@torch.no_grad()
def hf_logprobs(model: PreTrainedModel, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: HF's log_softmax of the distribution each output token was chosen from."""
    ids = torch.tensor([prompt + output])
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def check_against_hf(model: PreTrainedModel, prompt: list[int], out: dict[str, Any]) -> None:
    """`out` (a generate response with logprobs and TOP_N top logprobs): its output tokens' log-probabilities and
    each position's top TOP_N (tokens and values) are HF's over prompt + output."""
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
