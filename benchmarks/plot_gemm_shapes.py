"""Plots a gemm_shapes_<date>.json: cuBLAS time ÷ weight-read floor per shape against the token count M."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from plot_common import finish_axis, plt, save_beside


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sel = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["m"])
        ax.plot([r["m"] for r in sel], [r["linear_us"] / r["floor_us"] for r in sel], "o-", label=shape)
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1, label="weight read at copy bandwidth")
    title = f"cuBLAS on Llama-3.1-8B GEMM shapes · {report['gpu']} · {report['date']} · {report['commit']}"
    finish_axis(ax, "tokens M (bs x block of 10)", "time ÷ weight-read floor", title, title_size=9)
    return save_beside(fig, path)


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
