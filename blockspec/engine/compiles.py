"""Counts the Triton kernel variants this process compiles, through Triton's public post-compile hook.

`triton.knobs.runtime.jit_post_compile_hook` is called once each time a `@triton.jit` kernel gets a variant it did
not have in memory (new constexprs, dtypes, alignment or integer specialisation): compiled, or loaded from Triton's
on-disk cache. Either way the launch that needed it waits, so every one after start-up is a stall of the running
batch. The counter is process-wide (Triton's kernel caches are); an engine remembers where the count stood when its
start-up finished and reports the variants since then. Triton is optional (CPU installs): without it, or with a
Triton older than its `knobs` module (3.4), nothing can be counted and `counting` is False.
"""
from __future__ import annotations

import importlib.util
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelCompile:
    kernel: str  # the kernel function's name
    variant: str  # Triton's description of the variant: options and argument specialisations
    # NOTE: inside some engine's start-up (expected there); False for a compile that stalled serving
    during_startup: bool = False


class KernelCompileLog:
    """Every kernel variant compiled in this process since `install`, in order."""

    def __init__(self) -> None:
        self.compiles: list[KernelCompile] = []
        self.starting = 0  # engine start-ups under way in this process
        self.serving = False  # some engine finished its start-up: compiles outside a start-up are stalls
        self._runtime: Optional[Any] = None  # triton.knobs.runtime once our hook is installed
        self._previous_hook: Optional[Any] = None
        self._tried = False
        self._lock = threading.Lock()

    def install(self) -> None:
        """Chains onto Triton's post-compile hook (a hook already there keeps being called). Once per process."""
        if self._tried:  # NOTE: cheap after the first call: engine/core.py reads the count at the steps it reports
            return
        self._tried = True
        if importlib.util.find_spec("triton") is None:
            return
        import triton

        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            logger.warning("Triton %s has no post-compile hook (triton.knobs, 3.4+): kernel compiles are not counted",
                           triton.__version__)
            return
        self._previous_hook = runtime.jit_post_compile_hook
        runtime.jit_post_compile_hook = self._on_compile
        self._runtime = runtime

    @property
    def counting(self) -> bool:
        """Whether Triton still calls our hook. NOTE: bound methods compare equal, never identical; a component that
        replaced (or wrapped) it after us makes the count unknowable, so it reads as not counting."""
        return self._runtime is not None and self._runtime.jit_post_compile_hook == self._on_compile

    def _on_compile(self, *, repr: str, fn: Any, **details: Any) -> Optional[bool]:
        """Triton's JITHook signature (keywords key, repr, fn, compile, is_manual_warmup, already_compiled)."""
        self.record(str(getattr(fn, "name", fn)), repr)
        if self._previous_hook is not None:
            return self._previous_hook(repr=repr, fn=fn, **details)
        return None

    def record(self, kernel: str, variant: str) -> None:
        with self._lock:
            self.compiles.append(KernelCompile(kernel, variant, during_startup=self.starting > 0))
            stall = self.serving and not self.starting
        if stall:
            logger.warning("Triton kernel compiled after start-up (a stall of every running request): %s", variant)

    @property
    def count(self) -> int:
        return len(self.compiles)

    def stalls_since(self, mark: int) -> list[KernelCompile]:
        """The compiles since `mark` outside every engine's start-up. NOTE: a second engine starting in the same
        process compiles its own variants; those are not stalls of the first one."""
        return [event for event in self.compiles[mark:] if not event.during_startup]

    @contextmanager
    def startup(self) -> Iterator[None]:
        """An engine's start-up: compiles inside it are expected; once one has finished, compiles outside any
        start-up are logged as warnings."""
        with self._lock:
            self.starting += 1
        try:
            yield
        finally:
            with self._lock:
                self.starting -= 1
                self.serving = True


def by_kernel(compiles: list[KernelCompile]) -> dict[str, int]:
    """How many variants of each kernel, most first."""
    counts: dict[str, int] = {}
    for event in compiles:
        counts[event.kernel] = counts.get(event.kernel, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


_PROCESS_LOG = KernelCompileLog()


def kernel_compile_log() -> KernelCompileLog:
    """The process's log, its hook installed on first use."""
    _PROCESS_LOG.install()
    return _PROCESS_LOG
