"""One-off probe: cuBLAS GEMM throughput in a short burst vs sustained ~1 s, with SM clock and power (is the bs-32
cycle's GEMM rate power-limited?). Prints one line per shape and M."""
from __future__ import annotations

import argparse

import torch

from step_latency import DeviceSampler

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o_proj": (4096, 4096),
          "lm_head": (128256, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[320])
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args()
    for name, (n, k) in SHAPES.items():
        for m in args.tokens:
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
            torch.cuda._sleep(2_000_000_000 // 1000)  # ~1 ms idle
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            burst_us = start.elapsed_time(end) * 1e3 / len(weights)
            replays = max(1, int(args.seconds * 1e6 / (burst_us * len(weights))))
            with DeviceSampler() as sampler:
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
            sustained_us = start.elapsed_time(end) * 1e3 / (replays * len(weights))
            flop = 2 * m * n * k
            tele = sampler.summary()
            print(f"{name:>8} M={m:4d}: burst {burst_us:8.1f} us ({flop / burst_us / 1e6:5.0f} TFLOP/s)  sustained "
                  f"{sustained_us:8.1f} us ({flop / sustained_us / 1e6:5.0f} TFLOP/s)  "
                  + " ".join(f"{k} {v:.0f}" for k, v in tele.items()), flush=True)
            del weights


if __name__ == "__main__":
    main()
