"""The clock of the core a process runs on, sampled while a benchmark phase runs. A host-bound engine steps at its
core's clock: alone it may run at single-core turbo, beside busy HTTP and client processes at a lower all-core clock.
Benchmarks record the mean for the offline engine and for the server's engine process to tell the two apart."""
from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType
from typing import Optional

from blockspec.bench.processes import stat_fields


def core_of(pid: int) -> Optional[int]:
    """The CPU the process last ran on (Linux /proc; None when it cannot be read)."""
    fields = stat_fields(Path(f"/proc/{pid}/stat"))
    # NOTE: after the ")" that closes the command name, `processor` (field 39 of proc(5)) is the 37th
    return None if fields is None or len(fields) < 37 else int(fields[36])


def core_mhz(core: int) -> Optional[float]:
    """The current clock of `core` in MHz: cpufreq's scaling_cur_freq, else /proc/cpuinfo's "cpu MHz" (on a virtual
    machine that is often a constant); None when neither says."""
    try:
        return int(Path(f"/sys/devices/system/cpu/cpu{core}/cpufreq/scaling_cur_freq").read_text()) / 1e3
    except (OSError, ValueError):
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    processor = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            processor = int(value)
        elif key == "cpu MHz" and processor == core:
            return float(value)
    return None


class CoreClock:
    """`with CoreClock(pid) as clock:` samples the clock of the core `pid` runs on every `interval_s` on a thread of
    this process; `clock.mean_mhz` afterwards (None when nothing could be read)."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="core-clock", daemon=True)

    def __enter__(self) -> CoreClock:
        self._thread.start()
        return self

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean_mhz(self) -> Optional[float]:
        return sum(self.samples) / len(self.samples) if self.samples else None

    def _sample(self) -> None:
        while True:
            core = core_of(self.pid)
            mhz = None if core is None else core_mhz(core)
            if mhz is not None:
                self.samples.append(mhz)
            if self._stop.wait(self.interval_s):
                return
