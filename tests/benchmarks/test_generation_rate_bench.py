"""benchmarks/generation_rate.py on the CPU: every variant kind runs and the report has its layout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


from benchmarks import generation_rate


def test_generation_rate_tiny(tmp_path: Path) -> None:
    code = generation_rate.main(["--out", str(tmp_path), "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                                 "--variants", "base,generation_engine_sampled", "--seconds", "0.5",
                                 "--prompt-len", "4", "8", "--new-tokens", "4", "8"])
    assert code == 0
    [report_path] = tmp_path.glob("generation_rate_*.json")
    report = json.loads(report_path.read_text())
    assert {"gpu", "date", "commit", "shape", "rows"} <= set(report)
    assert [row["variant"] for row in report["rows"]] == ["base", "generation_engine_sampled"]
    for row in report["rows"]:
        assert row["output_tokens"] > 0 and row["tokens_per_s"] > 0 and row["steps"] > 0
    assert report["rows"][1]["engine"]["disable_radix_cache"] is True
    assert report_path.with_suffix(".png").is_file()


def test_generation_rate_rejects_unknown_variants(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown variant"):
        generation_rate.main(["--out", str(tmp_path), "--variants", "base,fastest"])
