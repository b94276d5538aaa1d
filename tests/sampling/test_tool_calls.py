"""Tool-call parsers (llama3 JSON, qwen3 Hermes-style), their streaming splitter, and the forced-call grammar: a
reply the grammar accepts always parses as a call of one of the tools."""
from __future__ import annotations

import json

import pytest

from blockspec.server.tool_calls import ToolCall, ToolCallStream, call_schema, parse_tool_calls, required_call_grammar

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [ToolCall("get_weather", '{"city": "Paris"}')]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": 1}}</tool_call>', "Let me check.", [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')]),
    ("The weather is nice.", "The weather is nice.", []),
    ('<tool_call>\n{"name": broken}\n</tool_call>', '<tool_call>\n{"name": broken}\n</tool_call>', []),
])
def test_qwen3_parser(text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert parse_tool_calls("qwen3", text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [ToolCall("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": [1]}}', None,
     [ToolCall("a", "{}"), ToolCall("b", '{"y": [1]}')]),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('{"name": "a", "parameters": {}} and then text', '{"name": "a", "parameters": {}} and then text', []),
])
def test_llama3_parser(text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert parse_tool_calls("llama3", text) == (content, calls)


def stream_all(parser: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    stream = ToolCallStream(parser)
    sent = "".join(stream.push(piece) for piece in pieces)
    rest, calls = stream.finish()
    return sent + rest, calls


def test_stream_holds_back_a_call_and_streams_content() -> None:
    reply = 'Checking <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    pieces = [reply[i:i + 3] for i in range(0, len(reply), 3)]
    stream = ToolCallStream("qwen3")
    early = "".join(stream.push(piece) for piece in pieces[:4])
    assert early == "Checking " and "<" not in early
    assert stream_all("qwen3", pieces) == ("Checking ", [ToolCall("get_weather", '{"city": "Oslo"}')])
    assert stream_all("qwen3", ["No tools <b>", "old</b>"]) == ("No tools <b>old</b>", [])
    assert stream_all("llama3", [" {\"name\": \"a\", ", "\"parameters\": {}}"]) == ("", [ToolCall("a", "{}")])
    assert stream_all("llama3", ["Sunny", " today"]) == ("Sunny today", [])
    assert stream_all("llama3", ["{not a call", "}"]) == ("{not a call}", [])


@pytest.mark.parametrize("parser", ["qwen3", "llama3"])
def test_forced_call_grammar_accepts_only_calls(parser: str) -> None:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_ebnf(required_call_grammar(parser, [WEATHER, TIME]))
    key = "arguments" if parser == "qwen3" else "parameters"
    good = json.dumps({"name": "get_weather", key: {"city": "Rome"}})
    wrapped = f"<tool_call>\n{good}\n</tool_call>" if parser == "qwen3" else good
    assert xgr.testing._is_grammar_accept_string(grammar, wrapped)
    assert parse_tool_calls(parser, wrapped)[1] == [ToolCall("get_weather", '{"city": "Rome"}')]
    bad = json.dumps({"name": "get_weather", key: {}})
    assert not xgr.testing._is_grammar_accept_string(grammar, bad)
    assert not xgr.testing._is_grammar_accept_string(grammar, "plain text")
    assert call_schema(parser, [TIME])["properties"]["name"] == {"const": "get_time"}
