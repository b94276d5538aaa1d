"""Model ids (unknown → 404 as vLLM, /v1/models/{id}), `echo` on completions, /health_generate — through the real
`openai` client where it applies."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from tests.support.server_support import openai_client, save_text_model, sse_payloads


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    model = save_text_model(Path(tmp_path_factory.mktemp("echo_model")))
    engine = Engine(model_path=str(model), device="cpu", dtype="float32", max_total_tokens=8192)
    with BackgroundServer(engine, ServerSettings(port=0, served_model_name="tiny")) as running:
        yield running


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    yield from openai_client(server, timeout=60)


def test_unknown_model_is_404(client: openai.OpenAI, server: BackgroundServer) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "gpt-4o" in str(caught.value) and caught.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Janet has", max_tokens=2)
    assert client.completions.create(model="tiny", prompt="Janet has", max_tokens=2).choices[0].text is not None
    root = server.engine.config.model_path
    assert client.completions.create(model=root, prompt="Janet has", max_tokens=2).model == "tiny"


def test_retrieve_model(client: openai.OpenAI) -> None:
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_echo_puts_the_prompt_first(client: openai.OpenAI, server: BackgroundServer) -> None:
    prompt = "Janet has 3 apples"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == echoed.choices[0].text
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    ids = list(tokenizer.encode(prompt))
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, echo=True, n=2)
    assert [c.text for c in by_ids.choices] == [tokenizer.decode(ids) + plain.choices[0].text] * 2


def test_echo_with_logprobs_is_400(server: BackgroundServer) -> None:
    response = httpx.post(server.base_url + "/v1/completions", timeout=30,
                          json={"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


def test_health_generate(server: BackgroundServer) -> None:
    response = httpx.get(server.base_url + "/health_generate", timeout=30)
    assert response.status_code == 200
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True, "echo": True}) as r:
        events = sse_payloads(r.iter_lines())
    assert events[0]["choices"][0]["text"] == "x" and events[-1] == "[DONE]"


def test_access_log_from_log_level_info(server: BackgroundServer) -> None:
    from blockspec.server.launch import _make_server

    for level, logged in (("warning", False), ("info", True), ("debug", True)):
        settings = ServerSettings(port=0, log_level=level)
        assert _make_server(server.app, settings).config.access_log is logged
