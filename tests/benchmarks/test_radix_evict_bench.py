"""benchmarks/radix_evict.py on a small tree: the report's layout and its plot."""
from __future__ import annotations

import json
from pathlib import Path


from benchmarks import radix_evict


def test_radix_evict_small(tmp_path: Path) -> None:
    out = tmp_path / "radix.json"
    assert (
        radix_evict.main(["--out", str(out), "--cached", "4", "16", "--rows", "8", "--length", "20", "--steps", "5"])
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["cached_sequences"] for r in report["rows"]] == [4, 16]
    assert all(r["us_per_step_median"] > 0 for r in report["rows"]) and {"gpu", "date", "commit"} <= set(report)
    assert out.with_suffix(".png").is_file()
