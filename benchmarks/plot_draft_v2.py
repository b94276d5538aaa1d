"""Plot of a draft_v2 result: held-out accept length per draft (shipped and every run) against the goals, and the demo
server's tokens/s at one client, target alone and with each draft. Usage: python plot_draft_v2.py RESULT.json"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from plot_common import plt, save_beside

SETS = (("gsm8k_heldout", 4.0), ("general_heldout", 3.0), ("gsm8k_long_heldout", None))  # NOTE: the last: no goal


def set_values(record: dict) -> dict:
    """A draft's accept length per held-out set, from its newest eval run (`accept` holds the goal sets' copies)."""
    return {name: run["accept_length"] for name, run in (record.get("eval") or {}).items()}


def plot(json_path: Path) -> Path:
    data = json.loads(json_path.read_text())
    details = data["details"]
    drafts = {"shipped": set_values(details["shipped"])}
    drafts.update({name: set_values(run) for name, run in data["runs"].items()})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(drafts))
    for i, (name, accept) in enumerate(drafts.items()):
        xs = [j + (i - (len(drafts) - 1) / 2) * width for j in range(len(SETS))]
        values = [accept.get(s) or 0.0 for s, _ in SETS]
        bars = left.bar(xs, values, width, label=name)
        left.bar_label(bars, fmt="%.2f", fontsize=7)
    for j, (_, goal) in enumerate(SETS):
        if goal is not None:
            left.hlines(goal, j - 0.45, j + 0.45, colors="k", linestyles="dashed", linewidth=1)
    left.set_xticks(range(len(SETS)), [s for s, _ in SETS])
    left.set_ylabel("accept length (tokens per verify, block 16)")
    left.set_title("held-out prompts (dashed: goal)")
    left.legend(fontsize=7)
    rows = [r for r in details["server_rows"] if "error" not in r]
    if rows:
        bars = right.bar([r["label"] for r in rows], [r["server_tok_s"] for r in rows], color="tab:gray")
        labels = []
        target = next((r["server_tok_s"] for r in rows if r["label"] == "target_only"), None)
        for row in rows:
            ratio = f"{row['server_tok_s'] / target:.2f}x" if target else ""
            accept = row.get("server_accept_length")
            labels.append(ratio + (f", τ {accept:.2f}" if accept else ""))
        right.bar_label(bars, labels=labels, fontsize=7)
    right.set_ylabel("tokens/s, 1 streaming client")
    right.set_title(f"demo pair through the server ({data['gpu']})")
    fig.suptitle(f"draft v2 (#24), {data['date']}, commit {data['commit']}", fontsize=10)
    return save_beside(fig, json_path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: plot_draft_v2.py RESULT.json")
    print(plot(Path(sys.argv[1])))
