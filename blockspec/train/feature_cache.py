"""The training sequences' target features kept after their first use (`--cache-features`), within memory limits.

A sequence's features are [tokens, taps x hidden] values in the target's dtype; with every sequence kept, later epochs
skip the target forward. The whole set can outgrow the device: 53,986 demo sequences filled an 80 GiB H100 and the
next step's logits found no room (2026-12-06). So features live in tiers: on the device up to `device_limit_bytes`
(what the training step leaves), then in host memory up to `host_limit_bytes` (copied to the device per step),
and past both they are not kept (the target recomputes them when they are drawn again)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

GIB = 1 << 30
# NOTE: what the cache leaves free on a GPU for the training step itself: the step's logits over the vocabulary
# (fp32, their gradients, a DFlash2 selector's top-k gradient) are several GiB each at the recipe's 32 x 32 blocks.
DEVICE_STEP_RESERVE_BYTES = 24 * GIB
HOST_SHARE = 0.5  # NOTE: of the host memory available when the cache is made; the rest for data, workers, evals
# NOTE: the device tier packs features into slabs of this size: tens of thousands of small tensors spread over the
# allocator's segments between the step's temporaries fragmented an H100 until a 2.7 GiB logits buffer found no room
# with 19 GiB reserved and free (2026-12-06)
SLAB_BYTES = 512 << 20
# NOTE: (limit, usage) of the memory cgroup, v2 then v1; v2 writes "max" and v1 a huge number where none is set
CGROUP_MEMORY_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
ALIGN_BYTES = 256


@dataclass
class FeatureCacheStats:
    device_sequences: int = 0
    device_bytes: int = 0
    host_sequences: int = 0
    host_bytes: int = 0
    not_kept: int = 0  # puts refused by both limits (those sequences' features are recomputed when drawn)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def available_host_bytes(meminfo: str = "/proc/meminfo",
                         cgroup_files: tuple[tuple[str, str], ...] = CGROUP_MEMORY_FILES) -> int:
    """Host memory available now: Linux's MemAvailable (else the free physical pages), and no more than the memory
    cgroup's limit less its usage where one is set (a container's /proc/meminfo describes the whole host). The
    arguments name the files read (tests give their own)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open(meminfo, encoding="ascii") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    for limit_file, usage_file in cgroup_files:
        try:
            limit_text, usage_text = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit_text.isdigit() and usage_text.isdigit():
            available = min(available, max(0, int(limit_text) - int(usage_text)))
        break
    return available


def default_device_limit(device: torch.device) -> int:
    """The device tier on a GPU: its memory less DEVICE_STEP_RESERVE_BYTES and what is allocated already (the target,
    the draft); none on a CPU (the host tier is the same memory there)."""
    if device.type != "cuda":
        return 0
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, total - DEVICE_STEP_RESERVE_BYTES - torch.cuda.memory_allocated(device))


class FeatureCache:
    """Features by sample index: `get` the kept ones (on `device`), `put` new ones (kept where a tier has room)."""

    def __init__(self, device: torch.device, device_limit_bytes: Optional[int] = None,
                 host_limit_bytes: Optional[int] = None,
                 host_bytes_available: Callable[[], int] = available_host_bytes, slab_bytes: int = SLAB_BYTES) -> None:
        """Limits in bytes; None: default_device_limit, and HOST_SHARE of the host memory available now. The device
        limit counts whole slabs of `slab_bytes`."""
        self.device = device
        self.slab_bytes = slab_bytes
        self._slabs: list[torch.Tensor] = []
        self._slab_used = 0  # bytes taken in the last slab
        self.device_limit = default_device_limit(device) if device_limit_bytes is None else device_limit_bytes
        self.host_limit = int(HOST_SHARE * host_bytes_available()) if host_limit_bytes is None else host_limit_bytes
        self.stats = FeatureCacheStats()
        self._on_device: dict[int, torch.Tensor] = {}
        self._on_host: dict[int, torch.Tensor] = {}

    def __contains__(self, index: int) -> bool:
        return index in self._on_device or index in self._on_host

    def get(self, index: int) -> torch.Tensor:
        """The features of sample `index` on the device (KeyError when not kept)."""
        if index in self._on_device:
            return self._on_device[index]
        # NOTE: pageable, not pinned: the pinned host allocator rounds each block up to a power of two, up to twice
        # the bytes counted against the host limit; a step draws ≈ 32 sequences, tens of MB to copy
        return self._on_host[index].to(self.device)

    def put(self, index: int, features: torch.Tensor) -> None:
        """Keeps a copy of `features` (on the device) in the first tier with room; none when neither has."""
        size = features.numel() * features.element_size()
        place = self._slab_place(size)
        if place is not None:
            place.copy_(features.reshape(-1).view(torch.uint8))
            self._on_device[index] = place.view(features.dtype).view(features.shape)
            self.stats.device_sequences += 1
            self.stats.device_bytes += size
        elif self.stats.host_bytes + size <= self.host_limit:
            self._on_host[index] = features.to("cpu", copy=True)
            self.stats.host_sequences += 1
            self.stats.host_bytes += size
        else:
            self.stats.not_kept += 1

    def _slab_place(self, size: int) -> Optional[torch.Tensor]:
        """`size` bytes of device slab (a new slab when the last has no room and the limit allows one), or None."""
        start = -(-self._slab_used // ALIGN_BYTES) * ALIGN_BYTES
        if not self._slabs or start + size > self.slab_bytes:
            if size > self.slab_bytes or (len(self._slabs) + 1) * self.slab_bytes > self.device_limit:
                return None
            self._slabs.append(torch.empty(self.slab_bytes, dtype=torch.uint8, device=self.device))
            start = 0
        self._slab_used = start + size
        return self._slabs[-1][start:start + size]
