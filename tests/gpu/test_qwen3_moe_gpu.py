"""Qwen3-MoE on the GPU: the fused Triton experts at Qwen3-30B-A3B layer sizes (bf16) against the reference and
captured in a CUDA graph; the tiny MoE target (fp32) through decode graphs, the DFlash cycle graph, piecewise
extend graphs and the overlap schedule (no host sync in a steady step), all equal to eager, the CPU and HF."""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from blockspec import Engine  # noqa: E402
from blockspec.layers.moe import ExpertRouting, SparseMoe, experts_reference, route  # noqa: E402
from tests.support.engine_runs import GREEDY, PROMPTS, run_prompts  # noqa: E402
from tests.support.engine_testing import hf_greedy, overlapped_run_checking_syncs  # noqa: E402


@pytest.mark.parametrize("tokens", [1, 8, 64 * 16])
def test_fused_layer_at_30b_a3b_sizes_and_in_a_graph(tokens: int) -> None:
    """Hidden 2048, 128 experts, top 8, expert intermediate 768, bf16: close to the fp32 reference experts on the
    layer's own routing; replayed from a CUDA graph on new inputs, equal to the eager call."""
    torch.manual_seed(0)
    routing = ExpertRouting(128, 8, True)
    fused = SparseMoe(2048, 768, routing, backend="triton").cuda()
    with torch.no_grad():
        for param in fused.parameters():
            param.normal_(0.0, 0.02)
    fused = fused.to(torch.bfloat16)
    experts = fused.experts
    x = torch.randn(tokens, 2048, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        # NOTE: the reference takes the bf16 router's choice. An fp32 router picks another k-th expert wherever the
        # k-th and (k+1)-th of the 128 logits are closer than bf16 rounds, and each such token is then off by a
        # whole expert's share: that measures the router's precision, not the kernel.
        weights, ids = route(fused.gate(x), routing)
        expected = experts_reference(x.float(), experts.gate_up_proj.float(), experts.down_proj.float(), weights, ids)
        got = fused(x).float()
        assert (got - expected).norm() / expected.norm() < 2e-2
        static_x = x.clone()
        out = torch.empty_like(static_x)
        fused(static_x, out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused(static_x, out)
        static_x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, fused(static_x))


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.support.draft_training import save_trained_target

    root = tmp_path_factory.mktemp("moe_gpu")
    return {"root": root, "target": save_trained_target(root, kind="qwen3_moe")}


def test_decode_graphs_equal_eager_cpu_and_hf(moe_pair: dict[str, Any]) -> None:
    root = moe_pair["root"]
    cpu, _ = run_prompts(root, False, device="cpu")
    eager, _ = run_prompts(root, False, device="cuda", disable_cuda_graph=True)
    graphed, engine = run_prompts(root, False, device="cuda", cuda_graph_bs=[1, 2, 4, 8, 16])
    assert engine.forward_counts["graph"] > 0
    assert graphed == eager == cpu
    assert graphed == [hf_greedy(moe_pair["target"], p, GREEDY["max_new_tokens"]) for p in PROMPTS]


@pytest.mark.parametrize("piecewise", [False, True])
def test_dflash_graphs_are_lossless(moe_pair: dict[str, Any], piecewise: bool) -> None:
    """The DFlash cycle in graphs (full block), with and without piecewise extend graphs: target-only tokens."""
    root = moe_pair["root"]
    target_only, _ = run_prompts(root, False, device="cuda")
    # NOTE: piecewise graphs are on by default for Qwen3-MoE since 350e0e4; the False case turns them off
    flags: dict[str, Any] = dict(enforce_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=64) if piecewise \
        else dict(disable_piecewise_cuda_graph=True)
    spec, engine = run_prompts(root, True, device="cuda", speculative_adaptive_verify="off", **flags)
    assert spec == target_only
    assert engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"] > 1.5
    assert engine.forward_counts["graph"] > 0
    assert (engine.forward_counts["piecewise"] > 0) == piecewise


@pytest.mark.parametrize("spec", [True, False])
def test_overlap_steady_steps_never_sync(moe_pair: dict[str, Any], spec: bool) -> None:
    """Overlapped greedy decode: a steady step launches the next one without a synchronising call (the MoE layer's
    routing and expert sort stay on the device), tokens equal to the synchronous schedule."""
    root = moe_pair["root"]
    sync, _ = run_prompts(root, spec, device="cuda", disable_overlap_schedule=True)
    flags = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft")) if spec else {}
    engine = Engine(model_path=str(root / "target"), dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True,
                    chunked_prefill_size=16, cuda_graph_bs=[1, 2, 4, 8], **flags)
    reqs, checked = overlapped_run_checking_syncs(engine, PROMPTS[:8], GREEDY)
    assert checked > 5
    assert [r.output_ids for r in reqs] == sync[:8]
