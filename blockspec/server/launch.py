"""Starting the server: in the foreground with the engine in a process of its own (the CLI), or on a background
thread with an in-process Engine (tests, notebooks)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any, Optional, Sequence, Union

import uvicorn
from fastapi import FastAPI

from blockspec.engine.engine import Engine
from blockspec.engine.process import EngineProcess, RemoteEngine
from blockspec.engine.process_exit import exit_now
from blockspec.engine.startup_report import summary_line
from blockspec.engine.wire import EngineInfo
from blockspec.server.app import create_app
from blockspec.server.args import ServeArgs, ServerSettings, parse_serve_args
from blockspec.server.engine_errors import EngineLoadError
from blockspec.server.engine_loop import EngineLoop
from blockspec.server.frontends import EngineAddresses, FrontendGroup, reuse_port_socket
from blockspec.server.http_protocol import limited_h11_protocol
from blockspec.server.state import get_state_of

logger = logging.getLogger(__name__)
SHUTDOWN_MARGIN_S = 5
# NOTE: how long after --shutdown-grace-s a SIGTERMed server may take to exit (documented in the README): the engine
# ends what still runs, the 503s / SSE error events are delivered, the engine and HTTP processes close their sockets
# and exit. tests/test_server_shutdown_deadline.py holds it with 1 and 4 HTTP processes.
SHUTDOWN_EXIT_MARGIN_S = 3
DRAIN_MESSAGE = "the server is shutting down and the request did not finish within the shutdown grace period"


class DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown (stop accepting, let in-flight responses finish) with a deadline of our own: after
    `grace_s` the engine ends what is still running with 503s / SSE error events, before uvicorn would cut the
    connections (its own timeout is `grace_s` plus a margin to deliver them)."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, grace_s: float,
                 frontends: Optional[FrontendGroup] = None) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.grace_s = grace_s
        self.frontends = frontends  # NOTE: they drain at the same time as this process (SIGTERM now, joined later)

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        if self.frontends is not None:
            self.frontends.terminate()
        self.engine_loop.begin_drain()
        if self.engine_loop.num_in_flight:
            logger.warning("shutting down: waiting up to %g s (--shutdown-grace-s) for %d request(s) in flight; "
                           "Ctrl-C again stops now", self.grace_s, self.engine_loop.num_in_flight)
        deadline = asyncio.get_running_loop().call_later(self.grace_s, self.engine_loop.fail_in_flight, DRAIN_MESSAGE)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def _make_server(app: FastAPI, settings: ServerSettings, frontends: Optional[FrontendGroup] = None) -> DrainingServer:
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=limited_h11_protocol(settings.header_timeout_s, settings.body_timeout_s, settings.max_connections),
        log_level=settings.log_level,
        access_log=settings.log_level in ("debug", "info"),  # NOTE: one line per request from --log-level info
        timeout_keep_alive=settings.timeout_keep_alive,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s) + SHUTDOWN_MARGIN_S,
    )
    return DrainingServer(config, get_state_of(app).loop, settings.shutdown_grace_s, frontends)


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: Optional[FrameType]) -> None:
    raise _Terminated()


def run_server(args: ServeArgs) -> int:
    """Starts the engine process (and the extra HTTP server processes of --api-server-count), then serves until
    interrupted. Returns the process exit code: 1 when the model cannot be loaded or the engine process dies."""
    logging.basicConfig(level=args.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for note in args.notes:
        print(f"blockspec: {note}", file=sys.stderr, flush=True)
    count = args.server.api_server_count
    busy = _port_in_use(args.server.host, args.server.port)
    if busy is not None:  # NOTE: before loading the model, which can take minutes
        print(f"blockspec serve: error: cannot listen on {args.server.host}:{args.server.port}: {busy}; stop what "
              "holds the port or pass another --port", file=sys.stderr)
        return 1
    addresses = EngineAddresses.create(count)
    engine_loop = EngineLoop(EngineProcess(args.engine, args.server.log_level), addresses=addresses)
    try:
        engine_loop.launch()
    except EngineLoadError as exc:
        print(f"blockspec serve: error: could not load the model: {exc}", file=sys.stderr)
        return 1
    assert engine_loop.info is not None
    sockets, frontends = None, None
    if count > 1:
        sockets = [reuse_port_socket(args.server.host, args.server.port)]
        args = dataclasses.replace(args, server=dataclasses.replace(args.server, port=int(sockets[0].getsockname()[1])))
        frontends = FrontendGroup(
            run_extra_frontend, count, (args, addresses.portable(), engine_loop.info, os.getpid())
        )
        stop_s = args.server.shutdown_grace_s + 2 * SHUTDOWN_MARGIN_S
        engine_loop.before_stop.append(lambda: frontends.stop(stop_s))
    server = _make_server(create_app(engine_loop, args.server), args.server, frontends)

    def engine_died() -> None:
        server.should_exit = True

    engine_loop.on_death.append(engine_died)
    if frontends is not None:
        try:
            frontends.start()
        except RuntimeError as exc:
            print(f"blockspec serve: error: {exc}", file=sys.stderr)
            asyncio.run(engine_loop.stop())
            return 1
    print(f"blockspec: {summary_line(engine_loop.info.startup)}", file=sys.stderr, flush=True)
    draft = args.engine.get("speculative_draft_model_path")
    decoding = f"with DFlash draft {draft}" if args.engine.get("speculative_algorithm") else "without a draft"
    print(f"blockspec: serving {args.engine['model_path']} {decoding} on http://{args.server.host}:{args.server.port}"
          + (f" ({count} HTTP server processes)" if count > 1 else ""), file=sys.stderr, flush=True)
    _serve(server, sockets)
    if engine_loop.died:
        print("blockspec serve: error: the engine process died", file=sys.stderr)
        return 1
    return 0


def _port_in_use(host: str, port: int) -> Optional[str]:
    """Why `host:port` cannot be listened on (bound as uvicorn binds it, SO_REUSEADDR), or None when it can; port 0
    always can."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve the host ({exc})"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _serve(server: "DrainingServer", sockets: Optional[list[socket.socket]]) -> None:
    # NOTE: uvicorn drains on SIGINT/SIGTERM, then re-raises the signal; ours makes that a clean exit too.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        server.run(sockets=sockets)
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_extra_frontend(index: int, ready: Any, args: ServeArgs, addresses: EngineAddresses, info: EngineInfo,
                       parent_pid: int) -> None:
    """Entry point of HTTP server process `index` (>= 1) of --api-server-count: the same app in front of the engine
    the first process launched; exits 1 when the engine dies, and on its own when the first process is gone."""
    logging.basicConfig(level=args.server.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[http-{index}]: %(message)s")
    engine_loop = EngineLoop(RemoteEngine(info), addresses=addresses, frontend=index)
    engine_loop.launch()
    server = _make_server(create_app(engine_loop, args.server), args.server)

    def stop() -> None:
        server.should_exit = True

    engine_loop.on_death.append(stop)

    def watch_parent() -> None:
        while not server.started:
            time.sleep(0.05)
        ready.set()
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        logger.error("the first server process is gone; stopping")
        stop()

    threading.Thread(target=watch_parent, name="blockspec-parent-watch", daemon=True).start()
    _serve(server, [reuse_port_socket(args.server.host, args.server.port)])
    exit_now(1 if engine_loop.died else 0)


def main(argv: Optional[Sequence[str]] = None, prog: str = "blockspec serve") -> int:
    return run_server(parse_serve_args(argv, prog))


class BackgroundServer:
    """`with BackgroundServer(engine) as server: httpx.get(server.base_url + "/health")` — loopback, free port.

    `engine`: an Engine (its core runs on a thread of this process) or an EngineLoop over any EngineHandle, launched
    here if it was not yet (benchmarks/frontend_capacity.py serves a stand-in engine process that way)."""

    def __init__(self, engine: Union[Engine, EngineLoop], settings: Optional[ServerSettings] = None,
                 startup_timeout: float = 60.0) -> None:
        self.settings = settings or ServerSettings(port=0)
        if self.settings.api_server_count != 1:
            raise ValueError("api_server_count > 1 needs `blockspec serve` (the engine in a process of its own)")
        if isinstance(engine, EngineLoop):
            engine.launch(startup_timeout)
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
