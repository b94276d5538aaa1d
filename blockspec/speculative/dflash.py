"""DFlashWorker: prefill with aux capture, then propose (draft) → verify (target) → commit, batched."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch

from blockspec.attention.base import graph_planner
from blockspec.attention.factory import make_backend
from blockspec.config import EngineConfig
from blockspec.kv.pool import KVPool
from blockspec.models.config import load_target_config
from blockspec.models.dflash_draft import DFlashDraftModel, load_draft_model
from blockspec.models.draft_config import DraftConfig, load_draft_config
from blockspec.request import Req
from blockspec.batch import ForwardBatch, ForwardMode, UniformRows
from blockspec.runner.cuda_graph import GraphedForward
from blockspec.runner.model_runner import ModelRunner, pick_dtype
from blockspec.runner.worker import TargetWorker
from blockspec.sampling import greedy_tokens, sampling_probs
from blockspec.speculative.acceptance import greedy_accept, rejection_accept
from blockspec.speculative.pending import PendingCycle, host_copy, launch_rows, next_cycle_rows

logger = logging.getLogger(__name__)


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
        self.draft_graph: GraphedForward | None = None
        self.cycle_graph: GraphedForward | None = None
        # NOTE: benchmarking only (--speculative-simulate-accept-len): commits unverified tokens, output is not lossless.
        self.simulate_accept_len = runner.config.speculative_simulate_accept_len

    @property
    def decode_slots_per_req(self) -> int:
        return self.block_size

    @property
    def is_speculative(self) -> bool:
        return True

    def init_cuda_graphs(self) -> None:
        self.runner.capture_piecewise(aux_consumer=self._materialise_draft_kv)
        if not self.runner.graphs_enabled:
            return
        runner = self.runner
        runner.capture_graph(ForwardMode.VERIFY, self.block_size, self.capture, self._verify_forward)
        self.draft_graph = GraphedForward(
            "draft", self._draft_logits, ForwardMode.DRAFT, self.block_size, self.runner.config.cuda_graph_bs,
            runner.req_to_token.table, runner.req_to_token.dummy_row, runner.max_positions, (), runner.graph_pool,
            host_planner=graph_planner(self.draft_attention),
        )
        # NOTE: all-greedy batches replay this one graph per cycle: propose → verify → both argmaxes. A backend that
        # plans on the host (FlashInfer) cannot plan the verify half from inside it, so it keeps the two graphs.
        if graph_planner(self.draft_attention) is None and graph_planner(runner.attention) is None:
            self.cycle_graph = GraphedForward(
                "greedy-cycle", self._greedy_cycle, ForwardMode.DRAFT, self.block_size, runner.config.cuda_graph_bs,
                runner.req_to_token.table, runner.req_to_token.dummy_row, runner.max_positions, (), runner.graph_pool,
            )
        with torch.inference_mode():
            self.draft_graph.capture()
            if self.cycle_graph is not None:
                self.cycle_graph.capture()

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
    def extend(self, reqs: Sequence[Req], chunk_lens: Sequence[int]) -> torch.Tensor:
        batch = self.build_extend_batch(reqs, chunk_lens, self.capture)
        output = self.run_extend(batch, reqs)
        if not output.aux_consumed:  # NOTE: piecewise graphs write the draft KV inside their last segment
            assert output.aux_hidden is not None
            self._materialise_draft_kv(output.aux_hidden, batch.positions, batch.out_cache_loc)
        return output.logits

    def _draft_rows(self, reqs: Sequence[Req]) -> UniformRows:
        """[bonus, mask x (B-1)] per request at positions kv_len .. kv_len+B-1."""
        b = self.block_size
        masks = [self.draft_config.mask_token_id] * (b - 1)
        return UniformRows.build(
            ForwardMode.DRAFT,
            [[req.all_ids[-1], *masks] for req in reqs],
            [req.pool_row for req in reqs],  # type: ignore[misc]
            [req.kv_len + b for req in reqs],
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
        accepted = (draft_argmax[:, 1:] == target_argmax[:, :-1]).to(torch.int64).cumprod(1).sum(1, keepdim=True)
        if self.simulate_accept_len is not None:
            accepted = torch.full_like(accepted, self.simulated_accepted())
        return (torch.cat([accepted, draft_argmax, target_argmax], dim=1),)

    def can_overlap(self, reqs: Sequence[Req]) -> bool:
        """Greedy batches on the one-graph cycle path (or all-eager) can run a cycle ahead of the host's commit."""
        return (self.cycle_graph is not None or self.draft_graph is None) and all(r.params.is_greedy for r in reqs)

    def _cycle_on_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The greedy cycle's [bs, 1 + 2B] tokens for device rows (UniformRows layout), in a tensor of its own."""
        if self.cycle_graph is not None and self.cycle_graph.can_run_device_rows(rows.shape[0]):
            self.runner.forward_counts["graph"] += 1
            (tokens,) = self.cycle_graph.replay_device_rows(rows)
            assert tokens is not None
            return tokens.clone()  # NOTE: the next replay of any graph overwrites its outputs
        self.runner.forward_counts["eager"] += 1
        (tokens,) = self._greedy_cycle(self.runner.device_rows_batch(ForwardMode.DRAFT, rows))
        return tokens

    @torch.inference_mode()
    def launch_cycle(self, reqs: Sequence[Req], carry: Optional[PendingCycle] = None) -> PendingCycle:
        """Launches a greedy cycle without waiting for it. Requests of `carry` (launched, not yet committed) take
        their input rows from its device outputs; the others from the host. The cycle's requests are ordered
        carried first. The scheduler has given each request slots up to kv_len + B (+ B more when carried)."""
        device = self.runner.device
        reqs_in_order, rows = launch_rows(
            reqs, carry, lambda cycle, index: next_cycle_rows(cycle, index, self.block_size),
            lambda fresh: self._draft_rows(fresh).rows.to(device, non_blocking=True), device,
        )
        tokens = self._cycle_on_rows(rows)
        host_tokens, ready = host_copy(tokens)
        return PendingCycle(reqs_in_order, rows, tokens, host_tokens, ready)

    def finish_cycle(self, cycle: PendingCycle) -> list[Optional[list[int]]]:
        """Waits for `cycle` and returns each request's committed tokens (None for one that finished since the
        launch: its cycle is discarded), advancing kv_len past them."""
        b = self.block_size

        def accepted_and_bonus(row: list[int]) -> list[int]:
            # NOTE: block tokens 0..accepted now have valid target KV (and draft KV, written in _verify_forward).
            accepted = row[0]
            return row[2:2 + accepted] + [row[b + 1 + accepted]]

        return cycle.commit(accepted_and_bonus)

    def greedy_cycle_tokens(self, reqs: Sequence[Req]) -> list[list[int]]:
        """Per request [accepted, d_0..d_{B-1}, t_0..t_{B-1}] (see _greedy_cycle) on the host, nothing committed."""
        return self.launch_cycle(reqs).wait()

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req]) -> tuple[ForwardBatch, torch.Tensor, dict[int, torch.Tensor]]:
        """Runs the draft over [bonus, mask x (B-1)] per request.

        Returns the draft batch, proposals d_1..d_{B-1} on the device [bs, B-1], and for sampled requests the
        draft distributions the proposals were drawn from ({request index: [B-1, V]})."""
        b = self.block_size
        batch = self._draft_rows(reqs).to_batch(self.runner.req_to_token.table, self.runner.max_positions)
        if self.draft_graph is not None and self.draft_graph.can_run(batch):
            all_logits, all_argmax = self.draft_graph.replay(batch)
        else:
            all_logits, all_argmax = self._draft_logits(batch)
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
        graph = self.runner.graphs.get(ForwardMode.VERIFY)
        if graph is not None and graph.can_run(batch):
            self.runner.forward_counts["graph"] += 1
            logits, _ = graph.replay(batch)
        else:
            self.runner.forward_counts["eager"] += 1
            logits, _ = self._verify_forward(batch)
        assert logits is not None
        return logits.view(bs, b, -1)

    @torch.inference_mode()
    def decode(self, reqs: Sequence[Req]) -> list[list[int]]:
        """One spec cycle; the scheduler has given each request slots for positions kv_len .. kv_len+B-1."""
        if self.can_overlap(reqs):  # NOTE: without a carry the cycle keeps the order of reqs (none is finished)
            return [tokens or [] for tokens in self.finish_cycle(self.launch_cycle(reqs))]
        b = self.block_size
        draft_batch, proposals_device, draft_probs = self.propose(reqs)
        logits = self.verify(draft_batch, proposals_device)
        # NOTE: greedy requests need only this device→host copy per cycle (sampled ones also sync in acceptance).
        host = torch.cat([proposals_device, greedy_tokens(logits)], dim=1).tolist()
        committed: list[list[int]] = []
        for i, req in enumerate(reqs):
            proposals, target_argmax = host[i][: b - 1], host[i][b - 1:]
            if self.simulate_accept_len is not None:
                accepted = self.simulated_accepted()
                bonus = target_argmax[accepted]
            elif i not in draft_probs:
                accepted, bonus = greedy_accept(proposals, target_argmax)
            else:
                accepted, bonus = rejection_accept(proposals, draft_probs[i], logits[i], req.params, req.generator)
            # NOTE: block tokens 0..accepted now have valid target KV (and draft KV, written in _verify_forward).
            req.kv_len += accepted + 1
            committed.append(proposals[:accepted] + [bonus])
        return committed

    def simulated_accepted(self) -> int:
        """Proposals counted as accepted under --speculative-simulate-accept-len (benchmarking only)."""
        assert self.simulate_accept_len is not None
        return max(0, min(self.block_size - 1, round(self.simulate_accept_len) - 1))


