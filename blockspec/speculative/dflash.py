"""DFlashWorker: prefill with aux capture, then propose (draft) → verify (target) → commit, batched; each cycle
verifies the verify length its policy picks for the batch size (dflash_base.py, verify_length.py)."""
from __future__ import annotations

import itertools
import time
from typing import Optional, Sequence

import torch

from blockspec.batch import DeviceRows, ForwardBatch, ForwardMode, build_batch, uniform_batch
from blockspec.host_tensors import int64_tensor, to_device
from blockspec.layers.argmax import greedy_tokens
from blockspec.request import Req
from blockspec.runner.graph_kind import GraphKind
from blockspec.sample.acceptance import greedy_accept_counts, rejection_accept
from blockspec.sample.penalties import penalized
from blockspec.sample.sampling import append_logprobs, sampling_probs
from blockspec.speculative.dflash_base import DFlashBase
from blockspec.worker.inflight import FirstTokens, InFlightStep, host_copy, launch_rows


class DFlashWorker(DFlashBase):
    """Each decode step is one spec cycle: a draft forward and a target verify forward over n ≤ B tokens/request."""

    def can_run_ahead(self, reqs: Sequence[Req]) -> bool:
        """Greedy batches on the one-graph cycle path (or all-eager) can run a cycle ahead of the host's commit."""
        return self.runner.graphs.runs_from_device_rows(GraphKind.GREEDY_CYCLE) and not any(
            r.samples_on_host for r in reqs
        )

    @torch.inference_mode()
    def launch(self, reqs: Sequence[Req], carry: Optional[InFlightStep] = None,
               first: Optional[FirstTokens] = None) -> InFlightStep:
        """Launches a greedy cycle without waiting for it, at the verify length chosen for this batch size. Requests
        of `carry` (launched, not yet committed) take their input rows from its device outputs; the others from the
        host, those of `first` with their bonus token from its tensor. The cycle's requests are ordered carried
        first. The scheduler has given each request slots up to kv_len + B (+ B more when carried)."""
        device, n = self.runner.device, self.choose_verify_length(len(reqs))
        mask = self.draft_config.mask_token_id
        reqs_in_order, rows = launch_rows(
            reqs, carry, lambda cycle, index: next_cycle_rows(cycle, index, n, mask),
            lambda fresh: self.block_rows(fresh, n).rows.to(device, non_blocking=True), device, first,
        )
        started = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if started is not None:
            started.record()
        began = time.perf_counter()
        (tokens,) = self.runner.graphs.run(GraphKind.GREEDY_CYCLE, DeviceRows(ForwardMode.DRAFT, rows), self.cycle_fn(n))
        assert tokens is not None
        tokens = tokens.clone()  # NOTE: the next replay of any graph overwrites its outputs
        host_tokens, ready = host_copy(tokens, timed=True)
        eager_ms = None if started is not None else (time.perf_counter() - began) * 1e3
        return InFlightStep(reqs_in_order, rows, tokens, host_tokens, ready, started, eager_ms)

    def finish(self, cycle: InFlightStep) -> list[Optional[list[int]]]:
        """Waits for `cycle` and returns each request's committed tokens (None for one that finished since the
        launch: its cycle is discarded), advancing kv_len past them."""
        n = cycle.tokens.shape[1] // 2
        rows = cycle.wait()
        self.observe_cycle(n, [row[0] for row in rows], len(rows), cycle.elapsed_ms())

        def accepted_and_bonus(row: list[int]) -> list[int]:
            # NOTE: block tokens 0..accepted now have valid target KV (and draft KV, written in _verify_forward).
            accepted = row[0]
            return row[1:1 + accepted] + [row[n + accepted]]

        return cycle.commit(accepted_and_bonus)

    def greedy_cycle_tokens(self, reqs: Sequence[Req]) -> list[list[int]]:
        """Public benchmark and test API: one greedy cycle for `reqs` (slots to kv_len + B given), nothing committed.

        Per request [accepted, d_1..d_{n-1}, t_0..t_{n-1}] (see _greedy_cycle) on the host, n the verify length
        chosen for the batch; through the graph registry like a served cycle (a graph replay, or eager when
        `runner.graphs.enabled` is False). benchmarks/step_latency.py times it as the cycle without the scheduler;
        tests compare it graph vs eager and against the committed path."""
        return self.launch(reqs).wait()

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req]) -> tuple[ForwardBatch, torch.Tensor, dict[int, torch.Tensor]]:
        """Runs the draft over the full block [bonus, mask x (B-1)] per request.

        Returns the draft batch, proposals d_1..d_{B-1} on the device [bs, B-1], and for sampled requests the
        draft distributions the proposals were drawn from ({request index: [B-1, V]})."""
        b = self.block_size
        batch = self.block_rows(reqs, b).to_batch(self.runner.req_to_token.table, self.runner.max_positions)
        all_logits, all_argmax = self.runner.graphs.run(GraphKind.DRAFT, batch, self._draft_logits)
        assert all_logits is not None and all_argmax is not None
        proposals = all_argmax.view(len(reqs), b)[:, 1:].clone()
        draft_probs: dict[int, torch.Tensor] = {}
        for i, req in enumerate(reqs):
            logits = all_logits.view(len(reqs), b, -1)[i, 1:]
            if req.grammar is not None:
                tokens, probs = constrained_proposals(req, logits)
                proposals[i] = torch.tensor(tokens, device=proposals.device)
                if probs is not None:
                    draft_probs[i] = probs
            elif not req.params.is_greedy:
                probs = sampling_probs(logits, req.params)
                proposals[i] = torch.multinomial(probs, 1, generator=req.generator).squeeze(-1)
                draft_probs[i] = probs
        return batch, proposals, draft_probs

    @torch.inference_mode()
    def verify(self, reqs: Sequence[Req], proposals: torch.Tensor) -> torch.Tensor:
        """Target logits [bs, n, V] over [bonus, d_1..d_{n-1}] (proposals [bs, n-1] on the device, n ≥ 1) at
        positions kv_len .. kv_len+n-1, with the draft KV of every verified row written."""
        bs, n = len(reqs), proposals.shape[1] + 1
        host = to_device(int64_tensor(itertools.chain.from_iterable(
            (req.all_ids[-1], req.pool_row, req.kv_len + n) for req in reqs)).view(bs, 3), proposals.device)
        rows = torch.cat([host[:, :1], proposals, host[:, 1:]], dim=1)
        batch = uniform_batch(ForwardMode.VERIFY, rows, self.runner.req_to_token.table,
                              [req.kv_len + n for req in reqs], self.capture, self.runner.max_positions)
        logits, _ = self.runner.graphs.run(GraphKind.VERIFY, batch, self._verify_forward)
        assert logits is not None
        return logits.view(bs, n, -1)

    def _proposals(self, reqs: Sequence[Req], num_draft_tokens: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The first n - 1 proposals [bs, n-1] and draft distributions [n-1, V] of sampled rows (no draft when n = 1)."""
        if num_draft_tokens == 1:  # NOTE: sampled rows still go through rejection_accept: it samples the bonus
            device = self.runner.device
            nothing = {i: torch.empty((0, 0), device=device) for i, req in enumerate(reqs) if not req.params.is_greedy}
            return torch.empty((len(reqs), 0), dtype=torch.int64, device=device), nothing
        _, proposals, draft_probs = self.propose(reqs)
        k = num_draft_tokens - 1
        return proposals[:, :k], {i: probs[:k] for i, probs in draft_probs.items()}

    @torch.inference_mode()
    def decode(self, reqs: Sequence[Req]) -> list[list[int]]:
        """One spec cycle; the scheduler has given each request slots for positions kv_len .. kv_len+B-1."""
        if self.can_run_ahead(reqs):  # NOTE: without a carry the cycle keeps the order of reqs (none is finished)
            return [tokens or [] for tokens in self.finish(self.launch(reqs))]
        proposals, draft_probs = self._proposals(reqs, self.choose_verify_length(len(reqs)))
        return self._accept(reqs, proposals, draft_probs, self.verify(reqs, proposals))

    def _accept(
        self, reqs: Sequence[Req], proposals_device: torch.Tensor, draft_probs: dict[int, torch.Tensor],
        logits: torch.Tensor,
    ) -> list[list[int]]:
        """Each request's committed tokens from its block's target logits [bs, n, V], kv_len advanced past them."""
        n = logits.shape[1]
        target_argmax = greedy_tokens(logits.reshape(-1, logits.shape[-1])).view(len(reqs), n)
        accepted_counts = self.accept_counts(proposals_device, target_argmax)
        # NOTE: greedy requests need only this device→host copy per cycle (sampled ones also sync in acceptance).
        host = torch.cat([accepted_counts, proposals_device, target_argmax], dim=1).tolist()
        committed: list[list[int]] = []
        for i, req in enumerate(reqs):
            accepted, proposals, target = host[i][0], host[i][1:n], host[i][n:]
            bonus = target[accepted]
            if self.simulated is None and (i in draft_probs or req.params.has_penalties or req.grammar is not None):
                accepted, bonus = self._accept_one(req, proposals, draft_probs.get(i), logits[i])
                host[i][0] = accepted
            # NOTE: block tokens 0..accepted now have valid target KV (and draft KV, written in _verify_forward).
            req.kv_len += accepted + 1
            committed.append(proposals[:accepted] + [bonus])
            if req.wants_logprobs:  # NOTE: block row j is the target's distribution of committed token j
                append_logprobs(req, logits[i, :accepted + 1], committed[-1])
        self.observe_cycle(n, [row[0] for row in host], len(reqs), None)
        return committed

    def _accept_one(
        self, req: Req, proposals: list[int], draft_probs: Optional[torch.Tensor], logits: torch.Tensor
    ) -> tuple[int, int]:
        """(accepted, bonus) for a sampled, penalised or constrained request, from its block's target logits [n, V]
        (penalised per row with the proposals before it counted, see penalties.py; masked per row with the grammar
        advanced along them, see grammar.py)."""
        if req.params.has_penalties:
            logits = penalized(logits, req, proposals)
        if req.grammar is not None:
            logits = req.grammar.masked(logits, proposals)
        if draft_probs is not None:
            return rejection_accept(proposals, draft_probs, logits, req.params, req.generator)
        target = logits.argmax(-1)
        accepted = int(greedy_accept_counts(torch.tensor([proposals], device=target.device), target[None]))
        return accepted, int(target[accepted])

    @torch.inference_mode()
    def mixed(
        self, reqs: Sequence[Req], chunk_lens: Sequence[int], decode_reqs: Sequence[Req]
    ) -> tuple[list[Optional[int]], list[list[int]]]:
        """One target forward over prefill chunks and verify blocks (an extend batch: a block is n causal tokens on top
        of the request's KV), after the draft proposed the blocks; the draft KV of every token is written from the
        same forward. Returns the chunks' first tokens (see `extend`) and the decode requests' committed tokens.
        The executor has given decode requests slots for kv_len .. kv_len+B-1."""
        n, num_chunks = self.choose_verify_length(len(decode_reqs)), len(reqs)
        proposals, draft_probs = self._proposals(decode_reqs, n)
        token_ids = self.chunk_token_ids(reqs, chunk_lens) + [self._draft_block(req, n) for req in decode_reqs]
        everyone = [*reqs, *decode_reqs]
        chunk_ends = list(itertools.accumulate(chunk_lens))
        offset = chunk_ends[-1] if chunk_ends else 0
        block_rows = [offset + i * n + j for i in range(len(decode_reqs)) for j in range(n)]
        batch = build_batch(
            ForwardMode.EXTEND, token_ids, [req.kv_len for req in everyone],
            [req.pool_row for req in everyone],  # type: ignore[misc]
            self.runner.req_to_token.table, [end - 1 for end in chunk_ends] + block_rows, self.capture,
        )
        if n > 1:  # NOTE: the mask placeholders become d_1..d_{n-1} (rows made on the device: no host→device copy)
            rows = torch.arange(len(decode_reqs) * n, device=batch.input_ids.device).view(-1, n)[:, 1:] + offset
            batch.input_ids[rows.reshape(-1)] = proposals.reshape(-1)
        output = self.extend_forward(batch)
        for req, length in zip(reqs, chunk_lens):
            req.kv_len += length
        first = self.first_tokens(reqs, output.logits[:num_chunks])
        block_logits = output.logits[num_chunks:].view(len(decode_reqs), n, -1)
        return first, self._accept(decode_reqs, proposals, draft_probs, block_logits)


def constrained_proposals(req: Req, draft_logits: torch.Tensor) -> tuple[list[int], Optional[torch.Tensor]]:
    """A constrained request's proposals from its draft rows [B-1, V] (each masked after the proposals before it) and,
    when it samples, the masked distributions they were drawn from."""
    assert req.grammar is not None
    if req.params.is_greedy:
        tokens, _ = req.grammar.propose(draft_logits, lambda row: int(row.argmax()))
        return tokens, None
    params, generator = req.params, req.generator
    tokens, masked = req.grammar.propose(
        draft_logits, lambda row: int(torch.multinomial(sampling_probs(row, params), 1, generator=generator))
    )
    return tokens, sampling_probs(masked, params)


def next_cycle_rows(
    cycle: InFlightStep, index: Optional[torch.Tensor], num_draft_tokens: int, mask_token_id: int
) -> torch.Tensor:
    """Input rows of the next cycle (verify length `num_draft_tokens`) for `cycle.reqs[index]` (all of them when
    index is None), from device outputs alone: the bonus token target[accepted], mask tokens, the same req→token row,
    kv_len + accepted + 1 + n (the cycle's rows end in kv_len + its own verify length).

    NOTE: valid only for requests that did not finish in `cycle` (a finished request's next cycle is discarded)."""
    rows, tokens = cycle.rows, cycle.tokens
    if index is not None:
        rows, tokens = rows[index], tokens[index]
    ran = rows.shape[1] - 2
    accepted = tokens[:, :1]
    bonus = tokens.gather(1, accepted + ran)
    masks = torch.full((rows.shape[0], num_draft_tokens - 1), mask_token_id, dtype=torch.int64, device=rows.device)
    seq_lens = rows[:, ran + 1:] - ran + accepted + 1 + num_draft_tokens
    return torch.cat([bonus, masks, rows[:, ran:ran + 1], seq_lens], dim=1)
