"""blockspec.bench.processes: results in the order of the argument tuples, one wall time, a dead process an error."""
from __future__ import annotations

import os
import time

import pytest

from blockspec.bench.processes import run_in_processes


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
