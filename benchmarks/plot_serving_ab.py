"""Plots the variants of one serving A/B call (`scripts/device_serving_ab.sh`: serving_vs_engine JSONs of one level,
one per variant) side by side: engine and server tok/s per variant with server ÷ engine on the bars, and TTFT
p50 / p99. Writes OUT (a PNG); the title names the GPU, date and commits of the inputs.

    python benchmarks/plot_serving_ab.py --out results/X.png results/serving_vs_engine_<date>_<commit>_ab_*.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from plot_common import plt


def variant_name(path: Path, report: dict[str, Any]) -> str:
    """`<commit> <tag>` from a serving_vs_engine_<date>_<commit>_ab_<tag>.json name."""
    tag = path.stem.split("_ab_", 1)[1] if "_ab_" in path.stem else path.stem
    return f"{report['commit']}\n{tag}"


def plot(paths: list[Path], out: Path) -> Path:
    reports = [json.loads(p.read_text()) for p in paths]
    rows = [(variant_name(p, r), row) for p, r in zip(paths, reports) for row in r["rows"]]
    if not rows:
        raise SystemExit("no rows in the given JSONs")
    fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(rows) + 4), 4.5))
    x = list(range(len(rows)))
    labels = [f"{name}\n{row['shape']} {row['mode']} @{row['concurrency']}" for name, row in rows]
    width = 0.38
    tok_ax.bar([i - width / 2 for i in x], [row["engine_tok_s"] for _, row in rows], width, label="offline engine")
    bars = tok_ax.bar([i + width / 2 for i in x], [row["server_tok_s"] for _, row in rows], width, label="server")
    for bar, (_, row) in zip(bars, rows):
        ratio = row.get("server_over_engine")
        if ratio is not None:
            tok_ax.annotate(f"{ratio:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=8)
    tok_ax.set_ylabel("output tok/s (bar label: server ÷ engine)")
    ttft_ax.bar([i - width / 2 for i in x], [row["ttft_p50_ms"] for _, row in rows], width, label="TTFT p50")
    ttft_ax.bar([i + width / 2 for i in x], [row["ttft_p99_ms"] for _, row in rows], width, label="TTFT p99")
    ttft_ax.set_ylabel("ms")
    for ax in (tok_ax, ttft_ax):
        ax.set_xticks(x, labels, fontsize=7)
        ax.legend(fontsize=7)
    gpus = sorted({r["gpu"] for r in reports})
    dates = sorted({r["date"] for r in reports})
    commits = sorted({r["commit"] for r in reports})
    fig.suptitle(f"serving A/B · {', '.join(gpus)} · {', '.join(dates)} · commits {', '.join(commits)}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="PNG path")
    parser.add_argument("jsons", type=Path, nargs="+", help="serving_vs_engine JSONs, one per variant, in plot order")
    args = parser.parse_args()
    print(f"wrote {plot(args.jsons, args.out)}")


if __name__ == "__main__":
    main()
