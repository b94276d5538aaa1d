"""DFlash2 on the GPU: the selector's walk inside the greedy-cycle CUDA graph (no host round trip: a steady overlapped
step runs under sync debug mode 'error'), graph replay equal to eager, lossless with graphs in fp32, and bf16
graphs running the same path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from blockspec import Engine  # noqa: E402
from blockspec.runner.graph_kind import GraphKind  # noqa: E402
from tests.support.engine_runs import GREEDY, PROMPTS, run_prompts  # noqa: E402
from tests.support.engine_testing import overlapped_run_checking_syncs, prefilled  # noqa: E402

pytest.importorskip("dflash.model")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.dflash2_drafts import save_trained_dflash2_pair

    root = tmp_path_factory.mktemp("dflash2_gpu")
    save_trained_dflash2_pair(root)
    return root


@pytest.mark.parametrize("page_size", [1, 16])
def test_dflash2_lossless_with_graphs(pair: Path, page_size: int) -> None:
    target_only, _ = run_prompts(pair, False, device="cuda", page_size=page_size)
    spec, engine = run_prompts(pair, True, device="cuda", page_size=page_size, speculative_adaptive_verify="off")
    assert spec == target_only
    assert engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"] > 1.5
    assert engine.forward_counts["graph"] > 0


def test_greedy_cycle_graph_equals_eager(pair: Path) -> None:
    """One cycle graph (padded batch 3 → 4) gives the eager cycle's selector walk and target argmaxes."""
    engine = Engine(model_path=str(pair / "target"), dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True,
                    cuda_graph_bs=[1, 2, 4, 8], speculative_algorithm="DFLASH",
                    speculative_draft_model_path=str(pair / "draft"))
    worker, runner = engine.worker, engine.runner
    assert runner.graphs.captured(GraphKind.GREEDY_CYCLE) and runner.graphs.captured(GraphKind.DRAFT)
    reqs = prefilled(engine, PROMPTS[:3], GREEDY)
    for req in reqs:
        runner.allocator.grow(req, req.kv_len + worker.block_size, runner.req_to_token)
    graphed = worker.greedy_cycle_tokens(reqs)
    _, proposals, _ = worker.propose(reqs)  # NOTE: the draft's own graph
    runner.graphs.enabled = False
    eager = worker.greedy_cycle_tokens(reqs)
    runner.graphs.enabled = True
    assert graphed == eager
    # NOTE: a row is [accepted | d_1..d_{n-1} | t_0..t_{n-1}] at the verify length n that adaptive verify chose for
    # this batch size on this GPU (n < B on the H200 at c34100e), so the cycle's proposals are the draft's first n - 1
    n = len(graphed[0]) // 2
    assert [row[1:n] for row in graphed] == proposals[:, :n - 1].tolist()
    for req in reqs:
        engine.scheduler.abort(req.rid)
    engine.step()


def test_overlapped_cycle_never_syncs(pair: Path) -> None:
    """Steady overlapped steps launch the next cycle (draft, selector walk, verify) with no synchronising call."""
    engine = Engine(model_path=str(pair / "target"), dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True,
                    chunked_prefill_size=16, cuda_graph_bs=[1, 2, 4, 8], speculative_algorithm="DFLASH",
                    speculative_draft_model_path=str(pair / "draft"))
    reqs, checked = overlapped_run_checking_syncs(engine, PROMPTS[:8], GREEDY)
    assert checked > 5
    target_only, _ = run_prompts(pair, False, device="cuda")
    assert [r.output_ids for r in reqs] == target_only[:8]


def test_bf16_graphs_run_the_selector(pair: Path) -> None:
    """bf16 (top-k of bf16 logits, codebooks in bf16, the bilinear scores in fp32): nearly every output equals bf16
    target-only decoding (a rare near-tie of bf16 GEMMs may flip)."""
    target_only, _ = run_prompts(pair, False, device="cuda", dtype="bfloat16")
    spec, engine = run_prompts(pair, True, device="cuda", dtype="bfloat16", speculative_adaptive_verify="off")
    same = sum(a == b for a, b in zip(spec, target_only))
    assert same >= len(PROMPTS) - 1
    assert engine.forward_counts["graph"] > 0
