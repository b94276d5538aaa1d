"""Starting the server: in the foreground with the engine in a process of its own (the CLI), or on a background
thread with an in-process Engine (tests, notebooks)."""
from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Optional, Sequence

import uvicorn
from fastapi import FastAPI

from blockspec.engine import Engine
from blockspec.server.app import create_app, get_state_of
from blockspec.server.args import ServeArgs, ServerSettings, parse_serve_args
from blockspec.server.engine_loop import EngineLoadError, EngineLoop
from blockspec.server.engine_process import EngineProcess
from blockspec.server.http_protocol import h11_protocol_with_header_timeout
from blockspec.startup.report import summary_line

logger = logging.getLogger(__name__)
SHUTDOWN_MARGIN_S = 5
DRAIN_MESSAGE = "the server is shutting down and the request did not finish within the shutdown grace period"


class DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown (stop accepting, let in-flight responses finish) with a deadline of our own: after
    `grace_s` the engine ends what is still running with 503s / SSE error events, before uvicorn would cut the
    connections (its own timeout is `grace_s` plus a margin to deliver them)."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, grace_s: float) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.grace_s = grace_s

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        self.engine_loop.begin_drain()
        deadline = asyncio.get_running_loop().call_later(self.grace_s, self.engine_loop.fail_in_flight, DRAIN_MESSAGE)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def _make_server(app: FastAPI, settings: ServerSettings) -> DrainingServer:
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=h11_protocol_with_header_timeout(settings.header_timeout_s),
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        timeout_keep_alive=settings.timeout_keep_alive,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s) + SHUTDOWN_MARGIN_S,
    )
    return DrainingServer(config, get_state_of(app).loop, settings.shutdown_grace_s)


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: Optional[FrameType]) -> None:
    raise _Terminated()


def run_server(args: ServeArgs) -> int:
    """Starts the engine process, then serves until interrupted. Returns the process exit code: 1 when the model
    cannot be loaded or the engine process dies."""
    logging.basicConfig(level=args.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_loop = EngineLoop(EngineProcess(args.engine, args.server.log_level))
    try:
        engine_loop.launch()
    except EngineLoadError as exc:
        print(f"blockspec serve: error: could not load the model: {exc}", file=sys.stderr)
        return 1
    server = _make_server(create_app(engine_loop, args.server), args.server)

    def engine_died() -> None:
        server.should_exit = True

    engine_loop.on_death.append(engine_died)
    assert engine_loop.info is not None
    print(f"blockspec: {summary_line(engine_loop.info.startup)}", file=sys.stderr, flush=True)
    print(f"blockspec: serving {args.engine['model_path']} on http://{args.server.host}:{args.server.port}", file=sys.stderr, flush=True)
    # NOTE: uvicorn drains on SIGINT/SIGTERM, then re-raises the signal; ours makes that a clean exit too.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        server.run()
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    if engine_loop.died:
        print("blockspec serve: error: the engine process died", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None, prog: str = "blockspec serve") -> int:
    return run_server(parse_serve_args(argv, prog))


class BackgroundServer:
    """`with BackgroundServer(engine) as server: httpx.get(server.base_url + "/health")` — loopback, free port."""

    def __init__(self, engine: Engine, settings: Optional[ServerSettings] = None, startup_timeout: float = 60.0) -> None:
        self.settings = settings or ServerSettings(port=0)
        self.engine = engine
        self.app = create_app(engine, self.settings)
        self._server = _make_server(self.app, self.settings)
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
