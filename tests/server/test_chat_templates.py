"""`--chat-template NAME|FILE` (issue 53, finding 3): the shipped templates render OpenAI tools in the format their
`--tool-call-parser` reads back, and a tools request runs through the server on the demo pair (SmolLM2-135M-Instruct,
whose own ChatML template renders no tools, with its DFlash draft) with `--chat-template chatml`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from blockspec.config.chat_templates import CHAT_TEMPLATES
from blockspec.server.tool_calls import parse_tool_calls
from blockspec.tokenizer import ToolsIgnoredError, load_tokenizer, render_chat
from tests.support.server_support import openai_client

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATION: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def demo_target() -> Path:
    from blockspec.models.smollm2 import embedded_draft_dir, ensure_smollm2_dir

    if embedded_draft_dir() is None:
        pytest.skip("the demo draft is missing from this checkout")
    try:
        return ensure_smollm2_dir()
    except (RuntimeError, ImportError) as exc:
        pytest.skip(f"the SmolLM2 demo target is not available here: {exc}")


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
def test_shipped_template_renders_tools_its_parser_reads(name: str, demo_target: Path) -> None:
    tokenizer = load_tokenizer(demo_target, chat_template=name)
    question = CONVERSATION[:2]
    prompt = render_chat(tokenizer, question, [WEATHER])
    assert '"name": "get_weather"' in prompt and "Be brief." in prompt and "What is the weather in Paris?" in prompt
    history = render_chat(tokenizer, CONVERSATION, [WEATHER])
    assert "sunny, 21 C" in history
    # NOTE: the assistant's earlier call is written as the parser expects the model to write a new one
    assert history.startswith(prompt)
    written = history[len(prompt):].split(END_OF_TURN[name])[0]
    _, calls = parse_tool_calls(CHAT_TEMPLATES[name], written)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})], written


def test_demo_target_own_template_renders_no_tools(demo_target: Path) -> None:
    with pytest.raises(ToolsIgnoredError):
        render_chat(load_tokenizer(demo_target), CONVERSATION[:2], [WEATHER])


@pytest.fixture(scope="module")
def client(demo_target: Path) -> Iterator[openai.OpenAI]:
    from blockspec import Engine
    from blockspec.models.smollm2 import embedded_draft_dir
    from blockspec.server import BackgroundServer
    from blockspec.server.args import ServerSettings

    engine = Engine(model_path=str(demo_target), device="cpu", dtype="float32", max_total_tokens=4096,
                    speculative_algorithm="DFLASH", speculative_draft_model_path=str(embedded_draft_dir()),
                    chat_template="chatml")
    with BackgroundServer(engine, ServerSettings(port=0, served_model_name="demo", tool_call_parser="qwen3")) as server:
        yield from openai_client(server)


def test_tools_on_the_demo_pair(client: openai.OpenAI) -> None:
    forced = client.chat.completions.create(model="demo", messages=CONVERSATION[:2], tools=[WEATHER],
                                            tool_choice="required", max_tokens=40, temperature=0)
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    answered = [*CONVERSATION[:2], choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    free = client.chat.completions.create(model="demo", messages=answered, tools=[WEATHER], max_tokens=16,
                                          temperature=0)
    assert free.choices[0].finish_reason in ("stop", "length", "tool_calls")
