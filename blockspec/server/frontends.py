"""Several HTTP server processes in front of one engine (`--api-server-count N`): the socket addresses they share
with the engine, the listening socket each binds on the same port (SO_REUSEPORT: the kernel spreads connections),
and the extra processes the first one starts and stops. Each has its own event loop, tokenizer and detokenizer."""
from __future__ import annotations

import logging
import multiprocessing
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


@dataclass
class EngineAddresses:
    """ZeroMQ ipc addresses: server process i binds to_engine[i] (PUSH) and from_engine[i] (PULL)."""

    to_engine: list[str]
    from_engine: list[str]
    _tmp: Optional[tempfile.TemporaryDirectory[str]] = field(default=None, repr=False, compare=False)

    @classmethod
    def create(cls, count: int) -> "EngineAddresses":
        tmp = tempfile.TemporaryDirectory(prefix="blockspec-zmq-")
        root = Path(tmp.name)
        return cls([f"ipc://{root / f'to_engine_{i}'}" for i in range(count)],
                   [f"ipc://{root / f'from_engine_{i}'}" for i in range(count)], tmp)

    def portable(self) -> "EngineAddresses":
        """The same addresses without the directory's owner (what another process gets)."""
        return EngineAddresses(self.to_engine, self.from_engine)

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port that other processes can bind too (SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(address)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class FrontendGroup:
    """The extra server processes (indices 1..N-1), started once the engine is ready and stopped before it."""

    def __init__(self, target: Callable[..., None], count: int, args: tuple[Any, ...]) -> None:
        """`target(index, ready, *args)` runs server process `index` and sets `ready` once it accepts connections."""
        context = multiprocessing.get_context("spawn")
        self.ready = [context.Event() for _ in range(1, count)]
        self.processes = [
            context.Process(target=target, args=(index, ready, *args), name=f"blockspec-http-{index}", daemon=True)
            for index, ready in zip(range(1, count), self.ready)
        ]

    def start(self, timeout: float = 300.0) -> None:
        """Starts them and waits until each accepts connections; RuntimeError if one exits or is too slow."""
        for process in self.processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process, ready in zip(self.processes, self.ready):
            while not ready.wait(0.1):
                if not process.is_alive() or time.monotonic() > deadline:
                    self.stop(5)
                    raise RuntimeError(
                        f"HTTP server process {process.name} did not start (exit code {process.exitcode})"
                    )

    def terminate(self) -> None:
        """SIGTERM to every extra process that runs: each drains its own requests."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()

    def stop(self, timeout: float) -> None:
        """terminate(), then waits up to `timeout` for each; kills what is left."""
        self.terminate()
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                logger.error("server process %s did not stop within %.0f s; killing it", process.name, timeout)
                process.kill()
                process.join(5)
