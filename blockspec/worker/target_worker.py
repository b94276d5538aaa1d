"""TargetWorker: runs a step's forwards for the target alone (no speculation) and samples their tokens."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import ContextManager, Optional, Sequence

import torch

from blockspec.attention.base import AttentionBackend, graph_planner
from blockspec.batch import DeviceRows, ForwardBatch, ForwardMode, UniformRows, build_batch
from blockspec.host_tensors import int64_tensor, to_device
from blockspec.layers.argmax import greedy_tokens
from blockspec.models.llama import ModelOutput
from blockspec.request import Req
from blockspec.runner.graph_kind import GraphKind
from blockspec.runner.graphs import EagerForward
from blockspec.runner.model_runner import ModelRunner
from blockspec.sample.sampling import append_logprobs, sample_next_tokens
from blockspec.worker.inflight import FirstTokens, InFlightStep, device_index, host_copy, launch_rows
from blockspec.worker.protocol import SpeculativeState, TreeShape


class TargetWorker:
    """The decode step commits one token per request; KV for it is one slot per request."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.capture: tuple[int, ...] = ()  # target layers whose outputs extend forwards return (DFlash: its taps)
        self.draft_attention: Optional[AttentionBackend] = None  # NOTE: no draft (DFlashWorker sets its own)

    @property
    def decode_slots_per_req(self) -> int:
        return 1

    @property
    def is_speculative(self) -> bool:
        return False

    @property
    def tree_shape(self) -> Optional[TreeShape]:
        return None  # NOTE: no draft tree

    @property
    def uniform_lengths(self) -> tuple[int, ...]:
        return (self.decode_slots_per_req,)

    def pinned_verify_length(self, num_draft_tokens: int) -> ContextManager[None]:
        return contextlib.nullcontext()  # NOTE: nothing to verify

    def forget_live_state(self) -> None:
        pass  # NOTE: target-only decoding learns nothing from traffic

    def speculative_state(self) -> Optional[SpeculativeState]:
        return None

    def init_cuda_graphs(self) -> None:
        graphs, attention = self.runner.graphs, self.runner.attention
        graphs.capture(GraphKind.DECODE, self.runner.eager_forward, ForwardMode.DECODE, 1, [attention])
        # NOTE: the overlap schedule's greedy step replays one graph: forward, argmax and the next step's rows, so the
        # host launches no argmax or row kernels between steps (a small target's decode is bound by that host work). A
        # backend that plans on the host (FlashInfer) runs no step ahead, so it has no use for this graph.
        if graph_planner(attention) is None:
            graphs.capture(GraphKind.GREEDY_DECODE, self.greedy_decode, ForwardMode.DECODE, 1, [attention])
        self.runner.capture_piecewise()

    def uniform_forward_fn(self, kind: GraphKind, tokens_per_req: int) -> EagerForward:
        """The function `graphs.run` is given for `kind` (tensor-parallel ranks mirror rank 0's forwards with it)."""
        if kind is GraphKind.DECODE:
            return self.runner.eager_forward
        if kind is GraphKind.GREEDY_DECODE:
            return self.greedy_decode
        raise ValueError(f"a target-only worker runs no {kind.value} forward")

    def greedy_decode(self, batch: ForwardBatch) -> tuple[torch.Tensor]:
        """A greedy decode step as one forward: the target's argmax (its head's, `argmax_only`: no float logits, and
        a vocab-parallel head gathers none) → the next step's input rows [argmax | req→token row | seq_len + 1]
        (UniformRows layout), whose column 0 is this step's token."""
        tokens = self.runner.model(dataclasses.replace(batch, argmax_only=True), self.runner.attention).logits
        return (decode_rows_after(tokens, batch.req_rows, batch.seq_lens),)

    # ---- extend ------------------------------------------------------------------------------
    @staticmethod
    def chunk_token_ids(reqs: Sequence[Req], chunk_lens: Sequence[int]) -> list[list[int]]:
        """The next `chunk_lens[i]` tokens of each request that have no KV yet."""
        return [req.all_ids[req.kv_len:req.kv_len + n] for req, n in zip(reqs, chunk_lens)]

    def build_extend_batch(self, reqs: Sequence[Req], chunk_lens: Sequence[int]) -> ForwardBatch:
        logits_rows = [end - 1 for end in itertools.accumulate(chunk_lens)]
        return build_batch(
            ForwardMode.EXTEND,
            self.chunk_token_ids(reqs, chunk_lens),
            [req.kv_len for req in reqs],
            [req.pool_row for req in reqs],  # type: ignore[misc]
            self.runner.req_to_token.table,
            logits_rows,
            self.capture,
        )

    def extend_forward(self, batch: ForwardBatch) -> ModelOutput:
        """The target forward of an extend batch (piecewise graphs or eager)."""
        return self.runner.forward_extend(batch)

    def run_extend(self, batch: ForwardBatch, reqs: Sequence[Req]) -> ModelOutput:
        output = self.extend_forward(batch)
        for req, n in zip(reqs, batch.extend_lens_cpu):
            req.kv_len += n
        return output

    def extend_logits(self, reqs: Sequence[Req], chunk_lens: Sequence[int]) -> torch.Tensor:
        """Computes KV for the next `chunk_lens[i]` pending tokens of each request; last-token logits [bs, V]."""
        return self.run_extend(self.build_extend_batch(reqs, chunk_lens), reqs).logits

    def extend(self, reqs: Sequence[Req], chunk_lens: Sequence[int]) -> list[Optional[int]]:
        """Runs the chunks; per request its first output token once its whole prompt is cached, else None."""
        return self.first_tokens(reqs, self.extend_logits(reqs, chunk_lens))

    def first_tokens(self, reqs: Sequence[Req], logits: torch.Tensor) -> list[Optional[int]]:
        """From last-token logits [bs, V] after an extend: the sampled token of each request whose prompt is now
        fully cached, None for one still mid-prompt."""
        ready = [i for i, req in enumerate(reqs) if req.pending_len == 0]
        first: list[Optional[int]] = [None] * len(reqs)
        if ready:
            for i, token in zip(ready, sample_next_tokens(logits[ready], [reqs[i] for i in ready])):
                first[i] = token
                if reqs[i].wants_logprobs and not reqs[i].finished:  # NOTE: finished: its sampling failed
                    append_logprobs(reqs[i], logits[i:i + 1], [token])
        return first

    def mixed(
        self, reqs: Sequence[Req], chunk_lens: Sequence[int], decode_reqs: Sequence[Req]
    ) -> tuple[list[Optional[int]], list[list[int]]]:
        """One extend forward over prefill chunks and the decode requests' last tokens (a chunk of one token each).
        Returns the chunks' first tokens (see `extend`) and each decode request's token."""
        first = self.extend([*reqs, *decode_reqs], [*chunk_lens, *[1] * len(decode_reqs)])
        decoded = first[len(reqs):]
        assert all(token is not None for token in decoded)
        return first[:len(reqs)], [[token] for token in decoded if token is not None]

    @torch.inference_mode()
    def launch_mixed(
        self, reqs: Sequence[Req], chunk_lens: Sequence[int], decode_reqs: Sequence[Req], carry: Optional[InFlightStep]
    ) -> tuple[InFlightStep, Optional[FirstTokens]]:
        """`mixed` launched behind `carry` without waiting: a decode request that `carry` runs takes its input token
        from carry's device output, one position past its kv_len (which lags carry's uncommitted token); the others
        their last token from the host. The prefill requests' kv_len advances now (as `extend`); a decode request's
        when its token is committed (InFlightStep.commit), so one that `carry` finishes keeps its length. The
        executor has given each decode request slots through that position."""
        carried_at = {id(req): i for i, req in enumerate(carry.reqs)} if carry is not None else {}
        lags = [int(id(req) in carried_at) for req in decode_reqs]
        # NOTE: a carried request's host token is a placeholder, overwritten below from carry's output
        token_ids = self.chunk_token_ids(reqs, chunk_lens) + [[req.all_ids[-1]] for req in decode_reqs]
        lengths = [*chunk_lens, *[1] * len(decode_reqs)]
        positions = [req.kv_len for req in reqs] + [req.kv_len + lag for req, lag in zip(decode_reqs, lags)]
        pool_rows = [req.pool_row for req in (*reqs, *decode_reqs)]
        batch = build_batch(ForwardMode.EXTEND, token_ids, positions, pool_rows,  # type: ignore[arg-type]
                            self.runner.req_to_token.table, [end - 1 for end in itertools.accumulate(lengths)],
                            self.capture)
        device = self.runner.device
        carried = [j for j, lag in enumerate(lags) if lag]
        if carried:
            assert carry is not None
            prefill_tokens = sum(chunk_lens)  # NOTE: a decode request's one token follows every prefill chunk
            index = device_index([carried_at[id(decode_reqs[j])] for j in carried], len(carry.reqs), device)
            sources = carry.tokens[:, 0] if index is None else carry.tokens[index, 0]
            at = to_device(int64_tensor([prefill_tokens + j for j in carried]), device)
            batch.input_ids[at] = sources.to(batch.input_ids.dtype)
        logits = self.extend_forward(batch).logits
        for req, n in zip(reqs, chunk_lens):
            req.kv_len += n
        tokens = greedy_tokens(logits)
        decoded = tokens[len(reqs):].view(-1, 1)
        # NOTE: UniformRows' layout [input token (unused after launch) | req→token row | seq_len], so the next decode
        # step derives its rows from this one (next_decode_rows) as from a decode step
        rows = UniformRows.build(ForwardMode.DECODE, [[0] for _ in decode_reqs], [req.pool_row for req in decode_reqs],
                                 [pos + 1 for pos in positions[len(reqs):]], device).rows  # type: ignore[misc]
        host_tokens, ready = host_copy(decoded)
        step = InFlightStep(list(decode_reqs), rows.to(device, non_blocking=True), decoded, host_tokens, ready)
        ready_at = [i for i, req in enumerate(reqs) if req.pending_len == 0]
        first = None
        if ready_at:
            index = device_index(ready_at, len(reqs), device)
            first = FirstTokens([reqs[i] for i in ready_at], tokens[: len(reqs)] if index is None else tokens[index])
        return step, first

    # ---- decode ------------------------------------------------------------------------------
    def _decode_rows(self, reqs: Sequence[Req]) -> UniformRows:
        """[last token | req→token row | kv_len + 1] per request: one new token at position kv_len."""
        return UniformRows.build(
            ForwardMode.DECODE,
            [[req.all_ids[-1]] for req in reqs],
            [req.pool_row for req in reqs],  # type: ignore[misc]
            [req.kv_len + 1 for req in reqs],
            self.runner.device,
        )

    def can_run_ahead(self, reqs: Sequence[Req]) -> bool:
        """Greedy batches whose decode runs from device rows can run a step ahead of the host's commit."""
        return self.runner.graphs.runs_from_device_rows(GraphKind.GREEDY_DECODE) and not any(
            r.samples_on_host for r in reqs
        )

    @torch.inference_mode()
    def launch(self, reqs: Sequence[Req], carry: Optional[InFlightStep] = None,
               first: Optional[FirstTokens] = None) -> InFlightStep:
        """Launches a greedy decode step without waiting for it: requests of `carry` take their token and length
        from its device outputs, those of `first` their token from its tensor. The executor has given each request
        slots up to kv_len + 2."""
        device = self.runner.device
        ordered, rows = launch_rows(
            reqs, carry, next_decode_rows,
            lambda fresh: self._decode_rows(fresh).rows.to(device, non_blocking=True), device, first,
        )
        (next_rows,) = self.runner.graphs.run(
            GraphKind.GREEDY_DECODE, DeviceRows(ForwardMode.DECODE, rows), self.greedy_decode
        )
        assert next_rows is not None
        next_rows = next_rows.clone()  # NOTE: the next replay of any graph (piecewise ones too) overwrites its outputs
        host_rows, ready = host_copy(next_rows)
        return InFlightStep(ordered, rows, next_rows[:, :1], host_rows[:, :1], ready, next_rows=next_rows)

    def finish(self, step: InFlightStep) -> list[Optional[list[int]]]:
        """Waits for `step`; each request's token (None for one that finished since the launch), kv_len advanced."""
        return step.commit(lambda row: row)  # NOTE: a decode row is [argmax]

    def decode(self, reqs: Sequence[Req]) -> list[list[int]]:
        """One token per request; the executor has given each request a slot at position kv_len."""
        logits = self.runner.forward_uniform(GraphKind.DECODE, self._decode_rows(reqs)).logits
        tokens = sample_next_tokens(logits, reqs)
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            req.kv_len += 1
            if req.wants_logprobs and not req.finished:  # NOTE: finished: its sampling failed (sampling_faults.py)
                append_logprobs(req, logits[i:i + 1], [token])
        return [[token] for token in tokens]


def next_decode_rows(step: InFlightStep, index: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows [token | req→token row | seq_len] with outputs [argmax] → the next step's
    [argmax | row | seq_len + 1] (as the step's forward computed them, when it did)."""
    if step.next_rows is not None:
        return step.next_rows if index is None else step.next_rows[index]
    rows, tokens = step.rows, step.tokens
    if index is not None:
        rows, tokens = rows[index], tokens[index]
    return decode_rows_after(tokens[:, 0], rows[:, 1], rows[:, 2])


def decode_rows_after(tokens: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The next decode step's input rows [token | req→token row | seq_len + 1] (UniformRows layout) of a decode step
    that produced `tokens` ([n]) for requests at `req_rows` ([n]) whose KV length after it is `seq_lens` ([n])."""
    return torch.stack([tokens, req_rows, seq_lens + 1], dim=1)
