"""DFlashWorker: prefill with aux capture, then propose (draft) → verify (target) → commit, batched."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence

import torch

from blockspec.attention.base import graph_planner
from blockspec.attention.factory import make_backend
from blockspec.kv.pool import KVPool
from blockspec.models.dflash_draft import DFlashDraftModel
from blockspec.models.llama import ModelOutput
from blockspec.models.draft_config import DraftConfig
from blockspec.penalties import penalized
from blockspec.request import Req
from blockspec.batch import DeviceRows, ForwardBatch, ForwardMode, UniformRows, build_batch
from blockspec.runner.model_runner import ModelRunner
from blockspec.runner.graphs import GraphKind
from blockspec.sampling import append_logprobs, greedy_tokens, sampling_probs
from blockspec.speculative.acceptance import forced_accept_count, greedy_accept_counts, rejection_accept
from blockspec.step.inflight import InFlightStep, host_copy, launch_rows
from blockspec.step.target_worker import TargetWorker

class DFlashWorker(TargetWorker):
    """Each decode step is one spec cycle: a draft forward and a target verify forward over B tokens/request."""

    def __init__(self, runner: ModelRunner, draft: DFlashDraftModel, draft_pool: KVPool, block_size: int) -> None:
        super().__init__(runner)
        self.draft = draft
        self.draft_config: DraftConfig = draft.config
        self.draft_pool = draft_pool
        self.block_size = block_size
        self.capture = tuple(self.draft_config.target_layer_ids)
        if runner.hidden_capture_layer_ids != self.capture:
            # NOTE: prefill graphs captured without the aux hidden states would starve the draft KV cache.
            raise ValueError(
                f"DFlash needs FULL hidden capture at layers {list(self.capture)} in prefill, but the model runner "
                f"was built with {list(runner.hidden_capture_layer_ids) or 'NONE'}"
            )
        dc = self.draft_config
        self.draft_attention = make_backend(
            runner.attention_backend, draft_pool, dc.num_heads, dc.num_kv_heads, dc.head_dim,
            dc.layer_windows, dc.layer_causal,
        )
        self.forced_accepted = forced_accept_count(runner.config.speculative_simulate_accept_len, block_size)

    @property
    def decode_slots_per_req(self) -> int:
        return self.block_size

    @property
    def is_speculative(self) -> bool:
        return True

    def init_cuda_graphs(self) -> None:
        self.runner.capture_piecewise(aux_consumer=self._materialise_draft_kv)
        graphs, b = self.runner.graphs, self.block_size
        target_planner, draft_planner = graph_planner(self.runner.attention), graph_planner(self.draft_attention)
        graphs.capture(GraphKind.VERIFY, self._verify_forward, ForwardMode.VERIFY, b, self.capture, target_planner)
        graphs.capture(GraphKind.DRAFT, self._draft_logits, ForwardMode.DRAFT, b, (), draft_planner)
        # NOTE: all-greedy batches replay this one graph per cycle: propose → verify → both argmaxes. A backend that
        # plans on the host (FlashInfer) cannot plan the verify half from inside it, so it keeps the two graphs.
        if draft_planner is None and target_planner is None:
            graphs.capture(GraphKind.GREEDY_CYCLE, self._greedy_cycle, ForwardMode.DRAFT, b)

    def _verify_forward(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, ...]:
        """Target forward over the blocks, then draft K/V for every block row.

        NOTE: rows past the accepted prefix get draft K/V too; their slots are either freed or rewritten (by the
        next propose and materialise) before any draft attention reads them, so only committed rows matter."""
        output = self.runner.model(batch, self.runner.attention)
        assert output.aux_hidden is not None
        self.draft.materialise_context(output.aux_hidden, batch.positions, batch.out_cache_loc, self.draft_pool)
        return output.logits, output.aux_hidden

    def _draft_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        embeds = self.runner.model.embed(batch.input_ids) * self.draft_config.input_embedding_scale
        return self.draft(batch, self.draft_attention, embeds)

    def _draft_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """Draft logits for every block row [T, V] (row 0 of each block is unused) and their argmax."""
        logits = self.draft.logits(self._draft_hidden(batch), self.runner.model.lm_head)
        return logits, greedy_tokens(logits)

    def _materialise_draft_kv(self, aux_hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.draft.materialise_context(aux_hidden, positions, slots, self.draft_pool)

    @torch.inference_mode()
    def extend_forward(self, batch: ForwardBatch) -> ModelOutput:
        """The target's extend forward, then the draft KV of every token from its aux hidden states."""
        output = self.runner.forward_extend(batch)
        if not output.aux_consumed:  # NOTE: piecewise graphs write the draft KV inside their last segment
            assert output.aux_hidden is not None
            self._materialise_draft_kv(output.aux_hidden, batch.positions, batch.out_cache_loc)
        return output

    def _draft_block(self, req: Req) -> list[int]:
        """The draft's input block [bonus, mask x (B-1)] at positions kv_len .. kv_len+B-1."""
        return [req.all_ids[-1], *[self.draft_config.mask_token_id] * (self.block_size - 1)]

    def _draft_rows(self, reqs: Sequence[Req]) -> UniformRows:
        return UniformRows.build(
            ForwardMode.DRAFT,
            [self._draft_block(req) for req in reqs],
            [req.pool_row for req in reqs],  # type: ignore[misc]
            [req.kv_len + self.block_size for req in reqs],
            self.runner.device,
        )

    def _verify_batch(
        self, draft_batch: ForwardBatch, proposals: torch.Tensor, float_logits: bool = True
    ) -> ForwardBatch:
        """The draft batch with block ids [bonus, d_1..d_{B-1}]: same slots, positions and attention extent."""
        bs, b = proposals.shape[0], self.block_size
        block_ids = torch.cat([draft_batch.input_ids.view(bs, b)[:, :1], proposals], dim=1).reshape(-1)
        return dataclasses.replace(
            draft_batch, mode=ForwardMode.VERIFY, input_ids=block_ids, capture_layer_ids=self.capture, attn_meta=None,
            float_logits=float_logits,
        )

    def _greedy_cycle(self, draft_batch: ForwardBatch) -> tuple[torch.Tensor]:
        """A whole greedy cycle on the device: draft argmax proposals, verify forward, target argmax, acceptance.

        Returns [bs, 1 + 2B] int64 rows [accepted | draft argmax per block row | target argmax after each block
        token]: draft columns 1..B-1 are the proposals d_1..d_{B-1}; `accepted` counts the leading proposals equal
        to the target's choice before them (greedy_accept), so the committed tokens are target[:accepted + 1]."""
        bs, b = draft_batch.batch_size, self.block_size
        draft_argmax = self.draft.argmax(self._draft_hidden(draft_batch), self.runner.model.lm_head).view(bs, b)
        logits, _ = self._verify_forward(self._verify_batch(draft_batch, draft_argmax[:, 1:], float_logits=False))
        assert logits is not None
        target_argmax = greedy_tokens(logits).view(bs, b)
        accepted = greedy_accept_counts(draft_argmax[:, 1:], target_argmax, self.forced_accepted)
        return (torch.cat([accepted, draft_argmax, target_argmax], dim=1),)

    def can_run_ahead(self, reqs: Sequence[Req]) -> bool:
        """Greedy batches on the one-graph cycle path (or all-eager) can run a cycle ahead of the host's commit."""
        return self.runner.graphs.runs_from_device_rows(GraphKind.GREEDY_CYCLE) and all(
            r.params.is_greedy and not (r.wants_logprobs or r.params.has_penalties) for r in reqs
        )

    @torch.inference_mode()
    def launch(self, reqs: Sequence[Req], carry: Optional[InFlightStep] = None) -> InFlightStep:
        """Launches a greedy cycle without waiting for it. Requests of `carry` (launched, not yet committed) take
        their input rows from its device outputs; the others from the host. The cycle's requests are ordered
        carried first. The scheduler has given each request slots up to kv_len + B (+ B more when carried)."""
        device = self.runner.device
        reqs_in_order, rows = launch_rows(
            reqs, carry, lambda cycle, index: next_cycle_rows(cycle, index, self.block_size),
            lambda fresh: self._draft_rows(fresh).rows.to(device, non_blocking=True), device,
        )
        (tokens,) = self.runner.graphs.run(GraphKind.GREEDY_CYCLE, DeviceRows(ForwardMode.DRAFT, rows), self._greedy_cycle)
        assert tokens is not None
        tokens = tokens.clone()  # NOTE: the next replay of any graph overwrites its outputs
        host_tokens, ready = host_copy(tokens)
        return InFlightStep(reqs_in_order, rows, tokens, host_tokens, ready)

    def finish(self, cycle: InFlightStep) -> list[Optional[list[int]]]:
        """Waits for `cycle` and returns each request's committed tokens (None for one that finished since the
        launch: its cycle is discarded), advancing kv_len past them."""
        b = self.block_size

        def accepted_and_bonus(row: list[int]) -> list[int]:
            # NOTE: block tokens 0..accepted now have valid target KV (and draft KV, written in _verify_forward).
            accepted = row[0]
            return row[2:2 + accepted] + [row[b + 1 + accepted]]

        return cycle.commit(accepted_and_bonus)

    def greedy_cycle_tokens(self, reqs: Sequence[Req]) -> list[list[int]]:
        """Public benchmark and test API: one greedy cycle for `reqs` (slots to kv_len + B given), nothing committed.

        Per request [accepted, d_0..d_{B-1}, t_0..t_{B-1}] (see _greedy_cycle) on the host; through the graph registry
        like a served cycle (a graph replay, or eager when `runner.graphs.enabled` is False). benchmarks/step_latency.py
        times it as the cycle without the scheduler; tests compare it graph vs eager and against the committed path."""
        return self.launch(reqs).wait()

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req]) -> tuple[ForwardBatch, torch.Tensor, dict[int, torch.Tensor]]:
        """Runs the draft over [bonus, mask x (B-1)] per request.

        Returns the draft batch, proposals d_1..d_{B-1} on the device [bs, B-1], and for sampled requests the
        draft distributions the proposals were drawn from ({request index: [B-1, V]})."""
        b = self.block_size
        batch = self._draft_rows(reqs).to_batch(self.runner.req_to_token.table, self.runner.max_positions)
        all_logits, all_argmax = self.runner.graphs.run(GraphKind.DRAFT, batch, self._draft_logits)
        assert all_logits is not None and all_argmax is not None
        proposals = all_argmax.view(len(reqs), b)[:, 1:].clone()
        draft_probs: dict[int, torch.Tensor] = {}
        for i, req in enumerate(reqs):
            if not req.params.is_greedy:
                probs = sampling_probs(all_logits.view(len(reqs), b, -1)[i, 1:], req.params)
                proposals[i] = torch.multinomial(probs, 1, generator=req.generator).squeeze(-1)
                draft_probs[i] = probs
        return batch, proposals, draft_probs

    @torch.inference_mode()
    def verify(self, draft_batch: ForwardBatch, proposals: torch.Tensor) -> torch.Tensor:
        """Target logits [bs, B, V] over [bonus, d_1..d_{B-1}]; the draft batch's slots and positions are reused."""
        bs, b = proposals.shape[0], self.block_size
        batch = self._verify_batch(draft_batch, proposals)
        logits, _ = self.runner.graphs.run(GraphKind.VERIFY, batch, self._verify_forward)
        assert logits is not None
        return logits.view(bs, b, -1)

    @torch.inference_mode()
    def decode(self, reqs: Sequence[Req]) -> list[list[int]]:
        """One spec cycle; the scheduler has given each request slots for positions kv_len .. kv_len+B-1."""
        if self.can_run_ahead(reqs):  # NOTE: without a carry the cycle keeps the order of reqs (none is finished)
            return [tokens or [] for tokens in self.finish(self.launch(reqs))]
        draft_batch, proposals, draft_probs = self.propose(reqs)
        return self._accept(reqs, proposals, draft_probs, self.verify(draft_batch, proposals))

    def _accept(
        self, reqs: Sequence[Req], proposals_device: torch.Tensor, draft_probs: dict[int, torch.Tensor],
        logits: torch.Tensor,
    ) -> list[list[int]]:
        """Each request's committed tokens from its block's target logits [bs, B, V], kv_len advanced past them."""
        b = self.block_size
        target_argmax = greedy_tokens(logits)
        accepted_counts = greedy_accept_counts(proposals_device, target_argmax, self.forced_accepted)
        # NOTE: greedy requests need only this device→host copy per cycle (sampled ones also sync in acceptance).
        host = torch.cat([accepted_counts, proposals_device, target_argmax], dim=1).tolist()
        committed: list[list[int]] = []
        for i, req in enumerate(reqs):
            accepted, proposals, target = host[i][0], host[i][1:b], host[i][b:]
            bonus = target[accepted]
            if self.forced_accepted is None and (i in draft_probs or req.params.has_penalties):
                accepted, bonus = self._accept_one(req, proposals, draft_probs.get(i), logits[i])
            # NOTE: block tokens 0..accepted now have valid target KV (and draft KV, written in _verify_forward).
            req.kv_len += accepted + 1
            committed.append(proposals[:accepted] + [bonus])
            if req.wants_logprobs:  # NOTE: block row j is the target's distribution of committed token j
                append_logprobs(req, logits[i, :accepted + 1], committed[-1])
        return committed

    def _accept_one(
        self, req: Req, proposals: list[int], draft_probs: Optional[torch.Tensor], logits: torch.Tensor
    ) -> tuple[int, int]:
        """(accepted, bonus) for a sampled or penalised request, from its block's target logits [B, V] (penalised per
        row with the proposals before it counted, see penalties.py)."""
        if req.params.has_penalties:
            logits = penalized(logits, req, proposals)
        if draft_probs is not None:
            return rejection_accept(proposals, draft_probs, logits, req.params, req.generator)
        target = logits.argmax(-1)
        accepted = int(greedy_accept_counts(torch.tensor([proposals], device=target.device), target[None], None))
        return accepted, int(target[accepted])

    @torch.inference_mode()
    def mixed(
        self, reqs: Sequence[Req], chunk_lens: Sequence[int], decode_reqs: Sequence[Req]
    ) -> tuple[list[Optional[int]], list[list[int]]]:
        """One target forward over prefill chunks and verify blocks (an extend batch: a block is B causal tokens on top
        of the request's KV), after the draft proposed the blocks; the draft KV of every token is written from the
        same forward. Returns the chunks' first tokens (see `extend`) and the decode requests' committed tokens.
        The executor has given decode requests slots for kv_len .. kv_len+B-1."""
        b, num_chunks = self.block_size, len(reqs)
        _, proposals, draft_probs = self.propose(decode_reqs)
        token_ids = self.chunk_token_ids(reqs, chunk_lens) + [self._draft_block(req) for req in decode_reqs]
        everyone = [*reqs, *decode_reqs]
        chunk_ends = list(itertools.accumulate(chunk_lens))
        offset = chunk_ends[-1] if chunk_ends else 0
        block_rows = [offset + i * b + j for i in range(len(decode_reqs)) for j in range(b)]
        batch = build_batch(
            ForwardMode.EXTEND, token_ids, [req.kv_len for req in everyone],
            [req.pool_row for req in everyone],  # type: ignore[misc]
            self.runner.req_to_token.table, [end - 1 for end in chunk_ends] + block_rows, self.capture,
        )
        proposal_rows = torch.tensor([r for r in block_rows if (r - offset) % b], device=batch.input_ids.device)
        batch.input_ids[proposal_rows] = proposals.reshape(-1)  # NOTE: the mask placeholders become d_1..d_{B-1}
        output = self.extend_forward(batch)
        for req, n in zip(reqs, chunk_lens):
            req.kv_len += n
        first = self.first_tokens(reqs, output.logits[:num_chunks])
        block_logits = output.logits[num_chunks:].view(len(decode_reqs), b, -1)
        return first, self._accept(decode_reqs, proposals, draft_probs, block_logits)


def next_cycle_rows(cycle: InFlightStep, index: Optional[torch.Tensor], block_size: int) -> torch.Tensor:
    """Input rows of the next cycle for `cycle.reqs[index]` (all of them when index is None), from device outputs
    alone: the bonus token target[accepted], the same mask tokens and req→token row, seq_len + accepted + 1.

    NOTE: valid only for requests that did not finish in `cycle` (a finished request's next cycle is discarded)."""
    rows, tokens = cycle.rows, cycle.tokens
    if index is not None:
        rows, tokens = rows[index], tokens[index]
    accepted = tokens[:, :1]
    bonus = tokens.gather(1, accepted + 1 + block_size)
    return torch.cat([bonus, rows[:, 1:block_size + 1], rows[:, block_size + 1:] + accepted + 1], dim=1)
