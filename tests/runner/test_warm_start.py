"""Warm start (issue 25) on CPU: the compile counter through Triton's public post-compile hook, the enumeration of
attention launch variants (against brute force), the warm-up's launches (Triton interpreter) and its leaving the
engine as it found it, and the counter in /server_info and /metrics. `test_warm_start_gpu.py` asserts that nothing
compiles while serving on a GPU."""
from __future__ import annotations

import itertools
import logging
import signal
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import torch
import triton
from triton.runtime.jit import JitFunctionInfo

from blockspec import Engine
from blockspec.attention import triton_backend
from blockspec.attention.triton_backend import TritonAttentionBackend, block_mode, launch_policy
from blockspec.attention.triton_kernels import paged_attention_kernel
from blockspec.batch import ForwardMode
from blockspec.kv.allocator import ReqToTokenTable
from blockspec.kv.pool import KVPool
from blockspec.engine.attention_variants import (
    ROW_BLOCK, AttentionWorkload, launch_variant, query_lengths, reachable_launches, workload_variants,
)
from blockspec.engine.compiles import KernelCompileLog, kernel_compile_log
from blockspec.engine.warmup import attention_workloads, warm_attention, warm_engine_paths, warm_kernels
from tests.support.server_support import metric_value, save_text_model, serve_text_model, server_process

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def fire_compile_hook(kernel_name: str = "paged_attention_kernel") -> None:
    """What Triton's JITFunction._do_compile does after compiling a variant: calls the public post-compile hook."""
    info = JitFunctionInfo(types.ModuleType("blockspec.attention.triton_kernels"), kernel_name, paged_attention_kernel)
    triton.knobs.runtime.jit_post_compile_hook(
        key="key", repr=f"{kernel_name}[num_warps=4](q_ptr: *bf16)", fn=info, compile={}, is_manual_warmup=False,
        already_compiled=False,
    )


@pytest.fixture
def restore_hook() -> Iterator[None]:
    saved = triton.knobs.runtime.jit_post_compile_hook
    yield
    triton.knobs.runtime.jit_post_compile_hook = saved


