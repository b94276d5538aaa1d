"""Piecewise decomposition (CPU, fp32): segment-by-segment forward == plain forward; buckets; can_run; mode guard."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec import Engine
from blockspec.batch import ForwardBatch, ForwardMode, build_batch
from tests.support.extend_batches import extend_batch, release
from tests.support.tiny_models import save_tiny_model
from blockspec.runner.piecewise_graph import PiecewiseGraphRunner, bucket_for, default_buckets

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

CAPTURE = (0, 2)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])  # NOTE: qwen3_moe: layer 0 sparse, 2 dense
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    root = tmp_path_factory.mktemp(f"pcg_{request.param}")
    save_tiny_model(request.param, root)
    return Engine(model_path=str(root), device="cpu", dtype="float32", page_size=16, max_total_tokens=2048,
                  skip_tokenizer_init=True)


@pytest.mark.parametrize("prefix,new", [([0], [5]), ([0, 0, 0], [3, 17, 9]), ([20, 0], [13, 40])])
@pytest.mark.parametrize("capture", [(), CAPTURE])
def test_segments_equal_plain_forward(
    engine: Engine, prefix: list[int], new: list[int], capture: tuple[int, ...]
) -> None:
    runner = engine.runner
    pcg = PiecewiseGraphRunner(runner.model, runner.attention, default_buckets(128), capture, runner.device)
    batch, reqs = extend_batch(engine, prefix, new, capture)  # a cached prefix reads whatever its slots hold
    check_against_plain_forward(engine, pcg, batch, capture)
    release(engine, reqs)


def check_against_plain_forward(engine: Engine, pcg: PiecewiseGraphRunner, batch: ForwardBatch,
                                capture: tuple[int, ...]) -> None:
    """`pcg.forward` (eager segments) gives the plain forward's logits, hidden, aux and KV; padding wrote only the
    dummy slot."""
    runner = engine.runner
    with torch.inference_mode():
        expected = runner.model(batch, runner.attention)
        kv_plain = [t.clone() for t in runner.kv_pool.k + runner.kv_pool.v]
        got = pcg.forward(batch, use_graphs=False)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.hidden, expected.hidden)
    if capture:
        torch.testing.assert_close(got.aux_hidden, expected.aux_hidden)
    else:
        assert got.aux_hidden is None
    for before, after in zip(kv_plain, runner.kv_pool.k + runner.kv_pool.v):
        torch.testing.assert_close(before[1:], after[1:])  # padding wrote only slot 0, the dummy slot


def test_capture_follows_the_requested_order(engine: Engine) -> None:
    """Captured layer outputs sit side by side in capture_layer_ids order, eager and piecewise alike (one capture,
    in the model's pieces)."""
    runner = engine.runner
    h = runner.target_config.hidden_size
    batch, reqs = extend_batch(engine, [0], [11], (0, 2))
    swapped, more = extend_batch(engine, [0], [11], (2, 0))  # the same tokens at other slots
    pcg = PiecewiseGraphRunner(runner.model, runner.attention, [16], (2, 0), runner.device)
    with torch.inference_mode():
        in_order = runner.model(batch, runner.attention).aux_hidden
        eager = runner.model(swapped, runner.attention).aux_hidden
        piecewise = pcg.forward(swapped, use_graphs=False).aux_hidden
    expected = torch.cat([in_order[:, h:], in_order[:, :h]], dim=-1)
    torch.testing.assert_close(eager, expected)
    torch.testing.assert_close(piecewise, expected)
    release(engine, reqs + more)


def test_padding_writes_only_the_dummy_slot(engine: Engine) -> None:
    runner = engine.runner
    pcg = PiecewiseGraphRunner(runner.model, runner.attention, [32], (), runner.device)
    batch, reqs = extend_batch(engine, [0], [5], ())
    embeddings = runner.model.model.embed_tokens.weight
    saved_row = embeddings[0].clone()
    with torch.no_grad():
        embeddings[0].fill_(0.5)  # NOTE: padding rows use token 0; make their K/V visible
        for cache in runner.kv_pool.k + runner.kv_pool.v:
            cache[0].zero_()
    sentinel = [cache.clone() for cache in runner.kv_pool.k + runner.kv_pool.v]
    written = set(batch.out_cache_loc.tolist())
    with torch.inference_mode():
        pcg.forward(batch, use_graphs=False)
    with torch.no_grad():
        embeddings[0].copy_(saved_row)
    for before, after in zip(sentinel, runner.kv_pool.k + runner.kv_pool.v):
        changed = set((before != after).any(-1).any(-1).nonzero().flatten().tolist())
        assert changed == written | {0}  # the 27 padding rows all went to slot 0, the dummy page's
    release(engine, reqs)


def test_buckets() -> None:
    buckets = default_buckets(4096)
    assert buckets[:9] == [4, 8, 12, 16, 20, 24, 28, 32, 48]
    assert 256 in buckets and 288 in buckets and 512 in buckets and 576 in buckets and 1024 in buckets
    assert buckets[-3:] == [3584, 3840, 4096]
    assert all(b % 4 == 0 for b in buckets)
    assert default_buckets(100)[-1] == 100
    assert default_buckets(8192)[-9:] == [4096, 4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192]
    assert default_buckets(5000)[-3:] == [4096, 4608, 5000]
    assert bucket_for(buckets, 1) == 4 and bucket_for(buckets, 33) == 48 and bucket_for(buckets, 4096) == 4096
    assert bucket_for(buckets, 4097) is None


def test_can_run_decisions(engine: Engine) -> None:
    runner = engine.runner
    pcg = PiecewiseGraphRunner(runner.model, runner.attention, [16, 32], CAPTURE, runner.device)
    ok, reqs = extend_batch(engine, [0], [20], CAPTURE)
    assert pcg.can_run(ok)
    other_mode, more = extend_batch(engine, [0], [20], ())
    assert not pcg.can_run(other_mode)  # hidden-capture mode differs from the captured one
    too_big, big = extend_batch(engine, [0], [40], CAPTURE)
    assert not pcg.can_run(too_big)
    decode = build_batch(ForwardMode.DECODE, [[5]], [3], [reqs[0].pool_row], runner.req_to_token.table, [0], CAPTURE)
    assert not pcg.can_run(decode)
    release(engine, reqs + more + big)


def test_dflash_refuses_runner_without_aux_capture(tmp_path: Path) -> None:
    pytest.importorskip("dflash.model")
    from blockspec.config.engine_config import EngineConfig
    from blockspec.models.draft_loading import load_draft_model
    from blockspec.models.draft_config import load_draft_config
    from blockspec.kv.pool import KVPool
    from blockspec.runner.model_runner import ModelRunner
    from blockspec.speculative.dflash import DFlashWorker
    from tests.support.tiny_models import save_tiny_draft

    target = save_tiny_model("llama", tmp_path / "target")
    save_tiny_draft(tmp_path / "draft", target, [0, 2], 4)
    config = EngineConfig(model_path=str(tmp_path / "target"), device="cpu", dtype="float32", max_total_tokens=256,
                          speculative_algorithm="DFLASH", speculative_draft_model_path=str(tmp_path / "draft"))
    runner = ModelRunner(config)  # hidden-capture mode NONE: wrong for DFlash
    draft_config = load_draft_config(tmp_path / "draft", runner.target_config)
    draft = load_draft_model(tmp_path / "draft", draft_config, runner.dtype, runner.device, runner.max_positions)
    pool = KVPool(runner.kv_pool.num_slots, 2, 2, 16, runner.dtype, runner.device)
    with pytest.raises(ValueError, match="FULL hidden capture"):
        DFlashWorker(runner, draft, pool, 4)


def test_aux_consumer_writes_the_draft_kv_like_eager_materialise(tmp_path: Path) -> None:
    """DFlash hands the captured aux to the last segment (inside its graph): the draft KV it writes equals the eager
    materialise at the real slots, and padding rows write only the dummy slot."""
    pytest.importorskip("dflash.model")
    from tests.support.tiny_models import save_tiny_draft

    target = save_tiny_model("llama", tmp_path / "target")
    save_tiny_draft(tmp_path / "draft", target, [0, 2], 4)
    engine = Engine(model_path=str(tmp_path / "target"), device="cpu", dtype="float32", max_total_tokens=512,
                    skip_tokenizer_init=True, speculative_algorithm="DFLASH",
                    speculative_draft_model_path=str(tmp_path / "draft"))
    runner, worker = engine.runner, engine.worker
    pcg = PiecewiseGraphRunner(runner.model, runner.attention, [32], (0, 2), runner.device,
                               aux_consumer=worker._materialise_draft_kv)
    batch, reqs = extend_batch(engine, [0, 4], [5, 9], (0, 2))
    draft_k = worker.draft_pool.k + worker.draft_pool.v
    with torch.no_grad():
        runner.model.model.embed_tokens.weight[0].fill_(0.5)  # NOTE: padding rows use token 0; make them visible
    with torch.inference_mode():
        expected = runner.model(batch, runner.attention)
        worker._materialise_draft_kv(expected.aux_hidden, batch.positions, batch.out_cache_loc)
        eager_k = [k.clone() for k in draft_k]
        for k in draft_k:
            k[batch.out_cache_loc] = 0.0
            k[0] = 0.0
        before = [k.clone() for k in draft_k]
        got = pcg.forward(batch, use_graphs=False)
    assert got.aux_consumed and not expected.aux_consumed
    real = batch.out_cache_loc
    for eager, after, start in zip(eager_k, draft_k, before):
        torch.testing.assert_close(after[real], eager[real])
        changed = set((after != start).any(-1).any(-1).nonzero().flatten().tolist())
        assert changed <= set(real.tolist()) | {0}
        assert 0 in changed  # the 18 padding rows of the 32-token bucket went to the dummy slot
    release(engine, reqs)


@pytest.fixture(scope="module")
def triton_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    pytest.importorskip("triton")
    root = tmp_path_factory.mktemp("pcg_triton")
    save_tiny_model("llama", root)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # NOTE: on CPU, Triton's interpreter (root conftest)
    return Engine(model_path=str(root), device=device, dtype="float32", page_size=4, max_total_tokens=2048,
                  skip_tokenizer_init=True, attention_backend="triton", max_running_requests=8, disable_cuda_graph=True)


@pytest.mark.parametrize("max_splits", [1, 4])
@pytest.mark.parametrize("prefix,new", [([0], [5]), ([20, 0, 3], [13, 40, 1])])
def test_whole_forward_graph_equals_plain_forward(triton_engine: Engine, prefix: list[int], new: list[int],
                                                  max_splits: int) -> None:
    """Triton attention inside the bucket's graph (GraphExtendAttention, unsplit and split over keys): the same
    logits, aux and KV as the plain forward; padding writes only the dummy slot; a batch with more requests than the
    static buffers is refused."""
    from blockspec.attention.triton_graph_extend import GraphExtendAttention

    runner = triton_engine.runner
    graph_attention = GraphExtendAttention(runner.attention, runner.req_to_token.table, 4, 64,  # type: ignore[arg-type]
                                           max_splits=max_splits, min_split_keys=0)
    assert graph_attention.plan_for(16).splits == max_splits
    pcg = PiecewiseGraphRunner(runner.model, runner.attention, [16, 64], CAPTURE, runner.device,
                               graph_attention=graph_attention)
    batch, reqs = extend_batch(triton_engine, prefix, new, CAPTURE)
    check_against_plain_forward(triton_engine, pcg, batch, CAPTURE)
    assert pcg.can_run(batch)
    release(triton_engine, reqs)
    crowded, reqs = extend_batch(triton_engine, [0] * 5, [1] * 5, CAPTURE)
    assert not pcg.can_run(crowded)
    release(triton_engine, reqs)
