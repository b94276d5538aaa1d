"""Full CUDA graphs for uniform batches (decode: 1 token/request; verify and draft: B tokens/request).

One graph per captured batch size, largest first, all in one memory pool. A real batch is padded up to the
next captured size: padded requests use the dummy req→token row, whose slots are the dummy page.

A backend that plans on the host (FlashInfer) passes `host_planner`: it runs outside the graph on the padded
static batch, before capture and before every replay, and writes the fixed buffers the captured kernels read.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Optional

import torch

from blockspec.attention.base import GraphPlanner
from blockspec.runner.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

GraphOutputs = tuple[Optional[torch.Tensor], ...]


class GraphedForward:
    """Captures `fn(batch) -> tuple of tensors whose first dim is the token count` per batch size."""

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
        self.host_planner = host_planner
        self.fn = fn
        self.mode = mode
        self.q = tokens_per_req
        self.batch_sizes = sorted(set(batch_sizes))
        self.req_to_token = req_to_token
        self.dummy_row = dummy_row
        self.max_seq_len = max_seq_len
        self.capture_layer_ids = capture_layer_ids
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        device = req_to_token.device
        n = self.batch_sizes[-1] * tokens_per_req
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_rows = torch.full((self.batch_sizes[-1],), dummy_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((self.batch_sizes[-1],), tokens_per_req, dtype=torch.int64, device=device)
        self.logits_rows = torch.arange(n, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, GraphOutputs] = {}

    def _static_batch(self, bs: int, seq_lens_cpu: Optional[list[int]] = None) -> ForwardBatch:
        n = bs * self.q
        batch = ForwardBatch(
            mode=self.mode,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            out_cache_loc=self.out_cache_loc[:n],
            req_rows=self.req_rows[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu if seq_lens_cpu is not None else [self.q] * bs,
            extend_lens_cpu=[self.q] * bs,
            logits_rows=self.logits_rows[:n],
            req_to_token=self.req_to_token,
            capture_layer_ids=self.capture_layer_ids,
            uniform_q_len=self.q,
            max_seq_len_hint=self.max_seq_len,
        )
        if self.host_planner is not None:
            batch.attn_meta = self.host_planner(batch)  # NOTE: host-side plan, outside the graph
        return batch

    def _run_into_shared(self, batch: ForwardBatch, shared: Optional[GraphOutputs]) -> GraphOutputs:
        """fn on a static batch; smaller graphs copy their outputs into slices of the largest's."""
        bs = batch.batch_size
        outputs = self.fn(batch)
        if shared is None:
            return outputs
        n = bs * self.q
        for target, out in zip(shared, outputs):
            if target is not None and out is not None:
                target[:n].copy_(out)
        return tuple(None if target is None else target[:n] for target in shared)

    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        shared: Optional[GraphOutputs] = None
        for bs in reversed(self.batch_sizes):
            batch = self._static_batch(bs)
            for _ in range(2):  # NOTE: warm-up compiles Triton kernels and settles allocator state off-graph
                self.fn(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self._run_into_shared(batch, shared)
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
            and batch.input_embeds is None
            and tuple(batch.capture_layer_ids) == self.capture_layer_ids
        )

    def replay(self, batch: ForwardBatch) -> GraphOutputs:
        bs = batch.batch_size
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        n, n_padded = bs * self.q, padded * self.q
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_cache_loc[:n].copy_(batch.out_cache_loc)
        self.req_rows[:bs].copy_(batch.req_rows)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        if padded > bs:
            self.input_ids[n:n_padded].zero_()
            self.positions[n:n_padded].zero_()
            self.out_cache_loc[n:n_padded].zero_()
            self.req_rows[bs:padded].fill_(self.dummy_row)
            self.seq_lens[bs:padded].fill_(self.q)
        if self.host_planner is not None:
            self._static_batch(padded, list(batch.seq_lens_cpu) + [self.q] * (padded - bs))
        self.graphs[padded].replay()
        return tuple(None if out is None else out[:n] for out in self.outputs[padded])
