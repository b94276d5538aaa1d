"""TargetWorker: turns scheduled requests into forward batches for the target alone (no speculation)."""
from __future__ import annotations

import itertools
from typing import Sequence

import torch

from blockspec.models.llama import ModelOutput
from blockspec.request import Req
from blockspec.runner.forward_batch import ForwardBatch, ForwardMode, UniformRows, build_batch
from blockspec.runner.model_runner import ModelRunner
from blockspec.sampling import sample_next_tokens


class TargetWorker:
    """The decode step commits one token per request; KV for it is one slot per request."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def decode_slots_per_req(self) -> int:
        return 1

    @property
    def is_speculative(self) -> bool:
        return False

    def init_cuda_graphs(self) -> None:
        if self.runner.graphs_enabled:
            self.runner.capture_graph(ForwardMode.DECODE, 1)
        self.runner.capture_piecewise()

    def build_extend_batch(self, reqs: Sequence[Req], chunk_lens: Sequence[int], capture: tuple[int, ...] = ()) -> ForwardBatch:
        token_ids = [req.all_ids[req.kv_len:req.kv_len + n] for req, n in zip(reqs, chunk_lens)]
        logits_rows = [end - 1 for end in itertools.accumulate(chunk_lens)]
        return build_batch(
            ForwardMode.EXTEND,
            token_ids,
            [req.kv_len for req in reqs],
            [req.pool_row for req in reqs],  # type: ignore[misc]
            self.runner.req_to_token.table,
            logits_rows,
            capture,
        )

    def run_extend(self, batch: ForwardBatch, reqs: Sequence[Req]) -> ModelOutput:
        output = self.runner.forward(batch)
        for req, n in zip(reqs, batch.extend_lens_cpu):
            req.kv_len += n
        return output

    def extend(self, reqs: Sequence[Req], chunk_lens: Sequence[int]) -> torch.Tensor:
        """Computes KV for the next `chunk_lens[i]` pending tokens of each request.

        Returns last-token logits per request [bs, V]; rows of requests still mid-prompt are unused."""
        batch = self.build_extend_batch(reqs, chunk_lens)
        return self.run_extend(batch, reqs).logits

    def decode(self, reqs: Sequence[Req]) -> list[list[int]]:
        """One token per request; the scheduler has given each request a slot at position kv_len."""
        rows = UniformRows.build(
            ForwardMode.DECODE,
            [[req.all_ids[-1]] for req in reqs],
            [req.pool_row for req in reqs],  # type: ignore[misc]
            [req.kv_len + 1 for req in reqs],
            self.runner.device,
        )
        logits = self.runner.forward_uniform(rows).logits
        for req in reqs:
            req.kv_len += 1
        return [[token] for token in sample_next_tokens(logits, reqs)]
