"""A client that stops reading a stream gets its engine requests aborted at once: EventStream closes the body generator
when its task is cancelled while `send` waits (the cleanup does not wait for the garbage collector), and the OpenAI
streams abort from their first chunks on, before the deltas' own cleanup exists."""
from __future__ import annotations

import asyncio
import gc
import json
from typing import Any, AsyncIterator

import httpx

from blockspec.server.state import EventStream, sse


def test_a_cancelled_stream_closes_its_generator_at_once() -> None:
    cleaned: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            for i in range(100):
                yield b"data: %d\n\n" % i
        finally:
            cleaned.append("aborted")

    async def main() -> None:
        blocked = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.body" and message.get("body"):
                blocked.set()
                await asyncio.Event().wait()  # NOTE: a full write buffer that never drains

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {}

        task = asyncio.ensure_future(EventStream(body())({"type": "http"}, receive, send))
        await blocked.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert cleaned == ["aborted"]

    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()


def test_a_stream_closed_before_its_deltas_still_aborts_its_requests() -> None:
    """The chat stream's role chunks and the completion stream's echo chunks come before the deltas (whose cleanup
    aborts the engine's requests): a client gone while they are sent must abort them too."""
    from types import SimpleNamespace

    from blockspec.request import Req, SamplingParams
    from blockspec.server.chat_tools import ChatTools
    from blockspec.server.openai_api import _chat_stream, _completion_stream
    from blockspec.server.submission import Submission

    async def main() -> list[str]:
        aborted: list[str] = []
        loop = asyncio.get_running_loop()
        reqs = [Req([1, 2, 3], SamplingParams(), f"r{i}") for i in range(2)]
        state = SimpleNamespace(abort_pending=lambda sub: aborted.extend(sub.reqs[i].rid for i in sorted(sub.pending)),
                                tokenizer=None)
        chat = _chat_stream(state, Submission(reqs, True, loop), None, {"id": "x"},  # type: ignore[arg-type]
                            SimpleNamespace(include_usage=False, n=2), ChatTools())
        assert b"assistant" in await chat.__anext__()
        await chat.aclose()
        completion = _completion_stream(
            state,
            Submission(reqs, True, loop),
            None,
            {"id": "y"},  # type: ignore[arg-type]
            SimpleNamespace(include_usage=False, n=2, logprobs=None),
            ["echo", "echo"],
        )
        assert b"echo" in await completion.__anext__()
        await completion.aclose()
        return aborted

    assert asyncio.run(main()) == ["r0", "r1", "r0", "r1"]


def test_unicode_line_separators_in_a_payload_stay_inside_one_event_line() -> None:
    """Generated text may hold U+0085, U+2028 or U+2029; readers built on str.splitlines (httpx's iter_lines) end a
    line there, so an unescaped one cut the event in two (the /generate stream's JSONDecodeError in the shutdown test).
    """
    text = "a\u2028b\x85c\u2029d é \u4e2d"
    event = sse({"text": text, "nested": [{"t": text}]})
    lines = httpx._decoders.LineDecoder().decode(event.decode())
    assert lines == [lines[0], ""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == {"text": text, "nested": [{"t": text}]}
    assert "é \u4e2d" in lines[0]  # NOTE: other non-ASCII text stays raw UTF-8
    assert sse("[DONE]") == b"data: [DONE]\n\n"
