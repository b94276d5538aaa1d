"""cuBLAS (torch.nn.functional.linear) on the Llama-3.1-8B GEMM shapes of a DFlash cycle, bf16, on one GPU.

For each weight (qkv, o_proj, gate_up, down, lm_head, draft fc) and token count M (1 request x block 10 up to 64
requests), times one F.linear as 20 launches inside a CUDA graph, and compares it with the memory floor (weight bytes
÷ copy bandwidth measured in this run) and with variants an engine could pick per captured batch size when cuBLAS's
choice for that M is poor: M padded up, the output split into two GEMMs. Writes JSON to --out."""
from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from device_timing import graphed_us as graph_us, read_bandwidth, save_report

SHAPES = {  # name: (in_features, out_features)
    "qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
    "lm_head": (4096, 128256), "draft_fc": (20480, 4096),
}


def pad_to(m: int, multiple: int) -> int:
    return -(-m // multiple) * multiple


def time_shape(name: str, k: int, n: int, m: int, bandwidth: float) -> dict[str, Any]:
    """F.linear at M tokens, and variants: M padded to a multiple of 64 / 128 (when it is not), the output split in
    two GEMMs at n/2 and (for qkv) at the q | kv boundary."""
    weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def split_at(cut: int) -> Callable[[], Any]:
        first, second = weight[:cut], weight[cut:]
        return lambda: (torch.matmul(x, first.t(), out=out[:, :cut]), torch.matmul(x, second.t(), out=out[:, cut:]))

    row: dict[str, Any] = {"shape": name, "m": m, "k": k, "n": n, "floor_us": n * k * 2 / bandwidth * 1e6,
                           "linear_us": graph_us(lambda: F.linear(x, weight))}
    for multiple in (64, 128):
        padded = pad_to(m, multiple)
        if padded != m:
            x_padded = torch.zeros(padded, k, dtype=torch.bfloat16, device="cuda")
            row[f"pad{multiple}_us"] = graph_us(lambda: F.linear(x_padded, weight))
    row["split_half_us"] = graph_us(split_at(n // 2))
    if name == "qkv":
        row["split_q_kv_us"] = graph_us(split_at(k))
    row["linear_over_floor"] = row["linear_us"] / row["floor_us"]
    row["linear_tflops"] = 2 * m * n * k / (row["linear_us"] * 1e-6) / 1e12
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[10, 40, 160, 320, 640])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    report = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "commit": os.environ.get("BLOCKSPEC_COMMIT", "unknown"), "torch": torch.__version__,
              "bandwidth_bytes_per_s": bandwidth, "rows": []}
    variants = ("pad64_us", "pad128_us", "split_half_us", "split_q_kv_us")
    print(f"{'shape':>9} {'M':>4} {'linear us':>10} {'x floor':>8} {'TFLOP/s':>8} " + " ".join(f"{v[:-3]:>10}" for v in variants))
    for name in args.shapes:
        k, n = SHAPES[name]
        for m in args.tokens:
            row = time_shape(name, k, n, m, bandwidth)
            report["rows"].append(row)
            cells = " ".join(f"{row[v]:10.1f}" if v in row else f"{'-':>10}" for v in variants)
            print(f"{name:>9} {m:>4} {row['linear_us']:10.1f} {row['linear_over_floor']:8.2f} "
                  f"{row['linear_tflops']:8.0f} {cells}", flush=True)
    save_report(args.out, "gemm_shapes", report)


if __name__ == "__main__":
    main()
