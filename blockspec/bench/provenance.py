"""What a benchmark result names about its run: the commit, the GPU and the date.

The device gets a working tree without git, so BLOCKSPEC_COMMIT (set by the device scripts) comes first."""
from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def commit_id() -> str:
    """$BLOCKSPEC_COMMIT, else the short hash of the checkout's HEAD, else "unknown"."""
    env = os.environ.get("BLOCKSPEC_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def gpu_name() -> str:
    """The CUDA device's name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def today() -> str:
    return datetime.date.today().isoformat()


def run_identity() -> dict[str, str]:
    """{"gpu", "date", "commit"} for a result's top level."""
    return {"gpu": gpu_name(), "date": today(), "commit": commit_id()}
