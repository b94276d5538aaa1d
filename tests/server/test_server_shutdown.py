"""Shutdown drains (issue 18): in-flight requests get --shutdown-grace-s to finish; after it streams end with an
SSE error event and the others with a 503, all in the OpenAI error shape. Plus the hardening flags."""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings, parse_serve_args
from tests.support.server_support import save_text_model, sse_payloads, server_process

GRACE_S = 1.5
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except Exception as exc:  # the assertion below names it
            result["error"] = exc
        result["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _stream(url: str, path: str, body: dict[str, Any], started: threading.Event) -> list[Any]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = []
        for line in r.iter_lines():
            started.set()
            lines.append(line)
        return sse_payloads(lines)


def _running(url: str) -> int:
    return int(httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]["num_running_reqs"])


def _start_clients(url: str) -> dict[str, tuple[threading.Thread, dict[str, Any]]]:
    """A long stream, a long non-streaming call, a /generate stream; then, once they run, a short stream."""
    started = [threading.Event() for _ in range(3)]
    clients = {
        "stream": _in_thread(lambda: _stream(url, "/v1/completions", {"prompt": [5, 6], **LONG}, started[0])),
        "gen_stream": _in_thread(
            lambda: _stream(
                url,
                "/generate",
                {"input_ids": [5, 7], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}},
                started[1],
            )
        ),
        "plain": _in_thread(
            lambda: httpx.post(
                url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **LONG}, timeout=60
            )
        ),
    }
    deadline = time.monotonic() + 30
    while not all(e.is_set() for e in started[:2]) or _running(url) < 3:
        failed = {name: r["error"] for name, (_, r) in clients.items() if "error" in r}
        assert not failed and time.monotonic() < deadline, f"the long requests never started: {failed}"
        time.sleep(0.02)
    clients["short"] = _in_thread(
        lambda: _stream(url, "/v1/completions", {"prompt": [5, 8], "max_tokens": 40, "ignore_eos": True}, started[2])
    )
    assert started[2].wait(30)
    return clients


def _check_outcomes(clients: dict[str, tuple[threading.Thread, dict[str, Any]]], shutdown_at: float) -> None:
    for thread, _ in clients.values():
        thread.join(60)
    results = {name: r for name, (_, r) in clients.items()}
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r.get('error')!r}"
    short = results["short"]["value"]
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length", short[-3:]
    assert "".join(e["choices"][0]["text"] for e in short[:-1]) and not any("error" in e for e in short[:-1])
    for name in ("stream", "gen_stream"):
        events = results[name]["value"]
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 503, events[-3:]
        assert set(errors[0]["error"]) == {"message", "type", "param", "code"}
        assert "shutting down" in errors[0]["error"]["message"]
        assert events[-1] == "[DONE]"
        assert results[name]["at"] - shutdown_at >= GRACE_S - 0.2  # they were given the grace period
    plain = results["plain"]["value"]
    assert plain.status_code == 503, plain.text
    assert set(plain.json()["error"]) == {"message", "type", "param", "code"}


def sigterm_drains(proc: "subprocess.Popen[str]", url: str) -> None:
    """Long and short requests in flight, SIGTERM: the short ones finish, the long ones end after the grace period
    with 503s; the server exits 0 and stops listening."""
    clients = _start_clients(url)
    shutdown_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _check_outcomes(clients, shutdown_at)
    assert proc.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_stop_drains_in_flight_requests(tmp_path: Path) -> None:
    engine = Engine(
        model_path=str(save_text_model(tmp_path / "model")), device="cpu", dtype="float32", max_total_tokens=16384
    )
    server = BackgroundServer(engine, ServerSettings(port=0, shutdown_grace_s=GRACE_S)).start()
    try:
        clients = _start_clients(server.base_url)
        shutdown_at = time.monotonic()
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        _check_outcomes(clients, shutdown_at)
        stopper.join(30)
        assert not stopper.is_alive()
    finally:
        server.stop()
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]


def test_sigterm_drains_then_exits_cleanly(tmp_path: Path) -> None:
    model = save_text_model(tmp_path / "model")
    with server_process(
        ["--model-path", str(model), "--max-total-tokens", "16384", "--shutdown-grace-s", str(GRACE_S)]
    ) as (proc, url):
        sigterm_drains(proc, url)


def test_hardening_flags() -> None:
    defaults = parse_serve_args(["--model-path", "/m", "--device", "cpu"]).server
    assert defaults.max_request_bytes == 16 * 1024 * 1024 and defaults.shutdown_grace_s == 20.0
    assert defaults.header_timeout_s == 10.0 and defaults.timeout_keep_alive == 5
    assert defaults.body_timeout_s == 60.0 and defaults.max_connections == 1000
    assert defaults == ServerSettings(port=30000)
    args = parse_serve_args([
        "--model-path", "/m", "--max-request-bytes", "1000", "--shutdown-grace-s", "0", "--header-timeout-s", "2.5",
        "--timeout-keep-alive", "9", "--body-timeout-s", "7.5", "--max-connections", "12",
    ]).server
    assert (args.max_request_bytes, args.shutdown_grace_s, args.header_timeout_s, args.timeout_keep_alive) == (
        1000,
        0.0,
        2.5,
        9,
    )
    assert (args.body_timeout_s, args.max_connections) == (7.5, 12)


@pytest.mark.parametrize("flag,value", [
    ("--max-request-bytes", "0"), ("--shutdown-grace-s", "-1"), ("--shutdown-grace-s", "inf"),
    ("--header-timeout-s", "0"), ("--header-timeout-s", "nan"), ("--timeout-keep-alive", "0"),
    ("--body-timeout-s", "0"), ("--body-timeout-s", "inf"), ("--max-connections", "0"),
])
def test_bad_hardening_flags_exit_2_naming_the_flag(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_serve_args(["--model-path", "/m", flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
