"""Sampling: seeded reproducibility, greedy equivalences, the exact filtered distribution, parameter validation."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from blockspec.request import Req, SamplingParams
from blockspec.sample.sampling import make_generator, sample_next_tokens, sampling_probs, sampling_probs_rows
from tests.support.engine_testing import VOCAB, hf_greedy, random_prompts, run_until_done

PROMPTS = random_prompts([4, 11, 1, 23, 7, 16], seed=3)
MAX_NEW = 16


def sampled(seed: int | None, **extra: Any) -> dict[str, Any]:
    return {"temperature": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True, "seed": seed, **extra}


# ---- seeds -------------------------------------------------------------------------------------
def test_same_seed_same_tokens_across_batches(tiny, make_engine) -> None:
    ckpt = tiny("qwen3", "sharp")
    engine = make_engine(ckpt.path, page_size=4, chunked_prefill_size=8)
    prompt = PROMPTS[1]
    alone = engine.generate(input_ids=prompt, sampling_params=sampled(1234))["output_ids"]
    assert engine.generate(input_ids=prompt, sampling_params=sampled(1234))["output_ids"] == alone

    # The same request inside a mixed batch (greedy, other seeds, other lengths) in two orders.
    others = [sampled(7), {"temperature": 0, "max_new_tokens": 9}, sampled(99, top_p=0.8), sampled(5, top_k=4)]
    for order in (0, 4):
        params = list(others)
        params.insert(order, sampled(1234))
        prompts = [PROMPTS[i] for i in (0, 2, 3, 4)]
        prompts.insert(order, prompt)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert outputs[order]["output_ids"] == alone

    # ... and arriving while other requests decode, in a small pool that forces retraction.
    tight = make_engine(ckpt.path, page_size=1, max_total_tokens=48, chunked_prefill_size=4)
    reqs, _ = tight.make_requests(input_ids=PROMPTS, sampling_params=[sampled(i) for i in range(len(PROMPTS))])
    mine, _ = tight.make_requests(input_ids=prompt, sampling_params=sampled(1234))
    for req in reqs:
        tight.scheduler.add_request(req)
    for _ in range(5):
        tight.step()
    tight.scheduler.add_request(mine[0])
    run_until_done(tight, reqs + mine)
    assert tight.scheduler.num_retractions > 0
    assert mine[0].output_ids == alone
    solo = [engine.generate(input_ids=p, sampling_params=sampled(i))["output_ids"] for i, p in enumerate(PROMPTS)]
    assert [r.output_ids for r in reqs] == solo


def test_different_seeds_differ(tiny, make_engine) -> None:
    engine = make_engine(tiny("qwen3", "sharp").path)
    outputs = engine.generate(input_ids=[PROMPTS[0]] * 4, sampling_params=[sampled(s) for s in range(4)])
    assert len({tuple(o["output_ids"]) for o in outputs}) >= 3
    unseeded = engine.generate(input_ids=[PROMPTS[0]] * 2, sampling_params=sampled(None))
    assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]


# ---- settings that reduce to greedy --------------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 1, "temperature": 1.5},
        {"temperature": 1e-4},
        {"min_p": 1.0},
        {"top_p": 1e-6},
    ],
    ids=["top_k1", "tiny_temperature", "min_p1", "tiny_top_p"],
)
def test_reduces_to_greedy(tiny, make_engine, params: dict[str, Any]) -> None:
    ckpt = tiny("llama")
    engine = make_engine(ckpt.path)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params={**sampled(3), **params})
    assert [o["output_ids"] for o in outputs] == [hf_greedy(ckpt.model, p, MAX_NEW) for p in PROMPTS]


# ---- the distribution itself -------------------------------------------------------------------
LOGITS = [2.0, 1.55, 1.2, 0.7, 0.3, 0.05, -0.5, -1.1]


def expected_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """softmax(logits / T), then keep the top-k, then the smallest prefix (by probability) whose mass before each
    kept token is < top_p of what remains, then tokens with p >= min_p * max p; renormalise after each step."""
    if temperature == 0 or top_k == 1:
        best = max(range(len(logits)), key=lambda i: logits[i])
        return [1.0 if i == best else 0.0 for i in range(len(logits))]
    weights = [math.exp(x / temperature) for x in logits]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order if top_k < 1 else order[:top_k]
    mass = sum(probs[i] for i in kept)
    prefix, before = [], 0.0
    for i in kept:
        if before >= top_p * mass:
            break
        prefix.append(i)
        before += probs[i]
    kept = prefix
    largest = max(probs[i] for i in kept)
    kept = [i for i in kept if probs[i] >= min_p * largest]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


CASES = [
    dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0),
    dict(temperature=0.5, top_k=-1, top_p=1.0, min_p=0.0),
    dict(temperature=2.0, top_k=3, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=-1, top_p=0.7, min_p=0.0),
    dict(temperature=0.8, top_k=-1, top_p=1.0, min_p=0.25),
    dict(temperature=1.3, top_k=6, top_p=0.85, min_p=0.1),
    dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sampling_frequencies(case: dict[str, float]) -> None:
    params = SamplingParams.from_dict({**case, "seed": 17})
    expected = torch.tensor(expected_distribution(LOGITS, **case), dtype=torch.float64)
    logits = torch.tensor(LOGITS)
    probs = sampling_probs(logits, params).double()
    assert torch.allclose(probs, expected, atol=1e-6), (probs, expected)

    n = 6000
    req = Req([0], params)
    req.generator = make_generator(params, torch.device("cpu"))
    # A greedy neighbour row must not disturb (or be disturbed by) the sampled rows.
    greedy = Req([0], SamplingParams.from_dict({"temperature": 0}))
    batch_logits = torch.cat([logits.expand(n, -1), -logits[None]])
    tokens = sample_next_tokens(batch_logits, [req] * n + [greedy])
    assert tokens[-1] == len(LOGITS) - 1
    empirical = torch.bincount(torch.tensor(tokens[:n]), minlength=len(LOGITS)).double() / n
    assert float((empirical - expected).abs().sum()) / 2 < 0.03
    assert float(empirical[expected == 0].sum()) == 0.0  # filtered tokens are never drawn


def test_sampling_probs_batched_rows() -> None:
    params = SamplingParams.from_dict({"temperature": 0.9, "top_k": 4, "top_p": 0.9, "min_p": 0.05})
    rows = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    batched = sampling_probs(rows, params)
    for i in range(5):
        expected = torch.tensor(expected_distribution(rows[i].tolist(), 0.9, 4, 0.9, 0.05))
        assert torch.allclose(batched[i].double(), expected.double(), atol=1e-6)


def test_sampling_probs_rows_mixed_params() -> None:
    """One batched pass with each row's own parameters equals each row alone, and the exact filtered distribution."""
    cases = [c for c in CASES if c["temperature"] > 0]
    rows = torch.randn(len(cases), 32, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams.from_dict(c) for c in cases]
    batched = sampling_probs_rows(rows, params)
    for i, case in enumerate(cases):
        assert torch.equal(batched[i], sampling_probs(rows[i], params[i])), case
        expected = torch.tensor(expected_distribution(rows[i].tolist(), **case), dtype=torch.float64)
        assert torch.allclose(batched[i].double(), expected, atol=1e-6), case


