"""What the benchmark plots share: a headless matplotlib, log2 x axes, and a PNG saved beside the JSON."""
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
