"""HTTP server: OpenAI-compatible and SGLang-native endpoints on top of one engine thread."""
from blockspec.server.app import create_app
from blockspec.server.launch import BackgroundServer, run_server

__all__ = ["BackgroundServer", "create_app", "run_server"]
