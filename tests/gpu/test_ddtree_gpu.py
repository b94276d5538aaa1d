"""DDTree on the GPU: the tree cycle captured in the greedy-cycle graph equals its eager run, and greedy output with a
tree budget equals target-only output under graphs and the overlap schedule (page sizes 1 and 16), the overlapped
step never waiting on the device.

NOTE: every test pins the tree every cycle (adaptive verify off). With adaptive verify, on by default with CUDA
graphs, this tiny pair ran n = 1 (a plain decode step) on nearly every cycle (H100, e7c3ed1: accept length 1.003, the
graph-vs-eager cycle 2 tokens wide), so the tree path went untested."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from blockspec.runner.graph_kind import GraphKind  # noqa: E402
from tests.support.engine_runs import GREEDY, PROMPTS, run_prompts  # noqa: E402
from tests.support.engine_testing import (  # noqa: E402
    graphed_and_eager_cycle, overlapped_run_checking_syncs, ready_for_one_cycle,
)

TREE_EVERY_CYCLE = {"speculative_adaptive_verify": "off"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.draft_training import save_trained_pair

    return save_trained_pair(tmp_path_factory.mktemp("gpu_ddtree"))


def test_tree_cycle_graph_equals_eager(tiny: Path) -> None:
    _, engine = run_prompts(tiny, True, device="cuda", speculative_tree_budget=24, **TREE_EVERY_CYCLE)
    worker = engine.worker
    # NOTE: with the tree every cycle, the tree's verify length (block + B) is the one greedy-cycle graph
    assert engine.runner.graphs.captured(GraphKind.GREEDY_CYCLE, worker.decode_slots_per_req)
    with ready_for_one_cycle(engine, PROMPTS[:3], GREEDY) as reqs:
        graphed, eager = graphed_and_eager_cycle(engine, reqs)
    assert graphed == eager and len(graphed[0]) == 2 * worker.decode_slots_per_req


@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_lossless_with_graphs_and_overlap(tiny: Path, page_size: int) -> None:
    target_only, _ = run_prompts(tiny, False, device="cuda", page_size=page_size)
    outputs, engine = run_prompts(tiny, True, device="cuda", page_size=page_size, speculative_tree_budget=32,
                                   **TREE_EVERY_CYCLE)
    assert outputs == target_only
    assert engine.forward_counts["graph"] > 0
    assert engine.scheduler.spec.as_dict()["avg_spec_accept_length"] > 1.5


def test_overlapped_tree_step_never_waits_on_the_device(tiny: Path) -> None:
    from blockspec import Engine

    engine = Engine(model_path=str(tiny / "target"), dtype="float32", max_total_tokens=4096,
                    skip_tokenizer_init=True, cuda_graph_bs=[1, 2, 4, 8], speculative_algorithm="DDTREE",
                    speculative_draft_model_path=str(tiny / "draft"), **TREE_EVERY_CYCLE)
    target_only, _ = run_prompts(tiny, False, device="cuda")
    # NOTE: 8 prompts, the largest captured batch (9 decode together in an eager cycle, which reads the host)
    reqs, checked = overlapped_run_checking_syncs(engine, PROMPTS[:8], GREEDY)
    assert checked > 5 and [r.output_ids for r in reqs] == target_only[:8]
    assert engine.scheduler.spec.as_dict()["avg_spec_accept_length"] > 1.5


def test_penalties_and_logprobs_on_the_tree_equal_target_only(tiny: Path) -> None:
    """Requests the host chooses for (penalties, logprobs) take the tree's synchronous step on CUDA: each tree row
    penalised as of its path; the same tokens and log-probabilities as target-only decoding."""
    params = {**GREEDY, "frequency_penalty": 0.8, "presence_penalty": 0.5, "repetition_penalty": 1.2}
    outs = {}
    for name, flags in (("target", {}), ("tree", dict(speculative_tree_budget=16, **TREE_EVERY_CYCLE))):
        _, engine = run_prompts(tiny, name == "tree", device="cuda", **flags)
        outs[name] = engine.generate(input_ids=PROMPTS[:4], sampling_params=params, return_logprob=True,
                                     top_logprobs_num=2)
        engine.shutdown()
    for target, tree in zip(outs["target"], outs["tree"]):
        assert tree["output_ids"] == target["output_ids"]
        got = torch.tensor([lp for lp, _, _ in tree["meta_info"]["output_token_logprobs"]])
        want = torch.tensor([lp for lp, _, _ in target["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    # NOTE: penalised continuations are harder to draft than free ones: walks past the root are what matters
    assert max(o["meta_info"]["spec_accept_length"] for o in outs["tree"]) > 1.2
