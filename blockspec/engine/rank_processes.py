"""The ranks of a tensor-parallel engine: rank 0 is the Engine's own process; it spawns ranks 1..N-1, each of which
builds its shard of the runner and worker, captures its graphs, then runs the forwards rank 0 mirrors to it.

NCCL on CUDA (rank r on cuda:r), gloo on CPU. A rank that fails reports its traceback and exits; gloo then fails
rank 0's pending collective ("connection closed"), which `rank_failures` turns into a TensorParallelError naming
the rank and its error, so the engine comes down with an error instead of hanging.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import json
import multiprocessing.util
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from blockspec.config.engine_config import EngineConfig
from blockspec.distributed.group import TensorParallel

# NOTE: an idle engine leaves its worker ranks waiting in a broadcast for as long as it is idle; a dead peer is
# detected by its closed connection (gloo), not by this timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
JOIN_POLL_S = 0.5
PR_SET_PDEATHSIG = 1
FAILURE_WAIT_S = 10.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot go on."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank r's config: on CUDA its own GPU, cuda:r."""
    if config.resolved_device.type != "cuda":
        return config
    return dataclasses.replace(config, device=f"cuda:{rank}")


def backend_for(config: EngineConfig) -> str:
    return "nccl" if config.resolved_device.type == "cuda" else "gloo"


def join_group(config: EngineConfig, rank: int, store: dist.Store) -> TensorParallel:
    if config.resolved_device.type == "cuda":
        torch.cuda.set_device(config.resolved_device)
    dist.init_process_group(backend_for(config), store=store, rank=rank, world_size=config.tp_size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, config.tp_size)


def check_shardable(config: EngineConfig) -> None:
    """Clear errors, before any process starts, for what tp_size cannot shard or run on."""
    from blockspec.models.config import load_target_config
    from blockspec.models.draft_config import load_draft_config

    tp = TensorParallel(0, config.tp_size)
    device = config.resolved_device
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError("tp_size > 1 puts rank r on cuda:r; choose the GPUs with CUDA_VISIBLE_DEVICES instead")
        if torch.cuda.device_count() < config.tp_size:
            raise ValueError(f"tp_size {config.tp_size} needs as many GPUs, {torch.cuda.device_count()} visible")
    target = load_target_config(config.model_path)
    shapes = [(target.num_heads, target.num_kv_heads, target.intermediate_size if target.has_dense_layers else None,
               "the target")]
    if target.moe is not None:
        tp.split(target.moe.expert_intermediate_size, "the target's moe_intermediate_size")
    if config.speculative_draft_model_path is not None:
        draft = load_draft_config(config.speculative_draft_model_path, target)
        shapes.append((draft.num_heads, draft.num_kv_heads, draft.intermediate_size, "the draft"))
    for heads, kv_heads, intermediate, which in shapes:
        tp.split(heads, f"{which}'s num_attention_heads")
        tp.local_kv_heads(kv_heads)
        if intermediate is not None:
            tp.split(intermediate, f"{which}'s intermediate_size")


class RankProcesses:
    """Ranks 1..N-1 of rank 0's engine (`python -m blockspec.engine.rank`, config as JSON on stdin): started
    and joined into the group here, stopped by `shutdown`. NOTE: plain subprocesses, not multiprocessing children:
    the server's engine process is daemonic, and daemonic processes may not have children."""

    def __init__(self, config: EngineConfig) -> None:
        check_shardable(config)
        self.config = config
        self.stopped = False
        port = free_port()
        self.store = dist.TCPStore("127.0.0.1", port, config.tp_size, is_master=True, wait_for_workers=False,
                                   timeout=COLLECTIVE_TIMEOUT)
        config_json = json.dumps(dataclasses.asdict(config))
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(1, config.tp_size):
            command = [sys.executable, "-m", "blockspec.engine.rank", "--rank", str(rank), "--port", str(port)]
            process = subprocess.Popen(command, stdin=subprocess.PIPE)
            assert process.stdin is not None
            process.stdin.write(config_json.encode())
            process.stdin.close()
            self.processes.append(process)
        multiprocessing.util.Finalize(None, kill_processes, args=(self.processes,), exitpriority=100)
        try:
            self._wait_joined()
            self.tp = join_group(rank_config(config, 0), 0, self.store)
        except BaseException:
            self.close()
            raise
        if backend_for(config) == "nccl":
            threading.Thread(target=self._abort_when_a_rank_dies, name="blockspec-tp-watch", daemon=True).start()

    def _abort_when_a_rank_dies(self) -> None:
        """NCCL does not notice a dead peer (gloo does): abort the group, so rank 0's pending collective fails
        instead of waiting for the dead rank forever. NOTE: not yet exercised on GPUs (#23)."""
        while not self.stopped:
            if any(process.poll() is not None for process in self.processes):
                if not self.stopped:
                    dist.distributed_c10d._abort_process_group()
                return
            time.sleep(JOIN_POLL_S)

    def _wait_joined(self) -> None:
        """Waits until every rank reached the group, raising as soon as one exited instead."""
        keys = [f"joined/{rank}" for rank in range(1, self.config.tp_size)]
        while not self.store.check(keys):
            if any(process.poll() is not None for process in self.processes):
                raise TensorParallelError(self.failure_report())
            time.sleep(JOIN_POLL_S)

    def wait_for_exit(self, seconds: float) -> bool:
        """Whether some rank has exited, waiting up to `seconds` for one to (a peer's closed connection may reach
        rank 0 before the process is gone)."""
        until = time.monotonic() + seconds
        while all(process.poll() is None for process in self.processes):
            if time.monotonic() > until:
                return False
            time.sleep(0.05)
        return True

    def failure_report(self) -> str:
        """What the failed ranks reported (their tracebacks, left in the store), or how they exited."""
        reports = []
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() in (None, 0):
                continue
            key = f"error/{rank}"
            if self.store.check([key]):
                reports.append(self.store.get(key).decode())
            else:
                reports.append(f"tensor-parallel rank {rank} exited with code {process.returncode}")
        return "\n".join(reports) or "a tensor-parallel collective failed, but every rank is still running"

    def shutdown(self, mirror_stop: Optional[Callable[[], None]] = None) -> None:
        """Stops the ranks (`mirror_stop` tells them to leave their loop), then tears down the group."""
        if self.stopped:
            return
        self.stopped = True
        if mirror_stop is not None and all(process.poll() is None for process in self.processes):
            with contextlib.suppress(RuntimeError):
                mirror_stop()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30.0)
        self.close()

    def close(self) -> None:
        """Kills whatever rank is still running and leaves the process group (an engine can start again)."""
        self.stopped = True
        kill_processes(self.processes)
        if dist.is_initialized():
            dist.destroy_process_group()


def die_with_parent() -> None:
    """Called first in a rank's process (Linux): SIGKILL when rank 0's process dies, however it dies. NOTE: the
    kernel sends it when the thread that started the rank exits: an Engine lives in a thread that outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def kill_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5.0)


@contextlib.contextmanager
def rank_failures(ranks: Optional[RankProcesses]) -> Iterator[None]:
    """Around rank 0's forwards: any error there leaves the ranks out of step, so they are stopped; when a rank had
    failed first (rank 0's collective then fails too), a TensorParallelError carries that rank's report."""
    if ranks is None:
        yield
        return
    try:
        yield
    except BaseException as error:
        if isinstance(error, TensorParallelError):
            raise
        failed = ranks.wait_for_exit(FAILURE_WAIT_S)
        report = ranks.failure_report() if failed else ""
        ranks.close()
        if failed:
            raise TensorParallelError(report) from error
        raise
