"""The smaller rough edges a newcomer meets (issue 53, finding 6): every --help names its defaults and is quick (no
torch imported to print it), train-draft marks only --target-model-path required, the served model id is readable,
an unknown model is OpenAI's model_not_found, `eval gsm8k` reports this run's accept length, `bench serving` writes
under blockspec's cache root, and the main Prometheus metrics also carry SGLang's names."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from blockspec.cli import build_parser, main
from blockspec.engine import wire
from blockspec.evals.gsm8k import GSM8KResult
from blockspec.server.metrics import ServerMetrics
from blockspec.server.openai_api import _check_model
from blockspec.server.state import APIError, served_model_name

REPO = Path(__file__).resolve().parents[2]


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # NOTE: argparse wraps lines; compare as one line


@pytest.mark.parametrize("argv, shown", [
    (["serve"], ["--port PORT 0 picks a free port (default: 30000)", "--page-size PAGE_SIZE tokens per KV page "
                 "(default 1)", "--max-queued-requests MAX_QUEUED_REQUESTS waiting requests beyond it get 503 "
                 "(default: 1024)"]),
    (["eval", "gsm8k"], ["--num-shots NUM_SHOTS default: 5", "--max-tokens MAX_TOKENS default: 512"]),
    (["bench", "serving"], ["--num-prompts NUM_PROMPTS requests per concurrency level (default: 200)"]),
    (["train-draft"], ["--steps STEPS optimizer steps (default: 2000 on a GPU, 300 on a CPU)",
                       "--batch-size BATCH_SIZE sequences per step (per GPU) (default: 16 on a GPU, 4 on a CPU)",
                       "--lr LR peak learning rate (default: 0.0006 on a GPU, 0.001 on a CPU)"]),
])
def test_help_shows_defaults(argv: list[str], shown: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(argv, capsys)
    for piece in shown:
        assert piece in text


def test_train_draft_marks_only_the_target_required(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["train-draft"], capsys)
    assert "required:" not in text and "target, data and output:" in text and "(default: True)" not in text


def test_bench_serving_writes_under_the_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    _, subparsers = build_parser()
    assert subparsers["serving"].parse_args([]).output_dir == tmp_path / "results" / "bench-serving"


@pytest.mark.parametrize("module", ["blockspec.cli", "blockspec.train.cli"])
def test_help_does_not_import_torch(module: str) -> None:
    code = (f"import sys, {module} as cli\n"
            "try:\n    cli.main(['train-draft', '--help'] if cli.__name__ == 'blockspec.cli' else ['--help'])\n"
            "except SystemExit:\n    pass\n"
            "import blockspec.cli\ntry:\n    blockspec.cli.main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False False"


def test_served_model_name_is_readable(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    assert served_model_name(None, str(model)) == "my-model"
    assert served_model_name(None, "org/name") == "org/name"
    assert served_model_name("chosen", str(model)) == "chosen"


def test_unknown_model_is_model_not_found() -> None:
    state: Any = SimpleNamespace(model_name="my-model", info=SimpleNamespace(model_path="/models/my-model"))
    _check_model(state, "my-model")
    _check_model(state, "/models/my-model")  # NOTE: the path still names it
    with pytest.raises(APIError) as raised:
        _check_model(state, "gpt-4o")
    error = raised.value.body()["error"]
    assert raised.value.status == 404
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found" and error["param"] == "model"


def test_gsm8k_reports_this_runs_accept_length() -> None:
    result = GSM8KResult(0.5, 2, 1, 0, 0, 1.0, 10, 10.0, server_avg_spec_accept_length=2.0,
                         run_avg_spec_accept_length=3.25)
    assert "Accept length: 3.250 (this run; since the server started: 2.000)" in result.summary()


def test_sglang_metric_names() -> None:
    metrics = ServerMetrics(max_accept_length=4)
    metrics.on_step(wire.StepStats(3, 1, 0, 100, 40, [0, 1, 2, 3, 4], [], 0, [], []), num_queued=2)
    metrics.on_finish(wire.FinishStat("length", 8, 5, 0.5, 0.05, 0.45, [2, 3], 0.001, 0.002, 0.047))
    text = metrics.render().decode()
    for blockspec_line, sglang_line in (("blockspec_num_running_reqs 3.0", "sglang:num_running_reqs 3.0"),
                                        ("blockspec_num_queue_reqs 2.0", "sglang:num_queue_reqs 2.0"),
                                        ("blockspec_token_usage 0.6", "sglang:token_usage 0.6"),
                                        ("blockspec_generation_tokens_total 5.0", "sglang:generation_tokens_total 5.0"),
                                        ("blockspec_e2e_request_latency_seconds_count 1.0",
                                         "sglang:e2e_request_latency_seconds_count 1.0")):
        assert blockspec_line in text and sglang_line in text
