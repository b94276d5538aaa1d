"""Does prefetching a GEMM's weight into L2 during an idle window make a skinny GEMM faster? (H200, 8B shapes)

Each "layer" is an idle window (a spin kernel standing in for attention, `--window-us`) followed by a GEMM of
M = `--tokens` rows against its own weight (every layer another copy, so weights are cold as in a forward). Variants,
all timed as one CUDA graph of `--layers` layers: the GEMMs alone; window + GEMM; window + GEMM with the weight
prefetched on a side stream from the window's start, per prefetch kind (bulk `cp.async.bulk.prefetch.L2`, one
`prefetch.global.L2` per line, or real loads kept alive by a never-taken store) and program count; the prefetch alone
(hints return before the data arrives, so only the load kind times a transfer); and load + GEMM back to back, which
less the load alone is the GEMM reading a warm L2 (what a perfect prefetch could buy). Writes JSON to --out."""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
from pathlib import Path
from typing import Any, Callable

import torch
import triton
import triton.language as tl

from plot_common import plt, save_beside
from device_timing import graphed_us, read_bandwidth, save_report

CHUNK_BYTES = 4096  # one bulk prefetch per chunk (a multiple of 16 bytes, as cp.async.bulk requires)
LINE_BYTES = 128
SHAPES = {"o_proj": (4096, 4096), "qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@triton.jit
def _prefetch_kernel(base_ptr, num_units, units_per_program, UNIT: tl.constexpr, BLOCK: tl.constexpr,
                     BULK: tl.constexpr):
    """Program p hints units [p * units_per_program, ...) of UNIT bytes into L2: one `cp.async.bulk.prefetch.L2`
    per unit (BULK) or one `prefetch.global.L2` per unit (a 128-byte line)."""
    first = tl.program_id(0) * units_per_program
    last = tl.minimum(first + units_per_program, num_units)
    for start in range(first, last, BLOCK):
        # NOTE: units past `last` are clamped onto it: a repeated prefetch of a resident line is free.
        unit = tl.minimum(start + tl.arange(0, BLOCK), last - 1)
        addresses = base_ptr + unit.to(tl.int64) * UNIT
        if BULK:
            tl.inline_asm_elementwise(f"cp.async.bulk.prefetch.L2.global [$1], {UNIT}; mov.u32 $0, 0;", "=r,l",
                                      [addresses], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addresses],
                                      dtype=tl.int32, is_pure=False, pack=1)


def prefetch_hints(tensor: torch.Tensor, programs: int, bulk: bool) -> None:
    """Hints every whole unit (4 KB bulk chunk or 128-byte line) of the contiguous CUDA `tensor` into L2."""
    assert tensor.is_cuda and tensor.is_contiguous() and tensor.data_ptr() % 16 == 0
    unit = CHUNK_BYTES if bulk else LINE_BYTES
    num_units = tensor.numel() * tensor.element_size() // unit  # a ragged tail stays unhinted
    if num_units == 0:
        return
    programs = min(programs, num_units)
    per_program = triton.cdiv(num_units, programs)
    _prefetch_kernel[(programs,)](tensor.view(-1).view(torch.uint8), num_units, per_program, UNIT=unit,
                                  BLOCK=128 if bulk else 512, BULK=bulk, num_warps=4)


@triton.jit
def _load_lines_kernel(base_ptr, sink_ptr, num_words, words_per_program, BLOCK: tl.constexpr):
    first = tl.program_id(0) * words_per_program
    last = tl.minimum(first + words_per_program, num_words)
    total = tl.zeros([BLOCK], tl.int32)
    for start in range(first, last, BLOCK):
        words = start + tl.arange(0, BLOCK)
        total ^= tl.load(base_ptr + words, mask=words < last, other=0, eviction_policy="evict_last")
    # NOTE: the store keeps the loads alive; it (almost) never happens.
    folded = tl.xor_sum(total, 0)
    tl.store(sink_ptr + tl.program_id(0), folded, mask=folded == 0x5EED5EED)


SINK: dict[int, torch.Tensor] = {}


def prefetch_loads(tensor: torch.Tensor, programs: int) -> None:
    """The alternative that surely lands in L2: the weight read into registers (evict_last) and dropped."""
    words = tensor.view(-1).view(torch.int32)
    sink = SINK.setdefault(programs, torch.empty(programs, dtype=torch.int32, device=tensor.device))
    per_program = triton.cdiv(words.numel(), programs)
    _load_lines_kernel[(programs,)](words, sink, words.numel(), per_program, BLOCK=2048, num_warps=8)


PREFETCHERS: dict[str, Callable[[torch.Tensor, int], None]] = {
    "bulk": lambda tensor, programs: prefetch_hints(tensor, programs, bulk=True),
    "line": lambda tensor, programs: prefetch_hints(tensor, programs, bulk=False),
    "load": prefetch_loads,
}


