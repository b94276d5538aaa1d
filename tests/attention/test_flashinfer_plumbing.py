"""CPU checks of the FlashInfer backend's plumbing (no FlashInfer needed): the install/device errors, and its
plans (indices, indptrs, layer groups, causal/window translation, graph buffers) run through a torch stand-in
of FlashInfer's wrappers (fake_flashinfer.py) equal the torch reference backend."""
from __future__ import annotations

import functools
import importlib.util
import sys
import types
from typing import Any, Iterator, Optional

import pytest
import torch

from blockspec.attention.factory import resolve_backend_name
from blockspec.attention.torch_backend import TorchAttentionBackend
from blockspec.batch import ForwardMode
from tests.support.fake_cuda_graphs import fake_graph_capture

BACKEND_MODULE = "blockspec.attention.flashinfer_backend"


def test_missing_flashinfer_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"pip install 'blockspec\[flashinfer\]'"):
        resolve_backend_name("flashinfer", torch.device("cuda"))


def test_flashinfer_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend_name("flashinfer", torch.device("cpu"))


def test_engine_on_cpu_refuses_flashinfer_clearly(tmp_path: Any) -> None:
    from blockspec import Engine
    from tests.support.tiny_models import save_tiny_model

    save_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="flashinfer"):
        Engine(model_path=str(tmp_path), device="cpu", attention_backend="flashinfer", skip_tokenizer_init=True)


