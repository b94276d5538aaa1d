"""Logprobs through the server (engine process boundary included): /generate's return_logprob / top_logprobs_num
(SGLang's meta_info layout), chat `logprobs` / `top_logprobs` and completions `logprobs` (OpenAI shapes), streamed
and whole, all equal to the offline engine's values for the same tokens."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from tests.support.server_support import save_text_model, sse_payloads

PROMPT_IDS = [5, 9, 13, 21, 8]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("logprob_model"))


def engine(model: Path) -> Engine:
    return Engine(model_path=str(model), device="cpu", dtype="float32", max_total_tokens=8192)


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[BackgroundServer]:
    with BackgroundServer(engine(model), ServerSettings(port=0)) as running:
        yield running


@pytest.fixture(scope="module")
def offline(model: Path) -> dict[str, Any]:
    out = engine(model).generate(input_ids=PROMPT_IDS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2)
    assert isinstance(out, dict)
    return out


def test_generate_matches_the_engine(server: BackgroundServer, offline: dict[str, Any]) -> None:
    body = {"input_ids": PROMPT_IDS, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2}
    out = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    assert out["output_ids"] == offline["output_ids"]
    got, want = out["meta_info"]["output_token_logprobs"], offline["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in got] == [entry[1] for entry in want]
    assert [entry[0] for entry in got] == pytest.approx([entry[0] for entry in want], abs=1e-5)
    assert len(out["meta_info"]["output_top_logprobs"]) == len(got)


def test_completions_logprobs_whole_and_streamed(server: BackgroundServer, offline: dict[str, Any]) -> None:
    body = {"prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    whole = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    want = [entry[0] for entry in offline["meta_info"]["output_token_logprobs"]]
    assert whole["token_logprobs"] == pytest.approx(want, abs=1e-5)
    assert len(whole["tokens"]) == len(whole["top_logprobs"]) == len(whole["text_offset"]) == 8
    assert all(len(top) <= 2 for top in whole["top_logprobs"])
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        events = [e for e in sse_payloads(response.iter_lines()) if isinstance(e, dict)]
    streamed: list[float] = []
    for event in events:
        entry = event["choices"][0]["logprobs"]
        if entry is not None:
            streamed += entry["token_logprobs"]
    assert streamed == pytest.approx(want, abs=1e-5)


def test_chat_logprobs_whole_and_streamed(server: BackgroundServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3}
    choice = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and all(len(entry["top_logprobs"]) == 3 for entry in content)
    assert all(entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode()) for entry in content)
    assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        events = [e for e in sse_payloads(response.iter_lines()) if isinstance(e, dict)]
    streamed = [
        entry["logprob"] for e in events for c in e["choices"] if c["logprobs"] for entry in c["logprobs"]["content"]
    ]
    assert streamed == pytest.approx([entry["logprob"] for entry in content], abs=1e-5)
    plain = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None},
                       timeout=60).json()["choices"][0]
    assert plain["logprobs"] is None
