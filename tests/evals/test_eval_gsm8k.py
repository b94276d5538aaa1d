"""`blockspec eval gsm8k`: answer parsing, prompt construction, and end-to-end runs against live servers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from blockspec import Engine
from blockspec.cli import main
from blockspec.evals.gsm8k import (
    default_data_path, few_shot_prefix, format_example, last_number, load_lines, reference_number,
)
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from tests.support.server_support import save_text_model
from tests.support.tiny_models import save_tiny_draft

DATA = default_data_path()
needs_data = pytest.mark.skipif(not DATA.is_file(), reason=f"GSM8K data not found at {DATA}")


def test_answer_parsing() -> None:
    assert last_number("so 3 + 4 = 7 apples") == 7.0
    assert last_number("It costs $1,234.50 in total.") == 1234.5
    assert last_number("a drop of -3 degrees") == -3.0
    assert last_number("no digits here") is None
    assert reference_number("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == 18.0
    assert reference_number("#### 1,000") == 1000.0
    with pytest.raises(ValueError):
        reference_number("no final answer")


def test_prompt_format() -> None:
    lines = [{"question": f"q{i}?", "answer": f"a {i}\n#### {i}"} for i in range(3)]
    assert format_example(lines[0], False) == "Question: q0?\nAnswer:"
    assert few_shot_prefix(lines, 2) == "Question: q0?\nAnswer: a 0\n#### 0\n\nQuestion: q1?\nAnswer: a 1\n#### 1\n\n"
    assert few_shot_prefix(lines, 0) == ""


@needs_data
def test_default_data_has_answers() -> None:
    lines = load_lines(DATA)
    assert len(lines) > 1000
    assert all("####" in line["answer"] for line in lines[:50])


@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[BackgroundServer]:
    from blockspec.models.smollm2 import ensure_smollm2_dir

    try:
        model_dir = ensure_smollm2_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    engine = Engine(model_path=str(model_dir), device="cpu", dtype="float32", max_total_tokens=16384, page_size=16)
    with BackgroundServer(engine, ServerSettings(port=0)) as running:
        yield running


@needs_data
def test_gsm8k_end_to_end_on_demo_model(
    smollm2_server: BackgroundServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gsm8k.json"
    code = main([
        "eval", "gsm8k", "--base-url", smollm2_server.base_url, "--num-examples", "3", "--num-threads", "3",
        "--max-tokens", "48", "--data-path", str(DATA), "--output", str(out), "--disable-tqdm",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    for label in ("Accuracy:", "Latency:", "Output throughput:", "Accept length:"):
        assert label in printed
    result = json.loads(out.read_text())
    assert result["num_examples"] == 3 and result["num_errors"] == 0
    assert 0.0 <= result["score"] <= 1.0 and result["output_tokens"] > 0
    questions = [s["question"] for s in result["samples"]]
    assert questions == [line["question"] for line in load_lines(DATA)[5:8]]  # the 5 shots are skipped
    assert result["server_avg_spec_accept_length"] is None  # no speculation on this server


@needs_data
def test_gsm8k_reports_accept_length_of_a_dflash_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("dflash.model")
    from transformers import AutoModelForCausalLM

    target_dir = save_text_model(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    save_tiny_draft(tmp_path / "draft", target, [0, 2], block_size=4)
    engine = Engine(
        model_path=str(target_dir), device="cpu", dtype="float32", max_total_tokens=16384, page_size=4,
        speculative_algorithm="DFLASH", speculative_draft_model_path=str(tmp_path / "draft"),
    )
    with BackgroundServer(engine, ServerSettings(port=0)) as server:
        code = main([
            "eval", "gsm8k", "--base-url", server.base_url, "--num-examples", "4", "--num-threads", "2",
            "--num-shots", "1", "--max-tokens", "16", "--data-path", str(DATA), "--output", str(tmp_path / "r.json"),
            "--disable-tqdm",
        ])
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["num_errors"] == 0
    assert result["server_avg_spec_accept_length"] >= 1.0
    assert result["run_avg_spec_accept_length"] >= 1.0
    printed = capsys.readouterr().out
    assert "Accept length: " in printed and "Accept length: n/a" not in printed


def test_missing_data_path_fails_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "gsm8k", "--data-path", str(tmp_path / "nope.jsonl")])
    assert exit_info.value.code == 2
    assert "--data-path" in capsys.readouterr().err


def test_unreachable_server_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "mini.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(7)))
    code = main(
        [
            "eval",
            "gsm8k",
            "--base-url",
            "http://127.0.0.1:9",
            "--data-path",
            str(data),
            "--num-examples",
            "1",
            "--disable-tqdm",
        ]
    )
    assert code == 1
    assert "error" in capsys.readouterr().err


def test_gsm8k_test_split_ships_in_the_package() -> None:
    import blockspec
    from blockspec.evals.gsm8k import default_data_path, load_lines

    path = default_data_path()
    assert Path(blockspec.__file__).parent in path.parents and (path.parent / "LICENSE").is_file()
    lines = load_lines(path)
    assert len(lines) == 1319 and {"question", "answer"} <= set(lines[0])
