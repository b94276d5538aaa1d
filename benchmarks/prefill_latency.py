"""Prefill/extend latency on Llama-3.1-8B shapes (random bf16 weights): eager vs piecewise CUDA graphs.

Token counts 16..2048 at batch 1 and 8, DFlash on (FULL aux capture + draft KV materialisation) and off; eager
and piecewise runs alternate (medians); also the piecewise capture time and graph memory. Writes
benchmarks/results/prefill_latency_<date>.json (+ .png).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.device_timing import cuda_ms
from benchmarks.results import add_out_argument, write_json
from benchmarks.step_latency import write_configs
from blockspec import Engine
from blockspec.bench.provenance import commit_id
from blockspec.request import Req, SamplingParams


def make_reqs(engine: Engine, batch_size: int, tokens: int, cached: int = 0) -> list[Req]:
    """`batch_size` requests sharing `tokens` new prompt tokens, each with `cached` more tokens ahead of them that
    count as already in the KV cache (as after a prefix-cache hit or an earlier chunk; `rewind` puts them back
    there)."""
    runner = engine.runner
    per_req = max(1, tokens // batch_size) + cached
    reqs = []
    for _ in range(batch_size):
        req = Req(torch.randint(10, engine.runner.target_config.vocab_size, (per_req,)).tolist(),
                  SamplingParams(temperature=0.0))
        req.pool_row = runner.req_to_token.acquire()
        runner.allocator.grow(req, per_req, runner.req_to_token)
        reqs.append(req)
    return reqs


def rewind(reqs: list[Req], cached: int = 0) -> list[int]:
    """Every request back to `cached` tokens in the KV cache; the lengths an extend of the rest computes."""
    for req in reqs:
        req.kv_len = cached
    return [req.prompt_len - cached for req in reqs]


def release(engine: Engine, reqs: list[Req]) -> None:
    for req in reqs:
        engine.runner.allocator.release(req)
        engine.runner.req_to_token.release(req.pool_row)


def run_extend(engine: Engine, reqs: list[Req], piecewise: bool, cached: int = 0) -> None:
    engine.runner.piecewise_enabled = piecewise
    engine.worker.extend_logits(reqs, rewind(reqs, cached))


def extend_ms(engine: Engine, batch_size: int, tokens: int, repeat: int, cached: int = 0) -> float:
    """Median ms of one extend of `tokens` prompt tokens over `batch_size` requests (each after `cached` tokens in
    the KV cache) with the runner as it is."""
    reqs = make_reqs(engine, batch_size, tokens, cached)
    ms = cuda_ms(lambda: run_extend(engine, reqs, True, cached), repeat)
    release(engine, reqs)
    return ms


def eager_vs_piecewise_ms(engine: Engine, batch_size: int, tokens: int, repeat: int) -> tuple[float, float]:
    """Median ms of eager and piecewise extends, measured alternately (clock or host drift hits both alike)."""
    reqs = make_reqs(engine, batch_size, tokens)
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(repeat):
        for graphed in (False, True) if round_index % 2 == 0 else (True, False):
            times[graphed].append(cuda_ms(lambda: run_extend(engine, reqs, graphed), 1))
    engine.runner.piecewise_enabled = True
    release(engine, reqs)
    return tuple(sorted(t)[len(t) // 2] for t in (times[False], times[True]))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeat", type=int, default=15)
    add_out_argument(parser)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    captures: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = write_configs(Path(tmp))
        for spec in (False, True):
            flags: dict[str, Any] = dict(model_path=str(target_dir), load_format="dummy", dtype="bfloat16",
                                         skip_tokenizer_init=True, max_total_tokens=65536, chunked_prefill_size=8192,
                                         cuda_graph_bs=[1], enforce_piecewise_cuda_graph=True,
                                         piecewise_cuda_graph_max_tokens=max(args.tokens))
            if spec:
                flags.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir))
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            engine = Engine(**flags)
            captures.append({"spec": spec, "engine_start_s": time.perf_counter() - start,
                             "memory_after_start_gib": (torch.cuda.memory_allocated() - before) / 2**30})
            for bs in args.batch_sizes:
                for tokens in args.tokens:
                    if tokens < bs:
                        continue
                    eager, graphed = eager_vs_piecewise_ms(engine, bs, tokens, args.repeat)
                    row = {"spec": spec, "bs": bs, "tokens": tokens, "eager_ms": eager, "piecewise_ms": graphed,
                           "speedup": eager / graphed}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            engine.shutdown()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    commit = commit_id()
    report = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit,
              "torch": torch.__version__, "rows": rows, "startup": captures}
    path = write_json(args.out / f"prefill_latency_{report['date']}.json", report)
    print(f"wrote {path}")
    print(f"{'spec':>5} {'bs':>3} {'tokens':>6} {'eager':>8} {'pcg':>8} {'x':>5}")
    for r in rows:
        print(f"{r['spec']!s:>5} {r['bs']:>3} {r['tokens']:>6} {r['eager_ms']:8.2f} {r['piecewise_ms']:8.2f} "
              f"{r['speedup']:5.2f}")
    for c in captures:
        print("startup:", c)


if __name__ == "__main__":
    main()
