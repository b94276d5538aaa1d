"""Starting the server: in the foreground (the CLI) or on a background thread (tests, notebooks)."""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Optional, Sequence

import uvicorn

from blockspec.engine import Engine
from blockspec.server.app import create_app
from blockspec.server.args import ServeArgs, ServerSettings, parse_serve_args

logger = logging.getLogger(__name__)


def _uvicorn_config(app: Any, settings: ServerSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=5,
    )


def run_server(args: ServeArgs) -> int:
    """Loads the engine, then serves until interrupted. Returns the process exit code."""
    logging.basicConfig(level=args.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(**args.engine)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"blockspec serve: error: could not load the model: {exc}", file=sys.stderr)
        return 1
    app = create_app(engine, args.server)
    server = uvicorn.Server(_uvicorn_config(app, args.server))
    print(f"blockspec: serving {args.engine['model_path']} on http://{args.server.host}:{args.server.port}", file=sys.stderr, flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT after its graceful shutdown
        pass
    engine.shutdown()
    return 0


def main(argv: Optional[Sequence[str]] = None, prog: str = "blockspec serve") -> int:
    return run_server(parse_serve_args(argv, prog))


class BackgroundServer:
    """`with BackgroundServer(engine) as server: httpx.get(server.base_url + "/health")` — loopback, free port."""

    def __init__(self, engine: Engine, settings: Optional[ServerSettings] = None, startup_timeout: float = 60.0) -> None:
        self.settings = settings or ServerSettings(port=0)
        self.engine = engine
        self.app = create_app(engine, self.settings)
        self._server = uvicorn.Server(_uvicorn_config(self.app, self.settings))
        self._thread = threading.Thread(target=self._server.run, name="blockspec-http", daemon=True)
        self._startup_timeout = startup_timeout
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def start(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = int(sockets[0].getsockname()[1])
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
