"""A draft's training_info.json: the commit it was made at, the accept-length evaluations recorded in it (`eval_runs`,
one entry per `--eval-prompts` run, newest last) and the one-line description the demo prints."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from blockspec.train.checkpoint import write_json

INFO_NAME = "training_info.json"


def git_commit() -> Optional[str]:
    """$BLOCKSPEC_COMMIT, else the checkout's HEAD. NOTE: the variable first: a copy of the working tree (the device's)
    may carry a stale .git whose HEAD is not the code that ran (7bb28a6 in v6's info, which ran 1ce39de)."""
    explicit = os.environ.get("BLOCKSPEC_COMMIT")
    if explicit:
        return explicit
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def read_info(draft_dir: str | Path) -> dict[str, Any]:
    path = Path(draft_dir) / INFO_NAME
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error.msg})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return info


def append_eval_run(draft_dir: str | Path, run: dict[str, Any]) -> dict[str, Any]:
    """Adds `run` to the draft's `eval_runs` (the file is created when missing); returns the whole info."""
    info = read_info(draft_dir)
    info.setdefault("eval_runs", []).append(run)
    write_json(Path(draft_dir) / INFO_NAME, json.loads(json.dumps(info, default=str)))
    return info


@dataclass(frozen=True)
class Measurement:
    prompt_set: str
    accept_length: float
    prompts: Optional[int]
    device: Optional[str]


def latest_measurements(info: dict[str, Any]) -> list[Measurement]:
    """The newest `eval_runs` entry's sets; for a draft trained before eval_runs existed, its last training eval."""
    runs = info.get("eval_runs") or []
    if runs:
        last = runs[-1]
        return [
            Measurement(name, float(result["accept_length"]), result.get("prompts"), last.get("device"))
            for name, result in last.get("sets", {}).items() if "accept_length" in result
        ]
    evals = [e for e in (info.get("result") or {}).get("evals", []) if "accept_length" in e]
    if not evals:
        return []
    source = (info.get("options") or {}).get("eval_data")
    name = "/".join(Path(str(source)).with_suffix("").parts[-2:]) if source else "held-out training prompts"
    return [Measurement(name, float(evals[-1]["accept_length"]), info.get("held_out_prompts"), info.get("device"))]


def describe_draft(draft_dir: str | Path) -> str:
    """`<path> (<layers> layers, block <B>); measured accept length: <set> <τ> (<n> prompts, <device>), ...`."""
    directory = Path(draft_dir)
    config = json.loads((directory / "config.json").read_text())
    shape = f"{config.get('num_hidden_layers', '?')} layers, block {config.get('block_size', '?')}"
    measured = latest_measurements(read_info(directory))
    if not measured:
        return f"{directory} ({shape}); no measured accept length in its {INFO_NAME}"
    parts = []
    for m in measured:
        where = ", ".join(x for x in (f"{m.prompts} prompts" if m.prompts else "", m.device or "") if x)
        parts.append(f"{m.prompt_set} {m.accept_length:.2f}" + (f" ({where})" if where else ""))
    return f"{directory} ({shape}); measured accept length: " + "; ".join(parts)
