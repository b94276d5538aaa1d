"""The penalties oracle: a plain HF greedy loop that applies frequency/presence/repetition penalties, logit_bias and
min_new_tokens as the engine should (written out here), and the penalty settings the tests sweep."""
from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

CASES: dict[str, dict[str, Any]] = {
    "frequency+presence": {"frequency_penalty": 0.8, "presence_penalty": 0.5},
    "strong frequency": {"frequency_penalty": 2.0, "presence_penalty": 2.0, "max_new_tokens": 40, "ignore_eos": True},
    "repetition": {"repetition_penalty": 1.7},
    "bias": {"logit_bias": {"17": 6.0, "23": -100.0}},
    "min_new_tokens": {"min_new_tokens": 12, "stop_token_ids": [40]},
}


@torch.no_grad()
def hf_penalised_greedy(model: PreTrainedModel, prompt: list[int], params: dict[str, Any], eos: set[int]) -> list[int]:
    """The greedy continuation of `prompt` under `params` (a request's sampling params), one full HF forward per
    token; stops at `eos` or a stop token unless ignore_eos."""
    output: list[int] = []
    stops = eos | set(params.get("stop_token_ids", []))
    for _ in range(params["max_new_tokens"]):
        ids = torch.tensor([prompt + output])
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float().tolist()
        for token in range(len(logits)):
            count = output.count(token)
            logits[token] -= params.get("frequency_penalty", 0.0) * count + params.get("presence_penalty", 0.0) * (
                count > 0
            )
            r = params.get("repetition_penalty", 1.0)
            if token in prompt or count:
                logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
            logits[token] += params.get("logit_bias", {}).get(str(token), 0.0)
            if token in stops and len(output) < params.get("min_new_tokens", 0):
                logits[token] = float("-inf")
        token = max(range(len(logits)), key=lambda t: logits[t])
        output.append(token)
        if token in stops and not params.get("ignore_eos"):
            break
    return output
