"""benchmarks/draft_v2.py's records: the state that stages share (summary.json under the state directory), the
result document (`draft_v2_<date>_<commit>.json`: the issue's three goal keys at top level, then gpu, date, commit,
per-run details and the rest under `details`), the server speed-ups, asset size checks and the draft packed in parts
small enough to come back from the device.

One result from the documents of several machines of one commit: a lease lost between the bench stage (the shipped
draft's held-out and server numbers) and a later train stage (a run's) leaves each in its own
draft_v2_<date>_<commit>.json. `merged_state` puts their runs, shipped record and server rows back into one stage
state and the result is written again (with its plot), so the choice to replace the shipped draft reads from one
document.

Usage: python -m benchmarks.draft_v2_report OUT_DIR RESULT.json RESULT.json [...]   (the inputs outside OUT_DIR: the
merged document takes their name there)"""
from __future__ import annotations

import datetime
import io
import json
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Optional

from benchmarks.results import plot_result


GSM8K_SET, GENERAL_SET = "gsm8k_heldout", "general_heldout"
GOALS = {"gsm8k_heldout_accept": 4.0, "general_heldout_accept": 3.0, "server_c1_speedup": 2.5}
ASSET_LIMIT_MIB, SHARD_LIMIT_MIB = 64.0, 12.0
PART_BYTES = 15 * 2**20  # NOTE: files back from the device are capped at 16 MiB each
MIB = 2**20


class State:
    """summary.json: what every stage measured so far (data counts, runs, the shipped draft, server rows)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "summary.json"
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.data.setdefault("runs", {})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def set_accepts(info: dict[str, Any]) -> dict[str, Optional[float]]:
    """The newest eval run's accept length per held-out set of a training_info.json."""
    runs = info.get("eval_runs") or []
    sets = runs[-1]["sets"] if runs else {}
    return {name: (float(sets[name]["accept_length"]) if name in sets else None) for name in (GSM8K_SET, GENERAL_SET)}


def asset_stats(draft_dir: Path) -> dict[str, Any]:
    """The draft's size against the asset rule (MiB to 4 decimals: a file a few bytes over a limit reads over it; a
    rank-128 selector codebook over a 49,152-token vocabulary is exactly 12 MiB, and its shard's header is not)."""
    shards = sorted(draft_dir.glob("*.safetensors"))
    sizes = [p.stat().st_size for p in shards]
    total = sum(p.stat().st_size for p in draft_dir.iterdir() if p.is_file())
    return {"asset_mib": round(total / MIB, 4), "largest_shard_mib": round(max(sizes, default=0) / MIB, 4),
            "shards": len(shards)}


def pack_draft(draft_dir: Path, out_dir: Path, name: str) -> list[Path]:
    """`draft_dir` as one tar cut into parts of at most PART_BYTES: `cat NAME.tar.part* | tar x` restores it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(draft_dir, arcname=name)
    data = buffer.getvalue()
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for number, start in enumerate(range(0, len(data), PART_BYTES)):
        part = out_dir / f"{name}.tar.part{number:02d}"
        part.write_bytes(data[start:start + PART_BYTES])
        parts.append(part)
    return parts


def best_run(runs: dict[str, Any]) -> Optional[str]:
    """The run with the highest sum of its two held-out accept lengths (both measured)."""
    scored = {name: r["accept"] for name, r in runs.items() if None not in r["accept"].values()}
    return max(scored, key=lambda n: sum(scored[n].values())) if scored else None


def goal(value: Optional[float], threshold: float, at_most: bool = False) -> dict[str, Any]:
    met = None if value is None else (value <= threshold if at_most else value >= threshold)
    return {"value": value, "goal": ("<= " if at_most else ">= ") + str(threshold), "met": met}


def result_document(state: State, gpu: str, commit: str, smoke: bool, date: Optional[str] = None) -> dict[str, Any]:
    runs: dict[str, Any] = state.data["runs"]
    chosen = state.data.get("chosen_run") or best_run(runs)
    run = runs.get(chosen or "", {})
    accept = run.get("accept", {GSM8K_SET: None, GENERAL_SET: None})
    speedup = (state.data.get("server_speedups") or {}).get(chosen or "")
    shipped = state.data.get("shipped", {})
    shipped_accept = shipped.get("accept", {})
    wins = {name: (accept.get(name) is not None and shipped_accept.get(name) is not None
                   and accept[name] > shipped_accept[name]) for name in (GSM8K_SET, GENERAL_SET)}
    asset = run.get("asset", {})
    details = {
        "smoke": smoke, "chosen_run": chosen, "data": state.data.get("data"),
        "shipped": {**shipped, "server_c1_speedup": (state.data.get("server_speedups") or {}).get("shipped")},
        "replaces_shipped": all(wins.values()) if shipped_accept else None, "wins_over_shipped": wins,
        "server_rows": state.data.get("server_rows", []),
        "goals": {
            "gsm8k_heldout_accept": goal(accept.get(GSM8K_SET), GOALS["gsm8k_heldout_accept"]),
            "general_heldout_accept": goal(accept.get(GENERAL_SET), GOALS["general_heldout_accept"]),
            "server_c1_speedup": goal(speedup, GOALS["server_c1_speedup"]),
            "asset_mib": goal(asset.get("asset_mib"), ASSET_LIMIT_MIB, at_most=True),
            "largest_shard_mib": goal(asset.get("largest_shard_mib"), SHARD_LIMIT_MIB, at_most=True),
        },
    }
    return {
        "gsm8k_heldout_accept": accept.get(GSM8K_SET), "general_heldout_accept": accept.get(GENERAL_SET),
        "server_c1_speedup": speedup, "gpu": gpu, "date": date or datetime.date.today().isoformat(), "commit": commit,
        "runs": runs, "details": details,
    }


def write_result(state: State, out_dir: Path, gpu: str, commit: str, smoke: bool, date: Optional[str] = None) -> Path:
    document = result_document(state, gpu, commit, smoke, date)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"draft_v2_{document['date']}_{commit}{'_smoke' if smoke else ''}.json"
    path.write_text(json.dumps(document, indent=1, default=str))
    return path


def speedups(rows: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    """Each DFlash row's tokens/s over the target-only row's (None where either failed)."""
    target = next((r for r in rows if r["label"] == "target_only" and "error" not in r), None)
    result: dict[str, Optional[float]] = {}
    for row in rows:
        if row["label"] == "target_only":
            continue
        ok = target is not None and "error" not in row and target["server_tok_s"] > 0
        result[row["label"]] = row["server_tok_s"] / target["server_tok_s"] if ok and target else None
    return result


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
    date, commit = max(d["date"] for d in documents), documents[0]["commit"]
    smoke = bool(documents[0]["details"]["smoke"])
    target = (out_dir / f"draft_v2_{date}_{commit}{'_smoke' if smoke else ''}.json").resolve()
    if any(p.resolve() == target for p in paths):
        raise SystemExit(f"error: the merged result would overwrite the input {target}: keep the inputs elsewhere")
    with tempfile.TemporaryDirectory() as tmp:
        state = merged_state(documents, Path(tmp))
        first = documents[0]
        path = write_result(state, out_dir, first["gpu"], commit, smoke, date=date)
    print(f"wrote {path}; {plot_result(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
