"""--stream-interval N (SGLang's flag): a streaming request gets a chunk once N new tokens are ready, and always its
last one; the streamed output reassembles to the non-streamed answer, stop strings included."""
from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from blockspec import Engine
from blockspec.config.engine_config import EngineConfig
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings, parse_serve_args
from tests.support.server_support import save_text_model, sse_payloads, wait_idle

INTERVAL = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    path = save_text_model(tmp_path_factory.mktemp("text_model"))
    engine = Engine(
        model_path=str(path), device="cpu", dtype="float32", max_total_tokens=8192, stream_interval=INTERVAL
    )
    with BackgroundServer(engine, ServerSettings(port=0)) as running:
        yield running


def _stream(server: BackgroundServer, body: dict) -> list:
    with httpx.stream("POST", server.base_url + "/generate", json={**body, "stream": True}, timeout=60) as response:
        events = sse_payloads(response.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_chunks_carry_at_least_the_interval_and_reassemble(server: BackgroundServer) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 23, "temperature": 0, "ignore_eos": True}}
    whole = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    chunks = _stream(server, body)
    lengths = [len(c["output_ids"]) for c in chunks]
    steps = [b - a for a, b in zip([0] + lengths, lengths)]
    assert all(step >= INTERVAL for step in steps[:-1]) and 0 < steps[-1] and lengths[-1] == 23, steps
    assert len(chunks) <= 23 // INTERVAL + 1
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    wait_idle(server.base_url)


def test_stop_strings_under_an_interval(server: BackgroundServer) -> None:
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = httpx.post(
        server.base_url + "/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": params}, timeout=60
    ).json()
    text = free["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {**params, "stop": [stop]}}
    whole = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    texts = [c["text"] for c in _stream(server, body)]
    assert all(whole["text"].startswith(t) for t in texts) and texts[-1] == whole["text"] == text[: text.index(stop)]
    wait_idle(server.base_url)


def test_a_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig.from_kwargs(model_path="m", stream_interval=0)
    assert parse_serve_args(["--model-path", "m", "--stream-interval", "8"]).engine["stream_interval"] == 8
    with pytest.raises(SystemExit):
        parse_serve_args(["--model-path", "m", "--stream-interval", "0"])
