"""A torch.profiler trace of `cycles` repeated cycles reduced to per-cycle tables (benchmarks/cycle_profile.py's rows),
and the difference of two such tables (what one cycle adds over another).

What counts as one launch:
  - on CUDA, every device activity the profiler recorded: kernels (inside a CUDA graph too, where CUPTI reports its
    nodes) and the copies and fills (memcpy / memset) the cycle runs; its time is the activity's device duration;
  - on the CPU, every innermost operator that would be a kernel on the GPU: an aten op that is none of the ops that
    only make views, allocate or look at metadata (METADATA_OPS) and called no op that is not one of those. Its time
    is its CPU time, which means little: the CPU figures are for the counts (each such op is a launch on the GPU).

Where the trace has Python stacks (with_stack, eager cycles), each launch is also charged to the innermost blockspec
function above it (`source`: "blockspec/speculative/tree_build.py: tree_from_candidates"), so a diff names the code
that adds launches; a kernel inside a graph replay has no Python caller and gets no source."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

# NOTE: operators that launch no kernel on the GPU (views, allocation, dtype/metadata queries, host scalars); the
# CPU counts leave them out so that they approximate the GPU's launches.
METADATA_OPS = frozenset({
    "aten::alias", "aten::as_strided", "aten::as_strided_", "aten::broadcast_tensors", "aten::contiguous",
    "aten::detach", "aten::detach_", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::expand",
    "aten::expand_as", "aten::lift_fresh", "aten::narrow", "aten::permute", "aten::reshape", "aten::_reshape_alias",
    "aten::resize_", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::scalar_tensor",
    "aten::select", "aten::set_", "aten::slice", "aten::split", "aten::squeeze", "aten::t", "aten::to",
    "aten::transpose", "aten::unbind", "aten::unflatten", "aten::unsqueeze", "aten::_unsafe_view", "aten::view",
    "aten::view_as", "aten::chunk", "aten::split_with_sizes", "aten::numpy_T", "aten::is_nonzero", "aten::dim",
    "aten::size", "aten::stride", "aten::is_same_size", "aten::_has_compatible_shallow_copy_type",
})
SOURCE_ROOT = "blockspec/"
COPY_PREFIXES = ("Memcpy", "Memset")  # NOTE: the names CUPTI gives copies and fills


@dataclass
class Launch:
    """One counted launch: its name, duration (µs) and the blockspec function that issued it (None: unknown)."""

    name: str
    us: float
    source: Optional[str]


@dataclass
class CycleTable:
    """Launches of a profiled run, per cycle. `device`: "cuda" (device activities) or "cpu" (leaf CPU ops)."""

    device: str
    cycles: int
    launches: list[Launch] = field(default_factory=list)

    @property
    def ops_per_cycle(self) -> float:
        return len(self.launches) / self.cycles

    @property
    def kernels_per_cycle(self) -> float:
        """Launches per cycle that are not copies or fills (CUDA: whether the trace saw the graph's kernels at all)."""
        return sum(1 for launch in self.launches if not launch.name.startswith(COPY_PREFIXES)) / self.cycles

    @property
    def us_per_cycle(self) -> float:
        return sum(launch.us for launch in self.launches) / self.cycles

    def by(self, key: str) -> dict[str, tuple[float, float]]:
        """{name or source: (calls per cycle, µs per cycle)}; launches without a source are left out by source."""
        totals: dict[str, list[float]] = {}
        for launch in self.launches:
            label = launch.name if key == "name" else launch.source
            if label is None:
                continue
            entry = totals.setdefault(label, [0.0, 0.0])
            entry[0] += 1
            entry[1] += launch.us
        return {label: (calls / self.cycles, us / self.cycles) for label, (calls, us) in totals.items()}

    def has_sources(self) -> bool:
        return any(launch.source is not None for launch in self.launches)

    def top(self, key: str, limit: int) -> list[dict[str, Any]]:
        """The `limit` heaviest names (or sources) by µs per cycle: {key, calls_per_cycle, us_per_cycle}."""
        rows = sorted(self.by(key).items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))[:limit]
        return [{key: label, "calls_per_cycle": round(calls, 3), "us_per_cycle": round(us, 3)}
                for label, (calls, us) in rows]