def graph_ms(body: Callable[[], None]) -> float:
    """ms of one replay of `body` captured as a CUDA graph."""
    return graphed_us(body, launches=1) / 1e3


def spin_cycles(window_us: float) -> int:
    """Spin-kernel cycles lasting about `window_us` (calibrated: the spin counts SM clock cycles)."""
    probe = 200_000
    us = graph_ms(lambda: torch.cuda._sleep(probe)) * 1e3
    return int(probe * window_us / us)


def run_shape(name: str, tokens: int, layers: int, window_us: float, program_counts: list[int]) -> dict[str, Any]:
    n, k = SHAPES[name]
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(layers)]
    x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(tokens, n, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    cycles = spin_cycles(window_us)

    def gemms() -> None:
        for w in weights:
            torch.matmul(x, w.t(), out=out)

    def windows() -> None:
        for _ in weights:
            torch.cuda._sleep(cycles)

    def window_then_gemms() -> None:  # the weight read once right before its GEMM: the GEMM from a warm L2
        for w in weights:
            prefetch_loads(w, 132)
            torch.matmul(x, w.t(), out=out)

    def window_gemms() -> None:
        for w in weights:
            torch.cuda._sleep(cycles)
            torch.matmul(x, w.t(), out=out)

    def prefetched(programs: int, prefetch: Callable[[torch.Tensor, int], None]) -> Callable[[], None]:
        def body() -> None:
            main = torch.cuda.current_stream()
            for w in weights:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch(w, programs)
                torch.cuda._sleep(cycles)
                torch.matmul(x, w.t(), out=out)
            main.wait_stream(side)
        return body

    def prefetch_only(programs: int, prefetch: Callable[[torch.Tensor, int], None]) -> Callable[[], None]:
        def body() -> None:
            for w in weights:
                prefetch(w, programs)
        return body

    row: dict[str, Any] = {"shape": name, "n": n, "k": k, "tokens": tokens, "layers": layers, "window_us": window_us,
                           "weight_mb": n * k * 2 / 1e6}
    per_layer = lambda ms: ms * 1e3 / layers  # noqa: E731
    row["gemm_us"] = per_layer(graph_ms(gemms))
    row["window_us_measured"] = per_layer(graph_ms(windows))
    row["window_gemm_us"] = per_layer(graph_ms(window_gemms))
    row["load_then_gemm_us"] = per_layer(graph_ms(window_then_gemms))
    for (kind, prefetch), programs in itertools.product(PREFETCHERS.items(), program_counts):
        row[f"prefetched_{kind}_{programs}_us"] = per_layer(graph_ms(prefetched(programs, prefetch)))
        row[f"prefetch_only_{kind}_{programs}_us"] = per_layer(graph_ms(prefetch_only(programs, prefetch)))
    print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return row


def plot(report: dict[str, Any], json_path: Path) -> Path:
    """Per shape: window + GEMM without and with each prefetch kind (best program count), and the bound: window +
    a GEMM reading a warm L2."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = report["rows"]
    series: dict[str, list[float]] = {"window + GEMM": [r["window_gemm_us"] for r in rows]}
    for kind in PREFETCHERS:
        series[f"+ {kind} prefetch"] = [min(v for k, v in r.items() if k.startswith(f"prefetched_{kind}_")) for r in rows]
    warm = [r["load_then_gemm_us"] - min(v for k, v in r.items() if k.startswith("prefetch_only_load_")) for r in rows]
    series["window + GEMM from warm L2"] = [r["window_us_measured"] + w for r, w in zip(rows, warm)]
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + (i - len(series) / 2 + 0.5) * width for x in range(len(rows))], values, width=width, label=label)
    ax.set_xticks(range(len(rows)), [f"{r['shape']} M={r['tokens']}" for r in rows], fontsize=8)
    ax.set_ylabel("µs per layer")
    ax.set_title(f"L2 prefetch during a {rows[0]['window_us']:.0f} µs window · {report['gpu']} · {report['date']} · "
                 f"{report['commit']}", fontsize=9)
    ax.legend(fontsize=7)
    return save_beside(fig, json_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["o_proj", "qkv"], choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[10])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--window-us", type=float, default=10.0)
    parser.add_argument("--programs", type=int, nargs="+", default=[16, 32, 132])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    print(f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = [run_shape(s, t, args.layers, args.window_us, args.programs) for s in args.shapes for t in args.tokens]
    report = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "commit": os.environ.get("BLOCKSPEC_COMMIT", "unknown"), "bandwidth_bytes_per_s": bandwidth, "rows": rows}
    print(plot(report, save_report(args.out, "l2_prefetch", report)))


if __name__ == "__main__":
    main()
