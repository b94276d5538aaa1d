"""Plots a serving_vs_engine_<date>_<commit>.json: server ÷ engine throughput and server tok/s vs closed-loop
concurrency, one line per shape and mode (the Poisson run as a lone marker at its mean in-flight requests)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from plot_common import concurrency_ticks, finish_axis, plt, save_titled


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows: list[dict[str, Any]] = report["rows"]
    fig, (ratio_ax, tok_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    def line(row: dict[str, Any]) -> tuple[str, str, str]:
        return row["shape"], row.get("weights", "dummy"), row["mode"]

    for index, key in enumerate(sorted({line(r) for r in rows})):
        color = f"C{index}"
        label = f"{key[0]}{' (real weights)' if key[1] == 'real' else ''} {key[2]}"
        closed = sorted((r for r in rows if line(r) == key and r["concurrency"] != "poisson"),
                        key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in closed]
        ratio_ax.plot(x, [r["server_over_engine"] for r in closed], "o-", color=color, label=label)
        tok_ax.plot(x, [r["server_tok_s"] for r in closed], "o-", color=color, label=f"{label} server")
        tok_ax.plot(x, [r["engine_tok_s"] for r in closed], "s:", color=color, alpha=0.7, label=f"{label} engine")
        for r in rows:
            if line(r) == key and r["concurrency"] == "poisson":
                ratio_ax.plot([max(1.0, r["mean_in_flight"])], [r["server_over_engine"]], "x", color=color, ms=9,
                              label=f"{label} Poisson {r['rate']:.1f} req/s")
    ratio_ax.axhline(0.9, color="gray", ls="--", alpha=0.6, label="goal 0.90")
    finish_axis(ratio_ax, "concurrent clients", "server tok/s ÷ engine tok/s", "server ÷ engine")
    finish_axis(tok_ax, "concurrent clients", "output tokens/s", "throughput (dotted: offline engine, same concurrency)")
    concurrency_ticks((ratio_ax, tok_ax), rows)
    return save_titled(fig, report, path)


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
