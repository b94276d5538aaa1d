"""GPU-only behaviour: Triton kernels at real sizes, CUDA-graph replay vs eager, DFlash lossless with graphs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from blockspec import Engine  # noqa: E402
from blockspec.batch import ForwardMode  # noqa: E402
from blockspec.runner.graph_kind import GraphKind  # noqa: E402
from tests.support.engine_runs import GREEDY, PROMPTS, run_prompts  # noqa: E402
from tests.support.engine_testing import overlapped_run_checking_syncs  # noqa: E402



@pytest.mark.parametrize("mode,prefix,new", [
    (ForwardMode.DECODE, [4096, 511, 100, 3000], [1, 1, 1, 1]),
    (ForwardMode.VERIFY, [4096, 511], [10, 10]),
    (ForwardMode.DRAFT, [4096, 511], [10, 10]),
    (ForwardMode.EXTEND, [0, 300], [512, 77]),
])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_real_sizes(mode: ForwardMode, prefix: list[int], new: list[int], page_size: int) -> None:
    from tests.support.attention_cases import make_case
    from blockspec.attention.torch_backend import TorchAttentionBackend
    from blockspec.attention.triton_backend import TritonAttentionBackend

    heads, kv_heads, head_dim = 32, 8, 128
    batch, pool_a, pool_b, q, k, v = make_case(mode, prefix, new, page_size, heads, kv_heads, head_dim, torch.bfloat16)
    reference = TorchAttentionBackend(pool_a, head_dim ** -0.5)
    triton_backend = TritonAttentionBackend(pool_b, head_dim ** -0.5, heads, kv_heads, head_dim)
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q.float(), k, v, 0, batch)
    batch.attn_meta = triton_backend.plan(batch)
    got = triton_backend.forward(q, k, v, 0, batch)
    error = (got.float() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e} (splits {batch.attn_meta.num_splits})"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.draft_training import save_trained_pair

    return save_trained_pair(tmp_path_factory.mktemp("gpu"))


run = run_prompts


def test_graph_replay_equals_eager(tiny: Path) -> None:
    cpu, _ = run(tiny, False, device="cpu")
    eager, eager_engine = run(tiny, False, device="cuda", disable_cuda_graph=True)
    # NOTE: a graph for all 9 prompts: with the prefix cache (the prompts are prefixes of each other) they may decode
    # in lockstep at bs 9 for the whole run, which the default sizes (largest 8) would leave to eager.
    graphed, engine = run(tiny, False, device="cuda", cuda_graph_bs=[1, 2, 4, 8, 16])
    assert engine.runner.attention_backend == "triton"
    assert engine.forward_counts["graph"] > 0 and eager_engine.forward_counts["graph"] == 0
    assert graphed == eager == cpu


@pytest.mark.parametrize("page_size", [1, 16])
def test_dflash_lossless_with_graphs(tiny: Path, page_size: int) -> None:
    target_only, _ = run(tiny, False, device="cuda", page_size=page_size)
    # NOTE: the full block every cycle, so the acceptance below is the draft's (test_gpu_adaptive.py: the default)
    spec, engine = run(tiny, True, device="cuda", page_size=page_size, speculative_adaptive_verify="off")
    assert spec == target_only
    stats = engine.get_server_info()["internal_states"][0]
    assert stats["avg_spec_accept_length"] > 1.5
    assert engine.forward_counts["graph"] > 0
    # 9 prompts > the largest captured batch (8): that step falls back to eager and stays lossless
    assert engine.forward_counts["eager"] > 0


def test_bf16_graphs_match_bf16_eager(tiny: Path) -> None:
    """bf16 GEMMs may pick other kernels for a padded batch, so a rare near-tie may flip; nearly all must match."""
    # NOTE: the same verify length in both (adaptive verify would pick its own for the graphed engine only)
    eager, _ = run(tiny, True, device="cuda", dtype="bfloat16", disable_cuda_graph=True)
    graphed, _ = run(tiny, True, device="cuda", dtype="bfloat16", speculative_adaptive_verify="off")
    assert sum(g == e for g, e in zip(graphed, eager)) >= len(PROMPTS) - 2


def test_piecewise_equals_eager_across_buckets(tiny: Path) -> None:
    from tests.support.extend_batches import extend_batch, release

    engine = Engine(model_path=str(tiny / "target"), dtype="bfloat16", max_total_tokens=8192, skip_tokenizer_init=True,
                    enforce_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=512)
    runner = engine.runner
    assert runner.piecewise is not None
    for total in (1, 3, 4, 5, 31, 33, 100, 257, 500):  # the tiny model's context is 512
        batch, reqs = extend_batch(engine, [0], [total], ())
        with torch.inference_mode():
            expected = runner.model(batch, runner.attention)
            untouched = torch.ones(runner.kv_pool.num_slots, dtype=torch.bool, device="cuda")
            untouched[batch.out_cache_loc] = False
            untouched[0] = False  # the dummy slot: padding rows write there
            before = [k[untouched].clone() for k in runner.kv_pool.k]
            got = runner.piecewise.forward(batch)
        for layer_before, k in zip(before, runner.kv_pool.k):
            assert torch.equal(layer_before, k[untouched]), f"{total} tokens: padding wrote a real KV slot"
        error = (got.logits - expected.logits).norm() / expected.logits.norm()
        assert error < 2e-2, f"{total} tokens: relative error {error:.2e}"
        release(engine, reqs)


@pytest.mark.parametrize("page_size", [1, 16])
def test_dflash_with_piecewise_is_lossless(tiny: Path, page_size: int) -> None:
    target_only, _ = run(tiny, False, device="cuda", page_size=page_size)
    eager_prefill, _ = run(tiny, True, device="cuda", page_size=page_size)
    spec, engine = run(tiny, True, device="cuda", page_size=page_size, enforce_piecewise_cuda_graph=True,
                       piecewise_cuda_graph_max_tokens=64)
    assert spec == eager_prefill == target_only
    counts = engine.forward_counts
    assert counts["piecewise"] > 0
    aux = engine.runner.piecewise.aux  # FULL capture at the draft's layers
    assert set(aux) == {0, 2}


def test_greedy_cycle_graph_equals_eager(tiny: Path) -> None:
    """One cycle graph (padded batch 3 → 4) gives the eager cycle's draft and target argmaxes."""
    from tests.support.engine_testing import graphed_and_eager_cycle, ready_for_one_cycle

    engine = Engine(model_path=str(tiny / "target"), dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True,
                    cuda_graph_bs=[1, 2, 4, 8], speculative_algorithm="DFLASH",
                    speculative_draft_model_path=str(tiny / "draft"))
    assert engine.runner.graphs.captured(GraphKind.GREEDY_CYCLE)
    with ready_for_one_cycle(engine, PROMPTS[:3], GREEDY) as reqs:
        graphed, eager = graphed_and_eager_cycle(engine, reqs)
    assert graphed == eager


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("spec", [True, False])
def test_overlap_schedule_with_graphs(tiny: Path, page_size: int, spec: bool) -> None:
    """Overlapped greedy decode (DFlash cycle graph / target decode graph): same tokens as the synchronous schedule
    and the target alone, and a steady-state step launches the next cycle without any synchronising device call
    (sync debug mode 'error')."""
    sync, _ = run(tiny, spec, device="cuda", page_size=page_size, disable_overlap_schedule=True)
    target_only, _ = run(tiny, False, device="cuda", page_size=page_size, disable_overlap_schedule=True)
    flags = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(tiny / "draft")) if spec else {}
    engine = Engine(model_path=str(tiny / "target"), dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True,
                    chunked_prefill_size=16, cuda_graph_bs=[1, 2, 4, 8], page_size=page_size, **flags)
    scheduler = engine.scheduler
    reqs, checked = overlapped_run_checking_syncs(engine, PROMPTS[:8], GREEDY)
    assert checked > 5
    assert [r.output_ids for r in reqs] == sync[:8] == target_only[:8]
    assert engine.forward_counts["graph"] > 0
    assert (scheduler.spec.verify_ct > 0) == spec
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
