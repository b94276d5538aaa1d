"""SGLang flags a DFlash user passes: mapped (--dtype half, --cuda-graph-max-bs, --max-prefill-tokens), accepted
no-ops (--enable-metrics, --kv-cache-dtype auto), or clear errors for values DFlash has no meaning for; every flag of
`blockspec serve` has help text."""
from __future__ import annotations

import pytest

from blockspec.config.engine_config import EngineConfig
from blockspec.server.args import build_serve_parser, parse_serve_args

BASE = ["--model-path", "/m"]


def test_mapped_flags() -> None:
    engine = parse_serve_args([*BASE, "--dtype", "half", "--cuda-graph-max-bs", "16", "--max-prefill-tokens", "4096",
                               "--enable-metrics", "--kv-cache-dtype", "auto", "--speculative-num-steps", "1",
                               "--speculative-eagle-topk", "1"]).engine
    assert engine["dtype"] == "float16" and engine["cuda_graph_bs"] == [1, 2, 4, 8, 12, 16]
    assert engine["chunked_prefill_size"] == 4096
    EngineConfig.from_kwargs(**engine)
    explicit = parse_serve_args([*BASE, "--cuda-graph-bs", "1", "3", "--cuda-graph-max-bs", "2"]).engine
    assert explicit["cuda_graph_bs"] == [1, 3]
    unchunked = parse_serve_args([*BASE, "--chunked-prefill-size", "-1", "--max-prefill-tokens", "512"]).engine
    assert unchunked["chunked_prefill_size"] == 512
    assert parse_serve_args([*BASE, "--max-prefill-tokens", "100000"]).engine["chunked_prefill_size"] == 8192


@pytest.mark.parametrize("argv, message", [
    (["--speculative-num-steps", "3"], "--speculative-num-steps 3: DFlash"),
    (["--speculative-eagle-topk", "4"], "--speculative-eagle-topk 4: DFlash"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype"),
    (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs must be >= 1"),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be >= 1"),
])
def test_meaningless_values_are_clear_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_serve_args([*BASE, *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_every_flag_has_help() -> None:
    parser = build_serve_parser()
    missing = [action.option_strings[0] for action in parser._actions
               if action.option_strings and action.option_strings[0] != "-h" and not action.help]
    assert missing == []
