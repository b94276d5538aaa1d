"""Shutdown drains (issue 18): in-flight requests get --shutdown-grace-s to finish; after it streams end with an
SSE error event and the others with a 503, all in the OpenAI error shape. Plus the hardening flags."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from blockspec import Engine
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings, parse_serve_args
from tests.support.server_support import save_text_model, server_process
from tests.support.shutdown_drain import GRACE_S, check_outcomes, sigterm_drains, start_clients


def test_stop_drains_in_flight_requests(tmp_path: Path) -> None:
    engine = Engine(
        model_path=str(save_text_model(tmp_path / "model")), device="cpu", dtype="float32", max_total_tokens=16384
    )
    server = BackgroundServer(engine, ServerSettings(port=0, shutdown_grace_s=GRACE_S)).start()
    try:
        clients = start_clients(server.base_url)
        shutdown_at = time.monotonic()
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        check_outcomes(clients, shutdown_at)
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
