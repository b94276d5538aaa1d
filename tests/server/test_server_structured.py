"""Structured output through the real `openai` client with DFlash on (CPU, tiny pair, the real Qwen3 tokenizer):
response_format json_schema / json_object, regex and ebnf extensions, /generate's SGLang fields, streaming, and 400s
naming the field."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from blockspec.server import BackgroundServer
from blockspec.tokenizer import chat_to_ids
from tests.support.server_support import openai_client, serve_qwen_dflash

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
MESSAGES: list[Any] = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]


@pytest.fixture(scope="module")
def server(qwen_vocab_pair: dict[str, Any]) -> Iterator[BackgroundServer]:
    yield from serve_qwen_dflash(Path(qwen_vocab_pair["root"]))


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    yield from openai_client(server)


def json_schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_enum_always_matches(client: openai.OpenAI, temperature: float) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=temperature,
                                               seed=seed, response_format=json_schema_format(SCHEMA))
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert json.loads(choice.message.content or "") in ({"answer": "yes"}, {"answer": "no"})


def test_chat_schema_equals_generate_json_schema(client: openai.OpenAI, server: BackgroundServer) -> None:
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                           response_format=json_schema_format(SCHEMA))
    ids = chat_to_ids(server.engine.tokenizer, MESSAGES)
    native = httpx.post(server.base_url + "/generate", timeout=60, json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(SCHEMA)}}).json()
    assert native["text"] == reply.choices[0].message.content
    assert native["meta_info"]["spec_verify_ct"] >= 1


def test_json_object_and_streaming(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                           response_format={"type": "json_object"})
    content = reply.choices[0].message.content or ""
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    assert content.startswith("{")
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, stream=True,
                                            response_format=json_schema_format(SCHEMA))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert json.loads(streamed) in ({"answer": "yes"}, {"answer": "no"})


def test_regex_and_ebnf_extensions(client: openai.OpenAI, server: BackgroundServer) -> None:
    for seed in range(4):
        completion = client.completions.create(
            model="tiny", prompt="Is it? ", max_tokens=10, temperature=1.0, seed=seed, extra_body={"regex": "(yes|no)"}
        )
        assert completion.choices[0].text in ("yes", "no")
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                          extra_body={"ebnf": 'root ::= "Answer: " ("yes" | "no")'})
    assert re.fullmatch("Answer: (yes|no)", chat.choices[0].message.content or "")
    native = httpx.post(server.base_url + "/generate", timeout=60, json={"text": "Is it? ", "sampling_params": {
        "max_new_tokens": 10, "regex": "[0-9]{2}"}}).json()
    assert re.fullmatch("[0-9]{2}", native["text"])


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"regex": "(yes"}, "regex"),
        ({"ebnf": "root ::= nothing"}, "ebnf"),
        ({"regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_grammar_is_400_naming_the_field(server: BackgroundServer, body: dict[str, Any], param: str) -> None:
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_generate_bad_regex_names_sampling_params_field(server: BackgroundServer) -> None:
    response = httpx.post(
        server.base_url + "/generate", timeout=60, json={"text": "x", "sampling_params": {"regex": "("}}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "sampling_params.regex"
