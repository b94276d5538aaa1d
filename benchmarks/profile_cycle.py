"""Kernel-level profile of one DFlash cycle on 8B shapes: propose + verify eager and graphed, and the one-graph
greedy cycle, at each `--batch-sizes` (default 1) and `--context`.

Prints the CUDA kernels by total time, and the wall time of the graph and of the whole scheduler step beside the
kernel sum, so the gap to the bandwidth floor can be attributed (kernels vs launch gaps vs host)."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec import Engine
from device_timing import cuda_ms
from step_latency import prefill, write_configs


def profile_batch(engine: Engine, bs: int, context: int, modes: list[str], host_profile: bool) -> None:
    worker, scheduler = engine.worker, engine.scheduler
    reqs = prefill(engine, bs, context)
    step_ms = cuda_ms(scheduler.step, 20)
    if host_profile:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [scheduler.step() for _ in range(20)])
        print(f"==== bs {bs} ctx {context}: host functions over 20 scheduler steps (tottime) ====")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    for req in reqs:
        engine.runner.allocator.grow(req, req.kv_len + worker.block_size, engine.runner.req_to_token)

    def two_step() -> None:
        batch, proposals, _ = worker.propose(reqs)
        worker.verify(reqs, proposals)

    for label in modes:
        engine.runner.graphs.enabled = label != "eager"
        cycle = (lambda: worker.greedy_cycle_tokens(reqs)) if label == "greedy-cycle" else two_step
        wall_ms = cuda_ms(cycle, 20)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                cycle()
            torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events) / 5 / 1e3
        launches = sum(e.count for e in events) // 5
        print(f"==== bs {bs} ctx {context} {label}: kernel sum {total:.2f} ms in {launches} kernels, "
              f"wall {wall_ms:.2f} ms; scheduler step {step_ms:.2f} ms ====")
        for e in events[:24]:
            print(f"{e.device_time_total / 5 / 1e3:8.3f} ms  {e.count // 5:5d}x  {e.key[:90]}")
    engine.runner.graphs.enabled = True
    for req in reqs:
        scheduler.abort(req.rid)
    scheduler.collect_finished()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--modes", nargs="+", default=["eager", "graphs", "greedy-cycle"],
                        choices=("eager", "graphs", "greedy-cycle"))
    parser.add_argument("--host-profile", action="store_true", help="cProfile 20 scheduler steps per batch size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = write_configs(Path(tmp))
        engine = Engine(model_path=str(target_dir), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=max(args.batch_sizes) * (args.context + 256) + 1024,
                        max_running_requests=max(args.batch_sizes), cuda_graph_bs=args.batch_sizes,
                        speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir),
                        speculative_simulate_accept_len=4.0, speculative_adaptive_verify="off")
        for bs in args.batch_sizes:
            profile_batch(engine, bs, args.context, args.modes, args.host_profile)
        engine.shutdown()


if __name__ == "__main__":
    main()
