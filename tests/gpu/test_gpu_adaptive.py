"""Adaptive verify length on the GPU: one greedy-cycle graph per verify length, each equal to its eager cycle; a
changing verify length stays lossless under graphs and the overlap schedule; adaptive verify is on by default with
graphs; the simulated acceptance profile draws fresh numbers on every graph replay."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from blockspec import Engine  # noqa: E402
from blockspec.runner.graph_kind import GraphKind  # noqa: E402
from tests.support.engine_runs import GREEDY, PROMPTS, run_prompts  # noqa: E402
from tests.support.engine_testing import graphed_and_eager_cycle, prefilled, ready_for_one_cycle  # noqa: E402
from tests.support.verify_cycling import CyclingVerifyLength  # noqa: E402

LENGTHS = (1, 4, 6, 8)  # default_verify_lengths(8): the tiny pair's block is 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.draft_training import save_trained_pair

    return save_trained_pair(tmp_path_factory.mktemp("gpu_adaptive"))


def engine_for(tiny: Path, **flags: object) -> Engine:
    return Engine(model_path=str(tiny / "target"), dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True,
                  cuda_graph_bs=[1, 2, 4, 8], speculative_algorithm="DFLASH",
                  speculative_draft_model_path=str(tiny / "draft"), **flags)


def test_each_verify_length_graph_equals_eager(tiny: Path) -> None:
    engine = engine_for(tiny)
    worker, runner = engine.worker, engine.runner
    assert all(runner.graphs.captured(GraphKind.GREEDY_CYCLE, n) and runner.graphs.captured(GraphKind.VERIFY, n)
               for n in LENGTHS)
    adaptive = worker.verify_policy
    with ready_for_one_cycle(engine, PROMPTS[:3], GREEDY) as reqs:
        try:
            for n in LENGTHS:
                worker.verify_policy = CyclingVerifyLength([n])
                graphed, eager = graphed_and_eager_cycle(engine, reqs)
                assert graphed == eager and len(graphed[0]) == 2 * n
        finally:
            worker.verify_policy = adaptive


@pytest.mark.parametrize("overlap", [True, False])
def test_changing_verify_length_lossless_with_graphs(tiny: Path, overlap: bool) -> None:
    target_only, _ = run_prompts(tiny, False, device="cuda")
    engine = engine_for(tiny, disable_overlap_schedule=not overlap)
    engine.worker.verify_policy = CyclingVerifyLength([1, 4, 8, 1, 1, 6, 8, 4])
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outputs] == target_only
    assert engine.forward_counts["graph"] > 0


def test_adaptive_is_the_default_with_graphs(tiny: Path) -> None:
    target_only, _ = run_prompts(tiny, False, device="cuda")
    spec, engine = run_prompts(tiny, True, device="cuda")
    assert spec == target_only
    info = engine.get_server_info()["internal_states"][0]["verify_length"]
    assert info["mode"] == "adaptive" and info["verify_lengths"] == list(LENGTHS)
    assert set(info["cost_model"]) == {"1", "2", "4", "8"} and info["in_use"]
    assert all(ms > 0 for ms in info["cycle_ms_startup"].values())


def test_simulated_profile_draws_per_replay(tiny: Path) -> None:
    engine = engine_for(tiny, speculative_simulate_accept_profile="geometric:3", speculative_adaptive_verify="off")
    reqs = prefilled(engine, PROMPTS, {**GREEDY, "max_new_tokens": 200})
    while engine.scheduler.has_work:
        engine.step()
    lengths = [n for req in reqs for n in req.spec_accept_lengths[:-1]]  # NOTE: the last may be cut by the length
    assert engine.forward_counts["graph"] > 0 and len(set(lengths)) >= 5
    expected = 1 + sum((2 / 3) ** j for j in range(1, 8))
    assert abs(sum(lengths) / len(lengths) - expected) < 0.35
