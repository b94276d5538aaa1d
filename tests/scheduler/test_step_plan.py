"""The step room (CPU, fp32): a plan with extend chunks and decode requests together commits exactly what the two
steps would one after the other (target-only and DFlash, against the HF greedy oracle), and the executor's public
switches (overlap, graphs) do what they say."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from blockspec import Engine
from blockspec.outputs import ExtendChunk, StepPlan
from blockspec.request import Req, SamplingParams
from blockspec.worker.inflight import InFlightStep, launch_rows
from tests.support.engine_testing import assert_engine_idle, hf_greedy, prefilled
from tests.support.tiny_models import save_tiny_draft, save_tiny_model

GREEDY = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
DECODING = [[5, 9, 11, 3], [40, 41, 42, 43, 44, 45, 46]]
ARRIVING = [[7 + i for i in range(13)], [2, 3]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("step_plan")
    target = save_tiny_model("llama", root / "target", residual_scale=0.3)
    save_tiny_draft(root / "draft", target, [0, 2], 8, num_layers=2, seed=3)
    return {"root": root, "target": target}


def engine_for(root: Path, spec: bool, **extra: Any) -> Engine:
    args: dict[str, Any] = dict(model_path=str(root / "target"), device="cpu", dtype="float32", page_size=4,
                                max_total_tokens=2048, skip_tokenizer_init=True, disable_overlap_schedule=True)
    if spec:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
    return Engine(**{**args, **extra})


@pytest.mark.parametrize("spec", [False, True])
def test_mixed_plan_commits_what_separate_steps_would(models: dict[str, Any], spec: bool) -> None:
    engine = engine_for(models["root"], spec)
    scheduler, runner = engine.scheduler, engine.runner
    decoding = prefilled(engine, DECODING, GREEDY)
    arriving = [Req(ids, SamplingParams.from_dict(GREEDY)) for ids in ARRIVING]
    for req in arriving:  # NOTE: admitted by hand, so the plan holds exactly these parts
        scheduler.add_request(req)
        scheduler.waiting.remove(req)
        req.pool_row = runner.req_to_token.acquire()
        runner.allocator.grow(req, req.prompt_len, runner.req_to_token)
        scheduler.running.append(req)
    plan = StepPlan(extend=[ExtendChunk(req, req.prompt_len) for req in arriving], decode=decoding)
    committed = {id(item.req): item for item in scheduler.steps.run(plan)}
    assert set(committed) == {id(req) for req in decoding + arriving}
    target = models["target"]
    for req in arriving:
        item = committed[id(req)]
        assert not item.verified and item.tokens == hf_greedy(target, req.all_ids[:req.prompt_len], 1)
    for req in decoding:
        item = committed[id(req)]
        expected = hf_greedy(target, req.all_ids[:req.prompt_len], 1 + len(item.tokens))
        assert item.verified and [req.output_ids[0], *item.tokens] == expected
        assert req.kv_len == req.prompt_len + len(item.tokens)
        assert len(item.tokens) >= 1 and (spec or len(item.tokens) == 1)
    for req in decoding + arriving:
        scheduler.abort(req.rid)
    scheduler.step()
    assert_engine_idle(engine)


def test_forward_counts_come_from_the_registry(models: dict[str, Any]) -> None:
    """On CPU no graph is captured: every forward is counted eager by the one place that picks (CudaGraphs.run)."""
    engine = engine_for(models["root"], True)
    graphs = engine.runner.graphs
    assert not graphs.available and not graphs and graphs.by_kind == {}
    engine.generate(input_ids=DECODING, sampling_params={**GREEDY, "max_new_tokens": 9})
    counts = engine.forward_counts
    assert counts["graph"] == 0 and counts["eager"] > 0
    assert engine.get_server_info()["internal_states"][0]["forward_counts"] == counts


def test_overlap_switch_is_the_executors(models: dict[str, Any]) -> None:
    engine = engine_for(models["root"], True, disable_overlap_schedule=False)
    steps = engine.scheduler.steps
    assert steps.overlap
    reqs = prefilled(engine, DECODING, GREEDY)
    engine.step()
    assert steps.in_flight is not None and {id(r) for r in steps.in_flight.reqs} == {id(r) for r in reqs}
    steps.overlap = False
    engine.step()  # drains, then a synchronous cycle
    assert steps.in_flight is None
    for req in reqs:
        engine.scheduler.abort(req.rid)
    engine.step()
    assert_engine_idle(engine)


def test_launch_rows_mixes_carried_and_fresh_requests() -> None:
    """launch_rows orders the carried requests first (in the order asked) and takes their rows from the carry's
    outputs at the right indices, the others from the host (the scheduler itself now drains before new requests
    decode, so this case is exercised here)."""
    reqs = [Req([1, 2], SamplingParams(), f"r{i}") for i in range(4)]
    carry_reqs = [reqs[2], reqs[0], reqs[3]]
    carry = InFlightStep(carry_reqs, torch.tensor([[20], [0], [30]]), torch.zeros(3, 1), torch.zeros(3, 1), None)

    def carried_rows(step: InFlightStep, index: Any) -> torch.Tensor:
        return step.rows if index is None else step.rows[index]

    def fresh_rows(fresh: list[Req]) -> torch.Tensor:
        return torch.tensor([[100 + int(r.rid[1:])] for r in fresh])

    order, rows = launch_rows([reqs[1], reqs[3], reqs[2]], carry, carried_rows, fresh_rows, torch.device("cpu"))
    assert [r.rid for r in order] == ["r3", "r2", "r1"]
    assert rows.tolist() == [[30], [20], [101]]
    order, rows = launch_rows(carry_reqs, carry, carried_rows, fresh_rows, torch.device("cpu"))
    assert order == carry_reqs and rows.tolist() == [[20], [0], [30]]
    order, rows = launch_rows(reqs[:2], None, carried_rows, fresh_rows, torch.device("cpu"))
    assert order == reqs[:2] and rows.tolist() == [[100], [101]]