@pytest.fixture()
def fake_backend_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The backend module imported against the stand-in; both leave sys.modules when the test ends."""
    import blockspec.attention as package
    from tests.support import fake_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.delitem(sys.modules, BACKEND_MODULE, raising=False)
    monkeypatch.delattr(package, "flashinfer_backend", raising=False)
    module = importlib.import_module(BACKEND_MODULE)
    monkeypatch.setattr(module, "check_supported", lambda device, dtype: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=132)
    )
    yield module
    # NOTE: runs before monkeypatch restores any real module, so nothing keeps the stand-in.
    sys.modules.pop(BACKEND_MODULE, None)
    if getattr(package, "flashinfer_backend", None) is module:
        delattr(package, "flashinfer_backend")


CASES = [
    # mode, prefix lens, new lens, page size, window of layer 0, draft causal of layer 0
    (ForwardMode.EXTEND, [0, 5, 17, 0], [9, 3, 20, 1], 1, None, None),
    (ForwardMode.EXTEND, [16, 3], [40, 70], 16, 24, None),
    (ForwardMode.DECODE, [0, 30, 300, 7], [1, 1, 1, 1], 16, None, None),
    (ForwardMode.DECODE, [30, 300], [1, 1], 1, 24, None),
    (ForwardMode.VERIFY, [4, 90, 13], [8, 8, 8], 1, None, None),
    (ForwardMode.DRAFT, [4, 90, 13], [8, 8, 8], 16, None, None),
    (ForwardMode.DRAFT, [40, 90], [16, 16], 1, 24, True),
    (ForwardMode.DRAFT, [40, 90], [16, 16], 16, 24, False),
]


@pytest.mark.parametrize("mode,prefix,new,page,window,draft_causal", CASES)
@pytest.mark.parametrize("for_graph", [False, True])
def test_plans_match_torch_reference(
    fake_backend_module: types.ModuleType, mode: ForwardMode, prefix: list[int], new: list[int], page: int,
    window: Optional[int], draft_causal: Optional[bool], for_graph: bool,
) -> None:
    from tests.support.attention_cases import make_case

    if for_graph and mode is ForwardMode.EXTEND:
        pytest.skip("CUDA graphs run uniform batches only")
    heads, kv_heads, head_dim = 8, 2, 16
    batch, pool_a, pool_b, q, k, v = make_case(mode, prefix, new, page, heads, kv_heads, head_dim, torch.float32)
    for pool in (pool_a, pool_b):  # layer 1: full attention, non-causal in a draft
        pool.k.append(pool.k[0].clone())
        pool.v.append(pool.v[0].clone())
    windows = [window, None]
    causal = [draft_causal, False] if draft_causal is not None else None
    reference = TorchAttentionBackend(pool_a, head_dim ** -0.5, windows, causal)
    backend = fake_backend_module.FlashInferAttentionBackend(
        pool_b, head_dim**-0.5, heads, kv_heads, head_dim, windows, causal
    )
    for layer_id in (0, 1):
        batch.attn_meta = reference.plan(batch)
        expected = reference.forward(q, k, v, layer_id, batch)
        batch.attn_meta = backend.plan_for_graph(batch) if for_graph else None
        batch.attn_meta = backend.plan(batch)  # inside a graph: keeps the plan made outside
        assert batch.attn_meta.for_graph == for_graph
        got = backend.forward(q, k, v, layer_id, batch)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    draft = mode is ForwardMode.DRAFT
    groups = len({(bool(draft_causal) if draft else True, window), (not draft, None)})
    assert len(batch.attn_meta.wrappers) == groups
    torch.testing.assert_close(pool_b.k[0], pool_a.k[0])


def test_graph_wrappers_are_per_batch_size_and_share_buffers(fake_backend_module: types.ModuleType) -> None:
    from tests.support.attention_cases import make_case

    batch, _, pool, *_ = make_case(ForwardMode.VERIFY, [4, 90, 13, 2], [8, 8, 8, 8], 1, 4, 2, 16, torch.float32)
    backend = fake_backend_module.FlashInferAttentionBackend(pool, 0.25, 4, 2, 16)
    first = backend.plan_for_graph(batch)
    again = backend.plan_for_graph(batch)
    assert first.wrappers == again.wrappers  # replays re-plan the captured wrappers
    small = backend.plan_for_graph(dataclass_slice(batch, 2))
    assert small.wrappers[(True, -1)] is not first.wrappers[(True, -1)]
    assert set(backend.graph_buffers) == {"kv_indptr", "kv_indices", "last_page_len", "qo_indptr"}


def dataclass_slice(batch: Any, bs: int) -> Any:
    import dataclasses

    n = bs * batch.uniform_q_len
    return dataclasses.replace(
        batch, input_ids=batch.input_ids[:n], positions=batch.positions[:n], out_cache_loc=batch.out_cache_loc[:n],
        req_rows=batch.req_rows[:bs], seq_lens=batch.seq_lens[:bs], seq_lens_cpu=batch.seq_lens_cpu[:bs],
        extend_lens_cpu=batch.extend_lens_cpu[:bs], attn_meta=None,
    )


def test_noncausal_window_shorter_than_block_is_refused(fake_backend_module: types.ModuleType) -> None:
    from tests.support.attention_cases import make_case

    batch, _, pool, *_ = make_case(ForwardMode.DRAFT, [40], [16], 1, 4, 2, 16, torch.float32)
    backend = fake_backend_module.FlashInferAttentionBackend(pool, 0.25, 4, 2, 16, [8], [False])
    with pytest.raises(ValueError, match="non-causal sliding window"):
        backend.plan(batch)


class ReplayByRerun:
    """Stands in for a captured CUDA graph on CPU: replay rebuilds the static batch (as the graph re-derives it
    from the static rows) with the capture-time plan and reruns the captured call, copying into the captured
    outputs (so a stale plan or stale fixed buffer shows up as a wrong output)."""

    def __init__(self, fn: Any, make_batch: Any, outputs: tuple[torch.Tensor, ...]) -> None:
        self.fn, self.make_batch, self.outputs = fn, make_batch, outputs

    def replay(self) -> None:
        for target, fresh in zip(self.outputs, self.fn(self.make_batch())):
            target.copy_(fresh)


@pytest.mark.parametrize("mode,q_len,window,draft_causal", [
    (ForwardMode.DECODE, 1, None, None), (ForwardMode.VERIFY, 8, None, None), (ForwardMode.DRAFT, 16, 24, False),
])
def test_graphed_forward_replans_before_every_replay(
    fake_backend_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch, mode: ForwardMode, q_len: int,
    window: Optional[int], draft_causal: Optional[bool],
) -> None:

    from blockspec.attention.base import graph_planner
    from blockspec.runner.cuda_graph import GraphedForward
    from blockspec.batch import build_batch
    from tests.support.attention_cases import make_case

    fake_graph_capture(monkeypatch)
    heads, kv_heads, head_dim = 4, 2, 16
    prefix = [4, 90, 13, 30]
    first, pool_a, pool_b, *_ = make_case(mode, prefix, [q_len] * 4, 16, heads, kv_heads, head_dim, torch.float32)
    windows, causal = [window], [draft_causal] if draft_causal is not None else None
    reference = TorchAttentionBackend(pool_a, head_dim ** -0.5, windows, causal)
    backend = fake_backend_module.FlashInferAttentionBackend(
        pool_b, head_dim**-0.5, heads, kv_heads, head_dim, windows, causal
    )
    n = 4 * q_len
    q_buf, k_buf, v_buf = (torch.zeros(n, h, head_dim) for h in (heads, kv_heads, kv_heads))

    def attention(batch: Any) -> tuple[torch.Tensor, ...]:
        batch.attn_meta = backend.plan(batch)
        t = batch.num_tokens
        return (backend.forward(q_buf[:t], k_buf[:t], v_buf[:t], 0, batch),)

    table = first.req_to_token
    graph = GraphedForward("attn", attention, mode, q_len, [1, 2, 4], table, table.shape[0] - 1, table.shape[1],
                           host_planner=graph_planner(backend))
    graph.capture()
    for bs in graph.graphs:  # NOTE: capture ran largest first; rebuild each size's static batch to rerun it
        rebuild = functools.partial(graph._static_batch, bs, meta=graph.metas[bs])
        graph.graphs[bs] = ReplayByRerun(attention, rebuild, graph.outputs[bs])  # type: ignore[assignment]
    rows = first.req_rows.tolist()
    for req_rows, starts in [(rows, prefix), (rows[1:], [p // 2 for p in prefix[1:]]), ([rows[2]], [prefix[2]])]:
        batch = build_batch(mode, [[1] * q_len for _ in req_rows], starts, req_rows, table, [0])
        t = batch.num_tokens
        q, k, v = (
            torch.randn(t, heads, head_dim),
            torch.randn(t, kv_heads, head_dim),
            torch.randn(t, kv_heads, head_dim),
        )
        q_buf[:t].copy_(q)
        k_buf[:t].copy_(k)
        v_buf[:t].copy_(v)
        (got,) = graph.replay(batch)
        batch.attn_meta = reference.plan(batch)
        torch.testing.assert_close(got, reference.forward(q, k, v, 0, batch), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("speculative", [False, True])
def test_worker_graphs_plan_flashinfer_outside_the_capture(
    fake_backend_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch, speculative: bool,
) -> None:
    """Every graph a worker captures plans a host-planned backend outside the capture (the target-only decode graph
    once planned inside it: on the GPU a host→device copy there aborts the capture)."""
    from types import SimpleNamespace

    from blockspec.kv.allocator import ReqToTokenTable
    from blockspec.runner.graph_kind import GraphKind
    from blockspec.runner.graphs import CudaGraphs
    from blockspec.speculative.dflash import DFlashWorker
    from blockspec.worker.target_worker import TargetWorker
    from tests.support.attention_cases import make_case

    capturing = fake_graph_capture(monkeypatch)
    _, _, pool, *_ = make_case(ForwardMode.DECODE, [4], [1], 1, 4, 2, 16, torch.float32)
    target = fake_backend_module.FlashInferAttentionBackend(pool, 0.25, 4, 2, 16)
    draft = fake_backend_module.FlashInferAttentionBackend(pool, 0.25, 4, 2, 16, [None], [False])
    planned_inside: list[str] = []
    for name, backend in (("target", target), ("draft", draft)):
        real_plan_wrappers = backend.plan_wrappers

        def spy(wrappers: Any, batch: Any, name: str = name, real: Any = real_plan_wrappers) -> None:
            if capturing.now:
                planned_inside.append(f"{name} {batch.mode.value}")
            real(wrappers, batch)

        monkeypatch.setattr(backend, "plan_wrappers", spy)

    def run_attention(backend: Any, batch: Any) -> tuple[torch.Tensor, ...]:
        batch.attn_meta = backend.plan(batch)
        return (torch.zeros(batch.num_tokens, 1),)

    table = ReqToTokenTable(4, 64, torch.device("cpu"))
    graphs = CudaGraphs(True, [1, 2], table, 64, torch.device("cpu"))
    runner = SimpleNamespace(graphs=graphs, attention=target, capture_piecewise=lambda **kw: None,
                             eager_forward=functools.partial(run_attention, target))
    if speculative:
        worker = DFlashWorker.__new__(DFlashWorker)  # NOTE: only what init_cuda_graphs reads, without a draft model
        worker.runner, worker.draft_attention, worker.block_size, worker.capture = runner, draft, 4, (0,)
        worker.tree = None
        monkeypatch.setattr(DFlashWorker, "verify_lengths", property(lambda self: (4,)))
        monkeypatch.setattr(DFlashWorker, "calibrate_verify_lengths", lambda self: None)
        monkeypatch.setattr(DFlashWorker, "_verify_forward", lambda self, batch: run_attention(target, batch))
        monkeypatch.setattr(DFlashWorker, "_draft_proposals", lambda self, batch: run_attention(draft, batch))
        worker.init_cuda_graphs()
        assert {kind for kind, _ in graphs.by_kind} == {GraphKind.VERIFY, GraphKind.DRAFT}
    else:
        TargetWorker(runner).init_cuda_graphs()  # type: ignore[arg-type]
        assert {kind for kind, _ in graphs.by_kind} == {GraphKind.DECODE}
    assert planned_inside == []
    assert all(graph.host_planner is not None for graph in graphs.by_kind.values())


def test_one_graph_cannot_replan_two_host_planned_backends(fake_backend_module: types.ModuleType) -> None:
    from blockspec.runner.graph_kind import GraphKind
    from blockspec.runner.graphs import single_host_planner
    from tests.support.attention_cases import make_case

    _, _, pool, *_ = make_case(ForwardMode.DECODE, [4], [1], 1, 4, 2, 16, torch.float32)
    backend = fake_backend_module.FlashInferAttentionBackend(pool, 0.25, 4, 2, 16)
    reference = TorchAttentionBackend(pool, 0.25)
    assert single_host_planner(GraphKind.DECODE, [reference]) is None
    assert single_host_planner(GraphKind.DECODE, [reference, backend]) is not None
    with pytest.raises(ValueError, match="greedy-cycle graph runs 2 attention backends that plan on the host"):
        single_host_planner(GraphKind.GREEDY_CYCLE, [backend, backend])
