"""Plots a greedy_drift_<date>_<commit>.json: the fp32 top-1 − top-2 logit margin at each first divergence, one
histogram per pair, with the largest margin of the target-only baseline (bs 1 vs bs B) marked."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from plot_common import plt, save_beside


def baseline_pair(summary: dict[str, Any]) -> str:
    """The target-only pair (target_bs1 vs target_bsB) of a result with one baseline pair: the one without dflash."""
    return next(pair for pair in summary if "dflash" not in pair)


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    summary: dict[str, Any] = report["summary"]
    margins = {pair: [r["fp32_margin"] for r in report["rows"] if r["pair"] == pair and r["fp32_margin"] is not None]
               for pair in summary}
    every = [m for values in margins.values() for m in values]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    labels = [f"{pair}: {len(values)}/{sum(r['pair'] == pair for r in report['rows'])} diverge"
              for pair, values in margins.items()]
    if every:
        top = max(every) or 1.0
        ax.hist(list(margins.values()), bins=[top * i / 12 for i in range(13)], label=labels)
    else:
        ax.text(0.5, 0.5, "no divergence in any pair", ha="center", transform=ax.transAxes)
        for label in labels:
            ax.plot([], [], label=label)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    # NOTE: results since --baseline-batch-sizes name their baseline's largest margin; older ones have one baseline pair
    baseline_max = report["baseline_max_margin"] if "baseline_max_margin" in report else \
        summary[baseline_pair(summary)]["max_margin"]
    if baseline_max is not None:
        ax.axvline(baseline_max, color="k", linestyle=":", label=f"baseline max margin {baseline_max:.3f}")
    ax.set_xlabel("fp32 top-1 − top-2 logit margin at the first divergence")
    ax.set_ylabel("prompts")
    ax.set_title(f"greedy drift · {report['gpu']} · {report['date']} · commit {report['commit']}", fontsize=9)
    ax.legend(fontsize=7)
    return save_beside(fig, path)


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
