"""Load: 32 concurrent clients send 224 requests with random parameters to a DFlash server, some cancelled
mid-stream, with arrivals admitted at once and held up to 3 steps (--max-prefill-wait-steps). None is lost or hangs,
the KV pool ends fully free, and greedy answers equal the offline Engine's."""
from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx
import pytest

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from tests.support.draft_training import train_tiny_draft
from tests.support.server_support import metric_value, wait_idle
from tests.support.tiny_models import save_tiny_draft, save_tiny_model

pytest.importorskip("dflash.model")

CLIENTS = 32
REQUESTS = 224
REQUEST_TIMEOUT_S = 60.0
ENGINE_FLAGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", skip_tokenizer_init=True, page_size=4, max_total_tokens=1024,
    chunked_prefill_size=64, speculative_algorithm="DFLASH",
)


@dataclass
class Spec:
    index: int
    endpoint: str
    prompt: list[int]
    params: dict[str, Any]
    stream: bool
    cancel_after: Optional[int]  # chunks read before the client walks away

    @property
    def greedy(self) -> bool:
        return self.params["temperature"] == 0


@dataclass
class Outcome:
    spec: Spec
    cancelled: bool = False
    output_ids: Optional[list[int]] = None
    completion_tokens: int = -1
    finish: Optional[str] = None
    errors: list[str] = field(default_factory=list)


