"""The runner and worker of one engine rank, target-only or DFlash: built the same way by Engine (rank 0, or the only
rank) and by every other tensor-parallel rank (engine/rank.py)."""
from __future__ import annotations

from typing import Optional

from blockspec.config.engine_config import EngineConfig
from blockspec.distributed.group import TensorParallel
from blockspec.runner.model_runner import ModelRunner
from blockspec.scheduler.step_executor import Worker
from blockspec.worker.target_worker import TargetWorker


def build_workers(config: EngineConfig, tp: Optional[TensorParallel] = None) -> tuple[ModelRunner, Worker]:
    """The runner and worker of one rank (`tp`: its shard; None: the whole model on one device)."""
    if config.speculative_algorithm == "DFLASH":
        from blockspec.speculative.build import build_dflash_worker

        return build_dflash_worker(config, tp)
    runner = ModelRunner(config, tp=tp)
    return runner, TargetWorker(runner)
