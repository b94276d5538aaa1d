"""Faults found by a fault run (issue 18): lone surrogates, huge bodies, tokenization on the event loop, half-sent
headers, the queue limit under bursts, and a request the KV pool cannot hold."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from blockspec import Engine
from blockspec.request import Finish, FinishReason
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from tests.support.server_support import save_text_model, sse_payloads, wait_idle

CHAT, CMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("text_model"))


def _engine(text_model: Path, **flags: Any) -> Engine:
    return Engine(model_path=str(text_model), device="cpu", dtype="float32", **{"max_total_tokens": 8192, **flags})


@pytest.fixture(scope="module")
def server(text_model: Path) -> Iterator[BackgroundServer]:
    settings = ServerSettings(port=0, max_request_bytes=64 * 1024, header_timeout_s=0.5, body_timeout_s=0.5)
    with BackgroundServer(_engine(text_model), settings) as running:
        yield running


def _assert_error(response: httpx.Response | dict[str, Any], status: int, param: str | None = None) -> dict[str, Any]:
    body = response if isinstance(response, dict) else response.json()
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, body
    if param is not None:
        assert error["param"] == param and error["message"].startswith(param), error
    return dict(error)


SURROGATES = [
    (CMPL, {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
    (CMPL, {"prompt": ["fine", "x\udfff"], "max_tokens": 2}, "prompt.1"),
    (GEN, {"text": "\ud800"}, "text"),
    (GEN, {"text": "hi", "sampling_params": {"stop": ["\ud800"]}}, "sampling_params"),
    (GEN, {"input_ids": [5, 6], "rid": "\ud800"}, "rid"),
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": "\ud800"}, "stop"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES, ids=[f"{p}:{param}" for p, _, param in SURROGATES])
def test_lone_surrogate_is_a_400_and_the_connection_lives_on(
    server: BackgroundServer, path: str, body: dict[str, Any], param: str
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        bad = conn.getresponse()
        payload = json.loads(bad.read())
        assert bad.status == 400, payload
        assert "surrogate" in _assert_error(payload, 400, param)["message"]
        sock = conn.sock
        conn.request(
            "POST",
            CMPL,
            body=json.dumps({"prompt": "hi", "max_tokens": 2, "ignore_eos": True}),
            headers={"content-type": "application/json"},
        )
        good = conn.getresponse()
        assert good.status == 200 and json.loads(good.read())["usage"]["completion_tokens"] == 2
        assert conn.sock is sock  # the same keep-alive connection answered
    finally:
        conn.close()


class TokenizerStandIn:
    """Replaces the server encoder's tokenizer (`BatchEncoder.backend`): each call runs `before` first."""

    def __init__(self, real: Any, before: Any) -> None:
        self.real, self.before = real, before

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> Any:
        self.before()
        return self.real.encode_batch(texts, add_special_tokens=add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        self.before()
        return self.real.encode(text, add_special_tokens=add_special_tokens)


def test_tokenizer_failure_is_a_400(server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise TypeError("TextEncodeInput must be Union[...]")

    encoder = server.app.state.blockspec.encoder
    monkeypatch.setattr(encoder, "backend", TokenizerStandIn(encoder.backend, broken))
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        _assert_error(client.post(CMPL, json={"prompt": "hi"}), 400, "prompt")
        _assert_error(client.post(GEN, json={"text": "hi"}), 400, "text")
        monkeypatch.undo()
        assert client.post(CMPL, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


TOKENIZED = [
    (CMPL, {"prompt": "apples", "max_tokens": 2}),
    (GEN, {"text": "apples", "sampling_params": {"max_new_tokens": 2}}),
    (CHAT, {"messages": [{"role": "user", "content": "apples"}], "max_tokens": 2}),
]


@pytest.mark.parametrize("path,body", TOKENIZED, ids=[p for p, _ in TOKENIZED])
def test_tokenization_leaves_the_event_loop_free(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    encoder = server.app.state.blockspec.encoder
    entered, release = threading.Event(), threading.Event()

    def slow() -> None:
        entered.set()
        release.wait(10)  # a 20 MB prompt's worth of tokenizer time

    monkeypatch.setattr(encoder, "backend", TokenizerStandIn(encoder.backend, slow))
    result: dict[str, int] = {}
    worker = threading.Thread(
        target=lambda: result.update(status=httpx.post(server.base_url + path, json=body, timeout=30).status_code)
    )
    worker.start()
    try:
        assert entered.wait(10)
        started = time.monotonic()
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 2
    finally:
        release.set()
        worker.join(30)
    assert result["status"] == 200


def test_body_over_max_request_bytes_is_a_413(server: BackgroundServer) -> None:
    big = {"prompt": "apples " * 20000, "max_tokens": 2}  # 140 kB > the 64 KiB limit
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        _assert_error(client.post(CMPL, json=big), 413, "body")
        chunked = (
            part.encode() for part in [json.dumps(big)[i : i + 8192] for i in range(0, len(json.dumps(big)), 8192)]
        )
        _assert_error(client.post(CMPL, content=chunked, headers={"content-type": "application/json"}), 413, "body")
        _assert_error(client.post(GEN, json={"input_ids": [5] * 40000}), 413, "body")
        assert client.post(CMPL, json={"prompt": "apples " * 100, "max_tokens": 2}).status_code == 200
        assert client.get("/health").status_code == 200


def test_default_limit_refuses_a_20_mb_prompt(text_model: Path) -> None:
    with BackgroundServer(_engine(text_model), ServerSettings(port=0)) as running:
        response = httpx.post(running.base_url + CMPL, json={"prompt": "a" * 20_000_000}, timeout=60)
        _assert_error(response, 413, "body")
        assert str(16 * 1024 * 1024) in response.json()["error"]["message"]


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    started, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - started
        data += chunk


def test_half_sent_headers_get_a_408_and_the_connection_closes(server: BackgroundServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        data, waited = _read_until_closed(sock, 10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and waited < 5
    _assert_error(json.loads(body), 408)


MALFORMED_FRAMINGS = {
    "bad_chunk_size": b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "negative_content_length": b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
    "non_numeric_content_length": b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n{}",
}


@pytest.mark.parametrize("name", list(MALFORMED_FRAMINGS))
def test_malformed_framing_is_a_400_in_the_openai_shape(server: BackgroundServer, name: str) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(MALFORMED_FRAMINGS[name])
        data, _ = _read_until_closed(sock, 10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, data
    assert "malformed" in _assert_error(json.loads(body), 400)["message"]
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("framing", ["content_length", "chunked"])
def test_stalled_body_gets_a_408_and_the_connection_closes(server: BackgroundServer, framing: str) -> None:
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    chunked = b"Transfer-Encoding: chunked\r\n\r\n5\r\n"
    head += b"Content-Length: 100\r\n\r\n" if framing == "content_length" else chunked
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + b'{"tex')  # NOTE: the rest never comes
        data, waited = _read_until_closed(sock, 10)
    head_in, _, body = data.partition(b"\r\n\r\n")
    assert head_in.startswith(b"HTTP/1.1 408") and waited < 5, data
    _assert_error(json.loads(body), 408, "body")


def test_body_written_whole_before_reading_gets_its_413_not_a_reset(server: BackgroundServer) -> None:
    body = json.dumps({"prompt": "apples " * 600_000, "max_tokens": 2}).encode()  # 4.2 MB > the 64 KiB limit
    # NOTE: Connection: close: on a keep-alive connection uvicorn already read and dropped the rest after the 413
    head = (f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)  # NOTE: like a client that reads only once its request is written
        sock.settimeout(10)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 413
        _assert_error(json.loads(response.read()), 413, "body")


def test_connections_over_the_cap_get_a_503_and_close(text_model: Path) -> None:
    with BackgroundServer(_engine(text_model), ServerSettings(port=0, max_connections=3)) as capped:
        held = [socket.create_connection(("127.0.0.1", capped.port)) for _ in range(3)]
        try:
            time.sleep(0.2)  # NOTE: the server has accepted them
            with socket.create_connection(("127.0.0.1", capped.port)) as extra:
                data, _ = _read_until_closed(extra, 10)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), data
            assert "--max-connections" in _assert_error(json.loads(body), 503)["message"]
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)  # NOTE: the server has seen them close
        assert httpx.get(capped.base_url + "/health", timeout=10).status_code == 200


def test_silent_and_trickling_connections_are_closed(server: BackgroundServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        assert _read_until_closed(sock, 10)[0] == b""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.settimeout(0.1)
        started = time.monotonic()
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:  # never finishes the head
            try:
                sock.sendall(bytes([byte]))
                closed = sock.recv(65536).startswith(b"HTTP/1.1 408")
            except socket.timeout:
                continue
            except OSError:
                closed = True
            if closed:
                break
        assert closed and time.monotonic() - started < 5


def test_header_timeout_leaves_long_responses_alone(server: BackgroundServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with client.stream(
            "POST", GEN, json={"input_ids": [5, 6], "sampling_params": {**LONG, "max_new_tokens": 1500}, "stream": True}
        ) as r:
            events = sse_payloads(r.iter_lines())  # lasts well over the 0.5 s header timeout
        assert events[-1] == "[DONE]" and len(events[-2]["output_ids"]) == 1500
        time.sleep(0.1)
        assert client.get("/health").status_code == 200


@pytest.fixture(scope="module")
def small_queue(text_model: Path) -> Iterator[BackgroundServer]:
    settings = ServerSettings(port=0, max_queued_requests=4)
    with BackgroundServer(_engine(text_model, max_running_requests=2), settings) as running:
        yield running


def test_queue_limit_counts_waiting_requests_not_running_ones(small_queue: BackgroundServer) -> None:
    url = small_queue.base_url
    batch = {"input_ids": [[5, 6 + i] for i in range(6)], "sampling_params": LONG, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", GEN, json=batch) as accepted:  # 2 run + 4 wait
            assert accepted.status_code == 200
            overflow = httpx.post(url + GEN, json={"input_ids": [5], "sampling_params": LONG}, timeout=30)
            assert overflow.status_code == 503 and overflow.json()["error"]["type"] == "server_overloaded"
        wait_idle(url)
        seven = client.post(GEN, json={**batch, "input_ids": [[5, 6 + i] for i in range(7)]})
        assert seven.status_code == 503
    wait_idle(url)


def test_queue_limit_admits_a_burst_up_to_running_plus_queued(
    small_queue: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = small_queue.engine.scheduler
    real_step, gate = scheduler.step, threading.Event()
    monkeypatch.setattr(scheduler, "step", lambda: gate.wait(30) and real_step())  # the whole burst lands before a step

    async def burst() -> list[int]:
        statuses: list[int] = []
        everyone_answered = asyncio.Event()
        async with httpx.AsyncClient(
            base_url=small_queue.base_url, timeout=30, limits=httpx.Limits(max_connections=64)
        ) as client:

            async def one(i: int) -> None:
                async with client.stream(
                    "POST", CMPL, json={"prompt": [5, i + 6], "max_tokens": 3000, "ignore_eos": True, "stream": True}
                ) as r:
                    statuses.append(r.status_code)
                    if len(statuses) == 30:
                        everyone_answered.set()
                    await asyncio.wait_for(everyone_answered.wait(), 30)

            await asyncio.gather(*(one(i) for i in range(30)))
        return statuses

    try:
        statuses = asyncio.run(burst())
    finally:
        gate.set()
    assert statuses.count(200) == 6 and statuses.count(503) == 24, statuses
    wait_idle(small_queue.base_url)


def _abort_after_two_tokens(monkeypatch: pytest.MonkeyPatch, engine: Engine, message: str) -> None:
    scheduler = engine.scheduler
    real_step = scheduler.step

    def step() -> Any:
        finished = real_step()
        for req in scheduler.running:
            if req.num_output_tokens >= 2 and not req.finished:
                req.finish = Finish(FinishReason.ABORT, message=message)
        return finished

    monkeypatch.setattr(scheduler, "step", step)


def test_engine_side_abort_is_an_answer_with_its_message(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _abort_after_two_tokens(monkeypatch, server.engine, "injected: out of room")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        native = client.post(GEN, json={"input_ids": [5, 6], "sampling_params": LONG})
        assert native.status_code == 200, native.text
        assert native.json()["meta_info"]["finish_reason"] == {"type": "abort", "message": "injected: out of room"}
        cmpl = client.post(CMPL, json={"prompt": [5, 6], "max_tokens": 3000, "ignore_eos": True})
        assert cmpl.status_code == 200, cmpl.text
        choice = cmpl.json()["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["abort_message"] == "injected: out of room"
        with client.stream(
            "POST",
            CHAT,
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3000,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            events = sse_payloads(r.iter_lines())
        final = [e for e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]][-1]
        assert (
            final["choices"][0]["finish_reason"] == "abort"
            and final["choices"][0]["abort_message"] == "injected: out of room"
        )
        assert events[-1] == "[DONE]"
    wait_idle(server.base_url)


def test_request_that_outgrows_the_kv_pool_ends_with_abort(text_model: Path) -> None:
    """Needs scheduler.py's two KV-pool finishes to be FinishReason.ABORT (issue 18)."""
    with BackgroundServer(_engine(text_model, max_total_tokens=64), ServerSettings(port=0)) as running, \
            httpx.Client(base_url=running.base_url, timeout=60) as client:
        native = client.post(
            GEN, json={"input_ids": [5, 6, 7], "sampling_params": {**LONG, "max_new_tokens": 200}}
        ).json()
        assert native["meta_info"]["finish_reason"]["type"] == "abort", native["meta_info"]
        assert "KV pool" in native["meta_info"]["finish_reason"]["message"]
        assert 0 < native["meta_info"]["completion_tokens"] < 200
        choice = client.post(CMPL, json={"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}).json()["choices"][
            0
        ]
        assert choice["finish_reason"] == "abort" and "KV pool" in choice["abort_message"]
        info = wait_idle(running.base_url)
        assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
