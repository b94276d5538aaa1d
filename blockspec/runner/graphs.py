"""CudaGraphs: the one owner of every full CUDA graph of an engine, and the one place that picks graph or eager.

Graphs are registered by (kind, tokens per request): one GraphedForward each, holding one graph per captured batch
size (DFlash captures its cycle and verify kinds once per verify length in use, speculative/verify_length.py). Every
uniform forward of the engine goes through `run(kind, inputs, eager)`: a replay when graphs are on and the graph of
the kind at the inputs' tokens per request accepts them, else `eager` on the batch built from them; both are
counted. `enabled` is the public switch (benchmarks time eager steps with `graphs.enabled = False`); turning it off
keeps the captured graphs. Rank 0 of a tensor-parallel group sends each run to the other ranks first
(runner/mirror.py).
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from blockspec.attention.base import AttentionBackend, GraphPlanner, graph_planner
from blockspec.batch import ForwardBatch, ForwardMode, GraphInputs
from blockspec.kv.allocator import ReqToTokenTable
from blockspec.runner.cuda_graph import GraphOutputs, GraphedForward
from blockspec.runner.graph_kind import GraphKind, tokens_per_request
from blockspec.runner.mirror import ForwardMirror

EagerForward = Callable[[ForwardBatch], GraphOutputs]


class CudaGraphs:
    def __init__(
        self, available: bool, batch_sizes: list[int], table: ReqToTokenTable, max_positions: int, device: torch.device,
        forward_mirror: Optional[ForwardMirror] = None,
    ) -> None:
        """`available`: whether this engine captures full graphs at all (CUDA, a graph-capable backend, not
        disabled by flags); when False `capture` is a no-op and every forward runs eagerly. `forward_mirror`: rank 0
        of a tensor-parallel group sends each run to the other ranks through it (once it is started)."""
        self.available = available
        self.enabled = available
        self.batch_sizes = batch_sizes
        self.table = table
        self.max_positions = max_positions
        self.pool = torch.cuda.graph_pool_handle() if available and device.type == "cuda" else None
        self.by_kind: dict[tuple[GraphKind, int], GraphedForward] = {}
        self.counts = {"graph": 0, "eager": 0}
        self.capture_seconds = 0.0  # every kind's capture together (start-up report)
        self.forward_mirror = forward_mirror

    def capture(
        self,
        kind: GraphKind,
        fn: EagerForward,
        mode: ForwardMode,
        tokens_per_req: int,
        attention: Sequence[AttentionBackend],
        capture_layer_ids: tuple[int, ...] = (),
    ) -> None:
        """Captures `fn` for uniform batches of `mode` with `tokens_per_req` rows each, at every configured batch size.

        `attention`: every attention backend `fn` runs. NOTE: required, because a backend that plans on the host
        (FlashInfer) must plan outside the graph, before capture and before every replay; a capture that did not
        know of it would plan inside the graph (a host→device copy there invalidates the capture)."""
        if not self.available:
            return
        host_planner = single_host_planner(kind, attention)
        graph = GraphedForward(
            kind.value, fn, mode, tokens_per_req, self.batch_sizes, self.table.table, self.table.dummy_row,
            self.max_positions, capture_layer_ids, self.pool, host_planner=host_planner,
        )
        started = time.perf_counter()
        with torch.inference_mode():
            graph.capture()
        self.capture_seconds += time.perf_counter() - started
        self.by_kind[(kind, tokens_per_req)] = graph

    def captured(self, kind: GraphKind, tokens_per_req: Optional[int] = None) -> bool:
        """Whether `kind` has graphs (at `tokens_per_req`, or at any when None)."""
        return any(k == kind and tokens_per_req in (None, q) for k, q in self.by_kind)

    def __bool__(self) -> bool:
        return bool(self.by_kind) and self.enabled

    def runs_from_device_rows(self, kind: GraphKind) -> bool:
        """Whether `kind` runs from device rows without the host waiting on the device: its graph plans on the device,
        or every forward is eager (off, or nothing captured). False when graphs run but `kind` has no device-planned
        graph (the overlap schedule would run it eagerly instead of through the host-planned graphs)."""
        if not self:
            return True
        graphs = [graph for (k, _), graph in self.by_kind.items() if k == kind]
        return bool(graphs) and all(graph.host_planner is None for graph in graphs)

    def run(self, kind: GraphKind, inputs: GraphInputs, eager: EagerForward) -> GraphOutputs:
        """A replay of `kind`'s graph if it is on and accepts `inputs`, else `eager` on the built batch.

        NOTE: replay outputs live in the shared graph pool: valid until the next replay of any graph."""
        if self.forward_mirror is not None:
            self.forward_mirror.uniform(kind, inputs)
        graph = self.by_kind.get((kind, tokens_per_request(inputs))) if self.enabled else None
        if graph is not None and graph.accepts(inputs):
            self.counts["graph"] += 1
            return graph.replay_inputs(inputs)
        self.counts["eager"] += 1
        return eager(self.eager_batch(inputs))

    def eager_batch(self, inputs: GraphInputs) -> ForwardBatch:
        if isinstance(inputs, ForwardBatch):
            return inputs
        return inputs.to_batch(self.table.table, self.max_positions)


def single_host_planner(kind: GraphKind, attention: Sequence[AttentionBackend]) -> Optional[GraphPlanner]:
    """The one host planner among the backends a graph runs (None when every backend plans on the device).

    NOTE: a replay plans one static batch outside the graph, so a graph can hold at most one host-planned backend
    (the greedy-cycle graph, which runs the draft and the target, is captured only when neither plans on the host)."""
    planners = [planner for planner in map(graph_planner, attention) if planner is not None]
    if len(planners) > 1:
        raise ValueError(f"the {kind.value} graph runs {len(planners)} attention backends that plan on the host; "
                         "one graph can replan only one of them")
    return planners[0] if planners else None
