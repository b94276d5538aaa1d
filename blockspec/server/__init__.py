"""HTTP server: OpenAI-compatible and SGLang-native endpoints on top of one engine thread."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blockspec.server.app import create_app
    from blockspec.server.launch import BackgroundServer, run_server

__all__ = ["BackgroundServer", "create_app", "run_server"]
# NOTE: imported on first use, so that the CLI's flag modules (server/args.py) load without the server and the engine
_EXPORTS = {"create_app": "blockspec.server.app", "BackgroundServer": "blockspec.server.launch",
            "run_server": "blockspec.server.launch"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'blockspec.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
