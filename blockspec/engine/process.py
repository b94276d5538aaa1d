"""Where the engine core runs: its own process (`blockspec serve`) or a thread of the server process (tests)."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
from abc import ABC, abstractmethod
from typing import Any, Optional

import zmq

from blockspec.engine import wire
from blockspec.engine.core import EngineCore
from blockspec.engine.engine import Engine
from blockspec.engine.progress_line import ProgressLine
from blockspec.engine.reports import engine_info
from blockspec.engine.process_exit import exit_now


class EngineHandle(ABC):
    """Starts the engine core against two ZeroMQ addresses and tells whether it still runs."""

    info: Optional[wire.EngineInfo] = None  # known before launch for an in-process engine, else from Ready

    @abstractmethod
    def launch(self, to_engine: list[str], from_engine: list[str]) -> None:
        """Starts the core against every HTTP server process's address pair (index i: server process i)."""

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def join(self, timeout: float) -> None: ...


class EngineThread(EngineHandle):
    """In-process mode (tests, notebooks): the Engine object stays reachable, e.g. to patch its scheduler. The
    messages still cross ZeroMQ sockets, so this exercises the same path as the engine process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.info = engine_info(engine)
        self._thread: Optional[threading.Thread] = None

    def launch(self, to_engine: list[str], from_engine: list[str]) -> None:
        core = EngineCore(self.engine, to_engine, from_engine)
        self._thread = threading.Thread(target=core.run, name="blockspec-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def run_engine_process(engine_kwargs: dict[str, Any], to_engine: list[str], from_engine: list[str], parent_pid: int,
                       log_level: str) -> None:
    """Entry point of the engine process: load the Engine, then serve the sockets until Stop or the parent is gone."""
    # NOTE: the server process owns shutdown (it drains, then sends Stop); a terminal's Ctrl-C reaches the whole
    # process group, so the engine ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    try:
        engine = Engine(**engine_kwargs)
    except (ValueError, FileNotFoundError, OSError) as exc:
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.connect(from_engine[0])
        push.send(wire.encode(wire.LoadFailed(str(exc))))
        push.close(linger=5000)
        context.term()
        sys.exit(1)
    EngineCore(engine, to_engine, from_engine, parent_pid, ProgressLine(engine)).run()
    engine.shutdown()
    exit_now(0)


class EngineProcess(EngineHandle):
    """The engine in a process of its own, spawned from the Engine's keyword arguments."""

    def __init__(self, engine_kwargs: dict[str, Any], log_level: str = "info") -> None:
        self.engine_kwargs = engine_kwargs
        self.log_level = log_level
        self.process: Optional[multiprocessing.process.BaseProcess] = None

    def launch(self, to_engine: list[str], from_engine: list[str]) -> None:
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_engine_process,
            args=(self.engine_kwargs, to_engine, from_engine, os.getpid(), self.log_level),
            name="blockspec-engine",
            daemon=True,
        )
        self.process.start()

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def join(self, timeout: float) -> None:
        if self.process is None:
            return
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    @property
    def exitcode(self) -> Optional[int]:
        return None if self.process is None else self.process.exitcode


class RemoteEngine(EngineHandle):
    """The engine as an extra HTTP server process sees it (`--api-server-count`): launched by the first server
    process, known by its EngineInfo and pid; alive while that pid is."""

    def __init__(self, info: wire.EngineInfo) -> None:
        self.info = info

    def launch(self, to_engine: list[str], from_engine: list[str]) -> None:
        raise RuntimeError("this engine was launched by another server process")

    def is_alive(self) -> bool:
        assert self.info is not None
        try:
            os.kill(self.info.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # NOTE: exists, owned by someone else: not ours, but alive
            return True
        return True

    def join(self, timeout: float) -> None:
        return None
