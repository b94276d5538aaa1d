"""Plots a deterministic_cost_<date>_<commit>.json: per context, the DFlash cycle and target-only decode step against
batch size with --enable-deterministic-inference off and on, and the on ÷ off ratios (cycle, verify, decode)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from plot_common import finish_axis, plt, save_beside


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows, cost = report["rows"], report["cost"]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(2, len(contexts), figsize=(6 * len(contexts), 8), squeeze=False)
    for column, context in enumerate(contexts):
        ax = axes[0][column]
        for spec in (True, False):
            for deterministic, style in ((False, "--"), (True, "-")):
                sel = sorted((r for r in rows if r["context"] == context and r["spec"] == spec
                              and r["deterministic"] == deterministic), key=lambda r: r["bs"])
                label = f"{'DFlash cycle' if spec else 'target decode'}, deterministic {'on' if deterministic else 'off'}"
                ax.plot([r["bs"] for r in sel], [r["cycle_ms"] for r in sel], ("o" if spec else "s") + style,
                        label=label)
        finish_axis(ax, "batch size", "ms per step", f"context {context}")
        ax = axes[1][column]
        for spec, key, style in ((True, "cycle_on_over_off", "o-"), (True, "verify_on_over_off", "^-"),
                                 (True, "propose_on_over_off", "v-"), (False, "cycle_on_over_off", "s-")):
            sel = sorted((r for r in cost if r["context"] == context and r["spec"] == spec and key in r),
                         key=lambda r: r["bs"])
            name = key.replace("_on_over_off", "")
            ax.plot([r["bs"] for r in sel], [r[key] for r in sel], style,
                    label=f"{'DFlash' if spec else 'target'} {name if spec else 'decode'}")
        ax.axhline(1.0, color="gray", lw=0.8)
        finish_axis(ax, "batch size", "deterministic on ÷ off", f"cost, context {context}")
    prefill = {r["deterministic"]: r["prefill_ms"] for r in rows if not r["spec"]}
    note = f" · prefill {rows[0]['prefill_tokens']} tok: {prefill.get(False, 0):.1f} → {prefill.get(True, 0):.1f} ms"
    fig.suptitle(f"--enable-deterministic-inference cost · {report['gpu']} · {report['date']} · commit "
                 f"{report['commit']}\n{report['shapes']}{note}", fontsize=9)
    return save_beside(fig, path)


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
