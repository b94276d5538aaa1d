"""Tool calls through the real `openai` client (CPU, DFlash on, tiny pair with the real Qwen3 tokenizer and chat
template, `--tool-call-parser qwen3`): a forced call comes back as message.tool_calls with finish_reason tool_calls,
streamed as tool-call deltas, and a tool result round-trips into the next prompt; errors are 400s naming the field."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from blockspec.server import BackgroundServer
from blockspec.server.protocol import ChatMessage
from blockspec.tokenizer import chat_to_ids
from tests.support.server_support import openai_client, serve_qwen_dflash

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME: Any = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(qwen_vocab_pair: dict[str, Any]) -> Iterator[BackgroundServer]:
    yield from serve_qwen_dflash(Path(qwen_vocab_pair["root"]), tool_call_parser="qwen3")


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    yield from openai_client(server)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_call_round_trips(client: openai.OpenAI, server: BackgroundServer, tool_choice: Any) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=60, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")
    else:
        assert call.function.name in ("get_weather", "get_time") and len(arguments) == 1
    result = "sunny, 21 C" if call.function.name == "get_weather" else "12:00"
    follow_up: list[Any] = [*QUESTION, choice.message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model="tiny", messages=follow_up, tools=[WEATHER, TIME], max_tokens=8,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and reply.usage is not None
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    ids = chat_to_ids(tokenizer, [ChatMessage(**m).as_template_input() for m in follow_up], [WEATHER, TIME])
    prompt = tokenizer.decode(ids)
    assert f"<tool_response>\n{result}\n</tool_response>" in prompt and call.function.arguments in prompt
    assert second.usage.prompt_tokens == len(ids)


def test_streamed_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice="required",
                                            max_tokens=60, temperature=0, stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    content = ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            entry["name"] += piece.function.name or "" if piece.function else ""
            entry["arguments"] += piece.function.arguments or "" if piece.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["city"] in ("Paris", "Oslo")


def test_auto_and_none_reply_with_content(client: openai.OpenAI) -> None:
    for tool_choice in ("auto", "none"):
        reply = client.chat.completions.create(
            model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice=tool_choice, max_tokens=8, temperature=0
        )
        choice = reply.choices[0]
        if choice.message.tool_calls:  # NOTE: a random tiny model rarely writes a well-formed call unforced
            assert tool_choice == "auto" and choice.finish_reason == "tool_calls"
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content is not None


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_400_naming_the_field(server: BackgroundServer, body: dict[str, Any], param: str) -> None:
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": QUESTION, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_completions_refuse_tools(server: BackgroundServer) -> None:
    response = httpx.post(server.base_url + "/v1/completions", timeout=60, json={"prompt": "x", "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_auto_parses_a_call_the_model_writes(client: openai.OpenAI) -> None:
    # NOTE: the regex makes the tiny random model write a Hermes-style call unforced by tool_choice; `auto` must read
    # it back as a tool call (content before it stays content), exactly as for a model that chose to call
    written = 'Let me look\\.<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "Oslo"\\}\\}\n</tool_call>'
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice="auto",
                                           max_tokens=64, temperature=0, extra_body={"regex": written})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
