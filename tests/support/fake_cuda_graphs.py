"""torch.cuda's graph capture replaced for CPU tests of capture logic: captures run the captured code once, eagerly,
and a flag says whether one is in progress."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch


class CaptureFlag:
    def __init__(self) -> None:
        self.now = False


def fake_graph_capture(monkeypatch: pytest.MonkeyPatch) -> CaptureFlag:
    """Patches torch.cuda's graph, pool, synchronize and memory calls for this test; the flag is set while code runs
    inside a (fake) `torch.cuda.graph` block."""
    flag = CaptureFlag()

    @contextlib.contextmanager
    def capture(*args: Any, **kwargs: Any) -> Iterator[None]:
        flag.now = True
        try:
            yield
        finally:
            flag.now = False

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    return flag