def make_specs(seed: int = 7) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(REQUESTS):
        params: dict[str, Any] = {"max_new_tokens": rng.randint(1, 40), "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.6:
            params["temperature"] = 0
        else:
            params.update(temperature=rng.uniform(0.3, 1.5), top_p=rng.uniform(0.5, 1.0), top_k=rng.choice([-1, 5, 20]))
            if rng.random() < 0.5:
                params["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.2:
            params["stop_token_ids"] = [rng.randrange(3, 95)]
        stream = rng.random() < 0.5
        cancel = rng.randint(1, 3) if stream and rng.random() < 0.25 else None
        if cancel is not None:  # NOTE: long enough that the abort reaches the engine before the request ends
            params.update(max_new_tokens=120, ignore_eos=True)
            params.pop("stop_token_ids", None)
        prompt = [rng.randrange(3, 95) for _ in range(rng.randint(1, 48))]
        specs.append(Spec(i, rng.choice(["generate", "completions"]), prompt, params, stream, cancel))
    return specs


def _body(spec: Spec) -> tuple[str, dict[str, Any]]:
    if spec.endpoint == "generate":
        return "/generate", {"input_ids": spec.prompt, "sampling_params": spec.params, "stream": spec.stream}
    p = dict(spec.params)
    body = {"prompt": spec.prompt, "max_tokens": p.pop("max_new_tokens"), "stream": spec.stream, **p}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    return "/v1/completions", body


async def run_one(client: httpx.AsyncClient, spec: Spec) -> Outcome:
    outcome = Outcome(spec)
    path, body = _body(spec)
    if not spec.stream:
        response = await client.post(path, json=body)
        data = response.json()
        if response.status_code != 200:
            outcome.errors.append(f"{response.status_code}: {data}")
        elif spec.endpoint == "generate":
            outcome.output_ids, outcome.completion_tokens = data["output_ids"], data["meta_info"]["completion_tokens"]
            outcome.finish = data["meta_info"]["finish_reason"]["type"]
        else:
            outcome.completion_tokens, outcome.finish = (
                data["usage"]["completion_tokens"],
                data["choices"][0]["finish_reason"],
            )
        return outcome
    chunks = 0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            outcome.errors.append(f"{response.status_code}: {await response.aread()!r}")
            return outcome
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks += 1
            if spec.cancel_after is not None and chunks >= spec.cancel_after:
                outcome.cancelled = True
                return outcome  # leaving the block closes the connection mid-stream
            if "error" in chunk:
                outcome.errors.append(str(chunk["error"]))
            elif spec.endpoint == "generate":
                outcome.output_ids = chunk["output_ids"]
                outcome.completion_tokens = chunk["meta_info"]["completion_tokens"]
                reason = chunk["meta_info"]["finish_reason"]
                outcome.finish = reason["type"] if reason else None
            elif chunk.get("usage"):
                outcome.completion_tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                outcome.finish = chunk["choices"][0]["finish_reason"]
    return outcome


async def run_load(base_url: str, specs: list[Spec]) -> list[Outcome]:
    pending: asyncio.Queue[Spec] = asyncio.Queue()
    for spec in specs:
        pending.put_nowait(spec)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=CLIENTS * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            while not pending.empty():
                spec = pending.get_nowait()
                try:
                    outcomes.append(await asyncio.wait_for(run_one(client, spec), REQUEST_TIMEOUT_S))
                except Exception as exc:  # a hang (timeout) or a transport failure is a lost request
                    outcomes.append(Outcome(spec, errors=[f"{type(exc).__name__}: {exc}"]))

        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    return outcomes


@pytest.fixture(scope="module")
def dflash_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("load_model")
    target = save_tiny_model("llama", root / "target", residual_scale=0.3)
    draft = save_tiny_draft(root / "draft", target, [0, 2], block_size=4, num_layers=2)
    train_tiny_draft(draft, target, steps=120)
    draft.save_pretrained(root / "draft")
    return root / "target", root / "draft"


@pytest.fixture(scope="module", params=[0, 3], ids=["admit-at-once", "arrivals-wait-3"])
def server(dflash_model: tuple[Path, Path], request: pytest.FixtureRequest) -> Iterator[BackgroundServer]:
    target, draft = dflash_model
    engine = Engine(model_path=str(target), speculative_draft_model_path=str(draft), **ENGINE_FLAGS,
                    max_prefill_wait_steps=request.param)
    with BackgroundServer(engine, ServerSettings(port=0)) as running:
        yield running


def test_concurrent_load_with_cancellations(server: BackgroundServer, dflash_model: tuple[Path, Path]) -> None:
    specs = make_specs()
    outcomes = asyncio.run(run_load(server.base_url, specs))
    assert sorted(o.spec.index for o in outcomes) == list(range(REQUESTS))  # none lost
    failures = [(o.spec, o.errors) for o in outcomes if o.errors]
    assert not failures, failures[:3]
    cancelled = [o for o in outcomes if o.cancelled]
    finished = [o for o in outcomes if not o.cancelled]
    assert len(cancelled) >= 10
    for o in finished:
        assert o.finish in ("stop", "length"), (o.spec, o.finish)
        assert 1 <= o.completion_tokens <= o.spec.params["max_new_tokens"], o.spec

    info = wait_idle(server.base_url)
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1.0
    # NOTE: with --max-prefill-wait-steps the load's arrivals were held (and none lost, none hung: above)
    assert (info["internal_states"][0]["num_steps_arrivals_held"] > 0) == (info["max_prefill_wait_steps"] > 0)
    metrics = httpx.get(server.base_url + "/metrics").text
    assert metric_value(metrics, "blockspec_requests_total", 'finish_reason="abort"') >= 1
    assert metric_value(metrics, "blockspec_spec_accept_length") > 1.0
    assert metric_value(metrics, "blockspec_spec_position_accept_rate", 'position="1"') > 0.0

    greedy = [o for o in finished if o.spec.greedy and o.spec.endpoint == "generate"]
    greedy_cmpl = [o for o in finished if o.spec.greedy and o.spec.endpoint == "completions"]
    assert len(greedy) >= 20 and len(greedy_cmpl) >= 20
    target, draft = dflash_model
    offline = Engine(model_path=str(target), speculative_draft_model_path=str(draft), **ENGINE_FLAGS)
    checked = greedy + greedy_cmpl
    expected = offline.generate(
        input_ids=[o.spec.prompt for o in checked], sampling_params=[o.spec.params for o in checked]
    )
    assert isinstance(expected, list)
    for o, want in zip(checked, expected):
        if o.output_ids is not None:
            assert o.output_ids == want["output_ids"], o.spec
        assert o.completion_tokens == len(want["output_ids"]), o.spec
        assert o.finish == want["meta_info"]["finish_reason"]["type"], o.spec
