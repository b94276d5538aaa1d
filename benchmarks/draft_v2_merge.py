"""One draft_v2 result from the documents of several machines of one commit: a lease lost between the bench stage
(the shipped draft's held-out and server numbers) and a later train stage (a run's) leaves each in its own
draft_v2_<date>_<commit>.json. Their runs, shipped record and server rows are put back into one stage state and the
result written again (with its plot), so the choice to replace the shipped draft reads from one document.

Usage: python draft_v2_merge.py OUT_DIR RESULT.json RESULT.json [...]   (the inputs outside OUT_DIR: the merged
document takes their name there)"""
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
        details = document["details"]
        for name, run in document["runs"].items():
            if name in state.data["runs"] and state.data["runs"][name] != run:
                raise ValueError(f"run {name!r} differs between the results")
            state.data["runs"][name] = run
        shipped = {k: v for k, v in details["shipped"].items() if k != "server_c1_speedup"}
        if shipped and state.data.get("shipped", shipped) != shipped:
            raise ValueError("the shipped draft's records differ between the results")
        state.data.update({"shipped": shipped} if shipped else {})
        for row in details["server_rows"]:
            if row["label"] in rows and rows[row["label"]] != row:
                raise ValueError(f"server row {row['label']!r} differs between the results")
            rows[row["label"]] = row
        if details.get("chosen_run") is not None and details["chosen_run"] in rows:  # NOTE: bench --run's choice
            state.data["chosen_run"] = details["chosen_run"]
    state.data["server_rows"] = list(rows.values())
    state.data["server_speedups"] = speedups(state.data["server_rows"])
    return state


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, paths = Path(argv[0]), [Path(a) for a in argv[1:]]
    documents = [json.loads(p.read_text()) for p in paths]
    date, commit, smoke = max(d["date"] for d in documents), documents[0]["commit"], bool(documents[0]["details"]["smoke"])
    target = (out_dir / f"draft_v2_{date}_{commit}{'_smoke' if smoke else ''}.json").resolve()
    if any(p.resolve() == target for p in paths):
        raise SystemExit(f"error: the merged result would overwrite the input {target}: keep the inputs elsewhere")
    with tempfile.TemporaryDirectory() as tmp:
        state = merged_state(documents, Path(tmp))
        first = documents[0]
        path = write_result(state, out_dir, first["gpu"], commit, smoke, date=date)
    from plot_draft_v2 import plot

    print(f"wrote {path} and {plot(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
