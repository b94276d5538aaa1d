"""No garbage collection inside a CUDA graph capture (runner/gc_pause.py): the destructors of an earlier engine's dead
cycles (its graphs, pools, events) make CUDA calls that invalidate a capture in progress. On the CPU, with
torch.cuda's capture replaced by a recorder: garbage from before is collected before the first capture, and no
collection runs inside any capture however low the collector's thresholds."""
from __future__ import annotations

import gc
from typing import Iterator

import pytest
import torch

from blockspec.batch import ForwardBatch, ForwardMode
from blockspec.kv.allocator import ReqToTokenTable
from blockspec.runner.cuda_graph import GraphedForward
from tests.support.fake_cuda_graphs import CaptureFlag, fake_graph_capture


class DeadCycle:
    """A reference cycle whose finaliser notes whether a capture was in progress when the collector ran it."""

    def __init__(self, events: list[str], capturing: CaptureFlag) -> None:
        self.me = self
        self.events, self.capturing = events, capturing

    def __del__(self) -> None:
        self.events.append("collected inside a capture" if self.capturing.now else "collected outside")


@pytest.fixture()
def low_thresholds() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # NOTE: any allocation may start a full collection
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def test_graphed_forward_captures_without_collecting(monkeypatch: pytest.MonkeyPatch, low_thresholds: None) -> None:
    capturing = fake_graph_capture(monkeypatch)
    events: list[str] = []

    def forward(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        if capturing.now:
            DeadCycle(events, capturing)  # NOTE: garbage made inside a capture: the collector must wait for the end
            _ = [[i] for i in range(200)]  # allocations that would start a collection
        return (batch.input_ids.float()[:, None] * 2,)

    table = ReqToTokenTable(4, 64, torch.device("cpu"))
    DeadCycle(events, capturing)  # NOTE: an earlier engine's garbage
    gc_enabled_before = gc.isenabled()
    graph = GraphedForward("decode", forward, ForwardMode.DECODE, 1, [1, 2, 4], table.table, table.dummy_row, 64)
    graph.capture()
    assert gc.isenabled() == gc_enabled_before
    gc.collect()
    assert events[0] == "collected outside" and "collected inside a capture" not in events, events
    assert len(events) == 4  # the garbage from before and one per captured batch size, all collected in the end
