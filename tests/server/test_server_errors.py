"""Bad input gets a 4xx naming the field and the server keeps serving; disconnects free KV; full queue → 503;
API keys."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from tests.support.server_support import metric_value, save_text_model, sse_payloads, wait_idle

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("text_model"))


def _engine(text_model: Path, **flags: Any) -> Engine:
    return Engine(model_path=str(text_model), device="cpu", dtype="float32", max_total_tokens=8192, **flags)


@pytest.fixture(scope="module")
def server(text_model: Path) -> Iterator[BackgroundServer]:
    with BackgroundServer(_engine(text_model), ServerSettings(port=0)) as running:
        yield running


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
GEN = "/generate"
BAD_INPUTS = [
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages.0.role"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": -5}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": "ten"}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 1.5}, "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "temperature": -0.1}, "temperature"),
    (CHAT, {"messages": USER, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": USER, "top_p": 0}, "top_p"),
    (CHAT, {"messages": USER, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": USER, "top_k": 0}, "top_k"),
    (CHAT, {"messages": USER, "n": 0}, "n"),
    (CMPL, {"prompt": "x", "n": 129}, "n"),
    (CHAT, {"messages": USER, "stream": "yes"}, "stream"),
    (CHAT, {"messages": USER, "stop": 5}, "stop"),
    (CHAT, {"messages": USER, "seed": "x"}, "seed"),
    (CHAT, {"messages": USER, "logprobs": "yes"}, "logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": USER, "response_format": {"type": "structural_tag"}}, "response_format"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"messages": USER, "tool_choice": "auto"}, "tool_choice"),
    (CMPL, {"prompt": "x", "logprobs": 6}, "logprobs"),
    (GEN, {"text": "hi", "top_logprobs_num": 2}, "top_logprobs_num"),
    (GEN, {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    (GEN, {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**9}, "top_logprobs_num"),
    (CHAT, {"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"messages": USER, "frequency_penalty": "lots"}, "frequency_penalty"),
    (CHAT, {"messages": USER, "min_tokens": -1}, "min_tokens"),
    (CHAT, {"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias"),
    (CMPL, {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    (CMPL, {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
    (GEN, {"text": "hi", "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": "apples " * 5000}]}, "messages"),
    (CHAT, {"messages": USER, "max_tokens": 5000}, "max_tokens"),
    (CMPL, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (CMPL, {"prompt": ""}, "prompt"),
    (CMPL, {"prompt": []}, "prompt"),
    (CMPL, {"prompt": [5, 100000]}, "prompt"),
    (CMPL, {"prompt": [5, -1]}, "prompt"),
    (CMPL, {}, "prompt"),
    (CMPL, {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    (GEN, {}, "text"),
    (GEN, {"text": "a", "input_ids": [1]}, "text"),
    (GEN, {"input_ids": []}, "input_ids"),
    (GEN, {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    (GEN, {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    (GEN, {"text": "hi", "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    (GEN, {"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params"),
    (GEN, {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    (GEN, {"text": "hi", "sampling_params": "greedy"}, "sampling_params"),
]


@pytest.mark.parametrize(
    "path,body,param", BAD_INPUTS, ids=[f"{p}:{param}:{i}" for i, (p, _, param) in enumerate(BAD_INPUTS)]
)
def test_bad_input_is_a_400_naming_the_field(
    server: BackgroundServer, path: str, body: dict[str, Any], param: str
) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param, error
        assert error["message"].startswith(param), error
        ok = client.post(CHAT, json={"messages": USER, "max_tokens": 3})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("content", [b"{not json", b'{"messages": [', b"[1, 2]", b""])
def test_malformed_json(server: BackgroundServer, content: bytes) -> None:
    response = httpx.post(
        server.base_url + CHAT, content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "body"


@pytest.mark.parametrize("content", [
    b'{"input_ids": [5, 6, 123456789012345678901234567890], "x": [1e400, NaN, -0, 1E5, 0.1], "a": 1, "a": 2}',
    b'"\\ud800"', b'{"t": "a\\udc00b"}', "\ufeff{}".encode(), '{"t": "\u00e9"}'.encode("utf-16"),
])
def test_fast_json_request_parses_as_json_loads(content: bytes) -> None:
    """Bodies pydantic-core parses give json.loads' value; those it refuses (lone surrogates, a BOM, UTF-16) go to
    json.loads itself."""
    import asyncio
    import json

    from blockspec.server.json_route import FastJSONRequest

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": content, "more_body": False}

    parsed = asyncio.run(FastJSONRequest({"type": "http", "method": "POST", "headers": []}, receive).json())
    assert repr(parsed) == repr(json.loads(content))


def test_unknown_route_and_method(server: BackgroundServer) -> None:
    assert httpx.get(server.base_url + "/v1/nothing", timeout=30).status_code == 404
    assert httpx.get(server.base_url + CHAT, timeout=30).status_code == 405


def _running(base_url: str) -> int:
    return int(httpx.get(base_url + "/server_info", timeout=30).json()["internal_states"][0]["num_running_reqs"])


def _wait_running(base_url: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while _running(base_url) != count:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.02)


LONG = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}


def test_stream_disconnect_aborts_and_frees_kv(server: BackgroundServer) -> None:
    aborted = metric_value(
        httpx.get(server.base_url + "/metrics").text, "blockspec_requests_total", 'finish_reason="abort"'
    )
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with client.stream("POST", CHAT, json={"messages": USER, "stream": True, **LONG}) as r:
            lines = r.iter_lines()
            next(line for line in lines if '"content"' in line)
        info = wait_idle(server.base_url)
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
    metrics = httpx.get(server.base_url + "/metrics").text
    assert metric_value(metrics, "blockspec_requests_total", 'finish_reason="abort"') == aborted + 1


def test_non_stream_disconnect_aborts_and_frees_kv(server: BackgroundServer) -> None:
    aborted = metric_value(
        httpx.get(server.base_url + "/metrics").text, "blockspec_requests_total", 'finish_reason="abort"'
    )
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + CMPL, json={"prompt": [5, 6, 7], **LONG}, timeout=httpx.Timeout(30, read=0.3))
    wait_idle(server.base_url)
    metrics = httpx.get(server.base_url + "/metrics").text
    assert metric_value(metrics, "blockspec_requests_total", 'finish_reason="abort"') == aborted + 1


def test_full_queue_answers_503(text_model: Path) -> None:
    engine = _engine(text_model, max_running_requests=1)
    with (
        BackgroundServer(engine, ServerSettings(port=0, max_queued_requests=1)) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        body = {"prompt": [5, 6], "stream": True, **LONG}
        with client.stream("POST", CMPL, json=body) as first:
            _wait_running(running.base_url, 1)
            with client.stream("POST", CMPL, json=body) as second:
                assert second.status_code == 200  # queued behind the first
                third = client.post(CMPL, json={"prompt": [5], "max_tokens": 2})
                assert third.status_code == 503
                assert third.json()["error"]["type"] == "server_overloaded"
                assert first.status_code == 200
        wait_idle(running.base_url)
        assert client.post(CMPL, json={"prompt": [5], "max_tokens": 2}).status_code == 200


def test_api_key(text_model: Path) -> None:
    with BackgroundServer(_engine(text_model), ServerSettings(port=0, api_key="sesame")) as running:
        url = running.base_url
        assert httpx.get(url + "/health").status_code == 200  # open, like SGLang
        assert httpx.get(url + "/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            response = httpx.post(url + CHAT, json={"messages": USER, "max_tokens": 2}, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["param"] == "authorization"
        assert httpx.get(url + "/server_info").status_code == 401
        good = {"Authorization": "Bearer sesame"}
        assert httpx.post(url + CHAT, json={"messages": USER, "max_tokens": 2}, headers=good).status_code == 200
        assert httpx.get(url + "/v1/models", headers=good).status_code == 200


def test_stream_keeps_serving_after_errors(server: BackgroundServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        bad = client.post(CHAT, json={"messages": USER, "stream": True, "temperature": -1})
        assert bad.status_code == 400
        with client.stream("POST", CHAT, json={"messages": USER, "stream": True, "max_tokens": 3}) as r:
            events = sse_payloads(r.iter_lines())
        assert events[-1] == "[DONE]"
    wait_idle(server.base_url)


def test_engine_step_failure_fails_requests_but_not_the_server(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = server.engine.scheduler
    real_step = scheduler.step
    calls = {"n": 0}

    def failing_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # after the prompt was scheduled: KV is held when it fails
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(scheduler, "step", failing_step)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        failed = client.post(CMPL, json={"prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True})
        assert failed.status_code == 500
        assert "injected fault" in failed.json()["error"]["message"]
        wait_idle(server.base_url)
        assert client.get("/health").status_code == 200
        ok = client.post(CMPL, json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
