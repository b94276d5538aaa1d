"""EventStream: a stream whose task is cancelled while `send` waits (a client that stopped reading) closes its body
generator at once, so the generator's cleanup (the engine requests' abort) does not wait for the garbage collector."""
from __future__ import annotations

import asyncio
import gc
from typing import Any, AsyncIterator

from blockspec.server.state import EventStream


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
