"""Where the host time of a serving run goes: py-spy over the server process and its engine process while closed-loop
clients keep it busy (serving_vs_engine.py --py-spy-s S), and a summary of py-spy's raw (collapsed) stacks.

`python benchmarks/serving_profile.py FILE.txt [--top N]` prints, per process, the busiest functions by self and by
inclusive samples (idle waits — zmq poll, selectors, sleeping threads — counted apart)."""
from __future__ import annotations

import argparse
import math
import shutil
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

SAMPLE_RATE = 250  # samples per second per thread
IDLE_MARKERS = ("select (selectors.py", "poll (zmq", "_poll (zmq", "wait (threading.py", "_worker (concurrent",
                "epoll", "run_forever (asyncio", "recv (zmq", "sleep")


def record(pid: int, seconds: float, out_path: Path, rate: int = SAMPLE_RATE) -> subprocess.Popen[bytes]:
    """Starts py-spy on `pid` and its children (the engine process) for `seconds`; raw collapsed stacks to out_path."""
    exe = shutil.which("py-spy")
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    command = [exe, "record", "--pid", str(pid), "--subprocesses", "--duration", str(math.ceil(seconds)),
               "--rate", str(rate), "--format", "raw", "--nonblocking", "--output", str(out_path)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def profile_level(pid: int, seconds: float, out_path: Path, run_clients: Callable[[], Any]) -> str:
    """Runs `run_clients` (which must keep the server busy for >= `seconds`) under py-spy; returns the summary."""
    spy = record(pid, seconds, out_path)
    try:
        run_clients()
    finally:
        _, err = spy.communicate(timeout=seconds + 60)
    if not out_path.exists():
        raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
    return summarize(out_path)


def _frames(stack: str) -> list[str]:
    return [f for f in stack.split(";") if f]


def summarize(path: Path, top: int = 15, rate: int = SAMPLE_RATE) -> str:
    """Per process (py-spy's `process PID:"cmdline"` frames with --subprocesses): busy share and top functions."""
    self_counts: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    idle: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = _frames(stack)
        # NOTE: with --subprocesses a child's stacks sit under its parent's process frame: the last one names it.
        starts = [i for i, frame in enumerate(frames) if frame.startswith("process ")]
        process = frames[starts[-1]] if starts else "process ?"
        body = frames[starts[-1] + 1:] if starts else frames
        totals[process] += count
        if any(marker in frame for frame in body[-2:] for marker in IDLE_MARKERS):
            idle[process] += count
            continue
        if body:
            self_counts[process][body[-1]] += count
        for frame in set(body):
            inclusive[process][frame] += count
    lines: list[str] = []
    for process, total in totals.most_common():
        busy = total - idle[process]
        # NOTE: py-spy drops samples of threads it sees idle (no --idle), so samples / rate is busy thread-seconds.
        lines.append(f"{process[:100]}: {total} samples = {total / rate:.2f} busy thread-s; "
                     f"{idle[process] / rate:.2f} s of it in waits")
        lines.append("  self:")
        lines += [f"    {100 * c / max(busy, 1):5.1f} %  {name[:140]}" for name, c in self_counts[process].most_common(top)]
        lines.append("  inclusive (frames under 90 % of busy):")
        below_wrappers = [(n, c) for n, c in inclusive[process].most_common() if c < 0.9 * busy]
        lines += [f"    {100 * c / max(busy, 1):5.1f} %  {name[:140]}" for name, c in below_wrappers[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=15)
    ns = parser.parse_args()
    print(summarize(ns.path, ns.top))
