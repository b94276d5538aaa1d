"""One draft_v2 result from the documents of several machines of one commit: a lease lost between the bench stage
(the shipped draft's held-out and server numbers) and a later train stage (a run's) leaves each in its own
draft_v2_<date>_<commit>.json. Their runs, shipped record and server rows are put back into one stage state and the
result written again (with its plot), so the choice to replace the shipped draft reads from one document.

Usage: python draft_v2_merge.py OUT_DIR RESULT.json RESULT.json [...]"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from draft_v2_report import State, write_result
from draft_v2_server import speedups


def merged_state(documents: list[dict[str, Any]], state_dir: Path) -> State:
    """A stage state holding every document's runs, the shipped record and the server rows (one row per label)."""
    identities = {(d["gpu"], d["commit"], bool(d["details"]["smoke"])) for d in documents}
    if len(identities) != 1:
        raise ValueError(f"results of different GPUs, commits or scales do not merge: {sorted(identities)}")
    data_records = {json.dumps(d["details"].get("data"), sort_keys=True) for d in documents}
    if len(data_records) != 1:
        raise ValueError("results of different data stages do not merge: their held-out sets differ")
    state = State(state_dir)
    state.data["data"] = documents[0]["details"].get("data")
    rows: dict[str, dict[str, Any]] = {}
    for document in documents:
        for name, run in document["runs"].items():
            if name in state.data["runs"] and state.data["runs"][name] != run:
                raise ValueError(f"run {name!r} differs between the results")
            state.data["runs"][name] = run
        shipped = {k: v for k, v in document["details"]["shipped"].items() if k != "server_c1_speedup"}
        if shipped:
            state.data["shipped"] = shipped
        for row in document["details"]["server_rows"]:
            rows[row["label"]] = row
    state.data["server_rows"] = list(rows.values())
    state.data["server_speedups"] = speedups(state.data["server_rows"])
    return state


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, paths = Path(argv[0]), [Path(a) for a in argv[1:]]
    documents = [json.loads(p.read_text()) for p in paths]
    with tempfile.TemporaryDirectory() as tmp:
        state = merged_state(documents, Path(tmp))
        first = documents[0]
        path = write_result(state, out_dir, first["gpu"], first["commit"], bool(first["details"]["smoke"]),
                            date=max(d["date"] for d in documents))
    from plot_draft_v2 import plot

    print(f"wrote {path} and {plot(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
