"""Summarises a same-run A/B of benchmarks/step_latency.py (scripts/device_ab.sh): per side and row, the cycle times
of every round, their median and spread, and new ÷ parent. Writes step_latency_ab_<date>_<new>_vs_<parent>.json and
a plot beside it.

Usage: python benchmarks/step_latency_ab.py benchmarks/results/step_latency_<date>_ab_*.json
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from plot_common import finish_axis, plt, save_beside

KEYS = ("cycle_ms", "sync_cycle_ms", "greedy_cycle_ms")


def summarise(paths: list[Path]) -> dict[str, Any]:
    reports = [json.loads(p.read_text()) for p in paths]
    sides: dict[str, list[dict[str, Any]]] = {}
    for path, report in zip(paths, reports):
        side = "new" if "_ab_new_" in path.name else "parent"
        sides.setdefault(side, []).append(report)
    commits = {side: runs[0]["commit"] for side, runs in sides.items()}
    rows = []
    for row in sides["new"][0]["rows"]:
        key = (row["spec"], row["bs"], row["context"])
        entry: dict[str, Any] = {"spec": row["spec"], "bs": row["bs"], "context": row["context"]}
        for side, runs in sides.items():
            for name in KEYS:
                values = [r[name] for run in runs for r in run["rows"]
                          if (r["spec"], r["bs"], r["context"]) == key and name in r]
                if values:
                    entry[f"{side}_{name}"] = values
                    entry[f"{side}_{name}_median"] = statistics.median(values)
        entry["new_over_parent"] = entry["new_cycle_ms_median"] / entry["parent_cycle_ms_median"]
        entry["parent_spread_ms"] = max(entry["parent_cycle_ms"]) - min(entry["parent_cycle_ms"])
        rows.append(entry)
    first = sides["new"][0]
    return {"gpu": first["gpu"], "date": first["date"], "new_commit": commits["new"],
            "parent_commit": commits["parent"], "rounds": {s: len(r) for s, r in sides.items()},
            "accept_len": first["accept_len"], "backends": first["backends"], "rows": rows,
            "sources": [p.name for p in paths]}


def plot(summary: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [f"{'DFlash' if r['spec'] else 'target'} bs {r['bs']}" for r in summary["rows"]]
    for offset, side in ((-0.18, "parent"), (0.18, "new")):
        for i, row in enumerate(summary["rows"]):
            values = row[f"{side}_cycle_ms"]
            ax.scatter([i + offset] * len(values), values, color="tab:gray" if side == "parent" else "tab:blue",
                       label=f"{side} {summary[side + '_commit']}" if i == 0 else None)
    finish_axis(ax, "row (ctx 512)", "ms per step (each round)", "same-run A/B, step_latency")
    ax.set_xscale("linear")
    ax.set_xticks(range(len(labels)), labels)
    fig.suptitle(f"{summary['gpu']} · {summary['date']} · {summary['new_commit']} vs {summary['parent_commit']}")
    return save_beside(fig, path)


if __name__ == "__main__":
    sources = [Path(p) for p in sys.argv[1:]]
    summary = summarise(sources)
    out = sources[0].parent / f"step_latency_ab_{summary['date']}_{summary['new_commit']}_vs_{summary['parent_commit']}.json"
    out.write_text(json.dumps(summary, indent=1))
    for row in summary["rows"]:
        print(f"{'DFlash' if row['spec'] else 'target'} bs {row['bs']:>2}: new {row['new_cycle_ms_median']:.2f} ms, "
              f"parent {row['parent_cycle_ms_median']:.2f} ms ({row['new_over_parent']:.3f}x; parent spread "
              f"{row['parent_spread_ms']:.2f} ms)")
    print(out, plot(summary, out))
