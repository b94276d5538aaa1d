"""`blockspec bench serving`: statistics helpers, and end-to-end runs (both backends) against a DFlash server."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterator

import pytest

from blockspec import Engine
from blockspec.bench.report import RequestResult, percentile, summarise
from blockspec.bench.serving import _concurrency_list
from blockspec.cli import main
from blockspec.evals.gsm8k import default_data_path
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from tests.support.server_support import save_text_model, wait_idle
from tests.support.tiny_models import save_tiny_draft


def test_percentile_and_concurrency_parsing() -> None:
    assert percentile([], 99) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 100) == 2.0
    assert _concurrency_list("1,4,16,64") == [1, 4, 16, 64]
    for bad in ("", "1,x", "0,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            _concurrency_list(bad)


def test_summarise() -> None:
    results = [
        RequestResult(True, ttft=0.1, latency=1.1, prompt_tokens=10, output_tokens=11, chunk_gaps=(0.1, 0.2)),
        RequestResult(True, ttft=0.3, latency=0.3, prompt_tokens=5, output_tokens=1),
        RequestResult(False, error="HTTP 503"),
    ]
    level = summarise(4, results, 2.0, 2.5)
    assert (level.completed, level.failed, level.first_error) == (2, 1, "HTTP 503")
    assert level.output_throughput == 6.0 and level.input_throughput == 7.5 and level.request_throughput == 1.0
    assert level.mean_ttft_ms == pytest.approx(200.0)
    assert level.mean_tpot_ms == pytest.approx(100.0)  # only requests with > 1 token have a TPOT
    assert level.mean_itl_ms == pytest.approx(150.0) and level.accept_length == 2.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    pytest.importorskip("dflash.model")
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bench_model")
    target_dir = save_text_model(root / "target")
    save_tiny_draft(root / "draft", AutoModelForCausalLM.from_pretrained(target_dir), [0, 2], block_size=4)
    engine = Engine(
        model_path=str(target_dir), device="cpu", dtype="float32", max_total_tokens=16384, page_size=4,
        speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"),
    )
    with BackgroundServer(engine, ServerSettings(port=0)) as running:
        yield running


@pytest.mark.parametrize("backend,dataset", [("sglang", "random"), ("openai", "gsm8k")])
def test_bench_serving_end_to_end(
    server: BackgroundServer, tmp_path: Path, backend: str, dataset: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if dataset == "gsm8k" and not default_data_path().is_file():
        pytest.skip("GSM8K data not found")
    out = tmp_path / "bench"
    code = main([
        "bench", "serving", "--base-url", server.base_url, "--backend", backend, "--dataset-name", dataset,
        "--concurrency", "1,4", "--num-prompts", "6", "--max-new-tokens", "8", "--random-input-len", "24",
        "--ignore-eos", "--output-dir", str(out), "--disable-tqdm", "--warmup", "1",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "concurrency   1:" in printed and "concurrency   4:" in printed
    (json_path,) = out.glob("serving-*.json")
    (png_path,) = out.glob("serving-*.png")
    assert png_path.stat().st_size > 1000
    report = json.loads(json_path.read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    assert report["server"]["speculative_algorithm"] == "DFLASH"
    for level in report["levels"]:
        assert level["completed"] == 6 and level["failed"] == 0, level["first_error"]
        assert level["output_throughput"] > 0 and level["mean_ttft_ms"] > 0 and level["mean_tpot_ms"] > 0
        assert level["output_throughput"] * level["duration_s"] == pytest.approx(6 * 8)
        assert level["accept_length"] >= 1.0
    wait_idle(server.base_url)


def test_bench_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in ((["--concurrency", "0"], "--concurrency"), (["--num-prompts", "0"], "--num-prompts"),
                       (["--backend", "vllm"], "--backend"), (["--temperature", "-1"], "--temperature")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "serving", "--dataset-name", "random", *argv])
        assert exit_info.value.code == 2
        assert flag in capsys.readouterr().err
