"""`blockspec serve` / `python -m blockspec.serve`: SGLang flag names, fail-fast validation, a real process."""
from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from blockspec.cli import main
from blockspec.config.engine_config import EngineConfig
from blockspec.server.args import config_fields_without_flag, parse_serve_args
from tests.support.server_support import save_text_model, server_process



def test_every_engine_config_field_has_a_flag() -> None:
    assert config_fields_without_flag() == []


def test_flags_map_onto_engine_config() -> None:
    args = parse_serve_args([
        "--model-path", "/m", "--tokenizer-path", "/t", "--host", "0.0.0.0", "--port", "8080", "--dtype", "bfloat16",
        "--device", "cuda:1", "--trust-remote-code", "--attention-backend", "triton", "--page-size", "16",
        "--max-running-requests", "32", "--max-total-tokens", "100000", "--chunked-prefill-size", "-1",
        "--context-length", "4096", "--mem-fraction-static", "0.7", "--cuda-graph-bs", "1", "2", "4",
        "--disable-cuda-graph", "--enforce-piecewise-cuda-graph", "--speculative-algorithm", "dflash",
        "--speculative-draft-model-path", "/d", "--speculative-num-draft-tokens", "8", "--api-key", "k",
        "--log-level", "INFO", "--max-queued-requests", "7", "--served-model-name", "m",
    ])
    engine = args.engine
    assert engine["model_path"] == "/m" and engine["tokenizer_path"] == "/t" and engine["trust_remote_code"] is True
    assert engine["dtype"] == "bfloat16" and engine["device"] == "cuda:1" and engine["attention_backend"] == "triton"
    assert engine["page_size"] == 16 and engine["max_running_requests"] == 32 and engine["max_total_tokens"] == 100000
    assert (
        engine["chunked_prefill_size"] == -1
        and engine["context_length"] == 4096
        and engine["mem_fraction_static"] == 0.7
    )
    assert (
        engine["cuda_graph_bs"] == [1, 2, 4] and engine["disable_cuda_graph"] and engine["enforce_piecewise_cuda_graph"]
    )
    assert engine["speculative_algorithm"] == "DFLASH" and engine["speculative_draft_model_path"] == "/d"
    assert engine["speculative_num_draft_tokens"] == 8 and engine["log_level"] == "info"
    EngineConfig.from_kwargs(**engine)  # every key is an EngineConfig field
    server = args.server
    assert (server.host, server.port, server.api_key, server.max_queued_requests) == ("0.0.0.0", 8080, "k", 7)
    assert server.served_model_name == "m" and server.log_level == "info"


def test_defaults() -> None:
    args = parse_serve_args(["--model-path", "/m"])
    assert args.server.host == "127.0.0.1" and args.server.port == 30000 and args.server.api_key is None
    assert args.server.max_queued_requests == 1024
    assert "cuda_graph_bs" not in args.engine  # EngineConfig's default list applies


BAD_FLAGS = [
    ([], "--model-path"),
    (["--bogus-flag", "1"], "--bogus-flag"),
    (["--page-size", "0"], "--page-size"),
    (["--page-size", "four"], "--page-size"),
    (["--dtype", "fp8"], "--dtype"),
    (["--attention-backend", "magic"], "--attention-backend"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--max-running-requests", "-1"], "--max-running-requests"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--cuda-graph-bs", "1", "zero"], "--cuda-graph-bs"),
    (["--cuda-graph-bs", "0"], "--cuda-graph-bs"),
    (["--speculative-algorithm", "eagle"], "--speculative-algorithm"),
    (["--speculative-algorithm", "DFLASH"], "--speculative-draft-model-path"),
    (
        [
            "--speculative-num-draft-tokens",
            "1",
            "--speculative-algorithm",
            "DFLASH",
            "--speculative-draft-model-path",
            "/d",
        ],
        "--speculative-num-draft-tokens",
    ),
    (["--device", "tpu"], "--device"),
    (["--port", "70000"], "--port"),
    (["--max-queued-requests", "0"], "--max-queued-requests"),
    (["--log-level", "loud"], "--log-level"),
    (["--load-format", "gguf"], "--load-format"),
]


@pytest.mark.parametrize("extra,flag", BAD_FLAGS, ids=[flag for _, flag in BAD_FLAGS])
def test_bad_flags_exit_2_naming_the_flag(extra: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = extra if flag == "--model-path" else ["--model-path", "/m", *extra]
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_unloadable_model_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model-path", str(tmp_path / "missing"), "--device", "cpu"]) == 1
    assert "could not load the model" in capsys.readouterr().err


@pytest.mark.parametrize("entry", [["-m", "blockspec.serve"], ["-m", "blockspec.cli", "serve"]])
def test_serve_process_answers_and_stops_on_sigint(entry: list[str], tmp_path: Path) -> None:
    model = save_text_model(tmp_path / "model")
    with server_process(["--model-path", str(model), "--max-total-tokens", "4096", "--page-size", "4"],
                        tuple(entry)) as (proc, url):
        reply = httpx.post(
            url + "/v1/completions", json={"prompt": "Janet", "max_tokens": 3, "ignore_eos": True}, timeout=30
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
