"""How much the HTTP server process can deliver (issue 18): the real server (FastAPI app, EngineLoop, streaming) in
front of a stand-in engine process that emits tokens at a fixed pace (benchmarks/paced_engine.py), driven by the
same closed-loop streaming clients as serving_vs_engine.py (/generate with input_ids).

The stand-in's paces are the engines' measured steps at 64 requests (H200, docs/performance.md): `smollm2-dflash` a
2.2 ms cycle of 3 tokens, `smollm2-target` a 1.2 ms step of 1, `llama8b-dflash` 22.5 ms / 4,
`llama8b-target` 6.7 ms / 1.
The ceiling of a level is what the stand-in would emit with every running slot busy (`paced_tok_s`); the server's
share of it (`server_over_paced`) and its CPU per streamed chunk say whether the server process is what limits
serving at that pace. The stand-in has no prefill: a request gets its first tokens at the step that admits it.

    python benchmarks/frontend_capacity.py --out benchmarks/results [--presets smollm2-dflash,llama8b-dflash]
        [--concurrency 1,8,64] [--rounds 16] [--py-spy-s 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from blockspec.bench.provenance import run_identity
from blockspec.evals.client import get_server_info
from blockspec.server import BackgroundServer
from blockspec.server.args import ServerSettings
from blockspec.server.engine_loop import EngineLoop
from paced_engine import Pace, PacedEngine
from serving_vs_engine_support import client_namespace, measure_level

PRESETS = {
    "smollm2-dflash": Pace(cycle_ms=2.2, tokens_per_step=3),
    "smollm2-target": Pace(cycle_ms=1.2, tokens_per_step=1),
    "llama8b-dflash": Pace(cycle_ms=22.5, tokens_per_step=4),
    "llama8b-target": Pace(cycle_ms=6.7, tokens_per_step=1),
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory of the JSON result")
    parser.add_argument("--presets", default="smollm2-dflash,smollm2-target", help=",".join(PRESETS))
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--rounds", type=int, default=16, help="requests per client in a level")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--client-procs", type=int, default=4, help="client processes sharing each level's clients "
                        "(>= 2: the server runs in this process)")
    parser.add_argument("--py-spy-s", type=float, default=0.0, help="py-spy this (the server's) process for ~S s "
                        "during the last level of the first preset: raw stacks and a summary beside the JSON "
                        "(needs ptrace of a parent: not inside every container)")
    parser.add_argument("--stream-interval", type=int, default=1, help="the stand-in streams as `blockspec serve "
                        "--stream-interval N` would (a chunk once N new tokens are ready)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--tag", default="")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def _py_spy(path: Path, seconds: float) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--duration", str(max(1, round(seconds))),
                             "--rate", "250", "--format", "raw", "--output", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def run_preset(name: str, pace: Pace, args: argparse.Namespace, levels: list[int], profile: Optional[Path]) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    loop = EngineLoop(PacedEngine(pace))
    with BackgroundServer(loop, ServerSettings(port=0, log_level="warning")) as server:
        ns = client_namespace(server.base_url, args.max_new_tokens, 600.0)
        warm = [[rng.randrange(10, pace.vocab_size) for _ in range(args.prompt_len)] for _ in range(64)]
        measure_level(client_namespace(server.base_url, 16, 600.0), warm, 64, 0.0, args.seed, 2, spawn=True)
        for index, concurrency in enumerate(levels):
            prompts = [[rng.randrange(10, pace.vocab_size) for _ in range(args.prompt_len)]
                       for _ in range(args.rounds * concurrency)]
            spy = _py_spy(profile, args.py_spy_s) if profile is not None and index == len(levels) - 1 else None
            report0 = get_server_info(server.base_url)
            level = measure_level(ns, prompts, concurrency, 0.0, args.seed, args.client_procs, spawn=True)
            report = get_server_info(server.base_url)
            cpu = level["http_cpu_share"] * level["duration_s"]  # NOTE: the HTTP server is this process
            if spy is not None:
                spy.wait(timeout=args.py_spy_s + 60)
            steps = report["busy_steps"] - report0["busy_steps"]
            paced = min(concurrency, pace.max_running) * pace.tokens_per_step / (pace.cycle_ms / 1e3)
            steps_per_request = -(-args.max_new_tokens // pace.tokens_per_step)
            steps_per_chunk = -(-pace.stream_interval // pace.tokens_per_step)
            chunks = len(prompts) * -(-steps_per_request // steps_per_chunk)  # the stand-in's deltas
            row = {"preset": name, "cycle_ms": pace.cycle_ms, "tokens_per_step": pace.tokens_per_step,
                   "stream_interval": pace.stream_interval,
                   "concurrency": concurrency, "paced_tok_s": paced, **level,
                   "server_over_paced": level["server_tok_s"] / paced,
                   "server_cpu_s": cpu, "server_cpu_share": level["http_cpu_share"],
                   "server_cpu_us_per_chunk": cpu / max(chunks, 1) * 1e6,
                   "server_cpu_us_per_request": cpu / max(len(prompts), 1) * 1e6,
                   "stand_in_steps": steps,
                   "stand_in_mean_running": (report["running_sum"] - report0["running_sum"]) / max(steps, 1),
                   "stand_in_lag_max_ms": report["lag_max_ms"]}
            rows.append(row)
            print(f"  {name:>15} {concurrency:>4} paced {paced:>9.0f} server {row['server_tok_s']:>9.0f} "
                  f"({row['server_over_paced']:.2f}) running {row['stand_in_mean_running']:5.1f} "
                  f"ttft50 {row['ttft_p50_ms']:6.1f} itl50 {row['itl_p50_ms']:5.2f} itl99 {row['itl_p99_ms']:6.1f} "
                  f"cpu {row['server_cpu_share']:.2f} ({row['server_cpu_us_per_chunk']:.0f} us/chunk), clients "
                  f"{row['clients_cpu_share']:.2f}, stand-in {row['engine_cpu_share']:.2f}", flush=True)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.presets.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        sys.exit(f"unknown preset(s) {unknown}; known: {', '.join(PRESETS)}")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    identity = run_identity()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"frontend_capacity_{identity['date']}_{identity['commit']}" + (f"_{args.tag}" if args.tag else "")
    path = args.out / f"{stem}.json"
    data: dict[str, Any] = {**identity, "flags": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    for i, name in enumerate(names):
        profile = args.out / f"{stem}_py_spy.txt" if args.py_spy_s > 0 and i == 0 else None
        started = time.perf_counter()
        pace = dataclasses.replace(PRESETS[name], stream_interval=args.stream_interval)
        data["rows"] += run_preset(name, pace, args, levels, profile)
        print(f"  {name} took {time.perf_counter() - started:.0f} s", flush=True)
        path.write_text(json.dumps(data, indent=1))
        if profile is not None and profile.exists():
            from serving_profile import summarize

            summary = summarize(profile, focus=("Server.run ",))
            (args.out / f"{stem}_py_spy_summary.txt").write_text(summary)
    if not args.no_plot:
        from plot_frontend_capacity import plot

        print(f"plotted {plot(path)}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
