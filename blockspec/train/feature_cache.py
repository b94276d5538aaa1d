"""The training sequences' target features kept after their first use (`--cache-features`), within memory limits.

A sequence's features are [tokens, taps x hidden] values in the target's dtype; with every sequence kept, later epochs
skip the target forward. The whole set can outgrow the device (docs/performance.md: the DFlash2 chain of
2026-12-06). So features live in tiers: on the device up to `device_limit_bytes` (what the training step leaves),
then in host memory up to `host_limit_bytes` (copied to the device per step), and past both they are not kept (the
target recomputes them when they are drawn again)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

GIB = 1 << 30
# NOTE: what the cache leaves free on a GPU for everything else after it is made: the training step (its logits over
# the vocabulary in fp32, their gradients and a DFlash2 selector's top-k gradient are each [rows, vocab]), the
# target's KV pool for feature extraction (grown on demand), and an evaluation engine started during training.
DEVICE_STEP_RESERVE_BYTES = 24 * GIB
# NOTE: of the host memory available when the cache is made, shared by the training processes on the host; the rest
# for the data, generation workers and evaluations
HOST_SHARE = 0.5
# NOTE: the device tier packs features into slabs of this size, each a fresh allocation: thousands of small tensors
# spread over the allocator's segments between the step's temporaries fragment the device until a large temporary
# finds no room although enough memory is reserved and free
SLAB_BYTES = 512 << 20
ALIGN_BYTES = 256
# NOTE: (limit, usage, stat) of the memory cgroup, v2 then v1; where none is set v2 writes "max", v1 a huge number
CGROUP_MEMORY_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
     "/sys/fs/cgroup/memory/memory.stat"),
)
# NOTE: the page cache the kernel reclaims first counts as used in the cgroup's usage; v2 and v1 name it so
RECLAIMABLE_STATS = ("inactive_file", "total_inactive_file")


@dataclass
class FeatureCacheStats:
    device_sequences: int = 0
    device_bytes: int = 0
    host_sequences: int = 0
    host_bytes: int = 0
    not_kept: int = 0  # puts refused by both limits (those sequences' features are recomputed when drawn)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _cgroup_room(limit_file: str, usage_file: str, stat_file: str) -> Optional[int]:
    """The cgroup's limit less its usage (reclaimable page cache not counted); None where no limit is set or the files
    cannot be read."""
    try:
        limit_text, usage_text = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
    except OSError:
        return None
    if not (limit_text.isdigit() and usage_text.isdigit()):
        return None
    reclaimable = 0
    try:
        for line in Path(stat_file).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name in RECLAIMABLE_STATS and value.strip().isdigit():
                reclaimable = int(value)
                break
    except OSError:
        pass
    return max(0, int(limit_text) - max(0, int(usage_text) - reclaimable))


def available_host_bytes(meminfo: str = "/proc/meminfo",
                         cgroup_files: tuple[tuple[str, str, str], ...] = CGROUP_MEMORY_FILES) -> int:
    """Host memory available now: Linux's MemAvailable (else the free physical pages), and no more than the memory
    cgroup's room where a limit is set (a container's /proc/meminfo describes the whole host). The arguments name the
    files read (tests give their own)."""
    available = 0
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with open(meminfo, encoding="ascii") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, ValueError, StopIteration):
        pass
    for files in cgroup_files:
        if Path(files[0]).exists():
            room = _cgroup_room(*files)
            return available if room is None else min(available, room)
    return available


def default_device_limit(device: torch.device) -> int:
    """The device tier on a GPU: the memory free now (the driver's free memory and what this process holds cached)
    less DEVICE_STEP_RESERVE_BYTES; none on a CPU (the host tier is the same memory there)."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(0, free + cached - DEVICE_STEP_RESERVE_BYTES)


def default_host_limit(host_bytes_available: Callable[[], int] = available_host_bytes) -> int:
    """HOST_SHARE of the host memory available now, split between the training processes of this host (torchrun's
    LOCAL_WORLD_SIZE: every rank caches what it draws, and over the epochs each draws every sequence)."""
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return int(HOST_SHARE * host_bytes_available()) // local_ranks


class FeatureCache:
    """Features by sample index: `get` the kept ones (on `device`), `put` new ones (kept where a tier has room)."""

    def __init__(self, device: torch.device, device_limit_bytes: Optional[int] = None,
                 host_limit_bytes: Optional[int] = None,
                 host_bytes_available: Callable[[], int] = available_host_bytes, slab_bytes: int = SLAB_BYTES) -> None:
        """Limits in bytes; None: default_device_limit, default_host_limit. The device limit counts whole slabs of
        `slab_bytes` (one slab of the whole limit where that is smaller)."""
        self.device = device
        self.device_limit = default_device_limit(device) if device_limit_bytes is None else device_limit_bytes
        self.host_limit = default_host_limit(host_bytes_available) if host_limit_bytes is None else host_limit_bytes
        self.slab_bytes = min(slab_bytes, self.device_limit) if self.device_limit > 0 else slab_bytes
        self.stats = FeatureCacheStats()
        self._on_device: dict[int, torch.Tensor] = {}
        self._on_host: dict[int, torch.Tensor] = {}
        self._slabs: list[torch.Tensor] = []
        self._slab_used = 0  # bytes taken in the last slab

    def __contains__(self, index: int) -> bool:
        return index in self._on_device or index in self._on_host

    def get(self, index: int) -> torch.Tensor:
        """The features of sample `index` on the device (KeyError when not kept)."""
        if index in self._on_device:
            return self._on_device[index]
        # NOTE: pageable, not pinned: the pinned host allocator rounds each block up to a power of two, up to twice
        # the bytes counted against the host limit, for a copy of the few sequences a step draws
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
            slab = self._new_slab()
            if slab is None:
                return None
            self._slabs.append(slab)
            start = 0
        self._slab_used = start + size
        return self._slabs[-1][start:start + size]

    def _new_slab(self) -> Optional[torch.Tensor]:
        """A slab in a segment of its own, or None (and no more slabs) when the device has no room for one."""
        if self.device.type == "cuda":
            # NOTE: cached free blocks go back first, so the slab is a fresh segment rather than a piece split off a
            # segment the step's temporaries use (what strands the remainder)
            torch.cuda.empty_cache()
        try:
            return torch.empty(self.slab_bytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            self.device_limit = len(self._slabs) * self.slab_bytes
            log.warning("feature cache: no room for another slab on %s; %d GiB there, the rest in host memory",
                        self.device, self.device_limit // GIB)
            return None
