"""A worker rank of a tensor-parallel engine: `python -m blockspec.engine.rank --rank R --port P`, the
EngineConfig as JSON on stdin (rank 0's RankProcesses starts these; see rank_processes.py).

Joins rank 0's store and process group, builds its shard of the runner and worker, captures its graphs (the same
collectives, in the same order, as every rank), then runs the forwards rank 0 mirrors until rank 0 stops it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

import torch.distributed as dist

from blockspec.config.engine_config import EngineConfig
from blockspec.engine.rank_processes import COLLECTIVE_TIMEOUT, die_with_parent, join_group, rank_config
from blockspec.engine.workers import build_workers
from blockspec.worker.forward_receiver import ForwardReceiver


def serve_rank(rank: int, config: EngineConfig, store: dist.Store) -> None:
    store.set(f"joined/{rank}", "1")
    tp = join_group(config, rank, store)
    runner, worker = build_workers(config, tp)
    worker.init_cuda_graphs()
    if runner.device.type == "cuda":
        # NOTE: this rank's attention variants compile here (no collectives); rank 0's warm-up requests, eager
        # passes included, reach this rank mirrored
        from blockspec.engine.warmup import attention_workloads, warm_attention

        warm_attention(attention_workloads(runner, worker), runner.req_to_token.table, runner.req_to_token.dummy_row)
    ForwardReceiver(tp, worker).serve()
    dist.destroy_process_group()


def main() -> None:
    die_with_parent()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    config = rank_config(EngineConfig(**json.loads(sys.stdin.read())), args.rank)
    logging.basicConfig(level=config.log_level.upper())
    store = dist.TCPStore("127.0.0.1", args.port, config.tp_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    try:
        serve_rank(args.rank, config, store)
    except BaseException:  # NOTE: left in rank 0's store for its error; exits at once (no finalizer waits on peers)
        store.set(f"error/{args.rank}", f"tensor-parallel rank {args.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
