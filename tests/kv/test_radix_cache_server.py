"""The radix cache through the HTTP server: meta_info cached_tokens, /server_info and /metrics numbers, POST
/flush_cache (refused while a request runs), and the --disable-radix-cache flag."""
from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings, parse_serve_args
from tests.support.server_support import metric_value, save_text_model, wait_idle

PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    model = save_text_model(tmp_path_factory.mktemp("radix_server"))
    engine = Engine(model_path=str(model), device="cpu", dtype="float32", max_total_tokens=2048, page_size=4)
    with BackgroundServer(engine, ServerSettings(port=0)) as running:
        yield running


def test_cached_tokens_stats_metrics_and_flush(server: BackgroundServer) -> None:
    prompt = list(range(5, 40))
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        first = client.post("/generate", json={"input_ids": prompt, "sampling_params": PARAMS}).json()
        second = client.post("/generate", json={"input_ids": prompt, "sampling_params": PARAMS}).json()
        assert first["output_ids"] == second["output_ids"]
        assert first["meta_info"]["cached_tokens"] == 0
        assert second["meta_info"]["cached_tokens"] == (len(prompt) - 1) // 4 * 4
        cache = client.get("/server_info").json()["internal_states"][0]["radix_cache"]
        assert cache["enabled"] and cache["tree_tokens"] > 0 and 0 < cache["cache_hit_rate"] < 1
        text = client.get("/metrics").text
        assert metric_value(text, "blockspec_cache_hit_rate") == pytest.approx(cache["cache_hit_rate"])
        assert metric_value(text, "blockspec_cached_tokens_total") == cache["cached_tokens_total"]
        assert "blockspec_radix_cache_evicted_tokens_total" in text
        assert metric_value(text, "blockspec_radix_cache_tokens") == cache["tree_tokens"]

        long = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
        with client.stream(
            "POST", "/generate", json={"input_ids": [5, 6], "rid": "busy", "sampling_params": long, "stream": True}
        ) as r:
            lines = r.iter_lines()  # NOTE: kept referenced: a dropped iterator closes the stream (the server aborts)
            next(line for line in lines if line.startswith("data: "))
            assert client.post("/flush_cache").status_code == 400
            client.post("/abort_request", json={"rid": "busy"})
        wait_idle(server.base_url)
        assert client.post("/flush_cache").status_code == 200
        info = client.get("/server_info").json()
        assert info["internal_states"][0]["radix_cache"]["tree_tokens"] == 0
        assert info["kv_cache"]["unused_slots"] == info["kv_cache"]["total_slots"]


def test_disable_radix_cache_flag() -> None:
    assert parse_serve_args(["--model-path", "m"]).engine["disable_radix_cache"] is False
    assert parse_serve_args(["--model-path", "m", "--disable-radix-cache"]).engine["disable_radix_cache"] is True
