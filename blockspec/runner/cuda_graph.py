"""Full CUDA graphs for uniform batches (decode: 1 token/request; verify and draft: B tokens/request).

One graph per captured batch size, largest first, all in one memory pool. A real batch is padded up to the
next captured size: padded requests use the dummy req→token row, whose slots are the dummy page.

The static input is one int64 buffer of UniformRows layout ([q token ids | req→token row | seq_len] per request);
positions, KV slots and the rest of the batch are derived from it inside the graph, so a replay from host rows is
one host→device copy plus the graph launch.

A backend that plans on the host (FlashInfer) passes `host_planner`: it runs outside the graph on the padded
static batch, before capture and before every replay, and writes the fixed buffers the captured kernels read.

NOTE: all graphs share one memory pool, so a graph's outputs are valid only until another graph is replayed; callers
copy or consume them first. Host planning for replay N+1 reuses the planner's buffers, so the caller must have
synchronised with replay N (every worker step ends with a device→host read of its tokens).
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Any, Callable, Optional

import torch

from blockspec.attention.base import GraphPlanner
from blockspec.batch import ForwardBatch, ForwardMode, GraphInputs, UniformRows, uniform_batch
from blockspec.runner.gc_pause import garbage_collection_paused

logger = logging.getLogger(__name__)

GraphOutputs = tuple[Optional[torch.Tensor], ...]


class GraphedForward:
    """Captures `fn(batch) -> tuple of tensors` per batch size; each output's first dim is the token count or the
    request count (bs x rows per request, fixed per output), so replays slice it to the real batch."""

    def __init__(
        self,
        name: str,
        fn: Callable[[ForwardBatch], GraphOutputs],
        mode: ForwardMode,
        tokens_per_req: int,
        batch_sizes: list[int],
        req_to_token: torch.Tensor,
        dummy_row: int,
        max_seq_len: int,
        capture_layer_ids: tuple[int, ...] = (),
        pool: Optional[tuple[int, int]] = None,
        host_planner: Optional[GraphPlanner] = None,
    ) -> None:
        self.name = name
        self.fn = fn
        self.mode = mode
        self.q = tokens_per_req
        self.batch_sizes = sorted(set(batch_sizes))
        self.req_to_token = req_to_token
        self.max_seq_len = max_seq_len
        self.capture_layer_ids = capture_layer_ids
        self.host_planner = host_planner
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        device = req_to_token.device
        max_bs = self.batch_sizes[-1]
        # NOTE: padding rows (dummy req→token row, seq_len q) read and write only the dummy page.
        self.padding_rows = torch.zeros((max_bs, tokens_per_req + 2), dtype=torch.int64, device=device)
        self.padding_rows[:, tokens_per_req] = dummy_row
        self.padding_rows[:, tokens_per_req + 1] = tokens_per_req
        self.rows = self.padding_rows.clone()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, GraphOutputs] = {}
        self.metas: dict[int, Any] = {}  # host planner's capture-time metadata per batch size
        self.rows_per_req: tuple[int, ...] = ()  # per output: q (token-level) or 1 (request-level)

    def _static_batch(self, bs: int, seq_lens_cpu: Optional[list[int]] = None, meta: Any = None) -> ForwardBatch:
        batch = uniform_batch(
            self.mode, self.rows[:bs], self.req_to_token, seq_lens_cpu if seq_lens_cpu is not None else [self.q] * bs,
            self.capture_layer_ids, self.max_seq_len,
        )
        batch.attn_meta = meta
        return batch

    def _host_plan(self, bs: int, seq_lens_cpu: Optional[list[int]] = None) -> Any:
        """The host planner's metadata for the static batch (None without one). NOTE: runs outside the graph."""
        if self.host_planner is None:
            return None
        return self.host_planner(self._static_batch(bs, seq_lens_cpu))

    def _run_into_shared(self, bs: int, shared: Optional[GraphOutputs], meta: Any) -> GraphOutputs:
        """fn on the static batch of size bs; smaller graphs copy their outputs into slices of the largest's."""
        outputs = self.fn(self._static_batch(bs, meta=meta))
        if shared is None:
            return outputs
        sliced = tuple(None if t is None else t[:bs * per_req] for t, per_req in zip(shared, self.rows_per_req))
        for target, out in zip(sliced, outputs):
            if target is not None and out is not None:
                target.copy_(out)
        return sliced

    def capture(self) -> None:
        with garbage_collection_paused():
            self._capture()

    def _capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        shared: Optional[GraphOutputs] = None
        for bs in reversed(self.batch_sizes):
            meta = self.metas[bs] = self._host_plan(bs)
            for _ in range(2):  # NOTE: warm-up compiles Triton kernels and settles allocator state off-graph
                warm = self.fn(self._static_batch(bs, meta=meta))
            if not self.rows_per_req:
                self.rows_per_req = tuple(0 if out is None else out.shape[0] // bs for out in warm)
            for out, per_req in zip(warm, self.rows_per_req):
                assert out is None or (per_req in (1, self.q) and out.shape[0] == bs * per_req), (
                    f"{self.name} graph output of shape {tuple(out.shape)}: first dim must be tokens or requests"
                )
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self._run_into_shared(bs, shared, meta)
            shared = shared if shared is not None else outputs
            self.graphs[bs] = graph
            self.outputs[bs] = outputs
        torch.cuda.synchronize()
        logger.info(
            "captured %s graphs for bs %s in %.1f s (%.0f MiB)", self.name, self.batch_sizes,
            time.perf_counter() - start, (torch.cuda.memory_allocated() - before) / 2**20,
        )

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.mode is self.mode
            and batch.uniform_q_len == self.q
            and batch.batch_size <= self.batch_sizes[-1]
            and tuple(batch.capture_layer_ids) == self.capture_layer_ids
        )

    def can_run_rows(self, rows: UniformRows) -> bool:
        return (
            rows.mode is self.mode
            and rows.q == self.q
            and rows.batch_size <= self.batch_sizes[-1]
            and tuple(rows.capture_layer_ids) == self.capture_layer_ids
        )

    def _padded(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def _launch(self, bs: int, padded: int, seq_lens_cpu: Optional[list[int]]) -> GraphOutputs:
        if padded > bs:
            self.rows[bs:padded].copy_(self.padding_rows[bs:padded])
        if self.host_planner is not None:
            assert seq_lens_cpu is not None
            self._host_plan(padded, list(seq_lens_cpu) + [self.q] * (padded - bs))
        self.graphs[padded].replay()
        outputs = self.outputs[padded]
        return tuple(None if out is None else out[:bs * per_req] for out, per_req in zip(outputs, self.rows_per_req))

    def replay(self, batch: ForwardBatch) -> GraphOutputs:
        """Replays for a device batch. NOTE: a uniform batch's positions are seq_len-q .. seq_len-1 and its slots
        come from the req→token table (build_batch / uniform_batch), so rows carry all of it."""
        bs, q = batch.batch_size, self.q
        self.rows[:bs, :q].copy_(batch.input_ids.view(bs, q))
        self.rows[:bs, q].copy_(batch.req_rows)
        self.rows[:bs, q + 1].copy_(batch.seq_lens)
        return self._launch(bs, self._padded(bs), batch.seq_lens_cpu)

    def replay_rows(self, rows: UniformRows) -> GraphOutputs:
        """Replays for host rows: one (async, pinned) host→device copy, then the graph."""
        bs = rows.batch_size
        self.rows[:bs].copy_(rows.rows, non_blocking=True)
        seq_lens_cpu = rows.rows[:, -1].tolist() if self.host_planner is not None else None
        return self._launch(bs, self._padded(bs), seq_lens_cpu)

    def can_run_device_rows(self, batch_size: int) -> bool:
        """Device rows carry no host seq_lens, so host-planned graphs cannot take them."""
        return self.host_planner is None and batch_size <= self.batch_sizes[-1]

    def replay_device_rows(self, rows: torch.Tensor) -> GraphOutputs:
        """Replays for rows already on the device (e.g. computed from the previous cycle's outputs): no host data, so
        the host does not wait for the device. Not for host-planned backends (they plan from host seq_lens)."""
        assert self.host_planner is None, f"{self.name}: a host-planned graph needs host rows"
        bs = rows.shape[0]
        self.rows[:bs].copy_(rows)
        return self._launch(bs, self._padded(bs), None)

    def accepts(self, inputs: GraphInputs) -> bool:
        """Whether a replay can run `inputs` (a built batch, host rows or device rows)."""
        if isinstance(inputs, ForwardBatch):
            return self.can_run(inputs)
        if isinstance(inputs, UniformRows):
            return self.can_run_rows(inputs)
        return (
            inputs.mode is self.mode and inputs.q == self.q
            and tuple(inputs.capture_layer_ids) == self.capture_layer_ids
            and self.can_run_device_rows(inputs.batch_size)
        )

    def replay_inputs(self, inputs: GraphInputs) -> GraphOutputs:
        if isinstance(inputs, ForwardBatch):
            return self.replay(inputs)
        if isinstance(inputs, UniformRows):
            return self.replay_rows(inputs)
        return self.replay_device_rows(inputs.rows)
