"""Warm start of `blockspec serve` (issue 25): seconds until /health is 200, the engine's start-up phases, and the
Triton kernel variants compiled after start-up while a varied load runs (must stay 0).

Dummy weights from a shape's config.json (`llama8b`: Llama-3.1-8B + a 5-layer DFlash draft, block 10; `smollm2`;
`tiny`), DFlash with a simulated accept length, piecewise graphs. The load: streaming greedy clients at several
concurrency levels over prompts of varied length (1 token to most of the context), then sampled requests with
logprobs. Triton's on-disk cache is whatever TRITON_CACHE_DIR points at: the caller makes it cold (an empty
directory) or warm (the same directory again). `--table A.json B.json ...` prints earlier results as a table.

    python -m benchmarks.warm_start --tag cold --out OUT     # TRITON_CACHE_DIR=$(mktemp -d) first
    python -m benchmarks.warm_start --table OUT/warm_start_*.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import httpx

from benchmarks.serving_vs_engine_support import ServerProcess, client_namespace, materialise
from blockspec.bench.provenance import run_identity
from blockspec.bench.serving import run_level

DEFAULT_ACCEPT = {"llama8b": 4.0, "smollm2": 3.2, "tiny": 2.0}


class CutShort(Exception):
    """SIGTERM (e.g. from `timeout`): raised so the server process is stopped on the way out."""


def _cut_short(signum: int, frame: Optional[FrameType]) -> None:
    raise CutShort(f"signal {signum}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b", choices=sorted(DEFAULT_ACCEPT))
    parser.add_argument("--tag", default="run", help="names the result: warm_start_<shape>_<tag>.json")
    parser.add_argument("--out", type=Path, default=Path("device-out"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompts-per-level", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--no-load", action="store_true", help="measure the start-up alone")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--extra-flags", default="",
                        help="more `blockspec serve` flags, e.g. --extra-flags=\"--enable-mixed-chunk\"")
    parser.add_argument("--table", type=Path, nargs="*", help="print these result files as a table and exit")
    return parser.parse_args()


def serve_flags(shape_name: str, workdir: Path, extra: str) -> list[str]:
    shape = materialise(shape_name, workdir, None, None)
    assert shape.draft is not None
    return [
        "--model-path", str(shape.target), "--load-format", "dummy", "--skip-tokenizer-init",
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(shape.draft),
        "--speculative-simulate-accept-len", str(DEFAULT_ACCEPT[shape_name]), "--page-size", "16",
        "--cuda-graph-bs", "1", "2", "4", "8", "16", "32", "64", "--enforce-piecewise-cuda-graph",
        "--log-level", "info", *extra.split(),
    ]


def varied_prompts(rng: random.Random, count: int, vocab: int, longest: int) -> list[list[int]]:
    """Bucket edges and chunk-sized prompts first, then log-uniform lengths in [1, longest]."""
    lens = [1, 2, 9, 16, 17, 63, 65, 200, 257, 511, 1000, 2047, 4097, longest]
    lens += [int(math.exp(rng.uniform(0.0, math.log(longest)))) for _ in range(max(0, count - len(lens)))]
    rng.shuffle(lens)
    return [[rng.randrange(10, vocab - 10) for _ in range(min(n, longest))] for n in lens[:count]]


async def sampled_requests(base_url: str, prompts: list[list[int]], max_new: int) -> int:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        bodies = [{"input_ids": p, "return_logprob": True, "top_logprobs_num": 3,
                   "sampling_params": {"temperature": 0.8, "top_p": 0.9, "seed": i, "max_new_tokens": max_new,
                                       "ignore_eos": True, "frequency_penalty": 0.3}} for i, p in enumerate(prompts)]
        responses = await asyncio.gather(*(client.post("/generate", json=body) for body in bodies))
    return sum(r.status_code != 200 for r in responses)


def compiles_after_startup(base_url: str) -> tuple[Any, float]:
    info = httpx.get(base_url + "/server_info", timeout=60).json()
    metric = next((float(line.split()[-1]) for line in httpx.get(base_url + "/metrics", timeout=60).text.splitlines()
                   if line.startswith("blockspec_kernel_compiles_after_startup ")), float("nan"))
    return info["internal_states"][0]["kernel_compiles_after_startup"], metric


def measure(args: argparse.Namespace) -> dict[str, Any]:
    workdir = args.out / f"warm_start_{args.shape}"
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result: dict[str, Any] = {"shape": args.shape, "tag": args.tag}
    server = ServerProcess(serve_flags(args.shape, workdir, args.extra_flags), workdir / f"server_{args.tag}.log",
                           args.startup_timeout)
    try:
        return _measure_server(args, server, started, result)
    finally:
        server.__exit__(None, None, None)  # NOTE: also when cut short inside __enter__ (no __exit__ then)


def _measure_server(args: argparse.Namespace, server: ServerProcess, started: float,
                    result: dict[str, Any]) -> dict[str, Any]:
    with server:
        result["healthy_s"] = round(time.monotonic() - started, 1)
        info = httpx.get(server.base_url + "/server_info", timeout=60).json()
        result["startup"] = info["startup"]
        result["compiles_at_health"] = info["internal_states"][0]["kernel_compiles_after_startup"]
        if not args.no_load:
            rng = random.Random(0)
            longest = int(info["context_length"]) - args.max_new_tokens - 64
            vocab = int(info["vocab_size"])
            ns = client_namespace(server.base_url, args.max_new_tokens, 600.0)
            failed, requests, load_started = 0, 0, time.monotonic()
            for concurrency in args.concurrency:
                prompts = varied_prompts(rng, max(args.prompts_per_level, concurrency), vocab, longest)
                results, _ = asyncio.run(run_level(ns, prompts, concurrency))
                failed += sum(not r.ok for r in results)
                requests += len(results)
            sampled = varied_prompts(rng, 16, vocab, min(1024, longest))
            failed += asyncio.run(sampled_requests(server.base_url, sampled, args.max_new_tokens))
            result.update(requests=requests + len(sampled), failed=failed,
                          load_s=round(time.monotonic() - load_started, 1))
        result["compiles_after_startup"], result["compiles_metric"] = compiles_after_startup(server.base_url)
    return result


def print_table(paths: list[Path]) -> None:
    phases = ("weights", "kv_pool", "graphs", "piecewise_graphs", "kernels", "total")
    print("| shape | Triton cache | healthy (s) | " + " | ".join(phases) + " | variants compiled at start-up | "
          "requests | compiles after start-up |")
    print("|---|---|---:|" + "---:|" * (len(phases) + 3))
    for path in paths:
        if not path.is_file():
            print(f"| {path.stem} | missing (cut short) |")
            continue
        row = json.loads(path.read_text())
        if "error" in row:
            print(f"| {row['shape']} | {row['tag']} | failed: {row['error'][:80]} |")
            continue
        seconds = row["startup"]["seconds"]
        print(f"| {row['shape']} | {row['tag']} | {row['healthy_s']} | "
              + " | ".join(f"{seconds[p]:.1f}" for p in phases)
              + f" | {row['startup']['kernel_variants_compiled']} | {row.get('requests', 0)} "
              f"({row.get('failed', 0)} failed) | {row['compiles_after_startup']} "
              f"(metric {row['compiles_metric']:g}) |")


def main() -> None:
    args = parse_args()
    if args.table is not None:
        print_table(args.table)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"warm_start_{args.shape}_{args.tag}.json"
    signal.signal(signal.SIGTERM, _cut_short)
    try:
        result = measure(args)
    except (RuntimeError, httpx.HTTPError, KeyError, CutShort) as exc:
        result = {"shape": args.shape, "tag": args.tag, "error": f"{type(exc).__name__}: {exc}"}
    result.update(run_identity())
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    if "error" in result or result.get("failed") or result.get("compiles_after_startup"):
        sys.exit(1)


if __name__ == "__main__":
    main()
