"""Tool calls in the model's own format (`--tool-call-parser`), parsed into OpenAI's `message.tool_calls`.

- qwen3 (Hermes style): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, text around them
  is the message content.
- llama3 (Llama-3.x JSON): the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`; any other reply is content.

tool_choice "required" or a named function constrains the reply to one call in that format through the grammar path
(an EBNF built from the tools' JSON schemas), so it holds under DFlash exactly as target-only decoding.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from blockspec.tokenizer import held_back

PARSERS = ("llama3", "qwen3")
_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_QWEN_START = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def openai(self, index: int) -> dict[str, Any]:
        return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(value: Any, arguments_key: str) -> Optional[ToolCall]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(parser: str, text: str) -> tuple[Optional[str], list[ToolCall]]:
    """(content, tool calls) of a whole reply; text that does not parse as a call stays content."""
    if parser == "qwen3":
        calls: list[ToolCall] = []
        kept: list[str] = []
        last = 0
        for match in _QWEN_CALL.finditer(text):
            try:
                call = _call_from(json.loads(match.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            kept.append(text[last:match.start()] if call is not None else text[last:match.end()])
            last = match.end()
            if call is not None:
                calls.append(call)
        content = ("".join(kept) + text[last:]).strip()
        return (content or None) if calls else text, calls
    return _parse_llama3(text)


def _parse_llama3(text: str) -> tuple[Optional[str], list[ToolCall]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _call_from(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return (None, calls) if calls else (text, [])


def call_schema(parser: str, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of one call of any of `tools` (OpenAI function definitions) in the parser's format."""
    arguments_key = "arguments" if parser == "qwen3" else "parameters"
    options = [{
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, arguments_key: tool.get("parameters") or {"type": "object"}},
        "required": ["name", arguments_key], "additionalProperties": False,
    } for tool in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def required_call_grammar(parser: str, tools: Sequence[dict[str, Any]]) -> str:
    """EBNF of a reply that is exactly one call of one of `tools` in the parser's format."""
    import xgrammar as xgr

    call = xgr.Grammar.from_json_schema(json.dumps(call_schema(parser, tools)), any_whitespace=False)
    if parser == "llama3":
        return str(call)
    opening, closing = (xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}") for s in ("<tool_call>\n", "\n</tool_call>"))
    return str(xgr.Grammar.concat(opening, call, closing))


class ToolCallStream:
    """Splits a streamed reply into content deltas and, once the reply ends, its tool calls: text that may begin a
    call is held back (qwen3: a possible `<tool_call>`; llama3: a reply opening with `{` or the python tag)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.in_call = False

    def push(self, delta: str) -> str:
        """Content that can be sent now."""
        self.text += delta
        if self.in_call:
            return ""
        if self.parser == "llama3":
            head = self.text.lstrip()
            if not head or _PYTHON_TAG.startswith(head) or head.startswith(("{", _PYTHON_TAG)):
                self.in_call = bool(head) and not _PYTHON_TAG.startswith(head)
                return ""
            return self._send(len(self.text))
        start = self.text.find(_QWEN_START, self.sent)
        if start >= 0:
            self.in_call = True
            return self._send(start)
        return self._send(len(self.text) - held_back(self.text, [_QWEN_START]))

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, the reply's tool calls)."""
        rest = self.text[self.sent:]
        content, calls = parse_tool_calls(self.parser, rest)
        return (content or "") if calls else rest, calls
