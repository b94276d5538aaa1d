"""The server side of the serving benchmarks: `python -m blockspec.serve` as a child process (optionally under a
wrapper such as py-spy), its environment and its log."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def exit_on_sigterm() -> None:
    """SIGTERM (`timeout`) unwinds like an error, so every ServerProcess (a session of its own, which the signal
    does not reach) is stopped by its context manager instead of outliving the benchmark on the GPU."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """`python -m blockspec.serve` on a free loopback port; healthy on enter, SIGTERM (then SIGKILL) on exit."""

    def __init__(self, flags: list[str], log_path: Path, startup_timeout: float, stop_timeout: float = 60.0,
                 wrapper: Optional[list[str]] = None) -> None:
        """`wrapper`: a command the server runs under (py-spy), which gets the server's SIGTERM passed on."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.wrapper = wrapper or []
        self.command = [*self.wrapper, sys.executable, "-m", "blockspec.serve", *flags, "--host", "127.0.0.1",
                        "--port", str(self.port)]
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def __enter__(self) -> "ServerProcess":
        with self.log_path.open("w") as log:
            # NOTE: a session of its own, so a server that ignores SIGTERM is killed with every process it started.
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                                         start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:  # NOTE: SIGTERM (exit_on_sigterm) while starting too: __exit__ never runs then
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was healthy")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {self.startup_timeout:.0f}s")

    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        target = self.proc.pid
        if self.wrapper:  # NOTE: the server is the wrapper's child; the wrapper ends (and writes) when it exits
            children = Path(f"/proc/{target}/task/{target}/children").read_text().split()
            target = int(children[0]) if children else target
        os.kill(target, signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
