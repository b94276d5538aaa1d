"""Penalties and logit_bias through the server: the OpenAI fields map onto the engine's sampling parameters (the
same tokens as /generate with SGLang's names), logit_bias really steers the output, and bad values are 400s
(tests/server/test_server_errors.py)."""
from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from blockspec.server import BackgroundServer
from tests.support.server_support import serve_text_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    yield from serve_text_model(tmp_path_factory.mktemp("penalty_model"))


def completion_text(client: httpx.Client, body: dict[str, Any]) -> str:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_openai_penalty_fields_equal_generate(server: BackgroundServer) -> None:
    openai_fields = {"frequency_penalty": 1.2, "presence_penalty": 0.6, "repetition_penalty": 1.3, "min_tokens": 4,
                     "logit_bias": {"7": 2.5}}
    sglang_fields = {"frequency_penalty": 1.2, "presence_penalty": 0.6, "repetition_penalty": 1.3, "min_new_tokens": 4,
                     "logit_bias": {"7": 2.5}}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        text = completion_text(client, {"prompt": "Janet has", "max_tokens": 12, "temperature": 0, **openai_fields})
        native = client.post("/generate", json={"text": "Janet has", "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, **sglang_fields}})
        plain = client.post(
            "/generate", json={"text": "Janet has", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        )
    assert native.status_code == 200 and plain.status_code == 200
    assert text == native.json()["text"]
    assert native.json()["output_ids"] != plain.json()["output_ids"]


def test_logit_bias_steers_every_token(server: BackgroundServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        response = client.post("/generate", json={"text": "Janet has", "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "logit_bias": {"11": 100.0}}})
        chat = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 6,
                "temperature": 0,
                "logit_bias": {"11": 100.0},
                "ignore_eos": True,
            },
        )
    assert response.status_code == 200 and response.json()["output_ids"] == [11] * 6
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 6
