"""TargetWorker: turns scheduled requests into forward batches for the target alone (no speculation)."""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from blockspec.models.llama import ModelOutput
from blockspec.request import Req
from blockspec.batch import ForwardBatch, ForwardMode, UniformRows, build_batch
from blockspec.runner.model_runner import ModelRunner
from blockspec.sampling import greedy_tokens, sample_next_tokens
from blockspec.speculative.pending import PendingCycle, host_copy, launch_rows, next_decode_rows


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

    def _decode_rows(self, reqs: Sequence[Req]) -> UniformRows:
        """[last token | req→token row | kv_len + 1] per request: one new token at position kv_len."""
        return UniformRows.build(
            ForwardMode.DECODE,
            [[req.all_ids[-1]] for req in reqs],
            [req.pool_row for req in reqs],  # type: ignore[misc]
            [req.kv_len + 1 for req in reqs],
            self.runner.device,
        )

    def can_overlap(self, reqs: Sequence[Req]) -> bool:
        """Greedy batches whose decode runs from device rows can run a step ahead of the host's commit."""
        return self.runner.can_replay_device_rows(ForwardMode.DECODE) and all(r.params.is_greedy for r in reqs)

    @torch.inference_mode()
    def launch_cycle(self, reqs: Sequence[Req], carry: Optional[PendingCycle] = None) -> PendingCycle:
        """Launches a greedy decode step without waiting for it (speculative/pending.py): requests of `carry` take their
        token and length from its device outputs. The scheduler has given each request slots up to kv_len + 2."""
        device = self.runner.device
        ordered, rows = launch_rows(
            reqs, carry, next_decode_rows, lambda fresh: self._decode_rows(fresh).rows.to(device, non_blocking=True),
            device,
        )
        tokens = greedy_tokens(self.runner.forward_device_rows(ForwardMode.DECODE, rows).logits).view(-1, 1)
        host_tokens, ready = host_copy(tokens)
        return PendingCycle(ordered, rows, tokens, host_tokens, ready)

    def finish_cycle(self, cycle: PendingCycle) -> list[Optional[list[int]]]:
        """Waits for `cycle`; each request's token (None for one that finished since the launch), kv_len advanced."""
        return cycle.commit(lambda row: row)  # NOTE: a decode row is [argmax]

    def decode(self, reqs: Sequence[Req]) -> list[list[int]]:
        """One token per request; the scheduler has given each request a slot at position kv_len."""
        logits = self.runner.forward_uniform(self._decode_rows(reqs)).logits
        for req in reqs:
            req.kv_len += 1
        return [[token] for token in sample_next_tokens(logits, reqs)]
