"""DFlashWorker: prefill with aux capture, then propose (draft) → verify (target) → accept → commit, batched; each
cycle verifies the verify length its policy picks for the batch size (speculative/verify_length.py).

What every DFlash step shares: the draft (DFlash or DFlash2: the architecture stays behind the draft's proposal
interface, models/dflash_draft.py) and its KV pool, the forwards graphs capture (verify with draft-KV materialise,
the draft's proposal tensors, the whole greedy cycle per verify length), input rows, and the verify-length policy
with the acceptance statistics it reads. The steps: propose and verify (host-sampled or constrained requests), the
greedy cycle launched ahead of the host's commit (the overlap schedule), accept (greedy or rejection sampling) and
the mixed step (prefill chunks + verify blocks in one forward)."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from blockspec.attention.base import graph_planner
from blockspec.attention.factory import make_backend
from blockspec.batch import DeviceRows, ForwardBatch, ForwardMode, UniformRows, build_batch, uniform_batch
from blockspec.config.speculative_flags import parse_verify_schedule
from blockspec.host_tensors import int64_tensor, to_device
from blockspec.kv.pool import KVPool
from blockspec.layers.argmax import greedy_tokens
from blockspec.models.dflash_draft import DFlashDraftModel
from blockspec.models.draft_config import DraftConfig
from blockspec.models.llama import ModelOutput
from blockspec.request import Req
from blockspec.runner.graph_kind import GraphKind
from blockspec.runner.graphs import EagerForward
from blockspec.runner.model_runner import ModelRunner
from blockspec.sample.acceptance import greedy_accept_counts, rejection_accept
from blockspec.sample.penalties import penalized
from blockspec.sample.sampling import append_logprobs
from blockspec.sample.sampling_faults import SamplingFault, choice_faults, fail_request, raise_first
from blockspec.speculative.cycle_timing import measure_cycle_times
from blockspec.speculative.host_proposals import host_proposals
from blockspec.speculative.simulated_accept import SimulatedAcceptance
from blockspec.speculative.tree_cycle import TreeCycle
from blockspec.speculative.tree_sampling import TreeTokens, needs_tree_tokens, tree_row_tokens
from blockspec.speculative.verify_length import (
    AcceptanceStats, AdaptiveVerifyLength, CycleTimes, FixedVerifyLength, VerifyLengthPolicy, default_verify_lengths,
    full_block,
)
from blockspec.worker.inflight import FirstTokens, InFlightStep, host_copy, launch_rows
from blockspec.worker.protocol import SpeculativeState, TreeShape, VerifyLengthChoice, chain_lengths
from blockspec.worker.target_worker import TargetWorker

CycleFn = Callable[[ForwardBatch], tuple[torch.Tensor]]


class DFlashWorker(TargetWorker):
    """Each decode step is one spec cycle: a draft forward and a target verify forward over n ≤ B tokens/request.

    A cycle of verify length n runs the draft over the full block [bonus, mask x (B-1)] (skipped when n = 1), then
    the target over [bonus, d_1..d_{n-1}]; its input rows are [bonus, mask x (n-1) | req→token row | kv_len + n]."""

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
        dc, heads = self.draft_config, draft.layers[0].self_attn  # NOTE: this rank's heads under tensor parallelism
        self.draft_attention = make_backend(
            runner.attention_backend, draft_pool, heads.num_heads, heads.num_kv_heads, dc.head_dim,
            dc.layer_windows, dc.layer_causal, runner.batch_invariant_attention,
        )
        config = runner.config
        self.simulated = None
        if config.speculative_simulate_accept_len is not None or config.speculative_simulate_accept_profile is not None:
            self.simulated = SimulatedAcceptance(
                config.speculative_simulate_accept_len, config.speculative_simulate_accept_profile, block_size,
                runner.device, config.random_seed,
            )
        # NOTE: DDTree (speculative_tree_budget > 0): the tree cycle is one more verify length (b + B) for the policy
        self.tree: Optional[TreeCycle] = None
        if config.tree_budget > 0:
            simulated_tree = None
            if config.simulates_tree_acceptance:
                simulated_tree = SimulatedAcceptance(
                    config.speculative_simulate_tree_accept_len, config.speculative_simulate_tree_accept_profile,
                    block_size, runner.device, config.random_seed + 1,
                )
            self.tree = TreeCycle(runner, draft, draft_pool, self._draft_hidden, block_size, config.tree_budget,
                                  self.capture, simulated_tree)
        self.acceptance = self._new_acceptance()
        self.verify_policy: VerifyLengthPolicy = self._initial_policy()
        self._cycle_fns: dict[int, CycleFn] = {}

    @property
    def decode_slots_per_req(self) -> int:
        return self.block_size if self.tree is None else self.tree.cycle_length

    @property
    def tree_shape(self) -> Optional[TreeShape]:
        tree = self.tree
        return None if tree is None else TreeShape(tree.cycle_length, tree.budget + 1, self.block_size)

    def _new_acceptance(self) -> AcceptanceStats:
        return AcceptanceStats(self.block_size - 1, tree_length=None if self.tree is None else self.tree.cycle_length)

    @property
    def is_speculative(self) -> bool:
        return True

    # ---- verify length -----------------------------------------------------------------------
    def _initial_policy(self) -> VerifyLengthPolicy:
        """The fixed schedule, the full block (adaptive off or impossible), or — until init_cuda_graphs has timed the
        cycles — the full block standing in for adaptive verify."""
        config, b = self.runner.config, self.block_size
        if self.tree is not None:  # NOTE: config refuses a fixed schedule with a tree
            reason = (f"DDTree: every cycle verifies a tree of {self.tree.budget} nodes" if not self.adaptive_wanted
                      else "adaptive verify (chain lengths and the tree): cycle times not measured yet")
            length = self.tree.cycle_length
            return FixedVerifyLength([(1, 1 << 30, length)], b, reason, tree_length=length)
        if config.speculative_num_draft_tokens_per_bs is not None:
            schedule = parse_verify_schedule(config.speculative_num_draft_tokens_per_bs)
            return FixedVerifyLength(schedule, b, "fixed schedule (speculative_num_draft_tokens_per_bs)")
        if config.speculative_adaptive_verify == "off":
            return full_block(b, "adaptive verify off: the full block")
        if config.speculative_adaptive_verify is None and not self.cycles_timed_live:
            return full_block(
                b,
                "adaptive verify needs measured cycle times and is on by default only where the greedy "
                "cycle runs in one CUDA graph (timed live); speculative_adaptive_verify on forces it",
            )
        return full_block(b, "adaptive verify: cycle times not measured yet")

    @property
    def cycles_timed_live(self) -> bool:
        """Whether served cycles refine the cycle times: the greedy cycle is one CUDA graph (graphs on, and no
        backend that plans on the host, like FlashInfer), whose overlapped replays are timed on the device."""
        return (self.runner.graphs.available and graph_planner(self.runner.attention) is None
                and graph_planner(self.draft_attention) is None)

    @property
    def adaptive_wanted(self) -> bool:
        config = self.runner.config
        return config.speculative_num_draft_tokens_per_bs is None and (
            config.speculative_adaptive_verify == "on"
            or (config.speculative_adaptive_verify is None and self.cycles_timed_live)
        )

    @property
    def verify_lengths(self) -> tuple[int, ...]:
        """Verify lengths graphs are captured for."""
        if not self.adaptive_wanted:
            return self.verify_policy.lengths
        tree = () if self.tree is None else (self.tree.cycle_length,)
        return default_verify_lengths(self.block_size) + tree

    def calibrate_verify_lengths(self) -> None:
        """Times every (batch size, verify length) cycle and switches to adaptive verify (when wanted)."""
        if not self.adaptive_wanted:
            return
        graphs, config = self.runner.graphs, self.runner.config
        sizes = graphs.batch_sizes if graphs else [b for b in config.cuda_graph_bs if b <= config.max_running_requests]
        times = measure_cycle_times(self.dummy_cycle, sorted(set(sizes)) or [1], self.verify_lengths)
        tree_length = None if self.tree is None else self.tree.cycle_length
        self.verify_policy = AdaptiveVerifyLength(self.verify_lengths, CycleTimes(times, tree_length=tree_length))

    def verify_length_info(self) -> dict[str, Any]:
        """For get_server_info: the verify length in use per batch size and why, and the acceptance it assumed."""
        survival = self.acceptance.survival()
        info = {**self.verify_policy.describe(self.acceptance), "block_size": self.block_size,
                "position_accept_rates": [round(r, 4) for r in self.acceptance.rates()],
                "expected_tokens_full_block": round(1.0 + sum(survival), 4)}
        if self.tree is not None:  # NOTE: the verify length block + budget stands for the tree cycle
            length = self.tree.cycle_length
            info["tree"] = {"budget": self.tree.budget, "verify_length": length,
                            "expected_tokens": round(self.acceptance.expected_tokens(length), 4)}
        return info

    def forget_live_state(self) -> None:
        """Forgets the acceptance and verify-length choices learnt so far (e.g. from the start-up warm-up's random
        prompts); the start-up cycle times stay."""
        self.acceptance = self._new_acceptance()
        self.verify_policy.reset_live()

    @property
    def uniform_lengths(self) -> tuple[int, ...]:
        return self.verify_lengths

    @contextlib.contextmanager
    def pinned_verify_length(self, num_draft_tokens: int) -> Iterator[None]:
        policy = self.verify_policy
        tree = None if self.tree is None else self.tree.cycle_length
        self.verify_policy = FixedVerifyLength([(1, 1 << 30, num_draft_tokens)], self.block_size, "warm-up", tree)
        try:
            yield
        finally:
            self.verify_policy = policy

    def speculative_state(self) -> Optional[SpeculativeState]:
        choices = [VerifyLengthChoice(bs, c.num_draft_tokens, c.expected_tokens, c.cycle_ms)
                   for bs, c in sorted(self.verify_policy.last.items())]
        return SpeculativeState(self.verify_length_info(), choices, self.acceptance.rates())

    def choose_verify_length(self, batch_size: int) -> int:
        return self.verify_policy.choose(batch_size, self.acceptance).num_draft_tokens

    def observe_cycle(self, num_draft_tokens: int, accepted: Sequence[int], batch_size: int, ms: float | None) -> None:
        self.acceptance.observe(num_draft_tokens, accepted)
        if ms is not None:
            self.verify_policy.observe_cycle(batch_size, num_draft_tokens, ms)

    # ---- graphs ------------------------------------------------------------------------------
    def init_cuda_graphs(self) -> None:
        self.runner.capture_piecewise(aux_consumer=self._materialise_draft_kv)
        graphs, b = self.runner.graphs, self.block_size
        target, draft = self.runner.attention, self.draft_attention
        # NOTE: host-chosen tree cycles run eagerly (DFlashWorker._tree_decode); chain lengths verify in graphs
        for n in self.chain_lengths:
            graphs.capture(GraphKind.VERIFY, self._verify_forward, ForwardMode.VERIFY, n, [target], self.capture)
        graphs.capture(GraphKind.DRAFT, self._draft_proposals, ForwardMode.DRAFT, b, [draft])
        # NOTE: all-greedy batches replay one graph per cycle: propose → verify → both argmaxes. A backend that
        # plans on the host (FlashInfer) cannot plan the verify half from inside it, so it keeps the two graphs.
        if graph_planner(draft) is None and graph_planner(target) is None:
            for n in self.verify_lengths:
                graphs.capture(GraphKind.GREEDY_CYCLE, self.cycle_fn(n), ForwardMode.DRAFT, n, [target, draft])
        self.calibrate_verify_lengths()

    @property
    def chain_lengths(self) -> tuple[int, ...]:
        """The verify lengths of chain cycles (all but the tree's)."""
        return chain_lengths(self.verify_lengths, self.tree_shape)

    def uniform_forward_fn(self, kind: GraphKind, tokens_per_req: int) -> EagerForward:
        if kind is GraphKind.VERIFY:
            return self._verify_forward
        if kind is GraphKind.DRAFT:
            return self._draft_proposals
        if kind is GraphKind.GREEDY_CYCLE:
            return self.cycle_fn(tokens_per_req)
        if kind in (GraphKind.TREE_VERIFY, GraphKind.TREE_WALK) and self.tree is not None:
            return self.tree.host_verify if kind is GraphKind.TREE_VERIFY else self.tree.host_walk
        return super().uniform_forward_fn(kind, tokens_per_req)

    def _verify_forward(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, ...]:
        """Target forward over the verified block rows, then draft K/V for every one of them.

        NOTE: rows past the accepted prefix get draft K/V too; their slots are either freed or rewritten (by the
        next propose and materialise) before any draft attention reads them, so only committed rows matter."""
        output = self.runner.model(batch, self.runner.attention)
        assert output.aux_hidden is not None
        self.draft.materialise_context(output.aux_hidden, batch.positions, batch.out_cache_loc, self.draft_pool)
        return output.logits, output.aux_hidden

    def _draft_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        embeds = self.runner.model.embed(batch.input_ids) * self.draft_config.input_embedding_scale
        return self.draft(batch, self.draft_attention, embeds)

    def _draft_proposals(self, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """The draft's proposal tensors of a full-block batch: greedy proposals [bs, B-1] first, then what the
        draft reads back per request to propose on the host (DFlashDraftModel.proposal_tensors)."""
        return self.draft.proposal_tensors(self._draft_hidden(batch), _anchors(batch), self.runner.model.lm_head)

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

    # ---- the greedy cycle --------------------------------------------------------------------
    def cycle_fn(self, num_draft_tokens: int) -> CycleFn:
        """The whole greedy cycle of this verify length as one function of its input batch (graph-capturable)."""
        if num_draft_tokens not in self._cycle_fns:
            if self.tree is not None and num_draft_tokens == self.tree.cycle_length:
                self._cycle_fns[num_draft_tokens] = self.tree
            else:
                self._cycle_fns[num_draft_tokens] = lambda batch: self._greedy_cycle(batch, num_draft_tokens)
        return self._cycle_fns[num_draft_tokens]

    def _full_draft_batch(self, batch: ForwardBatch, num_draft_tokens: int) -> ForwardBatch:
        """The draft's batch [bonus, mask x (B-1)] at kv_len .. kv_len+B-1 from a cycle batch of n rows per request."""
        bs, b, n = batch.batch_size, self.block_size, num_draft_tokens
        if n == b:
            return batch
        masks = torch.full(
            (bs, b - 1), self.draft_config.mask_token_id, dtype=torch.int64, device=batch.input_ids.device
        )
        rows = torch.cat([batch.input_ids.view(bs, n)[:, :1], masks, batch.req_rows[:, None],
                          batch.seq_lens[:, None] + (b - n)], dim=1)
        return uniform_batch(ForwardMode.DRAFT, rows, batch.req_to_token, [s + b - n for s in batch.seq_lens_cpu],
                             (), batch.max_seq_len_hint)

    def _greedy_cycle(self, batch: ForwardBatch, num_draft_tokens: int) -> tuple[torch.Tensor]:
        """A whole greedy cycle on the device: the draft's greedy proposals, verify forward, target argmax, acceptance.

        Returns [bs, 2n] int64 rows [accepted | d_1..d_{n-1} | target argmax after each of the n verified tokens];
        `accepted` counts the leading proposals equal to the target's choice before them (or the simulated count),
        so the committed tokens are proposals[:accepted] + [target[accepted]]."""
        bs, n = batch.batch_size, num_draft_tokens
        if n > 1:
            draft_batch = self._full_draft_batch(batch, n)
            greedy = self.draft.greedy_proposals(
                self._draft_hidden(draft_batch), _anchors(draft_batch), self.runner.model.lm_head
            )
            proposals = greedy[:, :n - 1]
            block_ids = torch.cat([batch.input_ids.view(bs, n)[:, :1], proposals], dim=1).reshape(-1)
        else:
            proposals, block_ids = batch.input_ids.view(bs, 1)[:, :0], batch.input_ids
        verify_batch = dataclasses.replace(batch, mode=ForwardMode.VERIFY, input_ids=block_ids,
                                           capture_layer_ids=self.capture, attn_meta=None, argmax_only=True)
        tokens, _ = self._verify_forward(verify_batch)
        assert tokens is not None
        target_argmax = tokens.view(bs, n)
        accepted = self.accept_counts(proposals, target_argmax)
        return (torch.cat([accepted, proposals, target_argmax], dim=1),)

    def accept_counts(self, proposals: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
        """[bs, 1] accepted proposals of verified blocks (the simulated count under a simulated acceptance)."""
        if self.simulated is not None:
            return self.simulated.accepted(proposals.shape[0], proposals.shape[1] + 1, proposals.device)
        return greedy_accept_counts(proposals, target_argmax)

    # ---- input rows --------------------------------------------------------------------------
    def _draft_block(self, req: Req, num_draft_tokens: int) -> list[int]:
        """The block's first n input tokens [bonus, mask x (n-1)] at positions kv_len .. kv_len+n-1."""
        return [req.all_ids[-1], *[self.draft_config.mask_token_id] * (num_draft_tokens - 1)]

    def block_rows(
        self, reqs: Sequence[Req], num_draft_tokens: int, mode: ForwardMode = ForwardMode.DRAFT
    ) -> UniformRows:
        """[bonus, mask x (n-1) | req→token row | kv_len + n] per request (n = B: the draft's input)."""
        return UniformRows.build(
            mode,
            [self._draft_block(req, num_draft_tokens) for req in reqs],
            [req.pool_row for req in reqs],  # type: ignore[misc]
            [req.kv_len + num_draft_tokens for req in reqs],
            self.runner.device,
        )

    @torch.inference_mode()
    def dummy_cycle(self, batch_size: int, num_draft_tokens: int) -> None:
        """One cycle on padding rows (the dummy req→token row: only the dummy page is read and written), through the
        graphs a served cycle uses; the host waits for its tokens. For timing (cycle_timing.py)."""
        graphs, n, device = self.runner.graphs, num_draft_tokens, self.runner.device
        rows = torch.zeros((batch_size, n + 2), dtype=torch.int64)
        rows[:, n], rows[:, n + 1] = self.runner.req_to_token.dummy_row, n
        tree = self.tree is not None and n == self.tree.cycle_length
        if graphs.runs_from_device_rows(GraphKind.GREEDY_CYCLE) or tree:
            (tokens,) = graphs.run(
                GraphKind.GREEDY_CYCLE, DeviceRows(ForwardMode.DRAFT, rows.to(device)), self.cycle_fn(n)
            )
            assert tokens is not None
            tokens.cpu()
            return
        if n > 1:  # NOTE: the synchronous cycle: the draft's graph, then the verify graph
            draft = torch.zeros((batch_size, self.block_size + 2), dtype=torch.int64)
            draft[:, -2], draft[:, -1] = self.runner.req_to_token.dummy_row, self.block_size
            graphs.run(GraphKind.DRAFT, UniformRows(ForwardMode.DRAFT, _pinned(draft, device)), self._draft_proposals)
        verify = UniformRows(ForwardMode.VERIFY, _pinned(rows, device), self.capture)
        logits, _ = graphs.run(GraphKind.VERIFY, verify, self._verify_forward)
        assert logits is not None
        greedy_tokens(logits).cpu()

    def can_run_ahead(self, reqs: Sequence[Req]) -> bool:
        """Greedy batches on the one-graph cycle path (or all-eager) can run a cycle ahead of the host's commit."""
        return self.runner.graphs.runs_from_device_rows(GraphKind.GREEDY_CYCLE) and not any(
            r.samples_on_host for r in reqs
        )

    def launch_mixed(
        self, reqs: Sequence[Req], chunk_lens: Sequence[int], decode_reqs: Sequence[Req], carry: Optional[InFlightStep]
    ) -> tuple[InFlightStep, Optional[FirstTokens]]:
        """Not on DFlash: its mixed step verifies blocks the draft proposes from committed tokens, so it runs after a
        drain (`mixed`); the executor never launches one ahead for a speculative worker."""
        raise NotImplementedError("a DFlash mixed step runs after a drain (StepExecutor.run), not ahead")

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
        (tokens,) = self.runner.graphs.run(
            GraphKind.GREEDY_CYCLE, DeviceRows(ForwardMode.DRAFT, rows), self.cycle_fn(n)
        )
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

        # NOTE: block tokens 0..accepted now have valid target KV (and draft KV, written in _verify_forward).
        return cycle.commit(lambda row: accepted_and_bonus(row, n))

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
        draft distributions the proposals were drawn from ({request index: [B-1, V]}). A request whose draft rows
        have nothing to sample from is failed on its own (sampling_faults.py; its proposals stay the argmax)."""
        b = self.block_size
        batch = self.block_rows(reqs, b).to_batch(self.runner.req_to_token.table, self.runner.max_positions)
        outputs = self.runner.graphs.run(GraphKind.DRAFT, batch, self._draft_proposals)
        tensors = tuple(t for t in outputs if t is not None)
        assert len(tensors) == len(outputs)
        proposals = tensors[0].clone()  # NOTE: the next replay of the draft graph overwrites its outputs
        draft_probs: dict[int, torch.Tensor] = {}
        for i, req in enumerate(reqs):
            if req.grammar is None and req.params.is_greedy:
                continue
            try:
                tokens, probs = host_proposals(self.draft.proposal_rows(tensors, i), req)
            except SamplingFault as fault:
                fail_request(req, str(fault))
                continue
            proposals[i] = torch.tensor(tokens, device=proposals.device)
            if probs is not None:
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
        """The first n - 1 proposals [bs, n-1] and draft distributions [n-1, V] of sampled rows (no draft when
        n = 1)."""
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
        n = self.choose_verify_length(len(reqs))
        if self.tree is not None and n == self.tree.cycle_length:
            return self._tree_decode(reqs, self.tree)
        proposals, draft_probs = self._proposals(reqs, n)
        return self._accept(reqs, proposals, draft_probs, self.verify(reqs, proposals))

    def _tree_decode(self, reqs: Sequence[Req], tree: TreeCycle) -> list[list[int]]:
        """One DDTree cycle on the host's schedule: the target's token at every tree row is its argmax, or for a
        request that samples, penalises or follows a grammar its own choice given the row's path (tree_sampling.py);
        the walk follows those tokens. A request whose walk reaches a row it cannot choose from fails alone. Two
        uniform forwards (TREE_VERIFY, TREE_WALK), so tensor-parallel ranks mirror both."""
        n, rows_per_tree = tree.cycle_length, tree.budget + 1
        graphs, device = self.runner.graphs, self.runner.device
        (flat_logits,) = graphs.run(GraphKind.TREE_VERIFY, self.block_rows(reqs, n), tree.host_verify)
        assert flat_logits is not None and tree.pending is not None
        verified = tree.pending
        logits = flat_logits.view(len(reqs), rows_per_tree, -1)
        tokens = greedy_tokens(flat_logits).view(len(reqs), rows_per_tree)
        chosen: dict[int, TreeTokens] = {}
        draft_tree, row_tokens = verified.tree, verified.row_tokens
        for i, req in enumerate(reqs):
            # NOTE: under a simulated acceptance the walk ignores the tokens (as the chain's acceptance does)
            if needs_tree_tokens(req) and tree.simulated is None:
                chosen[i] = tree_row_tokens(req, logits[i], row_tokens[i], draft_tree.parents[i],
                                            draft_tree.depths[i], draft_tree.ancestors[i])
                tokens[i] = chosen[i].tokens
        meta = to_device(int64_tensor(itertools.chain.from_iterable(
            (req.pool_row, req.kv_len + n) for req in reqs)).view(len(reqs), 2), device)  # type: ignore[misc]
        walk_rows = DeviceRows(ForwardMode.VERIFY, torch.cat([tokens, meta], dim=1))
        output_rows, walked_rows = graphs.run(GraphKind.TREE_WALK, walk_rows, tree.host_walk)
        assert output_rows is not None and walked_rows is not None
        rows, paths = output_rows.tolist(), walked_rows.tolist()
        committed: list[list[int]] = []
        for i, (req, row) in enumerate(zip(reqs, rows)):
            path = paths[i][:row[0] + 1]
            fault = chosen[i].fault_at(path[-1]) if i in chosen else None
            if fault is not None:  # NOTE: sampling_faults.py: the request alone fails, nothing of it is committed
                fail_request(req, fault)
            if req.finished:
                committed.append([])
                continue
            req.kv_len += row[0] + 1
            committed.append(accepted_and_bonus(row, n))
            if req.wants_logprobs:  # NOTE: walked row d is the target's distribution of committed token d
                append_logprobs(req, logits[i, path], committed[-1])
        self.observe_cycle(n, [row[0] for row in rows], len(reqs), None)
        return committed

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
            if req.finished:  # NOTE: its sampling failed in `propose` (sampling_faults.py): nothing to commit
                committed.append([])
                continue
            if self.simulated is None and (i in draft_probs or req.params.has_penalties or req.grammar is not None):
                try:
                    accepted, bonus = self._accept_one(req, proposals, draft_probs.get(i), logits[i])
                except SamplingFault as fault:
                    fail_request(req, str(fault))
                    committed.append([])
                    continue
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
        (penalised per row with the proposals before it counted, see sample/penalties.py; masked per row with the
        grammar advanced along them, see sample/grammar.py). SamplingFault when a row it reads has nothing to sample
        from."""
        if req.params.has_penalties:
            logits = penalized(logits, req, proposals)
        if req.grammar is not None:
            logits = req.grammar.masked(logits, proposals)
        if draft_probs is not None:
            return rejection_accept(proposals, draft_probs, logits, req.params, req.generator)
        target = logits.argmax(-1)
        accepted = int(greedy_accept_counts(torch.tensor([proposals], device=target.device), target[None]))
        # NOTE: a NaN row's argmax may match its proposal: every row read is checked (one read for all)
        raise_first(choice_faults(logits[:accepted + 1]))
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
        if self.tree is not None and n == self.tree.cycle_length:
            n = self.block_size  # NOTE: an extend forward verifies causal chains: the tree's turn becomes the block's
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



def accepted_and_bonus(row: list[int], num_draft_tokens: int) -> list[int]:
    """A cycle's committed tokens from its output row [accepted | proposals (n-1) | target (n)]: the accepted
    proposals and the target's token after them."""
    accepted = row[0]
    return row[1:1 + accepted] + [row[num_draft_tokens + accepted]]


def _pinned(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    return rows.pin_memory() if device.type == "cuda" else rows


def _anchors(batch: ForwardBatch) -> torch.Tensor:
    """[bs] each block's row-0 token (the last committed one) of a full-block draft batch."""
    return batch.input_ids.view(batch.batch_size, -1)[:, 0]



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
