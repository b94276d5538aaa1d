"""benchmarks/frontend_capacity.py on CPU: the stand-in engine speaks the engine's wire protocol (whole outputs, streamed
and not, an abort), and one short run writes rows that compare the server with the paced ceiling."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from blockspec.server import BackgroundServer  # noqa: E402
from blockspec.server.args import ServerSettings  # noqa: E402
from blockspec.server.engine_loop import EngineLoop  # noqa: E402
from paced_engine import Pace, PacedEngine  # noqa: E402
from server_support import sse_payloads  # noqa: E402


def test_stand_in_answers_like_an_engine() -> None:
    with BackgroundServer(EngineLoop(PacedEngine(Pace(cycle_ms=1.0, tokens_per_step=3))), ServerSettings(port=0)) as server:
        body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
        whole = httpx.post(server.base_url + "/generate", json=body, timeout=30).json()
        assert len(whole["output_ids"]) == 10 and whole["meta_info"]["completion_tokens"] == 10
        assert whole["meta_info"]["prompt_tokens"] == 3 and whole["meta_info"]["finish_reason"]["type"] == "length"
        with httpx.stream("POST", server.base_url + "/generate", json={**body, "stream": True}, timeout=30) as response:
            events = sse_payloads(response.iter_lines())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert [len(c["output_ids"]) for c in chunks][-1] == 10 and chunks[-1]["output_ids"] == whole["output_ids"]
        assert all(len(a["output_ids"]) < len(b["output_ids"]) for a, b in zip(chunks, chunks[1:]))
        info = httpx.get(server.base_url + "/server_info", timeout=30).json()
        assert info["stand_in"] is True and info["busy_steps"] >= 8
        assert httpx.get(server.base_url + "/metrics", timeout=30).status_code == 200
        # an abort ends the stream with an answer and frees the rid, as the engine core does
        long = {"input_ids": [11], "rid": "gone", "stream": True,
                "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}
        with httpx.stream("POST", server.base_url + "/generate", json=long, timeout=30) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert httpx.post(server.base_url + "/abort_request", json={"rid": "gone"}, timeout=30).status_code == 200
            events = sse_payloads(lines)
        assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        again = httpx.post(server.base_url + "/generate", json={**body, "rid": "gone"}, timeout=30).json()
        assert len(again["output_ids"]) == 10


@pytest.mark.slow
def test_short_run_writes_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import frontend_capacity

    monkeypatch.setenv("BLOCKSPEC_COMMIT", "test")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert frontend_capacity.main(["--out", str(tmp_path), "--presets", "llama8b-dflash", "--concurrency", "1,4",
                                   "--rounds", "2", "--max-new-tokens", "64", "--client-procs", "2"]) == 0
    (path,) = tmp_path.glob("frontend_capacity_*_test.json")
    assert path.with_suffix(".png").is_file()
    report = json.loads(path.read_text())
    assert report["commit"] == "test" and report["gpu"] == "cpu"
    rows = report["rows"]
    assert [(r["preset"], r["concurrency"]) for r in rows] == [("llama8b-dflash", 1), ("llama8b-dflash", 4)]
    for row in rows:
        assert row["completed"] == 2 * row["concurrency"] and row["failed"] == 0
        assert row["paced_tok_s"] == pytest.approx(min(row["concurrency"], 64) * 4 / 0.0225)
        assert 0 < row["server_over_paced"] <= 1.1 and row["stand_in_steps"] > 0  # NOTE: an idle stand-in steps at once
        assert row["server_cpu_s"] > 0 and row["clients_cpu_share"] > 0 and row["client_procs"] >= 1
