"""blockspec.bench.core_clock: the core a process runs on and that core's clock, sampled over a phase."""
from __future__ import annotations

import os
import sys
import time

import pytest

from blockspec.bench.core_clock import CoreClock, core_mhz, core_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux /proc")


def test_core_of_this_process_is_one_it_may_run_on() -> None:
    core = core_of(os.getpid())
    assert core is not None and core in os.sched_getaffinity(0)
    assert core_of(2**22 + 12345) is None  # NOTE: above any pid_max default: no such process


def test_samples_while_the_phase_runs_and_stops_after() -> None:
    clock_known = core_mhz(core_of(os.getpid()) or 0) is not None
    with CoreClock(os.getpid(), interval_s=0.01) as clock:
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            pass
    taken = len(clock.samples)
    time.sleep(0.05)
    assert len(clock.samples) == taken  # NOTE: the sampler thread has stopped
    if clock_known:
        assert taken >= 3 and clock.mean_mhz is not None and 100 < clock.mean_mhz < 10_000
    else:
        assert taken == 0 and clock.mean_mhz is None
