"""The target's responses for training: one generation engine, or `--gen-workers` engine processes on one device.

A 135M target decodes host-bound (≈ 50 responses a second through one engine on an H200, 2026-12-03): the scheduler
and the sampler's Python, not the GPU, set the pace. Several engine processes on the same device overlap that host
work. Each worker generates its own share of the missing prompts into its own cache file; the caller then reads the
whole cache and generates in-process whatever a failed worker left, so a lost worker costs time, never data."""
from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path
from typing import Any, Callable

import torch

from blockspec.config.engine_config import DEFAULT_CUDA_GRAPH_BS
from blockspec.models.config import load_target_config
from blockspec.train.data import ResponseCache, generate_missing
from blockspec.train.devices import dtype_name
from blockspec.train.options import TrainOptions

logger = logging.getLogger(__name__)

GEN_MAX_RUNNING = 256  # NOTE: small targets decode launch-bound; wide batches (graphs up to this size) feed the GPU


def wide_graph_bs(running: int) -> list[int]:
    """CUDA graph batch sizes for a generation engine of `running` requests: the defaults, then every 16 up to it."""
    return sorted({b for b in DEFAULT_CUDA_GRAPH_BS + list(range(80, GEN_MAX_RUNNING + 1, 16)) if b <= running} | {1})


def generation_engine_flags(running: int) -> dict[str, Any]:
    """Engine settings of the offline generators (responses, Magpie prompts): `running` requests a step. NOTE: no
    radix cache (every prompt is new; evicting finished ones scanned the whole tree each step) and piecewise graphs
    for the extends a full batch runs nearly every step: 10.4k → 90.9k tokens/s for the 135M target at 256 rows on
    an H200 (benchmarks/generation_rate.py, 2026-12-04)."""
    return {"max_running_requests": running, "cuda_graph_bs": wide_graph_bs(running), "disable_radix_cache": True,
            "enforce_piecewise_cuda_graph": True}


def response_engine_factory(
    options: TrainOptions, device: torch.device, dtype: torch.dtype, longest_prompt: int
) -> Callable[[], Any]:
    """The generation engine: wide batches and a KV pool that holds them all at their longest. NOTE: sized, not a
    share of free memory, so that several workers fit one device."""
    def make() -> Any:
        from blockspec.engine.engine import Engine

        running = min(options.gen_batch_size, GEN_MAX_RUNNING)
        return Engine(
            model_path=options.target_model_path,
            device=str(device),
            dtype=dtype_name(dtype),
            skip_tokenizer_init=True,
            **generation_engine_flags(running),
            max_total_tokens=running * (longest_prompt + options.max_new_tokens + 1),
            context_length=min(
                options.max_seq_len, load_target_config(options.target_model_path).max_position_embeddings
            ),
        )

    return make


def _worker(options: TrainOptions, prompts: list[list[int]], meta: dict[str, Any], device: torch.device,
            dtype: torch.dtype, rank: int, world: int, worker: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // options.gen_workers))  # NOTE: the workers share the host
    if device.type == "cuda" and device.index is not None:  # NOTE: a bare "cuda" is the current device already
        torch.cuda.set_device(device)
    cache = ResponseCache(options.cache_path, meta, f"{rank}-{worker}")
    shard, shards = rank + world * worker, world * options.gen_workers  # NOTE: the workers of rank r split its share
    made = generate_missing(prompts, cache, response_engine_factory(options, device, dtype, max(map(len, prompts))),
                            options.max_new_tokens, options.ignore_eos, options.gen_batch_size, shard, shards, False)
    logger.info("generation worker %d of rank %d: %d responses", worker, rank, made)


def generate_in_workers(options: TrainOptions, prompts: list[list[int]], meta: dict[str, Any], device: torch.device,
                        dtype: torch.dtype, rank: int, world: int) -> int:
    """Runs `options.gen_workers` worker processes (spawned: each starts CUDA itself) to their end; returns how many
    responses they added. A failed worker is logged, not raised: the caller generates what it left."""
    cached = ResponseCache(options.cache_path, meta, rank).load()
    if all(tuple(prompt) in cached for prompt in prompts):
        return 0  # NOTE: nothing to generate: no worker starts
    del cached
    files = [options.cache_path / f"responses.rank{rank}-{w}.jsonl" for w in range(options.gen_workers)]
    before = sum(_lines(f) for f in files)
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=_worker, args=(options, prompts, meta, device, dtype, rank, world, w), daemon=True)
        for w in range(options.gen_workers)
    ]
    for process in workers:
        process.start()
    codes = []
    for w, process in enumerate(workers):
        process.join()
        codes.append(int(process.exitcode if process.exitcode is not None else -1))
        if codes[-1] != 0:
            logger.warning("generation worker %d of rank %d exited with %d; its responses left are generated here",
                           w, rank, codes[-1])
    return sum(_lines(f) for f in files) - before


def _lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)
