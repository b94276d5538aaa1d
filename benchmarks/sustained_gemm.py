"""cuBLAS GEMM throughput in a short burst vs sustained (~`--seconds`), with SM clock and board power: shows when a
batch is power-limited rather than slow. Each shape's weight is replicated to ~2 GB so every GEMM reads it cold.
Writes sustained_gemm_<date>.json + a plot (TFLOP/s burst vs sustained per shape and M) to --out."""
from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any

import torch

from plot_common import plt, save_beside
from device_timing import DeviceSampler, save_report

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o_proj": (4096, 4096),
          "lm_head": (128256, 4096)}


def measure(name: str, m: int, seconds: float) -> dict[str, Any]:
    n, k = SHAPES[name]
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(max(1, 2 * 2**30 // (n * k * 2)))]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    for w in weights:
        torch.matmul(x, w.t(), out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            torch.matmul(x, w.t(), out=out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000)  # ~1 ms idle before the burst
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    burst_us = start.elapsed_time(end) * 1e3 / len(weights)
    replays = max(1, int(seconds * 1e6 / (burst_us * len(weights))))
    with DeviceSampler() as sampler:
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    sustained_us = start.elapsed_time(end) * 1e3 / (replays * len(weights))
    flop = 2 * m * n * k
    row = {"shape": name, "m": m, "burst_us": burst_us, "sustained_us": sustained_us,
           "burst_tflops": flop / burst_us / 1e6, "sustained_tflops": flop / sustained_us / 1e6, **sampler.summary()}
    if sampler.energy_j is not None:
        row["sustained_mj_per_gemm"] = sampler.energy_j * 1e3 / (replays * len(weights))
        row["sustained_pj_per_flop"] = sampler.energy_j * 1e12 / (replays * len(weights) * flop)
    print({key: round(v, 1) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    return row


def plot(report: dict[str, Any], json_path: Path) -> Path:
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r['shape']}\nM={r['m']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["burst_tflops"] for r in rows], width=0.4, label="burst")
    ax.bar([x + 0.2 for x in xs], [r["sustained_tflops"] for r in rows], width=0.4, label="sustained")
    for x, r in zip(xs, rows):
        if "sm_clock_mhz" in r:
            ax.annotate(f"{r['sm_clock_mhz']:.0f} MHz", (x + 0.2, r["sustained_tflops"]), ha="center", fontsize=6,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"cuBLAS burst vs sustained · {report['gpu']} · {report['date']} · {report['commit']}", fontsize=9)
    ax.legend(fontsize=7)
    return save_beside(fig, json_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[10, 320])
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = [measure(name, m, args.seconds) for name in SHAPES for m in args.tokens]
    report = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "commit": os.environ.get("BLOCKSPEC_COMMIT", "unknown"), "rows": rows}
    print(plot(report, save_report(args.out, "sustained_gemm", report)))


if __name__ == "__main__":
    main()
