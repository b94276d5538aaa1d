"""What a chat request's `tools` / `tool_choice` mean for its prompt, its grammar and its reply (tool_calls.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from blockspec.request import GrammarSpec, check_grammar
from blockspec.server.protocol import ChatCompletionRequest
from blockspec.server.state import APIError
from blockspec.server.tool_calls import ToolCall, parse_tool_calls, required_call_grammar


@dataclass(frozen=True)
class ChatTools:
    parser: Optional[str] = None  # the reply is parsed for calls in this format (None: plain content)
    template_tools: Optional[list[dict[str, Any]]] = None  # passed to the chat template
    grammar: Optional[str] = None  # EBNF forcing one call (tool_choice "required" or a named function)

    def sampling_fields(self) -> dict[str, Any]:
        return {} if self.grammar is None else {"ebnf": self.grammar}

    def reply(self, text: str, finish_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """(the assistant message, the finish_reason) of a finished reply."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_tool_calls(self.parser, text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content, "tool_calls": [call_json(c) for c in calls]}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason


def call_json(call: ToolCall, index: Optional[int] = None) -> dict[str, Any]:
    entry = call.openai(0)
    if index is None:
        entry.pop("index")
    else:
        entry["index"] = index
    return entry


def chat_tools(body: ChatCompletionRequest, parser: Optional[str]) -> ChatTools:
    """Validates tools and tool_choice (400s naming the field) and says what they change."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: needs tools", "tool_choice")
        return ChatTools()
    if parser is None:
        raise APIError(400, "tools: this server runs without --tool-call-parser (llama3 or qwen3)", "tools")
    functions = [tool.function.model_dump(exclude_none=True) for tool in body.tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", "tools")
    for function in functions:
        try:
            check_grammar(GrammarSpec("json_schema", json.dumps(function.get("parameters") or {"type": "object"})))
        except ValueError as exc:
            raise APIError(400, f"tools: function {function['name']!r} parameters: {exc}", "tools") from exc
    if choice == "none":
        return ChatTools()
    template_tools = [{"type": "function", "function": function} for function in functions]
    if choice in (None, "auto"):
        return ChatTools(parser, template_tools)
    if body.response_format is not None and body.response_format.get("type") != "text" or body.regex or body.ebnf:
        raise APIError(400, "tool_choice: a forced tool call cannot be combined with response_format, regex or ebnf",
                       "tool_choice")
    chosen = functions if choice == "required" else [f for f in functions if f["name"] == choice.function.name]
    if not chosen:
        assert not isinstance(choice, str)
        raise APIError(400, f"tool_choice: no function named {choice.function.name!r} in tools", "tool_choice")
    return ChatTools(parser, template_tools, required_call_grammar(parser, chosen))