def test_sample_next_tokens_rows_use_their_own_generators() -> None:
    """A seeded row draws the same token whatever else is in the batch (greedy rows, other seeds and filters)."""
    rows = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))

    def request(**params: Any) -> Req:
        req = Req([0], SamplingParams.from_dict(params))
        req.generator = make_generator(req.params, torch.device("cpu")) if not req.params.is_greedy else None
        return req

    alone = [sample_next_tokens(rows[2:3], [request(temperature=0.9, top_p=0.8, seed=s)])[0] for s in range(20)]
    batched = []
    for s in range(20):
        reqs = [request(temperature=0), request(temperature=1.2, top_k=5, seed=100 + s),
                request(temperature=0.9, top_p=0.8, seed=s), request(temperature=0.7, min_p=0.2, seed=7)]
        tokens = sample_next_tokens(rows, reqs)
        assert tokens[0] == int(rows[0].argmax())
        batched.append(tokens[2])
    assert batched == alone
    assert len(set(alone)) > 1  # NOTE: the seeds matter, so the equality above means something
    assert sampling_probs_rows(rows[:0], []).shape == (0, 32)


@pytest.mark.parametrize("extra", [{}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20}], ids=["plain", "filtered"])
def test_engine_first_token_follows_model_distribution(tiny, make_engine, extra: dict[str, Any]) -> None:
    """n requests with one prompt and distinct seeds: the first tokens are distributed as HF's softmax says."""
    ckpt = tiny("qwen3", "sharp")
    prompt = [5, 6, 7]
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([prompt])).logits[0, -1].double()
    case = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, **extra}
    expected = torch.tensor(expected_distribution(logits.tolist(), **case), dtype=torch.float64)
    assert float((expected - 1 / VOCAB).abs().sum()) / 2 > 0.5  # peaked enough for the test to mean something

    n = 8000
    engine = make_engine(ckpt.path, max_running_requests=512, max_total_tokens=4096)
    params = [{**case, "max_new_tokens": 1, "seed": 1000 + i} for i in range(n)]
    outputs = engine.generate(input_ids=[prompt] * n, sampling_params=params)
    firsts = torch.tensor([o["output_ids"][0] for o in outputs])
    empirical = torch.bincount(firsts, minlength=VOCAB).double() / n
    # NOTE: with ~40 tokens of non-negligible mass, the sampling noise alone is TV ≈ 0.03 at n = 8000.
    assert float((empirical - expected).abs().sum()) / 2 < 0.05
    assert float(empirical[expected == 0].sum()) == 0.0


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw,field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),  # would crash the whole batch inside multinomial
        ({"seed": 2**70}, "seed"),  # torch.Generator.manual_seed rejects it (inside add_request, too late)
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"seed": "abc"}, "seed"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"temprature": 0.5}, "temprature"),
    ],
)
def test_sampling_params_validation(tiny, make_engine, raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(raw)
    engine = make_engine(tiny("llama").path)
    with pytest.raises(ValueError, match=field):
        engine.generate(input_ids=[[3, 4], [5]], sampling_params=[{}, raw])
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_extreme_seeds_accepted(tiny, make_engine) -> None:
    engine = make_engine(tiny("llama").path)
    outputs = engine.generate(input_ids=[[3], [4]], sampling_params=[sampled(-(2**63)), sampled(2**64 - 1)])
    assert all(len(o["output_ids"]) == MAX_NEW for o in outputs)


@pytest.mark.parametrize("raw,field", [
    ({"stop": 5}, "stop"), ({"stop_token_ids": 7}, "stop_token_ids"), ({"ignore_eos": "no"}, "ignore_eos"),
    ({"top_p": True}, "top_p"), ({"top_k": True}, "top_k"),
])
def test_sampling_params_reject_wrong_types(raw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(raw)


def test_sampling_params_to_dict_round_trips_every_field_as_copies() -> None:
    """What the server sends the engine (wire.AddRequest.params): every field, read back equal, sharing no list."""
    import dataclasses

    params = SamplingParams.from_dict({"max_new_tokens": 5, "temperature": 0.5, "stop": ["x"], "stop_token_ids": [7],
                                       "logit_bias": {"3": 1.5}, "regex": "a+", "seed": 3})
    raw = params.to_dict()
    assert raw == dataclasses.asdict(params) and set(raw) == {f.name for f in dataclasses.fields(SamplingParams)}
    assert SamplingParams.from_dict(raw) == params
    raw["stop"].append("y"), raw["stop_token_ids"].append(8), raw["logit_bias"].clear()
    assert params.stop == ["x"] and params.stop_token_ids == [7] and params.logit_bias == {"3": 1.5}
