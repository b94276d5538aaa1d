"""Detokenisation leaves the engine loop: the server process decodes every request without stop strings (DecodeStream),
the engine decodes only those with stop strings; texts stay those of the offline engine, streamed or not, and a
server that falls behind merges a stream's queued deltas into one chunk."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from blockspec import Engine
from blockspec.request import Req
from blockspec.server import BackgroundServer
from blockspec.server.detokenize import OutputTexts
from blockspec.server.submission import Delta, coalesce
from blockspec.tokenizer import backend_of
from tests.support.server_support import serve_text_model, sse_payloads, wait_idle


def test_coalesce_merges_each_request_in_order() -> None:
    deltas = [
        Delta(0, "a", [1], logprobs=[-0.1]), Delta(1, "x", [7]), Delta(0, "b", [2], logprobs=[-0.2]),
        Delta(0, "c", [3], {"text": "abc"}, logprobs=[-0.3]), Delta(1, "y", [8]),
    ]
    merged = coalesce(deltas)
    assert [(d.index, d.text, d.ids) for d in merged] == [(0, "abc", [1, 2, 3]), (1, "xy", [7, 8])]
    assert merged[0].final and merged[0].output == {"text": "abc"} and merged[0].logprobs == [-0.1, -0.2, -0.3]
    assert not merged[1].final


def test_coalesce_keeps_an_error_final() -> None:
    merged = coalesce([Delta(0, "a", [1]), Delta(0, "", [], None, "gone", 503)])
    assert len(merged) == 1 and merged[0].error == "gone" and merged[0].status == 503 and merged[0].text == "a"


def test_output_texts_match_a_whole_decode(text_server: BackgroundServer) -> None:
    tokenizer = text_server.engine.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode("Janet has 3 apples, buys 4 more: 3 + 4 = 7. The quick brown fox!", add_special_tokens=False)
    texts = OutputTexts(backend_of(tokenizer))
    pieces = [texts.push("r", [token], True, final=i == len(ids) - 1) for i, token in enumerate(ids)]
    assert "".join(pieces) == texts.finish("r") == tokenizer.decode(ids, skip_special_tokens=True)
    assert texts.in_flight == 0
    assert OutputTexts(None).push("r", ids, True, final=True) == ""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("detok_model")


@pytest.fixture(scope="module")
def text_server(model_dir: Path) -> Iterator[BackgroundServer]:
    yield from serve_text_model(model_dir)


@pytest.fixture(scope="module")
def offline_engine(text_server: BackgroundServer, model_dir: Path) -> Engine:
    """A second engine on the served checkpoint: the served one belongs to the server's engine thread."""
    return Engine(model_path=str(model_dir), device="cpu", dtype="float32", max_total_tokens=8192)


@pytest.fixture
def admitted(text_server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> list[Req]:
    """The Reqs the engine admits during the test (the in-process engine's scheduler, patched)."""
    scheduler = text_server.engine.scheduler
    seen: list[Req] = []
    add = scheduler.add_request

    def recording(req: Req) -> None:
        seen.append(req)
        add(req)

    monkeypatch.setattr(scheduler, "add_request", recording)
    return seen


def _offline(engine: Engine, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    out = engine.generate(input_ids=ids, sampling_params=params)
    assert isinstance(out, dict)
    return out


def test_streamed_and_whole_texts_equal_the_offline_engine(
    text_server: BackgroundServer, offline_engine: Engine, admitted: list[Req]
) -> None:
    tokenizer = text_server.engine.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=text_server.base_url, timeout=60) as client:
        whole = client.post("/generate", json={"input_ids": ids, "sampling_params": params}).json()
        with client.stream("POST", "/v1/completions", json={"prompt": ids, "max_tokens": 24, "temperature": 0,
                                                             "ignore_eos": True, "stream": True}) as response:
            chunks = [p for p in sse_payloads(response.iter_lines()) if p != "[DONE]"]
    wait_idle(text_server.base_url)
    offline = _offline(offline_engine, ids, params)
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert (
        whole["text"]
        == streamed
        == offline["text"]
        == tokenizer.decode(offline["output_ids"], skip_special_tokens=True)
    )
    assert whole["output_ids"] == offline["output_ids"]
    assert len(admitted) == 2 and not any(req.detokenized for req in admitted)  # NOTE: decoded in the server


def test_stop_strings_are_decoded_by_the_engine(
    text_server: BackgroundServer, offline_engine: Engine, admitted: list[Req]
) -> None:
    tokenizer = text_server.engine.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode("Question: Janet has", add_special_tokens=False)
    free = _offline(offline_engine, ids, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert len(free["text"]) > 6
    stop = free["text"][3:6]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    offline = _offline(offline_engine, ids, params)
    assert offline["meta_info"]["finish_reason"]["matched"] == stop
    with httpx.Client(base_url=text_server.base_url, timeout=60) as client:
        with client.stream(
            "POST", "/generate", json={"input_ids": ids, "sampling_params": params, "stream": True}
        ) as response:
            chunks = [p for p in sse_payloads(response.iter_lines()) if p != "[DONE]"]
    wait_idle(text_server.base_url)
    assert chunks[-1]["text"] == offline["text"] and chunks[-1]["output_ids"] == offline["output_ids"]
    assert all(offline["text"].startswith(c["text"]) for c in chunks)  # NOTE: cumulative, never past the stop
    assert [req.detokenized for req in admitted] == [True]


def test_skip_special_tokens_false_is_decoded_with_them(text_server: BackgroundServer, offline_engine: Engine) -> None:
    tokenizer = text_server.engine.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode("The quick", add_special_tokens=False)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    with httpx.Client(base_url=text_server.base_url, timeout=60) as client:
        whole = client.post("/generate", json={"input_ids": ids, "sampling_params": params}).json()
    wait_idle(text_server.base_url)
    assert (
        whole["text"]
        == tokenizer.decode(whole["output_ids"], skip_special_tokens=False)
        == _offline(offline_engine, ids, params)["text"]
    )
