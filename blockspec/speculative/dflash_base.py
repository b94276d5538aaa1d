"""DFlashBase: what every DFlash step shares — the draft and its KV pool, the forwards graphs capture (verify with
draft-KV materialise, draft logits, the whole greedy cycle per verify length), input rows, and the verify-length
policy with the acceptance statistics it reads (speculative/verify_length.py)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from blockspec.attention.base import graph_planner
from blockspec.attention.factory import make_backend
from blockspec.batch import DeviceRows, ForwardBatch, ForwardMode, UniformRows, uniform_batch
from blockspec.config.speculative_flags import parse_verify_schedule
from blockspec.kv.pool import KVPool
from blockspec.layers.argmax import greedy_tokens
from blockspec.models.dflash_draft import DFlashDraftModel
from blockspec.models.draft_config import DraftConfig
from blockspec.models.llama import ModelOutput
from blockspec.request import Req
from blockspec.runner.graph_kind import GraphKind
from blockspec.runner.graphs import EagerForward
from blockspec.runner.model_runner import ModelRunner
from blockspec.sample.acceptance import greedy_accept_counts
from blockspec.speculative.cycle_timing import measure_cycle_times
from blockspec.speculative.simulated_accept import SimulatedAcceptance
from blockspec.speculative.verify_length import (
    AcceptanceStats, AdaptiveVerifyLength, CycleTimes, FixedVerifyLength, VerifyLengthPolicy, default_verify_lengths,
    full_block,
)
from blockspec.worker.target_worker import TargetWorker

CycleFn = Callable[[ForwardBatch], tuple[torch.Tensor]]


class DFlashBase(TargetWorker):
    """A cycle of verify length n runs the draft over the full block [bonus, mask x (B-1)] (skipped when n = 1), then
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
        self.acceptance = AcceptanceStats(block_size - 1)
        self.verify_policy: VerifyLengthPolicy = self._initial_policy()
        self._cycle_fns: dict[int, CycleFn] = {}

    @property
    def decode_slots_per_req(self) -> int:
        return self.block_size

    @property
    def is_speculative(self) -> bool:
        return True

    # ---- verify length -----------------------------------------------------------------------
    def _initial_policy(self) -> VerifyLengthPolicy:
        """The fixed schedule, the full block (adaptive off or impossible), or — until init_cuda_graphs has timed the
        cycles — the full block standing in for adaptive verify."""
        config, b = self.runner.config, self.block_size
        if config.speculative_num_draft_tokens_per_bs is not None:
            schedule = parse_verify_schedule(config.speculative_num_draft_tokens_per_bs)
            return FixedVerifyLength(schedule, b, "fixed schedule (speculative_num_draft_tokens_per_bs)")
        if config.speculative_adaptive_verify == "off":
            return full_block(b, "adaptive verify off: the full block")
        if config.speculative_adaptive_verify is None and not self.cycles_timed_live:
            return full_block(b, "adaptive verify needs measured cycle times and is on by default only where the greedy "
                                 "cycle runs in one CUDA graph (timed live); speculative_adaptive_verify on forces it")
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
        return default_verify_lengths(self.block_size) if self.adaptive_wanted else self.verify_policy.lengths

    def calibrate_verify_lengths(self) -> None:
        """Times every (batch size, verify length) cycle and switches to adaptive verify (when wanted)."""
        if not self.adaptive_wanted:
            return
        graphs, config = self.runner.graphs, self.runner.config
        sizes = graphs.batch_sizes if graphs else [b for b in config.cuda_graph_bs if b <= config.max_running_requests]
        times = measure_cycle_times(self.dummy_cycle, sorted(set(sizes)) or [1], self.verify_lengths)
        self.verify_policy = AdaptiveVerifyLength(self.verify_lengths, CycleTimes(times))

    def verify_length_info(self) -> dict[str, Any]:
        """For get_server_info: the verify length in use per batch size and why, and the acceptance it assumed."""
        survival = self.acceptance.survival()
        return {**self.verify_policy.describe(self.acceptance), "block_size": self.block_size,
                "position_accept_rates": [round(r, 4) for r in self.acceptance.rates()],
                "expected_tokens_full_block": round(1.0 + sum(survival), 4)}

    def reset_live_verify_state(self) -> None:
        """Forgets the acceptance and verify-length choices learnt so far (e.g. from the start-up warm-up's random
        prompts); the start-up cycle times stay."""
        self.acceptance = AcceptanceStats(self.block_size - 1)
        self.verify_policy.reset_live()

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
        for n in self.verify_lengths:
            graphs.capture(GraphKind.VERIFY, self._verify_forward, ForwardMode.VERIFY, n, [target], self.capture)
        graphs.capture(GraphKind.DRAFT, self._draft_logits, ForwardMode.DRAFT, b, [draft])
        # NOTE: all-greedy batches replay one graph per cycle: propose → verify → both argmaxes. A backend that
        # plans on the host (FlashInfer) cannot plan the verify half from inside it, so it keeps the two graphs.
        if graph_planner(draft) is None and graph_planner(target) is None:
            for n in self.verify_lengths:
                graphs.capture(GraphKind.GREEDY_CYCLE, self.cycle_fn(n), ForwardMode.DRAFT, n, [target, draft])
        self.calibrate_verify_lengths()

    def uniform_forward_fn(self, kind: GraphKind, tokens_per_req: int) -> EagerForward:
        if kind is GraphKind.VERIFY:
            return self._verify_forward
        if kind is GraphKind.DRAFT:
            return self._draft_logits
        if kind is GraphKind.GREEDY_CYCLE:
            return self.cycle_fn(tokens_per_req)
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

    # ---- the greedy cycle --------------------------------------------------------------------
    def cycle_fn(self, num_draft_tokens: int) -> CycleFn:
        """The whole greedy cycle of this verify length as one function of its input batch (graph-capturable)."""
        if num_draft_tokens not in self._cycle_fns:
            self._cycle_fns[num_draft_tokens] = lambda batch: self._greedy_cycle(batch, num_draft_tokens)
        return self._cycle_fns[num_draft_tokens]

    def _full_draft_batch(self, batch: ForwardBatch, num_draft_tokens: int) -> ForwardBatch:
        """The draft's batch [bonus, mask x (B-1)] at kv_len .. kv_len+B-1 from a cycle batch of n rows per request."""
        bs, b, n = batch.batch_size, self.block_size, num_draft_tokens
        if n == b:
            return batch
        masks = torch.full((bs, b - 1), self.draft_config.mask_token_id, dtype=torch.int64, device=batch.input_ids.device)
        rows = torch.cat([batch.input_ids.view(bs, n)[:, :1], masks, batch.req_rows[:, None],
                          batch.seq_lens[:, None] + (b - n)], dim=1)
        return uniform_batch(ForwardMode.DRAFT, rows, batch.req_to_token, [s + b - n for s in batch.seq_lens_cpu],
                             (), batch.max_seq_len_hint)

    def _greedy_cycle(self, batch: ForwardBatch, num_draft_tokens: int) -> tuple[torch.Tensor]:
        """A whole greedy cycle on the device: draft argmax proposals, verify forward, target argmax, acceptance.

        Returns [bs, 2n] int64 rows [accepted | d_1..d_{n-1} | target argmax after each of the n verified tokens];
        `accepted` counts the leading proposals equal to the target's choice before them (or the simulated count),
        so the committed tokens are proposals[:accepted] + [target[accepted]]."""
        bs, n = batch.batch_size, num_draft_tokens
        if n > 1:
            draft_batch = self._full_draft_batch(batch, n)
            draft_argmax = self.draft.argmax(self._draft_hidden(draft_batch), self.runner.model.lm_head)
            proposals = draft_argmax.view(bs, self.block_size)[:, 1:n]
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

    def block_rows(self, reqs: Sequence[Req], num_draft_tokens: int, mode: ForwardMode = ForwardMode.DRAFT) -> UniformRows:
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
        if graphs.runs_from_device_rows(GraphKind.GREEDY_CYCLE):
            (tokens,) = graphs.run(GraphKind.GREEDY_CYCLE, DeviceRows(ForwardMode.DRAFT, rows.to(device)), self.cycle_fn(n))
            assert tokens is not None
            tokens.cpu()
            return
        if n > 1:  # NOTE: the synchronous cycle: the draft's graph, then the verify graph
            draft = torch.zeros((batch_size, self.block_size + 2), dtype=torch.int64)
            draft[:, -2], draft[:, -1] = self.runner.req_to_token.dummy_row, self.block_size
            graphs.run(GraphKind.DRAFT, UniformRows(ForwardMode.DRAFT, _pinned(draft, device)), self._draft_logits)
        verify = UniformRows(ForwardMode.VERIFY, _pinned(rows, device), self.capture)
        logits, _ = graphs.run(GraphKind.VERIFY, verify, self._verify_forward)
        assert logits is not None
        greedy_tokens(logits).cpu()


def _pinned(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    return rows.pin_memory() if device.type == "cuda" else rows
