"""Kernel-level profile of one DFlash cycle at bs 1 on 8B shapes: propose + verify eager and graphed, and the
one-graph greedy cycle.

Prints the CUDA kernels by total time so the gap to the bandwidth floor can be attributed."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec import Engine
from step_latency import prefill, write_configs


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = write_configs(Path(tmp))
        engine = Engine(model_path=str(target_dir), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=8192, cuda_graph_bs=[1], speculative_algorithm="DFLASH",
                        speculative_draft_model_path=str(draft_dir), speculative_simulate_accept_len=4.0)
        worker = engine.worker
        reqs = prefill(engine, 1, 512)
        for req in reqs:
            engine.runner.allocator.grow(req, req.kv_len + worker.block_size, engine.runner.req_to_token)
        graphs, draft_graph = dict(engine.runner.graphs), worker.draft_graph

        def two_step() -> None:
            batch, proposals, _ = worker.propose(reqs)
            worker.verify(batch, proposals)

        for label in ("eager", "graphs", "greedy-cycle graph"):
            if label == "eager":
                engine.runner.graphs.clear()
                worker.draft_graph = None
            else:
                engine.runner.graphs.update(graphs)
                worker.draft_graph = draft_graph
            cycle = (lambda: worker.greedy_cycle_tokens(reqs)) if label == "greedy-cycle graph" else two_step
            for _ in range(3):
                cycle()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    cycle()
                torch.cuda.synchronize()
            print(f"==== {label}: per cycle, top kernels ====")
            events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in events) / 5 / 1e3
            print(f"total kernel time per cycle {total:.2f} ms")
            for e in events[:18]:
                print(f"{e.device_time_total / 5 / 1e3:8.3f} ms  {e.count // 5:5d}x  {e.key[:90]}")


if __name__ == "__main__":
    main()