def test_compile_log_counts_through_tritons_hook_and_keeps_the_previous_one(
    restore_hook: None, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []
    triton.knobs.runtime.jit_post_compile_hook = lambda *, repr, **_: seen.append(repr)
    log = KernelCompileLog()
    log.install()
    log.install()  # NOTE: idempotent: the chain does not grow
    assert log.counting
    with log.startup():
        fire_compile_hook()
    assert log.count == 1 and log.compiles[0].kernel == "paged_attention_kernel" and len(seen) == 1
    with caplog.at_level(logging.WARNING, logger="blockspec.engine.compiles"):
        fire_compile_hook("_rmsnorm_kernel")
    assert log.count == 2 and len(seen) == 2
    assert "compiled after start-up" in caplog.text and "_rmsnorm_kernel" in caplog.text
    assert [event.during_startup for event in log.compiles] == [True, False]


def test_another_engines_startup_compiles_are_not_stalls() -> None:
    """Two engines in one process: the second one's start-up compiles its own variants; the first engine, already
    serving, counts only compiles outside every start-up."""
    log = KernelCompileLog()
    with log.startup():
        log.record("first_engine_kernel", "a")
    first_engine_mark = log.count
    with log.startup():
        log.record("second_engine_kernel", "b")
    assert log.stalls_since(first_engine_mark) == [] and log.count - first_engine_mark == 1
    log.record("serving_kernel", "c")
    assert [event.kernel for event in log.stalls_since(first_engine_mark)] == ["serving_kernel"]


def test_compile_log_stops_counting_when_its_hook_is_replaced(restore_hook: None) -> None:
    log = KernelCompileLog()
    log.install()
    assert log.counting
    triton.knobs.runtime.jit_post_compile_hook = lambda **_: None  # NOTE: another component overwrites it
    assert not log.counting
    log.install()  # NOTE: once per process: it does not fight the other component
    assert not log.counting


def tiny_backend(heads: int = 8, kv_heads: int = 2, head_dim: int = 16, layers: int = 2,
                 windows: list[int | None] | None = None) -> TritonAttentionBackend:
    pool = KVPool(64, layers, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    return TritonAttentionBackend(pool, head_dim ** -0.5, heads, kv_heads, head_dim, sliding_windows=windows)


def test_policies_fill_whole_row_blocks() -> None:
    policies = [getattr(triton_backend, name) for name in dir(triton_backend) if name.endswith("_POLICY")]
    assert len(policies) >= 5
    assert all(p.tiles.block_m % ROW_BLOCK == 0 for p in policies)
    # NOTE: query_lengths relies on the policy being constant between multiples of ROW_BLOCK rows
    for rows, batch_size, block in itertools.product(range(1, 400), (1, 3, 40), (False, True)):
        block_end = -(-rows // ROW_BLOCK) * ROW_BLOCK
        assert launch_policy(rows, batch_size, 8, block) == launch_policy(block_end, batch_size, 8, block)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 3, 8])
def test_each_policy_holds_one_interval_of_rows(kv_heads: int, block: bool) -> None:
    """reachable_launches stops scanning a batch size once the longest query's policy is reached and saturated."""
    for batch_size in (1, 2, 3, 5, 8, 13, 33, 64, 200):
        seen: list[Any] = []
        for rows in range(1, 20000, 3):
            policy = launch_policy(rows, batch_size, kv_heads, block)
            if not seen or seen[-1] != policy:
                assert policy not in seen, f"policy returns at rows {rows}, batch size {batch_size}"
                seen.append(policy)


@pytest.mark.parametrize("heads,kv_heads,mode,min_q,max_q,max_bs,seq_step", [
    (8, 2, ForwardMode.EXTEND, 1, 90, 12, 7), (32, 8, ForwardMode.EXTEND, 1, 70, 12, 7),
    (8, 8, ForwardMode.EXTEND, 1, 80, 12, 7), (32, 8, ForwardMode.EXTEND, 1, 700, 3, 61),
    (32, 8, ForwardMode.DECODE, 1, 1, 12, 7), (32, 8, ForwardMode.VERIFY, 10, 10, 40, 7),
    (9, 3, ForwardMode.DRAFT, 16, 16, 12, 7), (9, 3, ForwardMode.VERIFY, 17, 65, 4, 61),
])
def test_reachable_launches_match_brute_force(heads: int, kv_heads: int, mode: ForwardMode, min_q: int, max_q: int,
                                              max_bs: int, seq_step: int) -> None:
    backend = tiny_backend(heads, kv_heads)
    max_seq = 9000
    workload = AttentionWorkload(backend, mode, min_q, max_q, max_bs, max_seq)
    group = heads // kv_heads
    expected = set()
    for bs, q in itertools.product(range(1, max_bs + 1), range(min_q, max_q + 1)):
        policy = launch_policy(q * group, bs, kv_heads, block_mode(mode))
        for seq in sorted({*range(q, max_seq + 1, seq_step), *(2 ** k for k in range(16) if q <= 2 ** k <= max_seq)}):
            expected.add((policy.tiles, backend.choose_splits(bs, q * group, policy, seq)))
        expected.add((policy.tiles, backend.choose_splits(bs, q * group, policy, max_seq)))
    assert reachable_launches(workload) >= expected
    assert len(reachable_launches(workload) - expected) == 0, "every enumerated launch has a batch that makes it"
    assert list(query_lengths(min_q, max_q, group))[0] == min_q


def test_warm_attention_launches_every_variant_and_layer_class() -> None:
    backend = tiny_backend(windows=[None, 8])
    table = ReqToTokenTable(2, 64, torch.device("cpu"))
    workloads = [AttentionWorkload(backend, ForwardMode.EXTEND, 1, 40, 4, 64),
                 AttentionWorkload(backend, ForwardMode.DRAFT, 4, 4, 4, 64)]
    variants = [v for w in workloads for v in workload_variants(w)]
    assert {v.layer_id for v in variants} == {0, 1}  # the windowed layer is a class of its own
    assert len({v.splits for v in variants}) > 1
    assert warm_attention(workloads, table.table, table.dummy_row) == len(variants)


def test_tree_variants_warm_up_with_the_served_mask_strides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton specialises an integer argument of 1: a tree variant warmed up with a 1 x 1 mask (strides 1) is not the
    variant a served [bs, B + 1, B + 1] mask launches, which then compiled while serving."""
    backend = tiny_backend()
    table = ReqToTokenTable(2, 64, torch.device("cpu"))
    rows = 33  # NOTE: a tree of 32 nodes and its root
    (variant, *_) = workload_variants(AttentionWorkload(backend, ForwardMode.VERIFY, rows, rows, 2, 64, tree=True))
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(backend, "forward", lambda q, k, v, layer_id, batch, **kw: seen.append(batch.tree_mask))
    launch_variant(backend, variant, table.table, table.dummy_row)
    assert variant.tree_rows == rows and "tree of 33 rows" in variant.describe()
    assert seen[0].shape == (1, rows, rows) and seen[0].stride() == (rows * rows, rows, 1)


def test_engine_warmup_leaves_the_engine_as_it_found_it(
    make_engine: Callable[..., Engine], trained_pair: dict[str, Any]
) -> None:
    root = trained_pair["root"]
    engine = make_engine(root / "target", attention_backend="triton", speculative_algorithm="DFLASH",
                         speculative_draft_model_path=str(root / "draft"), chunked_prefill_size=16,
                         max_running_requests=4, cuda_graph_bs=[1, 2])
    assert engine.startup.warmup is None  # NOTE: on CPU start-up does not warm up: nothing compiles
    modes = [w.mode for w in attention_workloads(engine.runner, engine.worker)]
    assert modes == [ForwardMode.EXTEND, ForwardMode.VERIFY, ForwardMode.DRAFT]
    reference = engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=GREEDY)["output_ids"]
    for counts in (engine.runner.graphs.counts, engine.runner.piecewise_counts):
        for key in counts:
            counts[key] = 0
    workloads = attention_workloads(engine.runner, engine.worker)
    report = warm_kernels(
        engine.runner, engine.worker, engine.new_scheduler
    )  # NOTE: the attention launches run in Triton's interpreter here
    assert report.request_passes == 1  # CPU: no graphs, so one pass as configured
    assert report.attention_variants == sum(len(workload_variants(w)) for w in workloads) > 0
    assert all(n == 0 for n in engine.forward_counts.values())
    allocator = engine.runner.allocator
    assert allocator.free_slots == allocator.total_slots
    assert engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=GREEDY)["output_ids"] == reference


def test_warmup_forgets_what_its_cycles_taught_adaptive_verify(make_engine: Callable[..., Engine],
                                                               trained_pair: dict[str, Any]) -> None:
    root = trained_pair["root"]
    flags = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"),
                 max_running_requests=4, cuda_graph_bs=[1, 2])
    # NOTE: a fixed schedule with n = 1 (no cycle timing at start-up, slow in Triton's interpreter)
    triton_engine = make_engine(root / "target", attention_backend="triton",
                                speculative_num_draft_tokens_per_bs="1-2:1,3-4:8", **flags)
    assert min(triton_engine.worker.verify_lengths) == 1
    verify = next(
        w for w in attention_workloads(triton_engine.runner, triton_engine.worker) if w.mode == ForwardMode.VERIFY
    )
    assert (verify.min_q, verify.max_q) == (1, triton_engine.worker.block_size)  # NOTE: every verify length's launches
    engine = make_engine(root / "target", speculative_adaptive_verify="on", **flags)  # NOTE: torch attention: fast
    worker = engine.worker
    warm_engine_paths(engine.runner, engine.worker, engine.new_scheduler)
    policy = worker.verify_policy
    assert not policy.last and not policy.cycles and not any(policy.times.live_cycles.values())
    assert not any(worker.acceptance.tried)
    engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=GREEDY)
    assert any(worker.acceptance.tried) and policy.last  # NOTE: served traffic is learnt again


def test_startup_report_and_compile_counter_in_server_info(make_engine: Callable[..., Engine], tiny: Any,
                                                           restore_hook: None) -> None:
    engine = make_engine(tiny("llama").path)
    info = engine.get_server_info()
    startup = info["startup"]
    assert set(startup["seconds"]) == {"weights", "kv_pool", "graphs", "piecewise_graphs", "kernels", "total"}
    assert startup["seconds"]["total"] >= startup["seconds"]["weights"] > 0
    assert info["internal_states"][0]["kernel_compiles_after_startup"] == 0
    fire_compile_hook()
    assert engine.get_server_info()["internal_states"][0]["kernel_compiles_after_startup"] == 1
    assert kernel_compile_log().counting


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from serve_text_model(tmp_path_factory.mktemp("warm_model"))


def test_compiles_after_startup_in_server_info_and_metrics(server: Any, restore_hook: None) -> None:
    url = server.base_url
    before = httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]["kernel_compiles_after_startup"]
    fire_compile_hook()
    body = {"input_ids": [1, 2, 3], "sampling_params": GREEDY}
    assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
    info = httpx.get(url + "/server_info", timeout=30).json()
    assert info["internal_states"][0]["kernel_compiles_after_startup"] == before + 1
    assert info["startup"]["seconds"]["total"] > 0
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert metric_value(metrics, "blockspec_kernel_compiles_after_startup") == before + 1


def test_serve_process_prints_startup_and_exports_it(tmp_path: Path) -> None:
    """The engine process's start-up report crosses to the server process in EngineInfo."""
    model = save_text_model(tmp_path / "model")
    with server_process(["--model-path", str(model), "--max-total-tokens", "2048"]) as (proc, url):
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert metric_value(metrics, "blockspec_startup_seconds", 'phase="total"') > 0
        assert metric_value(metrics, "blockspec_startup_seconds", 'phase="weights"') > 0
        assert (
            httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]["kernel_compiles_after_startup"]
            == 0
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert proc.stdout is not None
    output = proc.stdout.read()
    assert "blockspec: start-up " in output and "weights" in output and "Triton kernel variants" in output, output
