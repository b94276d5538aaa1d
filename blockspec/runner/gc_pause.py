"""Python's cyclic garbage collector held off while CUDA graphs are captured.

NOTE: PyTorch no longer collects garbage when a capture begins (only under `force_cudagraph_gc`), so a collection
can start in the middle of one, triggered by any allocation of the captured Python code. It runs the destructors of
whatever dead cycles it finds: an earlier engine's CUDA graphs, memory pools and events. Their CUDA calls are not
allowed while this thread captures in global mode: the capture is invalidated, and the next launch fails with
"operation failed due to a previous error during capture" — only when such garbage exists, so only in some orders of
tests, or after a shut-down engine in one process. Collecting once before the captures and pausing the collector
until they end keeps every foreign destructor out of them; garbage made meanwhile is collected afterwards.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def garbage_collection_paused() -> Iterator[None]:
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
