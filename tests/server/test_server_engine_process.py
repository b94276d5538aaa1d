"""The engine in its own process: wire round trip, and what the server does when the engine process dies."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from blockspec.engine import wire
from blockspec.engine.process import EngineProcess
from blockspec.request import Req, SamplingParams
from blockspec.server.engine_errors import EngineLoadError, EngineStoppedError
from blockspec.server.engine_loop import EngineLoop
from tests.support.server_support import save_text_model, server_process

LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}


def test_wire_round_trip() -> None:
    add = wire.AddRequest("r", [1, 2], {"stop": ["x"]}, True, 1.5)
    assert wire.decode_to_engine(wire.encode([add, wire.Abort("r")])) == [add, wire.Abort("r")]
    out = wire.Outputs([wire.DeltaOut("r", "t", [3], {"meta_info": {"id": "r"}})], None)
    assert wire.decode_from_engine(wire.encode(out)) == out


def test_unloadable_model_is_a_load_error(tmp_path: Path) -> None:
    loop = EngineLoop(EngineProcess({"model_path": str(tmp_path / "missing"), "device": "cpu"}))
    with pytest.raises(EngineLoadError):
        loop.launch()


def test_engine_process_death_fails_in_flight_and_refuses_new(tmp_path: Path) -> None:
    model = save_text_model(tmp_path / "model")
    kwargs = {"model_path": str(model), "device": "cpu", "dtype": "float32", "max_total_tokens": 200000}
    loop = EngineLoop(EngineProcess(kwargs, "warning"))
    loop.launch()
    deaths: list[bool] = []
    loop.on_death.append(lambda: deaths.append(True))

    async def scenario() -> None:
        loop.start()
        info = await loop.call("get_server_info")
        assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
        loop_times = info["internal_states"][0]["serving_loop"]  # NOTE: added by the engine process's loop
        assert set(loop_times) == {"intake_seconds", "idle_seconds", "publish_seconds", "flush_seconds", "loops"}
        assert all(v >= 0 for v in loop_times.values())
        req = Req([5, 6, 7], SamplingParams.from_dict(LONG), "long")
        submission = loop.submit([req], stream=True)
        first = await asyncio.wait_for(submission.next(), 30)
        assert first.ids and not first.final
        assert loop.info is not None
        os.kill(loop.info.pid, signal.SIGKILL)
        while not submission.done:
            delta = await asyncio.wait_for(submission.next(), 10)
        assert delta.error is not None and delta.status == 503 and "died" in delta.error
        assert not loop.alive and deaths == [True]
        with pytest.raises(EngineStoppedError):
            loop.submit([Req([5], SamplingParams.from_dict(LONG), "late")], stream=False)
        with pytest.raises(EngineStoppedError):
            await loop.call("get_server_info")
        await loop.stop()

    asyncio.run(scenario())


def test_serve_exits_non_zero_when_the_engine_dies(tmp_path: Path) -> None:
    model = save_text_model(tmp_path / "model")
    with server_process(["--model-path", str(model), "--max-total-tokens", "200000"]) as (proc, url):
        events: list[Any] = []
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": "Janet", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        first.set()

        pid = httpx.get(url + "/server_info", timeout=10).json()["engine_pid"]
        assert pid != proc.pid
        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(30)
        os.kill(pid, signal.SIGKILL)
        client.join(30)
        assert not client.is_alive()
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 503, events[-3:]
        assert set(errors[0]["error"]) == {"message", "type", "param", "code"}
        assert proc.wait(timeout=30) != 0
