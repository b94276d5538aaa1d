"""Joins serving_vs_engine result JSONs (rows of several device calls, commits or shapes) into one table + plot.

Each row keeps where it came from: `source` (its file), `commit` (its run's), `weights` ("dummy" or "real", read
from its engine's load format where an older file's rows lack it; "unknown" without one); the engines are keyed
"<file>:<shape>/<mode>" (file names must differ). Rows of the same shape, weights, mode, client and level
(concurrency, or Poisson rate) in several files: the later file's row wins (list the files oldest first); rows from
before issue 49 name no client ("generate_stream": streaming /generate against a waves engine). The top-level
`commit` names every commit the rows come from.
Usage: python -m benchmarks.merge_serving_results OUT.json IN.json [IN.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.serving_workload import row_weights


def merge(paths: list[Path], out: Path) -> dict[str, Any]:
    merged: dict[str, Any] = {"gpu": None, "date": None, "commit": None, "sources": [], "engines": {}, "errors": [],
                              "rows": []}
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}  # by (shape, weights, mode, client, level)
    if len({path.name for path in paths}) < len(paths):
        raise ValueError(f"two inputs share a file name: {[path.name for path in paths]}")
    for path in paths:
        data = json.loads(path.read_text())
        if merged["gpu"] not in (None, data["gpu"]):
            raise ValueError(f"{path}: measured on {data['gpu']}, the others on {merged['gpu']}")
        merged.update(gpu=data["gpu"], date=max(merged["date"] or "", data["date"]))
        extra_flags = data.get("flags", {}).get("extra_flags")
        merged["sources"].append({"file": path.name, "commit": data["commit"], "extra_flags": extra_flags})
        for key, engine in data.get("engines", {}).items():
            merged["engines"][f"{path.name}:{key}"] = engine
        merged["errors"] += [{**error, "source": path.name} for error in data.get("errors", [])]
        for row in data["rows"]:
            engine = data.get("engines", {}).get(f"{row['shape']}/{row['mode']}")
            weights = row.get("weights") or (row_weights(engine) if engine is not None else "unknown")
            row = {**row, "weights": weights, "source": path.name, "commit": data["commit"]}
            level = (str(row["concurrency"]), row.get("rate"))
            rows[(row["shape"], row["weights"], row["mode"], row.get("client", "generate_stream"), level)] = row
    commits = [source["commit"] for source in merged["sources"]]
    merged["commit"] = "+".join(dict.fromkeys(commits)) or None
    merged["rows"] = list(rows.values())
    out.write_text(json.dumps(merged, indent=1, default=str))
    return merged


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    merge([Path(p) for p in argv[1:]], out)
    from benchmarks.plots import plot_serving_vs_engine

    print(f"wrote {out} and {plot_serving_vs_engine(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