def build_dflash_worker(config: EngineConfig) -> tuple[ModelRunner, DFlashWorker]:
    assert config.speculative_draft_model_path is not None
    target_config = load_target_config(config.model_path)
    draft_config = load_draft_config(config.speculative_draft_model_path, target_config)
    block_size = config.speculative_num_draft_tokens or draft_config.block_size
    device = config.resolved_device
    dtype = pick_dtype(config, device)
    draft_bytes = KVPool.bytes_per_slot(draft_config.num_layers, draft_config.num_kv_heads, draft_config.head_dim, dtype)
    runner = ModelRunner(
        config, extra_kv_bytes_per_slot=draft_bytes, extra_positions=2 * block_size,  # NOTE: overlap reserves 2 blocks ahead
        hidden_capture_layer_ids=tuple(draft_config.target_layer_ids),
    )
    draft = load_draft_model(
        config.speculative_draft_model_path, draft_config, runner.dtype, runner.device, runner.max_positions,
        dummy=config.load_format == "dummy",
    )
    draft_pool = KVPool(
        runner.kv_pool.num_slots, draft_config.num_layers, draft_config.num_kv_heads, draft_config.head_dim,
        runner.dtype, runner.device,
    )
    logger.info("DFlash draft: %d layers, block %d, taps %s", draft_config.num_layers, block_size, draft_config.target_layer_ids)
    return runner, DFlashWorker(runner, draft, draft_pool, block_size)
