"""Kernel warm-up at the end of start-up: compiles every Triton kernel variant serving can launch.

Three parts. (1) Attention: every reachable launch variant (attention_variants.py) of each Triton backend of the
engine, per mode it runs (extend; decode or verify; draft); under deterministic inference the batch-invariant
backends' variants (lanes split or not). (2) The fused MoE experts: each tile set the kernels can choose, once per
expert shape (the tiles follow the batch's tokens per expert, which synthetic requests would not all reach).
(3) Every other path: a few synthetic requests (random
token ids, greedy and sampled, one arriving while the others decode) through a scheduler of their own, once as
configured, once with piecewise graphs off (eager extends) and once with full graphs off (eager decode / verify /
draft; under DFlash once per verify length): the fused norms, rope + KV store, SiLU·mul and argmax in every place
they run outside a captured graph. Afterwards the engine's forward counts are zeroed, DFlash forgets what the
synthetic cycles taught it (acceptance, verify-length choices) and the pool is as before (every request freed).
"""
from __future__ import annotations

import logging
import random
import time
from typing import Callable

import torch

from blockspec.attention.batch_invariant_backend import BatchInvariantAttentionBackend
from blockspec.attention.triton_backend import TritonAttentionBackend
from blockspec.batch import ForwardMode
from blockspec.engine.attention_variants import AttentionWorkload, launch_variant, layer_classes, workload_variants
from blockspec.engine.startup_report import WarmupReport
from blockspec.layers.moe import SparseMoe
from blockspec.request import Req, build_requests
from blockspec.runner.model_runner import ModelRunner
from blockspec.scheduler.admission import ArrivalBatching
from blockspec.scheduler.scheduler import Scheduler
from blockspec.worker.protocol import Worker, chain_lengths

logger = logging.getLogger(__name__)

SchedulerFactory = Callable[[], Scheduler]  # NOTE: a fresh scheduler over the engine's worker, pool and table

WARMUP_PROMPT_LENS = (3, 29, 11)  # NOTE: the last one arrives while the others decode (a mixed step, if enabled)
WARMUP_ARRIVAL_STEP = 2


def attention_workloads(runner: ModelRunner, worker: Worker) -> list[AttentionWorkload]:
    """The Triton attention calls the engine can make, bounded by its flags."""
    config = runner.config
    max_batch_size = max([config.max_running_requests, *config.cuda_graph_bs])
    max_seq_len = runner.max_positions
    max_extend = min(config.chunk_budget or runner.context_length, runner.context_length)
    tree = worker.tree_shape
    # NOTE: adaptive verify runs verifies of every captured length n (eagerly above the largest graph batch); a tree
    # cycle's length stands for its tree verify (tree.verify_rows) and its draft block (tree.draft_rows)
    chain = chain_lengths(worker.uniform_lengths, tree)
    draft_q = max(chain) if tree is None else tree.draft_rows
    workloads: list[AttentionWorkload] = []
    if isinstance(runner.attention, TritonAttentionBackend):
        uniform_mode = ForwardMode.VERIFY if worker.is_speculative else ForwardMode.DECODE
        workloads.append(
            AttentionWorkload(runner.attention, ForwardMode.EXTEND, 1, max_extend, max_batch_size, max_seq_len)
        )
        if chain:
            workloads.append(
                AttentionWorkload(runner.attention, uniform_mode, min(chain), max(chain), max_batch_size, max_seq_len)
            )
        if tree is not None:
            workloads.append(AttentionWorkload(runner.attention, ForwardMode.VERIFY, tree.verify_rows,
                                               tree.verify_rows, max_batch_size, max_seq_len, tree=True))
    if isinstance(worker.draft_attention, TritonAttentionBackend):
        workloads.append(
            AttentionWorkload(
                worker.draft_attention, ForwardMode.DRAFT, draft_q, draft_q, max_batch_size, max_seq_len
            )
        )
    return workloads


@torch.inference_mode()
def warm_attention(workloads: list[AttentionWorkload], req_to_token: torch.Tensor, dummy_row: int) -> int:
    """Launches every variant of every workload once; returns how many."""
    launched = 0
    for workload in workloads:
        variants = workload_variants(workload)
        for variant in variants:
            launch_variant(workload.backend, variant, req_to_token, dummy_row)
        logger.info("attention warm-up, %s (q %d..%d, bs <= %d, seq <= %d): %d variants", workload.mode.value,
                    workload.min_q, workload.max_q, workload.max_batch_size, workload.max_seq_len, len(variants))
        logger.debug("attention variants: %s", "; ".join(v.describe() for v in variants))
        launched += len(variants)
    return launched


@torch.inference_mode()
def warm_batch_invariant_attention(runner: ModelRunner, worker: Worker) -> int:
    """Deterministic inference: every variant of the batch-invariant backends (per mode, lanes split or not, per
    layer class); returns how many."""
    uniform_mode = ForwardMode.VERIFY if worker.is_speculative else ForwardMode.DECODE
    backends = [(runner.attention, (ForwardMode.EXTEND, uniform_mode)),
                (worker.draft_attention, (ForwardMode.DRAFT,))]
    launched = 0
    for backend, modes in backends:
        if not isinstance(backend, BatchInvariantAttentionBackend):
            continue
        for mode in modes:
            launched += backend.warm_up(mode, layer_classes(backend, mode), runner.req_to_token.table,
                                        runner.req_to_token.dummy_row)
    return launched


