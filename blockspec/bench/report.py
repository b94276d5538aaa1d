"""Per-level statistics of the serving benchmark, and its JSON + PNG outputs."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_gaps: tuple[float, ...] = ()
    error: str = ""


@dataclass
class LevelResult:
    concurrency: int
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    mean_e2e_ms: float
    accept_length: Optional[float]
    first_error: str = ""

    def describe(self) -> str:
        accept = "n/a" if self.accept_length is None else f"{self.accept_length:.2f}"
        return (
            f"concurrency {self.concurrency:>3}: {self.completed}/{self.num_prompts} ok in {self.duration_s:.1f}s | "
            f"{self.request_throughput:.2f} req/s, {self.output_throughput:.1f} out tok/s | "
            f"TTFT mean {self.mean_ttft_ms:.1f} ms p99 {self.p99_ttft_ms:.1f} ms | "
            f"TPOT mean {self.mean_tpot_ms:.2f} ms | accept length {accept}"
        )


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(values: Sequence[float], how: str) -> float:
    if not values:
        return 0.0
    if how == "mean":
        return statistics.fmean(values) * 1000.0
    if how == "median":
        return statistics.median(values) * 1000.0
    return percentile(values, 99.0) * 1000.0


def summarise(
    concurrency: int, results: Sequence[RequestResult], duration: float, accept_length: Optional[float]
) -> LevelResult:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    gaps = [g for r in ok for g in r.chunk_gaps]
    duration = max(duration, 1e-9)
    errors = [r.error for r in results if not r.ok]
    return LevelResult(
        concurrency=concurrency,
        num_prompts=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        input_throughput=sum(r.prompt_tokens for r in ok) / duration,
        output_throughput=sum(r.output_tokens for r in ok) / duration,
        mean_ttft_ms=_ms(ttfts, "mean"),
        median_ttft_ms=_ms(ttfts, "median"),
        p99_ttft_ms=_ms(ttfts, "p99"),
        mean_tpot_ms=_ms(tpots, "mean"),
        median_tpot_ms=_ms(tpots, "median"),
        p99_tpot_ms=_ms(tpots, "p99"),
        mean_itl_ms=_ms(gaps, "mean"),
        mean_e2e_ms=_ms([r.latency for r in ok], "mean"),
        accept_length=accept_length,
        first_error=errors[0] if errors else "",
    )


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    x = [level["concurrency"] for level in levels]
    panels = [
        ("output_throughput", "output tokens/s"),
        ("mean_ttft_ms", "mean TTFT (ms)"),
        ("mean_tpot_ms", "mean TPOT (ms)"),
        ("accept_length", "accept length (tokens/verify)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, panels):
        y = [level[key] if level[key] is not None else float("nan") for level in levels]
        ax.plot(x, y, marker="o")
        if all(v != v for v in y):  # NaN everywhere: e.g. no speculative decoding on this server
            ax.text(0.5, 0.5, "not reported", transform=ax.transAxes, ha="center", va="center", color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    server = report.get("server", {})
    fig.suptitle(
        f"blockspec serving: {server.get('model_path')} ({server.get('speculative_algorithm') or 'no speculation'})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(report: dict[str, Any], output_dir: Path, plot_png: bool = True) -> tuple[Path, Optional[Path]]:
    output_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = output_dir / f"serving-{stamp}.json"
    json_path.write_text(json.dumps(report, indent=2))
    if not plot_png:
        return json_path, None
    png_path = output_dir / f"serving-{stamp}.png"
    plot(report, png_path)
    return json_path, png_path
