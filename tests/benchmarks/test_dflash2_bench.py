"""benchmarks/dflash2.py's cycle half on tiny shapes (CPU): it imports as part of the benchmarks package, writes its
result into the --out directory like every benchmark (scripts/device.sh bench passes one), with the issue's rows."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import dflash2


def test_cycle_smoke_writes_the_rows(tmp_path: Path) -> None:
    assert dflash2.main(["--part", "cycle", "--smoke", "--context", "32", "--batch-sizes", "1", "--repeat", "1",
                         "--out", str(tmp_path), "--commit", "abc1234"]) == 0
    (path,) = tmp_path.glob("dflash2_*_abc1234.json")
    assert path.with_suffix(".png").is_file()
    result = json.loads(path.read_text())
    assert {row["draft_arch"] for row in result["rows"]} == {"dflash", "dflash2"}
    for row in result["rows"]:
        assert {"shape", "bs", "draft_arch", "cycle_ms"} <= set(row) and row["cycle_ms"] > 0
    assert result["commit"] == "abc1234" and result["gpu"] and result["date"]
