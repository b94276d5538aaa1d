"""The server talks (issue 53, finding 5): a progress line while the engine has work (requests, generation throughput,
DFlash's accept length), the draft named at start-up, a busy port refused before the model loads, and a shutdown
with requests in flight says how long it waits."""
from __future__ import annotations

import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from blockspec import Engine
from blockspec.cli import main
from blockspec.engine.progress_line import ProgressLine
from tests.support.server_support import save_text_model, server_process

LINE = re.compile(r"^blockspec: #running-req \d+, #queue-req \d+, gen throughput \(token/s\) [\d.]+, "
                  r"accept len [\d.]+, token usage [\d.]+$")


def test_progress_line_reports_throughput_and_accept_length(trained_pair: dict[str, Any]) -> None:
    root = Path(trained_pair["root"])
    engine = Engine(model_path=str(root / "target"), device="cpu", dtype="float32", max_total_tokens=2048,
                    skip_tokenizer_init=True, speculative_algorithm="DFLASH",
                    speculative_draft_model_path=str(root / "draft"))
    lines: list[str] = []
    progress = ProgressLine(engine, interval_s=3600, write=lines.append)
    try:
        reqs, _ = engine.make_requests(input_ids=[[5, 6, 7, 8]] * 2,
                                       sampling_params={"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
        for req in reqs:
            engine.scheduler.add_request(req)
        now = 0.0
        while engine.scheduler.has_work:
            finished = engine.step()
            now += 0.5
            progress.after_step(finished, now)
    finally:
        engine.shutdown()
    assert len(lines) == 1 and LINE.match(lines[0]), lines  # NOTE: one line when the engine ran out of work
    throughput = float(lines[0].split("(token/s) ")[1].split(",")[0])
    assert throughput > 0


def test_busy_port_is_refused_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["serve", "--model-path", str(tmp_path / "missing"), "--device", "cpu", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in err
    assert "could not load the model" not in err  # NOTE: the port was checked first


def test_console_names_the_draft_reports_progress_and_announces_the_drain(tmp_path: Path) -> None:
    model = save_text_model(tmp_path / "model")
    with server_process(["--model-path", str(model), "--max-total-tokens", "4096", "--page-size", "4",
                         "--shutdown-grace-s", "1"], ("-m", "blockspec.cli", "serve")) as (proc, url):
        reply = httpx.post(url + "/v1/completions", json={"prompt": "Janet", "max_tokens": 8, "ignore_eos": True},
                           timeout=30)
        assert reply.status_code == 200
        started = threading.Event()

        def long_stream() -> None:
            body = {"prompt": "Janet", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
                    for _ in stream.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass

        client = threading.Thread(target=long_stream)
        client.start()
        assert started.wait(30)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        client.join(30)
        assert proc.stdout is not None
        out = proc.stdout.read()
    assert "without a draft on http://127.0.0.1:" in out, out
    assert re.search(r"blockspec: #running-req \d+, #queue-req \d+, gen throughput \(token/s\) [\d.]+, token usage",
                     out), out
    assert "shutting down: waiting up to 1 s (--shutdown-grace-s) for 1 request(s) in flight" in out, out
