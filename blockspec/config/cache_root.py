"""Where blockspec keeps what it makes for itself (the converted demo target, draft-training response caches,
`bench serving` results): $BLOCKSPEC_CACHE, else ~/.cache/blockspec."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_root() -> Path:
    env = os.environ.get("BLOCKSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "blockspec"
