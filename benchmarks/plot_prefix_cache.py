"""Plots a prefix_cache_<date>_<commit>.json: throughput, TTFT p50 (log scale) and accept length per workload and
shape, radix cache off vs on."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from plot_common import plt, save_titled

PANELS = (("tok_s", "output tokens/s", False), ("ttft_p50_ms", "TTFT p50 (ms)", True), ("accept_len", "accept length", False))


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows: list[dict[str, Any]] = report["rows"]
    groups = sorted({(r["shape"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.5))
    width = 0.38
    for ax, (key, label, log) in zip(axes, PANELS):
        for offset, cache, color in ((-width / 2, "off", "C7"), (width / 2, "on", "C0")):
            values = []
            for group in groups:
                match = [r for r in rows if (r["shape"], r["workload"]) == group and r["cache"] == cache]
                values.append(float(match[0][key] or 0.0) if match else 0.0)
            ax.bar([i + offset for i in range(len(groups))], values, width, color=color, label=f"cache {cache}")
        ax.set_xticks(range(len(groups)), [f"{w}\n{s}" for s, w in groups], fontsize=8)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.set_title(label)
        ax.legend(fontsize=7)
    return save_titled(fig, report, path, prefix="radix prefix cache · ")


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
