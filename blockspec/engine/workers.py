"""The runner and worker of one engine rank, target-only or DFlash: built the same way by Engine (rank 0, or the only
rank) and by every other tensor-parallel rank (engine/rank.py). Under DFlash the target's KV budget is shared with
the draft's pool."""
from __future__ import annotations

import logging
import time
from typing import Optional

from blockspec.config.engine_config import EngineConfig
from blockspec.distributed.group import TensorParallel
from blockspec.kv.pool import KVPool
from blockspec.models.config import load_target_config
from blockspec.models.draft_loading import load_draft_model
from blockspec.models.draft_config import load_draft_config
from blockspec.runner.model_runner import ModelRunner, pick_dtype
from blockspec.speculative.dflash import DFlashWorker
from blockspec.worker.protocol import Worker
from blockspec.worker.target_worker import TargetWorker

logger = logging.getLogger(__name__)


def build_workers(config: EngineConfig, tp: Optional[TensorParallel] = None) -> tuple[ModelRunner, Worker]:
    """The runner and worker of one rank (`tp`: its shard; None: the whole model on one device)."""
    if config.speculative_algorithm == "DFLASH":
        return build_dflash_worker(config, tp)
    runner = ModelRunner(config, tp=tp)
    return runner, TargetWorker(runner)


def build_dflash_worker(config: EngineConfig, tp: Optional[TensorParallel] = None) -> tuple[ModelRunner, DFlashWorker]:
    """Under `tp` this rank's shards of the target, the draft and both KV pools."""
    assert config.speculative_draft_model_path is not None
    target_config = load_target_config(config.model_path)
    draft_config = load_draft_config(config.speculative_draft_model_path, target_config)
    block_size = config.speculative_num_draft_tokens or draft_config.block_size
    # NOTE: a DDTree cycle's rows are block + B wide (speculative/tree_cycle.py)
    cycle_slots = block_size + config.tree_budget
    device = config.resolved_device
    dtype = pick_dtype(config, device)
    draft_kv_heads = draft_config.num_kv_heads if tp is None else tp.local_kv_heads(draft_config.num_kv_heads)
    draft_bytes = KVPool.bytes_per_slot(draft_config.num_layers, draft_kv_heads, draft_config.head_dim, dtype)
    runner = ModelRunner(
        # NOTE: overlap reserves 2 blocks ahead
        config, extra_kv_bytes_per_slot=draft_bytes, extra_positions=2 * cycle_slots,
        hidden_capture_layer_ids=tuple(draft_config.target_layer_ids), tp=tp,
    )
    started = time.perf_counter()
    draft = load_draft_model(
        config.speculative_draft_model_path, draft_config, runner.dtype, runner.device, runner.max_positions,
        dummy=config.load_format == "dummy", tp=tp, kernels=runner.kernels,
    )
    runner.startup_seconds["weights"] += time.perf_counter() - started
    started = time.perf_counter()
    draft_pool = KVPool(
        runner.kv_pool.num_slots, draft_config.num_layers, draft_kv_heads, draft_config.head_dim,
        runner.dtype, runner.device,
    )
    runner.startup_seconds["kv_pool"] += time.perf_counter() - started
    logger.info(
        "%s draft: %d layers, block %d, taps %s", "DFlash" if draft_config.dflash2 is None else "DFlash2",
        draft_config.num_layers, block_size, draft_config.target_layer_ids,
    )
    return runner, DFlashWorker(runner, draft, draft_pool, block_size)
