"""blockspec: an LLM serving engine built around DFlash speculative decoding."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blockspec.engine.engine import Engine
    from blockspec.request import SamplingParams

__all__ = ["Engine", "SamplingParams"]
__version__ = "0.1.0"
# NOTE: imported on first use: `blockspec --help` and every other import of a blockspec module would otherwise load
# torch and the whole engine first (seconds)
_EXPORTS = {"Engine": "blockspec.engine.engine", "SamplingParams": "blockspec.request"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'blockspec' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
