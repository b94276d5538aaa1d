"""Where the host time of one extend goes: the worker's whole extend (batch building, attention plan, the model's
pieces — graph replays on the piecewise path — with attention launched between them, logits, first tokens) timed
on the host per part, without device syncs inside it (issue 18: a piecewise extend of 1 x 128 tokens on SmolLM2
shapes takes ≈ 4.9 ms of wall time against ≈ 0.9 ms of kernels on the H200).

`host_split(engine, reqs, repeat)` returns median µs per part; `first_tokens` ends in the device→host read of the
sampled tokens, so it holds whatever device work the host did not wait for earlier; `draft_kv` is the eager path's
draft-KV materialise (the piecewise path runs it inside its last graph); `other` is the rest of `total`. Used by profile_prefill.py
(`--host-split`); tests run it on the CPU."""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

from blockspec import Engine
from blockspec.request import Req
from prefill_latency import rewind

PARTS = ("build_batch", "plan", "graph_replays", "attention", "draft_kv", "logits", "first_tokens")


class _Timed:
    """A graph whose replay is timed (stands in for the CUDAGraph in the piecewise runner's dict)."""

    def __init__(self, graph: Any, add: Callable[[float], None]) -> None:
        self.graph, self.add = graph, add

    def replay(self) -> None:
        start = time.perf_counter()
        self.graph.replay()
        self.add(time.perf_counter() - start)


@contextmanager
def _timing(owner: Any, name: str, add: Callable[[float], None]) -> Iterator[None]:
    """`owner.name` timed while the block runs (an instance attribute shadowing the method, removed after)."""
    had_own, original = name in vars(owner), getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            add(time.perf_counter() - start)

    setattr(owner, name, timed)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def host_split(engine: Engine, reqs: list[Req], repeat: int, cached: int = 0) -> dict[str, float]:
    """Median host µs per part of `repeat` whole extends of `reqs` (their prompts after `cached` tokens already in
    the KV cache; prefill_latency.make_reqs), and `total`."""
    worker, runner = engine.worker, engine.runner
    samples: dict[str, list[float]] = {part: [] for part in (*PARTS, "total", "other")}
    current: dict[str, float] = {}

    def adder(part: str) -> Callable[[float], None]:
        def add(seconds: float) -> None:
            current[part] = current.get(part, 0.0) + seconds
        return add

    piecewise = runner.piecewise if runner.piecewise_enabled else None
    saved_graphs = piecewise.graphs if piecewise is not None else None
    if piecewise is not None:
        piecewise.graphs = {key: _Timed(graph, adder("graph_replays")) for key, graph in piecewise.graphs.items()}
    try:
        with _timing(worker, "build_extend_batch", adder("build_batch")), \
                _timing(runner.attention, "plan", adder("plan")), \
                _timing(runner.attention, "forward", adder("attention")), \
                _timing(runner.model, "compute_logits", adder("logits")), \
                _timing(worker, "_materialise_draft_kv", adder("draft_kv")) if hasattr(worker, "_materialise_draft_kv") \
                else nullcontext(), \
                _timing(worker, "first_tokens", adder("first_tokens")):
            for _ in range(repeat):
                current.clear()
                lengths = rewind(reqs, cached)
                start = time.perf_counter()
                worker.extend(reqs, lengths)
                total = time.perf_counter() - start
                for part in PARTS:
                    samples[part].append(current.get(part, 0.0))
                samples["total"].append(total)
                samples["other"].append(total - sum(current.values()))
    finally:
        if piecewise is not None and saved_graphs is not None:
            piecewise.graphs = saved_graphs
    return {part: round(statistics.median(values) * 1e6, 1) for part, values in samples.items()}
