"""Plots a prefill_latency_<date>.json: eager vs piecewise CUDA graphs per token count."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


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
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the extend batch")
    ax.set_ylabel("ms per forward")
    ax.set_title(f"Prefill, Llama-3.1-8B shapes · {report['gpu']} · {report['date']} · {report['commit']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
