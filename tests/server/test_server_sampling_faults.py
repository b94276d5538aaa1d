"""Under load through the server (DFlash, concurrent clients): requests with degenerate sampling values never fail the
others (issue 47). A temperature below GREEDY_TEMPERATURE answers as greedy; a request whose row has nothing to sample
from gets its own 400 in OpenAI's error shape (an error event when streaming); every other request answers with the
tokens it gets alone."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from blockspec.server import BackgroundServer
from tests.support.server_support import serve_qwen_dflash, sse_payloads, wait_idle

pytest.importorskip("dflash.model")

MAX_NEW = 8
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,", "Dear Sir,", "Q: why?"]
GOOD: list[dict[str, Any]] = [
    {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    {"temperature": 0.8, "top_p": 0.9, "seed": 3, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    {"temperature": 0, "frequency_penalty": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
]
FAILING: list[dict[str, Any]] = [
    {"temperature": 1.0, "seed": 1, "repetition_penalty": 1e-300, "max_new_tokens": MAX_NEW},
    {"temperature": 0, "regex": "a", "min_new_tokens": 4, "max_new_tokens": MAX_NEW},
    {"temperature": 1.0, "seed": 2, "regex": "a", "min_new_tokens": 4, "max_new_tokens": MAX_NEW},
]
TINY_TEMPERATURE = {"temperature": 1e-300, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(qwen_vocab_pair: dict[str, Any]) -> Iterator[BackgroundServer]:
    yield from serve_qwen_dflash(Path(qwen_vocab_pair["root"]))


async def generate(client: httpx.AsyncClient, prompt: str, params: dict[str, Any], stream: bool) -> tuple[int, Any]:
    """(status, the final output or the error body); a streamed error arrives as an event with the status in it."""
    body = {"text": prompt, "sampling_params": params, "stream": stream}
    if not stream:
        response = await client.post("/generate", json=body)
        return response.status_code, response.json()
    async with client.stream("POST", "/generate", json=body) as response:
        lines = [line async for line in response.aiter_lines()]
    events = [event for event in sse_payloads(lines) if isinstance(event, dict)]  # NOTE: not the "[DONE]"
    errors = [event for event in events if "error" in event]
    if errors:
        return errors[-1]["error"]["code"], errors[-1]
    return response.status_code, events[-1]  # NOTE: chunks carry the cumulative output_ids


async def chat(client: httpx.AsyncClient, fields: dict[str, Any]) -> tuple[int, Any]:
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Say something."}], "max_tokens": MAX_NEW, **fields})
    return response.status_code, response.json()


def test_degenerate_requests_under_load_fail_alone(server: BackgroundServer) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            good = [(prompt, GOOD[i % len(GOOD)]) for i, prompt in enumerate(PROMPTS)]
            alone = [await generate(client, prompt, params, False) for prompt, params in good]
            greedy_alone = await generate(client, PROMPTS[0], GOOD[0], False)
            jobs = [generate(client, prompt, params, stream=i % 2 == 1) for i, (prompt, params) in enumerate(good * 3)]
            jobs += [generate(client, PROMPTS[i % len(PROMPTS)], params, stream=i % 2 == 0)
                     for i, params in enumerate(FAILING * 3)]
            jobs += [generate(client, PROMPTS[0], TINY_TEMPERATURE, stream) for stream in (False, True)]
            chat_greedy = await chat(client, {"temperature": 0})
            chats = [chat(client, {"temperature": 1e-300}), chat(client, {"temperature": 1.0, "seed": 4,
                                                                           "repetition_penalty": 1e-300})]
            *results, (tiny_status, tiny), (failed_status, failed) = await asyncio.gather(*jobs, *chats)
        assert tiny_status == 200 and tiny["choices"][0]["message"] == chat_greedy[1]["choices"][0]["message"], tiny
        assert failed_status == 400, failed
        assert failed["error"]["message"].startswith("sampling failed for this request: "), failed
        n_good = len(good) * 3
        for (status, output), (_, expected) in zip(results[:n_good], alone * 3):
            assert status == 200, output
            assert output["output_ids"] == expected["output_ids"]
        for status, output in results[n_good:n_good + len(FAILING) * 3]:
            assert status == 400, output
            assert output["error"]["message"].startswith("sampling failed for this request: "), output
            assert output["error"]["type"] == "invalid_request_error", output
        for status, output in results[n_good + len(FAILING) * 3:]:
            assert status == 200 and output["output_ids"] == greedy_alone[1]["output_ids"], output

    asyncio.run(run())
    wait_idle(server.base_url)  # raises unless the KV pool is fully free again and nothing runs
