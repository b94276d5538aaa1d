"""Where the host time of a serving run goes: a server started under py-spy (the server and its engine process) while
closed-loop clients keep it busy (serving_vs_engine.py --py-spy-s S), and a summary of py-spy's raw stacks.

`python -m benchmarks.serving_profile FILE.txt[.gz] [--top N]` prints, per process, the busiest functions by self
and by inclusive samples (idle waits — zmq poll, selectors, sleeping threads — counted apart)."""
from __future__ import annotations

import argparse
import gzip
import shutil
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

SAMPLE_RATE = 250  # samples per second per thread
FOCUS = ("EngineCore.run ",)  # NOTE: the engine process's serving loop
IDLE_MARKERS = ("select (selectors.py", "poll (zmq", "_poll (zmq", "wait (threading.py", "_worker (concurrent",
                "epoll", "run_forever (asyncio", "recv (zmq", "sleep")


def py_spy_wrapper(out_path: Path, rate: int = SAMPLE_RATE) -> list[str]:
    """The command prefix that runs the server as py-spy's child (with its engine process): a profiler that is the
    target's parent may read it where ptrace is limited to descendants (containers, Yama scope 1), as on the device."""
    exe = shutil.which("py-spy")
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    return [exe, "record", "--subprocesses", "--rate", str(rate), "--format", "raw", "--nonblocking",
            "--output", str(out_path), "--"]


def profile_server(start_server: Callable[[list[str]], Any], out_path: Path, run_clients: Callable[[str], Any]) -> str:
    """Starts a server under py-spy (`start_server(wrapper)` returns a context manager with `base_url`), runs
    `run_clients(base_url)`, stops it (py-spy writes on its exit) and returns the summary of the serving loops."""
    with start_server(py_spy_wrapper(out_path)) as server:
        run_clients(server.base_url)
    if not out_path.exists():
        raise RuntimeError("py-spy wrote nothing")
    summary = summarize(out_path, top=40, focus=FOCUS)
    compress(out_path)
    return summary


def compress(path: Path) -> Path:
    """PATH → PATH.gz (the raw stacks of a serving run are tens of MB as text; the device returns small files
    only)."""
    packed = path.with_name(path.name + ".gz")
    with path.open("rb") as raw, gzip.open(packed, "wb") as out:
        shutil.copyfileobj(raw, out)
    path.unlink()
    return packed


def profile_top_level(start_server: Callable[[list[str]], Any], sent: list[list[int]], concurrency: int,
                      args: argparse.Namespace, stem: Path) -> None:
    """serving_vs_engine.py --py-spy-s: a fresh server under py-spy, a warm-up, then `sent` at `concurrency` closed-loop
    clients; raw stacks to STEM.txt.gz, the summary (40 functions a list) to STEM_summary.txt and stdout."""
    from benchmarks.serving_vs_engine_support import client_namespace, measure_level, run_clients

    def clients(url: str) -> None:
        measure_level(client_namespace(url, args.warmup_new_tokens, args.request_timeout), sent[:args.warmup],
                      concurrency, 0.0, args.seed)
        run_clients(client_namespace(url, args.max_new_tokens, args.request_timeout), sent, concurrency, 0.0,
                    args.seed, args.client_procs)

    summary = profile_server(start_server, stem.with_suffix(".txt"), clients)
    stem.with_name(stem.name + "_summary.txt").write_text(summary + "\n")
    print(summary, flush=True)


def _stacks(path: Path) -> list[tuple[str, list[str], int]]:
    """(process, frames below its process frame, samples) per line of py-spy's raw output."""
    out = []
    text = gzip.open(path, "rt", errors="replace").read() if path.suffix == ".gz" else path.read_text(errors="replace")
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = [f for f in stack.split(";") if f]
        # NOTE: with --subprocesses a child's stacks sit under its parent's process frame: the last one names it.
        starts = [i for i, frame in enumerate(frames) if frame.startswith("process ")]
        process = frames[starts[-1]] if starts else "process ?"
        out.append((process, frames[starts[-1] + 1:] if starts else frames, int(count_text)))
    return out


def summarize(path: Path, top: int = 15, rate: int = SAMPLE_RATE, focus: tuple[str, ...] = ()) -> str:
    """Per process (py-spy's `process PID:"cmdline"` frames with --subprocesses): busy share and top functions.
    `focus`: in a process with stacks through one of these frames, only those stacks count (the engine's serving
    loop, not its start-up)."""
    stacks = _stacks(path)
    focused = {process for process, body, _ in stacks if any(f.startswith(focus) for f in body)} if focus else set()
    self_counts: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    idle: Counter[str] = Counter()
    for process, body, count in stacks:
        if process in focused and not any(f.startswith(focus) for f in body):
            continue
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
        lines += [f"    {100 * c / max(busy, 1):5.1f} %  {name[:140]}"
                  for name, c in self_counts[process].most_common(top)]
        lines.append("  inclusive (frames under 90 % of busy):")
        below_wrappers = [(n, c) for n, c in inclusive[process].most_common() if c < 0.9 * busy]
        lines += [f"    {100 * c / max(busy, 1):5.1f} %  {name[:140]}" for name, c in below_wrappers[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--focus", nargs="*", default=list(FOCUS), help="frames (prefixes) a process's stacks must "
                        "pass through, in processes that have any (default: the engine's serving loop)")
    ns = parser.parse_args()
    print(summarize(ns.path, ns.top, focus=tuple(ns.focus)))
