"""benchmarks/extend_host_split.py on the CPU: every part of a whole extend is timed, the parts fit in the total, and
the timed methods are the engine's own again afterwards."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from blockspec import Engine

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from extend_host_split import PARTS, host_split  # noqa: E402
from prefill_latency import make_reqs, release  # noqa: E402
from serving_vs_engine_support import materialise  # noqa: E402


@pytest.mark.parametrize("speculative", [False, True])
def test_host_split_times_every_part_and_restores_the_engine(tmp_path: Path, speculative: bool) -> None:
    shape = materialise("tiny", tmp_path, None, None)
    flags = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(shape.draft)) if speculative else {}
    engine = Engine(model_path=str(shape.target), load_format="dummy", skip_tokenizer_init=True, device="cpu",
                    dtype="float32", **flags)
    reqs = make_reqs(engine, 3, 48)
    before = [dict(vars(owner)) for owner in (engine.worker, engine.runner.attention)]
    split = host_split(engine, reqs, 3)
    assert set(split) == {*PARTS, "total", "other"}
    assert split["attention"] > 0 and split["build_batch"] > 0 and split["first_tokens"] > 0
    assert (split["draft_kv"] > 0) == speculative
    assert split["total"] >= sum(split[part] for part in PARTS) * 0.999
    assert [dict(vars(owner)) for owner in (engine.worker, engine.runner.attention)] == before
    assert "compute_logits" not in vars(engine.runner.model)
    release(engine, reqs)
