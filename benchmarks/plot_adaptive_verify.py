"""Plots an adaptive_verify_<date>_<commit>.json: tokens/s against batch size per (profile, context) for target-only,
fixed DFlash and adaptive DFlash (the verify length adaptive ended on is written beside each point)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from plot_common import finish_axis, plt, save_beside


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows = report["rows"]
    profiles = sorted({r["profile"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(profiles), len(contexts), figsize=(6 * len(contexts), 4.2 * len(profiles)),
                             squeeze=False)
    for i, profile in enumerate(profiles):
        for j, context in enumerate(contexts):
            ax = axes[i][j]
            sel = sorted((r for r in rows if r["profile"] == profile and r["context"] == context), key=lambda r: r["bs"])
            sizes = [r["bs"] for r in sel]
            for key, style, label in (("target_tok_s", "s-", "target-only"), ("fixed_tok_s", "o--", "DFlash, full block"),
                                      ("adaptive_tok_s", "^-", "DFlash, adaptive verify")):
                ax.plot(sizes, [r[key] for r in sel], style, label=label)
            for r in sel:
                ax.annotate(f"n={r['adaptive_num_draft_tokens']}", (r["bs"], r["adaptive_tok_s"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 4))
            ax.set_yscale("log")
            finish_axis(ax, "batch size", "tokens/s (all requests)", f"profile {profile}, context {context}", 10)
    fig.suptitle(f"adaptive verify · {report['gpu']} · {report['date']} · commit {report['commit']} · {report['shapes']}")
    return save_beside(fig, path)


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
