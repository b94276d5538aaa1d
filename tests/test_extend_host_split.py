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


def test_extends_after_cached_tokens_compute_only_the_new_ones(tmp_path: Path) -> None:
    from prefill_latency import rewind
    from profile_prefill import parse_case

    assert parse_case("31x682+4110") == (31, 682, 4110) and parse_case("8x2048") == (8, 2048, 0)
    for bad in ("31x", "0x8", "4x2", "2x8+-1", "2x8+a"):
        with pytest.raises(SystemExit, match="--cases"):
            parse_case(bad)
    shape = materialise("tiny", tmp_path, None, None)
    engine = Engine(model_path=str(shape.target), load_format="dummy", skip_tokenizer_init=True, device="cpu",
                    dtype="float32", speculative_algorithm="DFLASH", speculative_draft_model_path=str(shape.draft))
    reqs = make_reqs(engine, 2, 16, cached=40)
    assert [req.prompt_len for req in reqs] == [48, 48]
    assert rewind(reqs, 40) == [8, 8] and all(req.kv_len == 40 for req in reqs)
    split = host_split(engine, reqs, 2, cached=40)
    assert split["attention"] > 0 and all(req.kv_len == 48 for req in reqs)  # NOTE: the extend computed the 8 new
    release(engine, reqs)
