"""Plots a prefill_latency_<date>.json: eager vs piecewise CUDA graphs per token count."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from plot_common import finish_axis, plt, save_beside


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in (False, True):
        for bs, color in ((1, "tab:blue"), (8, "tab:orange")):
            sel = sorted((r for r in rows if r["spec"] == spec and r["bs"] == bs), key=lambda r: r["tokens"])
            if not sel:
                continue
            tag = f"bs {bs}{', DFlash (aux capture)' if spec else ''}"
            style = "-" if spec else ":"
            ax.plot([r["tokens"] for r in sel], [r["eager_ms"] for r in sel], "x" + style, color=color, alpha=0.5, label=f"eager, {tag}")
            ax.plot([r["tokens"] for r in sel], [r["piecewise_ms"] for r in sel], "o" + style, color=color, label=f"piecewise, {tag}")
    title = f"Prefill, Llama-3.1-8B shapes · {report['gpu']} · {report['date']} · {report['commit']}"
    finish_axis(ax, "tokens in the extend batch", "ms per forward", title, title_size=9)
    return save_beside(fig, path)


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