@torch.inference_mode()
def warm_experts(runner: ModelRunner) -> int:
    """Part (2): SparseMoe.warm_up of one layer per expert shape and dtype (layers alike launch the same variants);
    returns the tile sets run."""
    launched, seen = 0, set()
    for module in runner.model.modules():
        if isinstance(module, SparseMoe):
            weights = module.experts.gate_up_proj
            shape = (tuple(weights.shape), tuple(module.experts.down_proj.shape), weights.dtype, module.routing.top_k)
            if shape not in seen:
                seen.add(shape)
                launched += module.warm_up()
    return launched


def _warmup_requests(runner: ModelRunner, worker: Worker, scheduler: Scheduler, tag: str) -> list[Req]:
    vocab = runner.target_config.vocab_size
    room = min(runner.context_length, runner.allocator.total_slots)
    budget = room - 4 * worker.decode_slots_per_req - 2  # NOTE: prompt + 2 blocks ahead fit any pool
    lens = [max(1, min(n, budget)) for n in WARMUP_PROMPT_LENS]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lens]
    max_new = 2 * worker.decode_slots_per_req + 2  # NOTE: >= 2 decode steps, so the overlap path runs
    greedy = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}
    sampled = {"temperature": 0.8, "seed": 1, "max_new_tokens": max_new, "ignore_eos": True}
    return build_requests(prompts, [greedy, sampled, greedy], [f"warmup-{tag}-{i}" for i in range(len(prompts))],
                          scheduler.limits)


def _run_requests(runner: ModelRunner, worker: Worker, new_scheduler: SchedulerFactory, tag: str) -> None:
    if tag == "eager-uniform" and worker.is_speculative:
        # NOTE: eager cycles of every verify length the policy may pick (graphed ones compiled at capture).
        for n in worker.uniform_lengths:
            with worker.pinned_verify_length(n):
                _run_scheduler(runner, worker, new_scheduler, f"{tag}-n{n}")
        return
    _run_scheduler(runner, worker, new_scheduler, tag)


def _run_scheduler(runner: ModelRunner, worker: Worker, new_scheduler: SchedulerFactory, tag: str) -> None:
    scheduler = new_scheduler()
    scheduler.arrivals = ArrivalBatching(0)  # NOTE: the late arrival must meet the others decoding (a mixed step)
    reqs = _warmup_requests(runner, worker, scheduler, tag)
    for req in reqs[:-1]:
        scheduler.add_request(req)
    steps, arrived = 0, False
    while scheduler.has_work or not arrived:
        if not arrived and (steps == WARMUP_ARRIVAL_STEP or not scheduler.has_work):
            scheduler.add_request(reqs[-1])
            arrived = True
        scheduler.step()
        steps += 1
    scheduler.drain()
    scheduler.collect_finished()
    scheduler.flush_cache()  # NOTE: the synthetic prompts leave nothing in the radix cache (shared with the engine's)


def warm_engine_paths(runner: ModelRunner, worker: Worker, new_scheduler: SchedulerFactory) -> int:
    """Synthetic requests as configured, then with piecewise graphs off, then with full graphs off, each pass through
    a scheduler of its own from `new_scheduler` (over the engine's worker, pool and table); returns the number of
    passes. NOTE: the public switches are restored and the forward counts zeroed afterwards."""
    passes = [("configured", runner.piecewise_enabled, runner.graphs.enabled)]
    if runner.piecewise is not None:
        passes.append(("eager-extend", False, runner.graphs.enabled))
    if bool(runner.graphs):
        passes.append(("eager-uniform", runner.piecewise_enabled, False))
    saved = (runner.piecewise_enabled, runner.graphs.enabled)
    try:
        for tag, piecewise, graphs in passes:
            runner.piecewise_enabled, runner.graphs.enabled = piecewise, graphs
            _run_requests(runner, worker, new_scheduler, tag)
    finally:
        runner.piecewise_enabled, runner.graphs.enabled = saved
    worker.forget_live_state()  # NOTE: random prompts teach nothing about served acceptance
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    for counts in (runner.graphs.counts, runner.piecewise_counts):
        for key in counts:
            counts[key] = 0
    return len(passes)


def warm_kernels(runner: ModelRunner, worker: Worker, new_scheduler: SchedulerFactory) -> WarmupReport:
    """The whole warm-up of an engine's runner and worker (`new_scheduler`: see warm_engine_paths)."""
    start = time.perf_counter()
    variants = warm_attention(attention_workloads(runner, worker), runner.req_to_token.table,
                              runner.req_to_token.dummy_row)
    variants += warm_batch_invariant_attention(runner, worker)
    expert_tiles = warm_experts(runner)
    passes = warm_engine_paths(runner, worker, new_scheduler)
    return WarmupReport(variants, expert_tiles, passes, time.perf_counter() - start)
