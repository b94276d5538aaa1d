"""A server's shutdown drain, driven from outside: long and short requests in flight (streams, a non-streaming call,
a /generate stream) and what each must get once the server stops with GRACE_S of grace (--shutdown-grace-s)."""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Any, Callable

import httpx
import pytest

from tests.support.server_support import sse_payloads

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


def start_clients(url: str) -> dict[str, tuple[threading.Thread, dict[str, Any]]]:
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


def check_outcomes(clients: dict[str, tuple[threading.Thread, dict[str, Any]]], shutdown_at: float) -> None:
    """After a shutdown began at `shutdown_at` (with GRACE_S of grace): the short stream finished normally; the long
    streams ended with one 503 error event (OpenAI error shape) no sooner than the grace period, then [DONE]; the
    long non-streaming call got a 503 in the same shape."""
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
    clients = start_clients(url)
    shutdown_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    check_outcomes(clients, shutdown_at)
    assert proc.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
