"""A CPU emulation of CUDA graph capture and replay, for testing what a captured forward computes on replay.

`replayed_graph_capture(monkeypatch)` patches torch.cuda's graph calls for one test: a capture runs GraphedForward's
captured body (`_run_into_shared`, the forward on the static batch) once and records the call; a replay runs that
same call again and copies its outputs into the captured output tensors. As with a real graph:
- what the body computed on the host stays as it was at capture: the static batch is built with the capture-time
  host values (seq_lens_cpu = [q] x bs, max_seq_len_hint, the capture's planner metadata, whose buffers a host
  planner rewrites before each replay), while device inputs (the static rows, the req→token table, the KV pools)
  are read afresh;
- outputs live in one pool: every replay first overwrites the outputs of every captured graph (NaN, or -1 for
  integers) before writing its own, so an output read after another graph's replay reads garbage, as it may on a
  GPU, where the next replay of any graph reuses that memory.

NOTE: unlike a real graph, Python state the body reads besides the batch (an attribute changed since capture) is
read afresh. `enable_emulated_graphs` turns an engine built on the CPU into one whose uniform forwards replay
through the emulation (its graphs captured as on CUDA); run the engine with `attention_backend="triton"` (Triton's
CPU interpreter): the torch backend plans from the host's seq_lens, so no graph of it can be right.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from blockspec import Engine
from blockspec.runner.cuda_graph import GraphOutputs, GraphedForward


class ReplayedGraph:
    """One captured graph: the recorded body and the outputs it wrote at capture."""

    def __init__(self, pool: "EmulatedPool") -> None:
        self.pool = pool
        self.name = ""  # the GraphedForward's name (its GraphKind's value)
        self.body: Optional[Callable[[], GraphOutputs]] = None
        self.outputs: GraphOutputs = ()

    def replay(self) -> None:
        assert self.body is not None, "replay of a graph that captured nothing"
        self.pool.overwrite_outputs()
        with torch.inference_mode():
            fresh = self.body()
            for captured, out in zip(self.outputs, fresh):
                if captured is not None and out is not None and captured.data_ptr() != out.data_ptr():
                    captured.copy_(out)
        self.pool.replays[self.name] += 1


class EmulatedPool:
    """Every graph captured in a test (on CUDA an engine's graphs share one memory pool)."""

    def __init__(self) -> None:
        self.graphs: list[ReplayedGraph] = []
        self.capturing: Optional[ReplayedGraph] = None
        self.replays: Counter[str] = Counter()  # replays per graph name

    def overwrite_outputs(self) -> None:
        with torch.inference_mode():
            for graph in self.graphs:
                for out in graph.outputs:
                    if out is not None:
                        out.fill_(float("nan") if out.is_floating_point() else -1)


def replayed_graph_capture(monkeypatch: pytest.MonkeyPatch) -> EmulatedPool:
    """Patches torch.cuda's graph, pool, synchronize and memory calls, and records GraphedForward's captured body,
    for this test; returns the pool of every graph captured (and its replays per graph name)."""
    pool = EmulatedPool()
    run_into_shared = GraphedForward._run_into_shared

    def recorded(graphed: GraphedForward, bs: int, shared: Optional[GraphOutputs], meta: Any) -> GraphOutputs:
        outputs = run_into_shared(graphed, bs, shared, meta)
        graph = pool.capturing
        if graph is not None:
            graph.name = graphed.name
            graph.body = lambda: run_into_shared(graphed, bs, shared, meta)
            graph.outputs = outputs
        return outputs

    @contextlib.contextmanager
    def capture(graph: ReplayedGraph, *args: Any, **kwargs: Any) -> Iterator[None]:
        pool.capturing = graph
        try:
            yield
        finally:
            pool.capturing = None
            pool.graphs.append(graph)

    monkeypatch.setattr(GraphedForward, "_run_into_shared", recorded)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pool)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: ReplayedGraph(pool))
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    return pool


def enable_emulated_graphs(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> EmulatedPool:
    """Captures `engine`'s graphs (a CPU engine: none so far) under the emulation, as start-up does on CUDA, and turns
    them on; its uniform forwards then replay them."""
    pool = replayed_graph_capture(monkeypatch)
    graphs = engine.runner.graphs
    monkeypatch.setattr(graphs, "available", True)
    monkeypatch.setattr(graphs, "enabled", True)
    engine.worker.init_cuda_graphs()
    assert graphs.by_kind, "no graph captured"
    return pool
