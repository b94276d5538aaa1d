"""Plots a step_latency_<date>.json (spec cycle and target-only decode vs batch size, graphs on/off, floor)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from plot_common import finish_axis, plt, save_beside


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    backends = report.get("backends", ["triton"])
    rows = [r for r in report["rows"] if r.get("backend", "triton") == backends[0] and r.get("tp", 1) == 1]
    others = backends[1:]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for spec, graphs, style in [(True, True, "o-"), (True, False, "o--"), (False, True, "s-"), (False, False, "s--")]:
            sel = sorted((r for r in rows if r["context"] == context and r["spec"] == spec and r["graphs"] == graphs), key=lambda r: r["bs"])
            label = f"{'DFlash cycle' if spec else 'target decode'}, graphs {'on' if graphs else 'off'}, {backends[0]}"
            ax.plot([r["bs"] for r in sel], [r["cycle_ms"] for r in sel], style, label=label)
        for backend in others:
            sel = sorted((r for r in report["rows"] if r.get("backend") == backend and r["context"] == context
                          and r["spec"] and r["graphs"] and r.get("tp", 1) == 1), key=lambda r: r["bs"])
            ax.plot([r["bs"] for r in sel], [r["cycle_ms"] for r in sel], "^-", label=f"DFlash cycle, graphs on, {backend}")
        floor = sorted((r for r in rows if r["context"] == context and r["spec"] and r["graphs"]), key=lambda r: r["bs"])
        sustained = [r for r in floor if "sustained_greedy_cycle_ms" in r]
        if sustained:
            ax.plot([r["bs"] for r in sustained], [r["sustained_greedy_cycle_ms"] for r in sustained], "x-.",
                    label="DFlash cycle graph, sustained (power settled)")
        ax.plot([r["bs"] for r in floor], [r["floor_ms"] for r in floor], "k:", label="DFlash floor (bytes / BW)")
        for ref in report.get("dflash_reference", []):
            if ref.get("context") == context:
                ax.axhline(ref["cycle_ms"], color="gray", alpha=0.5, label="z-lab dflash_generate (bs 1)")
        finish_axis(ax, "batch size", "ms per step", f"Llama-3.1-8B shapes, context {context}")
    fig.suptitle(f"{report['gpu']} · {report['date']} · commit {report['commit']} · simulated accept len {report['accept_len']}")
    return save_beside(fig, path)


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
