"""What the benchmark plots share: a headless matplotlib, log2 x axes, concurrency ticks, and a PNG saved beside the
JSON under a title naming the GPU, date and commit."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402,F401  (re-exported for the plot scripts)


def finish_axis(ax: Any, xlabel: str, ylabel: str, title: str, title_size: Optional[float] = None) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    ax.legend(fontsize=7)


def save_beside(fig: Any, json_path: Path) -> Path:
    fig.tight_layout()
    out = json_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def concurrency_ticks(axes: Any, rows: list[dict[str, Any]]) -> None:
    """x ticks at the closed-loop concurrency levels of `rows` (a Poisson row's "poisson" is no level)."""
    ticks = sorted({r["concurrency"] for r in rows if r["concurrency"] != "poisson"})
    for ax in axes:
        ax.set_xticks(ticks, [str(t) for t in ticks])


def save_titled(fig: Any, report: dict[str, Any], json_path: Path, prefix: str = "") -> Path:
    """Titles the figure with the report's GPU, date and commit, saves it beside the JSON and closes it."""
    fig.suptitle(f"{prefix}{report['gpu']} · {report['date']} · commit {report['commit']}", fontsize=10)
    out = save_beside(fig, json_path)
    plt.close(fig)
    return out
