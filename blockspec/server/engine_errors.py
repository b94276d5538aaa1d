"""Why the server's link to the engine refuses or fails a request (raised by EngineLoop, answered by the API)."""
from __future__ import annotations

DIED_MESSAGE = "the engine process died"


class QueueFullError(RuntimeError):
    """More requests wait than --max-queued-requests allows (429)."""


class EngineStoppedError(RuntimeError):
    """The engine is not running, or the server is shutting down (503)."""


class EngineLoadError(RuntimeError):
    """The engine could not start."""
