"""Plots a frontend_capacity_<date>_<commit>.json: the server's share of the stand-in's paced ceiling and the server
process's CPU per engine delta vs closed-loop concurrency, one line per pace."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from plot_common import concurrency_ticks, finish_axis, plt, save_titled


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows: list[dict[str, Any]] = report["rows"]
    fig, (share_ax, cpu_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, preset in enumerate(dict.fromkeys(r["preset"] for r in rows)):
        mine = sorted((r for r in rows if r["preset"] == preset), key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in mine]
        share_ax.plot(x, [r["server_over_paced"] for r in mine], "o-", color=f"C{index}", label=preset)
        cpu_ax.plot(x, [r["server_cpu_us_per_chunk"] for r in mine], "o-", color=f"C{index}", label=preset)
    share_ax.axhline(0.9, color="gray", ls="--", alpha=0.6, label="0.90")
    finish_axis(share_ax, "concurrent clients", "server tok/s ÷ paced ceiling", "server share of the stand-in's pace")
    finish_axis(cpu_ax, "concurrent clients", "server CPU µs per engine delta", "server process CPU per delta")
    cpu_ax.set_yscale("log")
    concurrency_ticks((share_ax, cpu_ax), rows)
    return save_titled(fig, report, path)


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
