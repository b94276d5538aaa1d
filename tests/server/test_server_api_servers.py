"""--api-server-count N: N HTTP server processes on one port in front of one engine process. Requests from any of
them get the same answers, every process's /metrics counts every request, SIGTERM drains all of them, and an engine
that dies takes all of them down."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings, default_api_server_count, parse_serve_args
from tests.support.server_support import metric_value, save_text_model, server_process, wait_idle
from tests.support.shutdown_drain import GRACE_S, sigterm_drains

COUNT = 3


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _server_pids(url: str, tries: int = 60) -> dict[int, int]:
    """index → pid of the server processes seen over `tries` fresh connections (the kernel picks one per
    connection)."""
    seen: dict[int, int] = {}
    for _ in range(tries):
        with httpx.Client(base_url=url, timeout=10) as client:
            info = client.get("/server_info").json()["api_server"]
        assert info["count"] == COUNT
        seen[info["index"]] = info["pid"]
    return seen


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return save_text_model(tmp_path / "model")


def test_requests_spread_over_server_processes_with_the_same_answers(model: Path) -> None:
    with server_process(["--model-path", str(model), "--api-server-count", str(COUNT)]) as (proc, url):
        pids = _server_pids(url)
        assert sorted(pids) == list(range(COUNT)) and len(set(pids.values())) == COUNT and proc.pid in pids.values()

        def one(i: int) -> tuple[int, dict[str, Any]]:
            with httpx.Client(base_url=url, timeout=60) as client:
                body = {
                    "input_ids": [5, 6, 7 + i % 3],
                    "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                    "stream": i % 2 == 1,
                }
                if i % 2:
                    with client.stream("POST", "/generate", json=body) as reply:
                        lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
                    return i, json.loads(lines[-1][len("data: "):])
                return i, client.post("/generate", json=body).json()

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = dict(pool.map(one, range(36)))
        for i, answer in answers.items():
            reference = answers[i % 6]  # NOTE: same prompt (i % 3) and same mode (i % 2) as i
            assert answer["output_ids"] == reference["output_ids"] and answer["text"] == reference["text"]
            assert len(answer["output_ids"]) == 6
        wait_idle(url)
        for _ in range(6):  # every process counts every finished request (the engine sends its stats to all)
            with httpx.Client(base_url=url, timeout=10) as client:
                text = client.get("/metrics").text
            assert metric_value(text, "blockspec_requests_total", 'finish_reason="length"') >= 36
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_sigterm_drains_every_server_process(model: Path) -> None:
    with server_process(["--model-path", str(model), "--max-total-tokens", "16384", "--shutdown-grace-s",
                         str(GRACE_S), "--api-server-count", str(COUNT)]) as (proc, url):
        pids = _server_pids(url)
        sigterm_drains(proc, url)
        assert all(_gone(pid) for pid in pids.values())


def test_engine_death_stops_every_server_process(model: Path) -> None:
    with server_process(["--model-path", str(model), "--api-server-count", str(COUNT)]) as (proc, url):
        pids = _server_pids(url)
        engine_pid = httpx.get(url + "/server_info", timeout=10).json()["engine_pid"]
        os.kill(engine_pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert all(_gone(pid) for pid in pids.values())


def test_api_server_count_default_scales_with_cores_on_a_gpu() -> None:
    assert [default_api_server_count("cuda", cores) for cores in (None, 2, 7, 8, 16, 128)] == [1, 1, 1, 2, 4, 4]
    assert default_api_server_count("cuda:1", 16) == 4
    assert default_api_server_count("cpu", 128) == 1


def test_api_server_count_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_serve_args(["--model-path", "/m", "--device", "cpu"]).server.api_server_count == 1
    assert parse_serve_args(["--model-path", "/m", "--api-server-count", "4"]).server.api_server_count == 4
    for bad in ("0", "65"):
        with pytest.raises(SystemExit) as exc:
            parse_serve_args(["--model-path", "/m", "--api-server-count", bad])
        assert exc.value.code == 2 and "--api-server-count" in capsys.readouterr().err


def test_in_process_server_refuses_several_server_processes(model: Path) -> None:
    engine = Engine(model_path=str(model), device="cpu", dtype="float32", max_total_tokens=1024)
    with pytest.raises(ValueError, match="api_server_count"):
        BackgroundServer(engine, ServerSettings(port=0, api_server_count=2))