def _is_python(event: Any) -> bool:
    """A Python-tracer frame (with_stack), not an operator; older torch has no flag: its names are `file(line): fn`."""
    flag = getattr(event, "is_python_function", None)
    if flag is not None:
        return bool(flag)
    return "::" not in event.name and "(" in event.name


def source_of(event: Any) -> Optional[str]:
    """The innermost blockspec Python function above `event` ("blockspec/<path>.py: <function>"), or None."""
    parent = event
    while parent is not None:
        if _is_python(parent):
            name: str = parent.name
            start = name.rfind(SOURCE_ROOT)
            if start >= 0 and "(" in name:
                path, _, rest = name[start:].partition("(")
                return f"{path}: {rest.partition(': ')[2]}"
        parent = parent.cpu_parent
    return None


def _is_device(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def cycle_table(events: Iterable[Any], cycles: int, cuda: bool) -> CycleTable:
    """The launches of a trace's events (torch.profiler's `profile.events()`) over `cycles` cycles.

    NOTE: a device activity's source is the Python function above the CPU event it is linked to (the runtime's
    launch call); inside a graph replay that is the replay, so graph rows carry no sources (`with_stack` off)."""
    events = list(events)
    table = CycleTable("cuda" if cuda else "cpu", cycles)
    if cuda:
        by_correlation = {event.id: event for event in events if not _is_device(event) and not _is_python(event)}
        for event in events:
            if _is_device(event):
                launcher = by_correlation.get(getattr(event, "linked_correlation_id", 0) or -1)
                table.launches.append(Launch(event.name, event.time_range.elapsed_us(),
                                             None if launcher is None else source_of(launcher)))
        return table
    for event in events:
        if _is_operator(event) and event.name not in METADATA_OPS and not _calls_counted_op(event):
            table.launches.append(Launch(event.name, event.self_cpu_time_total, source_of(event)))
    return table


def _is_operator(event: Any) -> bool:
    return (not _is_device(event) and not _is_python(event) and not getattr(event, "is_user_annotation", False)
            and "::" in event.name)


def _calls_counted_op(event: Any) -> bool:
    """Whether an operator below `event` is counted (then `event` is not: the ops it called are its launches).

    NOTE: an op that calls only metadata ops (addmm resolving its inputs' conjugation, say) is itself the launch."""
    stack = list(event.cpu_children)
    while stack:
        child = stack.pop()
        if _is_operator(child) and child.name not in METADATA_OPS:
            return True
        stack.extend(child.cpu_children)
    return False


def grown(base: dict[str, tuple[float, float]], other: dict[str, tuple[float, float]], key: str, limit: int,
          by_calls: bool = False) -> list[dict[str, Any]]:
    """Entries whose calls or µs per cycle grow from `base` to `other` (CycleTable.by's), most added µs first; with
    `by_calls` (the CPU's: its µs mean little) those whose calls grow, most added calls first: {key, base_calls,
    calls, base_us, us, added_calls, added_us} per cycle."""
    rows = []
    for label, (calls, us) in other.items():
        base_calls, base_us = base.get(label, (0.0, 0.0))
        if calls > base_calls + 1e-9 or (us > base_us + 1e-9 and not by_calls):
            rows.append({key: label, "base_calls": round(base_calls, 3), "calls": round(calls, 3),
                         "base_us": round(base_us, 3), "us": round(us, 3),
                         "added_calls": round(calls - base_calls, 3), "added_us": round(us - base_us, 3)})
    first, second = ("added_calls", "added_us") if by_calls else ("added_us", "added_calls")
    rows.sort(key=lambda row: (-row[first], -row[second], row[key]))
    return rows[:limit]
