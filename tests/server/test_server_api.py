"""HTTP endpoints on a tiny Llama with a real tokenizer: shapes of OpenAI and SGLang answers, streaming, metrics."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from tests.support.server_support import metric_value, save_text_model, sse_payloads, wait_idle


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("text_model"))


@pytest.fixture(scope="module")
def server(text_model: Path) -> Iterator[BackgroundServer]:
    engine = Engine(model_path=str(text_model), device="cpu", dtype="float32", max_total_tokens=8192, page_size=4)
    with BackgroundServer(engine, ServerSettings(port=0, served_model_name="tiny")) as running:
        yield running


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c
    wait_idle(server.base_url)


def test_health_models_and_model_info(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 4096
    assert client.get("/get_model_info").json()["is_generation"] is True


def test_chat_completion_matches_offline_engine(client: httpx.Client, server: BackgroundServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many apples?"}]
    body = client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0}
    ).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    ids = server.engine.chat_input_ids(messages)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["total_tokens"] == len(ids) + body["usage"]["completion_tokens"]
    native = client.post(
        "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    ).json()
    assert native["text"] == choice["message"]["content"]


def test_completions_batch_and_usage(client: httpx.Client) -> None:
    body = client.post(
        "/v1/completions",
        json={"prompt": ["The quick", "Janet has"], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    ).json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 10
    tokens = client.post(
        "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    ).json()
    assert tokens["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_stream_reassembles_to_the_non_stream_answer(client: httpx.Client) -> None:
    request = {
        "messages": [{"role": "user", "content": "Count: 1 2 3"}],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = client.post("/v1/chat/completions", json=request).json()
    with client.stream(
        "POST", "/v1/chat/completions", json={**request, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16


def test_completion_stream_batch(client: httpx.Client) -> None:
    request = {
        "prompt": ["The quick", "The lazy dog"],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with client.stream("POST", "/v1/completions", json=request) as r:
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    whole = client.post("/v1/completions", json={**request, "stream": False}).json()
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]


def test_generate_text_batch_and_stream(client: httpx.Client) -> None:
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    batch = client.post("/generate", json={"text": ["Janet has", "The fox"], "sampling_params": params}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert all(o["meta_info"]["completion_tokens"] == 8 and len(o["output_ids"]) == 8 for o in batch)
    assert batch[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    with client.stream("POST", "/generate", json={"text": "Janet has", "sampling_params": params, "stream": True}) as r:
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["output_ids"] == batch[0]["output_ids"] and last["text"] == batch[0]["text"]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    lengths = [len(e["output_ids"]) for e in events[:-1]]
    assert lengths == sorted(lengths) and len(lengths) > 1  # cumulative, several chunks


def test_stop_string_never_streamed(client: httpx.Client) -> None:
    ids = [5, 6, 7, 8]
    free = client.post(
        "/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}},
    ).json()
    text = free["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    whole = client.post("/generate", json={"input_ids": ids, "sampling_params": params}).json()
    assert whole["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert whole["text"] == text[: text.index(stop)]
    with client.stream("POST", "/generate", json={"input_ids": ids, "sampling_params": params, "stream": True}) as r:
        events = sse_payloads(r.iter_lines())
    texts = [e["text"] for e in events[:-1]]
    assert all(whole["text"].startswith(t) for t in texts)  # the cut stop string was never sent
    assert texts[-1] == whole["text"]


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    request = {"prompt": "The quick", "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    first = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    second = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    assert first == second


def test_server_info_and_metrics(client: httpx.Client) -> None:
    client.post("/v1/completions", json={"prompt": "Janet", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    info = client.get("/server_info").json()
    assert client.get("/get_server_info").json()["kv_cache"] == info["kv_cache"]
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"] == 8192
    assert info["served_model_name"] == "tiny" and info["vocab_size"] > 300
    assert info["max_queued_requests"] == 1024
    text = client.get("/metrics").text
    assert metric_value(text, "blockspec_requests_total", 'finish_reason="length"') >= 1
    assert metric_value(text, "blockspec_generation_tokens_total") >= 4
    assert metric_value(text, "blockspec_time_to_first_token_seconds_count") >= 1
    assert metric_value(text, "blockspec_time_per_output_token_seconds_count") >= 1
    assert metric_value(text, "blockspec_kv_total_slots") == 8192
    assert "blockspec_num_queue_reqs" in text and "blockspec_token_usage" in text


def test_abort_request_endpoint(client: httpx.Client, server: BackgroundServer) -> None:
    params = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with client.stream(
        "POST", "/generate", json={"input_ids": [5, 6], "rid": "to-abort", "sampling_params": params, "stream": True}
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert client.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
        events = sse_payloads(lines)
    final = [e for e in events if isinstance(e, dict)][-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(final["output_ids"]) < 3000
