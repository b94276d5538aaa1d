"""Continuous batching: admission by KV budget, chunked prefill, retraction, finish checks.

Each step the scheduler plans what runs (StepPlan) and commits what comes back; how a step runs, what is in flight
and the overlap schedule belong to the StepExecutor (scheduler/step_executor.py)."""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Optional

import torch
from transformers import PreTrainedTokenizerBase

from blockspec.config.engine_config import EngineConfig
from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.kv.prefix_cache import PrefixCache
from blockspec.outputs import Committed, ExtendChunk, StepPlan
from blockspec.request import Finish, FinishReason, Req, RequestLimits
from blockspec.sample.grammar import GrammarCompiler
from blockspec.sample.sampling import make_generator
from blockspec.scheduler.admission import ArrivalBatching
from blockspec.scheduler.finish import commit_tokens
from blockspec.scheduler.stats import SchedulerStats, SpecStatistics
from blockspec.scheduler.step_executor import StepExecutor
from blockspec.tokenizer import TextStream, backend_of
from blockspec.worker.protocol import Worker

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        worker: Worker,
        allocator: PageAllocator,
        table: ReqToTokenTable,
        context_length: int,
        vocab_size: int,
        eos_token_ids: list[int],
        tokenizer: Optional[PreTrainedTokenizerBase],
        device: torch.device,
    ) -> None:
        self.config = config
        self.steps = StepExecutor(worker, allocator, table, overlap=not config.disable_overlap_schedule)
        self.allocator = allocator
        self.table = table
        self.prefix_cache = PrefixCache(allocator, table, enabled=not config.disable_radix_cache)
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self._backend = backend_of(tokenizer) if tokenizer is not None else None
        # NOTE: False in the server's engine process: text is then made there only for requests with stop strings
        # (the finish check needs it); the server process detokenises the rest.
        self.detokenize_all = True
        self.device = device
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.requests_by_rid: dict[str, Req] = {}  # NOTE: every queued or running request, until collect_finished
        self.detokenizers: dict[str, TextStream] = {}
        self._grammar_compiler: Optional[GrammarCompiler] = None  # built on the first constrained request
        self.num_retractions = 0
        self.num_steps = 0
        self.num_extend_steps = 0  # steps that ran prefill chunks (with or without decode in the same forward)
        self.extend_step_seconds = 0.0  # wall time of those steps (host work and device waits), and of all steps
        self.step_seconds = 0.0
        self.arrivals = ArrivalBatching(
            config.max_prefill_wait_steps, config.prefill_wait_policy, config.enable_mixed_chunk
        )
        self.spec = SpecStatistics(worker.decode_slots_per_req)

    # ---- requests in and out -------------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.vocab_size, self.context_length, self.allocator.total_slots,
                             self.steps.slots_per_decode, self.tokenizer is not None)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            len(self.running), len(self.waiting), self.num_retractions, self.num_steps, self.num_extend_steps,
            self.step_seconds, self.extend_step_seconds, self.steps.mixed_steps, self.arrivals.held_steps,
            self.spec.as_dict(), list(self.spec.accept_histogram),
        )

    def check_request(self, req: Req) -> None:
        """Raises ValueError for a request that can never be served."""
        self.limits.check(req)

    def add_request(self, req: Req) -> None:
        self.check_request(req)
        # NOTE: here, not in check_request: that one must stay safe to call off the engine thread.
        if req.rid in self.requests_by_rid:
            raise ValueError(f"request id {req.rid!r} is already in use by a queued or running request")
        if not req.params.is_greedy:
            req.generator = make_generator(req.params, self.device)
        spec = req.params.grammar_spec
        if spec is not None:
            req.grammar = self.grammar_compiler.start(spec)
        if req.params.min_new_tokens:
            req.min_tokens_blocked_ids = self.eos_token_ids | set(req.params.stop_token_ids)
        if self._backend is not None and (self.detokenize_all or req.params.stop):
            self.detokenizers[req.rid] = TextStream(self._backend, req.params.skip_special_tokens)
            req.detokenized = True
        if req.params.max_new_tokens == 0:
            req.finish = Finish(FinishReason.LENGTH, length=0)
        req.admitted_samples_on_host = None
        req.admitted_samples_on_host = req.samples_on_host
        req.received_time = time.monotonic()
        self.waiting.append(req)
        self.requests_by_rid[req.rid] = req

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            assert self.tokenizer is not None, "RequestLimits.check refuses grammars without a tokenizer"
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return self._grammar_compiler

    def abort(self, rid: str) -> bool:
        req = self.requests_by_rid.get(rid)
        if req is None or req.finished:
            return False
        req.finish = Finish(FinishReason.ABORT, message="aborted by the client")
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one engine step -------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Runs one step: an extend plan if any prompt work can be scheduled, else a decode step (overlapped with the
        step in flight when the batch allows it). Returns the requests that finished (or were aborted) during it."""
        started, extends_before = time.perf_counter(), self.num_extend_steps
        done = self._step()
        elapsed = time.perf_counter() - started
        self.step_seconds += elapsed
        extended = self.num_extend_steps > extends_before
        if extended:
            self.extend_step_seconds += elapsed
        self.arrivals.observe(elapsed, extended)
        return done

    def _step(self) -> list[Req]:
        done = self.collect_finished()
        self.num_steps += 1
        plan = self._schedule_extend()
        self.num_extend_steps += bool(plan.extend)
        if plan and self.config.enable_mixed_chunk:
            # NOTE: the running requests decode in the same forward: behind the step in flight where the batch can
            # run ahead (greedy target-only), else after committing it
            launch = self.steps.launch_mixed_ahead(plan, self._decoding())
            if launch is not None:
                self._apply(launch.in_flight_commits)
                self._apply(self.steps.mixed_commits(launch))
            else:
                self._apply(self.steps.drain())
                decoding = self._decoding()
                if decoding and self.steps.fits(decoding):
                    plan.decode = decoding
                self._apply(self.steps.run(plan))
        elif plan:
            # NOTE: the extend is queued behind the decode step in flight (its requests have no prompt work and are not
            # retracted here); that step is committed and applied while the device runs both, so its host work sits
            # inside the wait for the first tokens and its finished requests leave a step sooner. When the batch can
            # run ahead, the next decode step is queued behind the extend too (the new requests' first tokens taken
            # on the device), so the device does not idle after the extend; else it launches from host rows.
            logits = self.steps.launch_extend(plan)
            ahead = self.steps.extend_run_ahead(plan, logits, self._decoding())
            if ahead is not None:
                self._apply(ahead)
            else:
                self._apply(self.steps.drain())
                self._apply(self.steps.extend_commits(plan, logits))
        else:
            committed = self.steps.run_ahead(self._decoding())
            if committed is None:
                self._apply(self.steps.drain())
                committed = self.steps.run(StepPlan(decode=self._make_decode_room()))
            self._apply(committed)
        for chunk in plan.extend:  # NOTE: their prompt KV so far joins the radix cache (later arrivals share it)
            self.prefix_cache.cache_prefill(chunk.req)
        return done + self.collect_finished()

    def drain(self) -> None:
        """Commits the decode step in flight, if any (benchmarks time whole blocks of steps, then switch settings)."""
        self._apply(self.steps.drain())

    def _decoding(self) -> list[Req]:
        # NOTE: pending_len == 1 and not finished, spelled out: this runs over the whole batch every step
        return [r for r in self.running if r.finish is None and not r.in_prefill and len(r.all_ids) - r.kv_len == 1]

    # NOTE: conservative while a step is in flight: its requests already hold most of their next step's slots (the
    # overlap schedule keeps them between launches), yet each still counts a full step here
    def _decode_headroom(self, num_running: int) -> int:
        pages = self.allocator.pages_for(self.steps.slots_per_decode) + 1
        return num_running * pages * self.allocator.page_size

    def _schedule_extend(self) -> StepPlan:
        budget = self.config.chunk_budget or 1 << 62
        plan = StepPlan()
        for req in self.running:
            if budget <= 0 or not req.in_prefill:
                continue
            n = min(req.pending_len, budget)
            if not self.allocator.can_grow(req, req.kv_len + n):
                break
            self.allocator.grow(req, req.kv_len + n, self.table)
            plan.extend.append(ExtendChunk(req, n))
            budget -= n
        # NOTE: only then: the waiting prompts' sum and the decoding list cost O(requests)
        if self.arrivals.max_wait_steps:
            decoding, rows = len(self._decoding()), min(
                self.config.max_running_requests - len(self.running), self.table.free_rows
            )
            admissible = min(len(self.waiting), max(rows, 0))
            # NOTE: the prompt tokens this step could take are the admissible requests', not the whole queue's: a
            # queue deeper than the free rows (every request submitted at once, a saturated server) otherwise reads as
            # a full extend step and each freed row costs an extend step of its own
            admissible_tokens = sum(req.pending_len for req in itertools.islice(self.waiting, admissible))
            if self.arrivals.hold(self.num_steps, admissible_tokens, budget, decoding > 0, bool(plan.extend),
                                  decoding, admissible):
                return plan
        in_batch = None
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_running_requests
            and self.table.free_rows
        ):
            req = self.waiting[0]
            if req.pending_len + self.steps.slots_per_decode > self.allocator.total_slots:
                self.waiting.popleft()
                req.finish = Finish(FinishReason.ABORT, message="the sequence no longer fits the KV pool")
                self.running.append(req)  # collected by collect_finished at the end of this step
                continue
            self.prefix_cache.attach(req)  # NOTE: kv_len now starts after its cached prefix (whole pages)
            if plan.extend and in_batch is None:
                in_batch = self.prefix_cache.in_batch(plan.extend)
            if in_batch is not None and in_batch.should_wait(req):
                self.prefix_cache.detach(req)  # NOTE: it stays first: nothing behind it takes the rows, KV or budget
                self.arrivals.release_next()  # nor does arrival batching hold it again
                break
            n = min(req.pending_len, budget)
            need = self.allocator.pages_for(n) * self.allocator.page_size
            full = bool(self.running) and self.allocator.free_slots - need < self._decode_headroom(
                len(self.running) + 1
            )
            if full or not self.allocator.can_grow(req, req.kv_len + n):
                self.prefix_cache.detach(req)
                break
            self.waiting.popleft()
            req.in_prefill = True
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.prefix_cache.admitted(req)
            req.pool_row = self.table.acquire()
            self.allocator.grow(req, req.kv_len + n, self.table)
            self.running.append(req)
            plan.extend.append(ExtendChunk(req, n))
            budget -= n
            if in_batch is not None:
                in_batch.computing(req, req.kv_len + n)
        return plan

    def _make_decode_room(self) -> list[Req]:
        """The decoding requests, once the pool has slots for their next step (retracting the newest if needed)."""
        while True:
            decode_reqs = self._decoding()
            if self.steps.fits(decode_reqs):
                return decode_reqs
            victim = self.running[-1]
            if len(self.running) == 1:
                victim.finish = Finish(FinishReason.ABORT, message="the sequence no longer fits the KV pool")
                return []
            self._retract(victim)

    def _retract(self, req: Req) -> None:
        logger.info("KV pool full: retracting %s to the waiting queue", req.rid)
        self.num_retractions += 1
        self._release(req)
        req.kv_len = 0
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _release(self, req: Req) -> None:
        if req.pool_row is not None:
            self.prefix_cache.release(req)
            self.table.release(req.pool_row)
            req.pool_row = None

    def flush_cache(self) -> bool:
        """Empties the radix cache; refused (False) while any request is queued or running."""
        if self.has_work:
            return False
        self.drain()  # NOTE: a step in flight holds only finished requests here
        self.prefix_cache.flush()
        return True

    def collect_finished(self) -> list[Req]:
        finished = [r for r in self.running if r.finish is not None]  # NOTE: twice a step over the batch
        if self.waiting:
            finished += [r for r in self.waiting if r.finish is not None]
        for req in finished:
            self._release(req)
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            del self.requests_by_rid[req.rid]
            detok = self.detokenizers.pop(req.rid, None)
            matched_text = req.finish is not None and isinstance(req.finish.matched, str)
            if detok is not None and not matched_text:  # NOTE: text after a matched stop string stays cut
                req.text += detok.flush()
        return finished

    # ---- committing tokens -----------------------------------------------------------------
    def _apply(self, committed: list[Committed]) -> None:
        speculative, spec = self.steps.is_speculative, self.spec
        for item in committed:
            req = item.req
            if not item.verified:  # NOTE: an extend's first token: the request decodes from now on
                req.in_prefill = False
            appended = commit_tokens(req, item.tokens, self.eos_token_ids, self.context_length,
                                     self.detokenizers.get(req.rid))
            if item.verified and speculative:  # NOTE: one verify cycle of this request, `appended` tokens kept
                req.spec_verify_ct += 1
                req.spec_accept_lengths.append(appended)
                spec.record(appended)
