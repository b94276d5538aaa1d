"""benchmarks/serving_profile.py: py-spy's raw stacks summarised per process (the serving loop in focus), read the same
from the gzip the benchmark keeps."""
from __future__ import annotations

from pathlib import Path

from benchmarks.serving_profile import compress, summarize

RAW = """\
process 10:"python -m blockspec.serve";<module> (x.py:1);EngineCore.run (engine_core.py:100);Scheduler.step (scheduler.py:125);launch (dflash.py:40) 30
process 10:"python -m blockspec.serve";<module> (x.py:1);EngineCore.run (engine_core.py:100);_publish (engine_core.py:190) 10
process 10:"python -m blockspec.serve";<module> (x.py:1);startup (engine.py:5) 50
process 11:"python -m blockspec.server";run_forever (asyncio/base_events.py:1);select (selectors.py:468) 20
"""


def test_summary_focuses_the_serving_loop_and_reads_gzip(tmp_path: Path) -> None:
    path = tmp_path / "stacks.txt"
    path.write_text(RAW)
    plain = summarize(path, focus=("EngineCore.run ",))
    packed = compress(path)
    assert not path.exists() and packed.name == "stacks.txt.gz"
    assert summarize(packed, focus=("EngineCore.run ",)) == plain
    engine = plain.split("process 11")[0]
    assert "startup" not in engine  # NOTE: outside the serving loop: left out of a focused process
    assert "75.0 %  launch (dflash.py:40)" in engine and "25.0 %  _publish (engine_core.py:190)" in engine
    assert "0.08 s of it in waits" in plain  # NOTE: the HTTP process's event loop idles in select
