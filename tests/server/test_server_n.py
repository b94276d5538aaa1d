"""n > 1 (parallel sampling of one prompt) on /v1/chat/completions and /v1/completions: n choices indexed as OpenAI
does (prompt i's choice j at i * n + j), seeded choices reproducible and different from each other, streaming
included, usage counting each prompt once; KV fully free after."""
from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from blockspec.server import BackgroundServer
from tests.support.server_support import serve_text_model, sse_payloads, wait_idle

USER = [{"role": "user", "content": "hi"}]
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    yield from serve_text_model(tmp_path_factory.mktemp("n_model"))


def post(server: BackgroundServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.base_url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_n_choices(server: BackgroundServer) -> None:
    body = {"messages": USER, "n": 4, **SAMPLED}
    first, again = post(server, "/v1/chat/completions", body), post(server, "/v1/chat/completions", body)
    texts = [c["message"]["content"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert texts == [c["message"]["content"] for c in again["choices"]]  # seeded: reproducible
    assert len(set(texts)) > 1  # and the choices are different samples
    single = post(server, "/v1/chat/completions", {"messages": USER, **SAMPLED})
    assert first["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] == 4 * single["usage"]["completion_tokens"]
    assert single["choices"][0]["message"]["content"] == texts[0]  # choice 0 uses the seed as given
    wait_idle(server.base_url)


def test_completions_n_with_two_prompts_and_streaming(server: BackgroundServer) -> None:
    body = {"prompt": ["Janet has", "The cat"], "n": 3, **SAMPLED}
    whole = post(server, "/v1/completions", body)
    assert [c["index"] for c in whole["choices"]] == list(range(6))
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=60) as response:
        events = sse_payloads(response.iter_lines())
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert events[-1] == "[DONE]"
    assert [texts[i] for i in range(6)] == [c["text"] for c in whole["choices"]]
    usage_events = [e for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage_events[-1]["usage"] == whole["usage"]
    single = post(server, "/v1/completions", {"prompt": ["Janet has", "The cat"], **SAMPLED})
    assert whole["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    wait_idle(server.base_url)


def test_chat_stream_n(server: BackgroundServer) -> None:
    body = {"messages": USER, "n": 2, **SAMPLED}
    whole = post(server, "/v1/chat/completions", body)
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        events = [e for e in sse_payloads(response.iter_lines()) if isinstance(e, dict)]
    texts = {0: "", 1: ""}
    finishes = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert finishes == {0: "length", 1: "length"}
