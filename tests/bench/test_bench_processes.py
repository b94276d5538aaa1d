"""blockspec.bench.processes: results in the order of the argument tuples, one wall time, a dead process an error."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from blockspec.bench.processes import http_server_pids, process_cpu_s, run_in_processes


def square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def spin(seconds: float) -> float:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return seconds


def die(code: int) -> None:
    os._exit(code)


def test_results_in_argument_order_from_separate_processes() -> None:
    results, wall, cpu = run_in_processes(square_and_pid, [(3,), (1,), (2,)])
    assert [value for value, _ in results] == [9, 1, 4]
    assert len({pid for _, pid in results}) == 3 and os.getpid() not in {pid for _, pid in results}
    assert wall >= 0.0 and cpu >= 0.0


def test_cpu_time_is_the_sum_of_what_the_processes_spent_running() -> None:
    """Two processes spinning 0.2 s of CPU each: 0.4 s in all, their start-up (imports) left out."""
    _, _, cpu = run_in_processes(spin, [(0.2,), (0.2,)])
    assert 0.4 <= cpu < 0.6


def test_a_dead_process_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="a client process died"):
        run_in_processes(die, [(3,)])


# NOTE: a stand-in for `blockspec serve --api-server-count 2`: the first server process starts the engine process
# (with a child of its own), one more server process (with a child) and a helper; it prints the engine's and the extra
# server's pids, then waits.
_SERVE_TREE = """
import subprocess, sys
sleep = {sleep!r}
with_child = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(" + repr(sleep) + "); time.sleep(60)"]
engine = subprocess.Popen(with_child)
extra = subprocess.Popen(with_child)
helper = subprocess.Popen(sleep)
print(engine.pid, extra.pid, flush=True)
sys.stdin.read()
"""


def test_http_server_pids_are_the_engines_parent_and_its_other_descendants() -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    main = subprocess.Popen([sys.executable, "-c", _SERVE_TREE.format(sleep=sleep)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert main.stdout is not None
        engine, extra = map(int, main.stdout.readline().split())
        deadline = time.monotonic() + 30
        while len(pids := http_server_pids(engine)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)  # NOTE: the grandchildren start a moment later
        time.sleep(0.5)
        pids = http_server_pids(engine)
        assert pids[0] == main.pid and extra in pids and engine not in pids
        assert len(pids) == 4  # main, extra and its child, the helper; not the engine's child
        assert http_server_pids(2 ** 22 + 12345) == []  # no such process
    finally:
        os.killpg(main.pid, signal.SIGKILL)  # NOTE: the whole tree (its own process group)
        main.wait()


def test_process_cpu_s_of_another_process_is_exact_below_a_clock_tick() -> None:
    """A child's CPU time grows by about the 3 ms it spins, not by 0 or 10 ms (/proc/<pid>/stat counts 10 ms
    ticks); a process that is gone reads as None."""
    code = ("import time\nprint('ready', flush=True)\ninput()\n"
            "end = time.process_time() + 0.003\nwhile time.process_time() < end: pass\n"
            "print('spun', flush=True)\ninput()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline() == "ready\n"  # NOTE: start-up done; the child waits in input()
        before = process_cpu_s(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "spun\n"
        after = process_cpu_s(child.pid)
        assert before is not None and after is not None and 0.003 <= after - before < 0.009
    finally:
        child.communicate("\n", timeout=30)
    assert process_cpu_s(child.pid) is None
