"""Paged slot allocation and the req→token table.

A KV slot is `page * page_size + offset`. Page 0 is reserved as the dummy page: padded rows of a
batch write there, so it is never handed to a request. With the radix prefix cache, pages it holds and no request
reads count as free: the allocator evicts them (its `reclaimer`) when the free list runs short.
"""
from __future__ import annotations

from typing import Optional, Protocol

import numpy as np
import torch

from blockspec.host_tensors import int64_array, int64_tensor, to_device
from blockspec.request import Req


class PageReclaimer(Protocol):
    """Pages held elsewhere (the radix cache) that can be taken back on demand."""

    @property
    def evictable_pages(self) -> int: ...

    def evict(self, num_pages: int) -> list[int]: ...


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is the dummy page)")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free_pages: list[int] = list(range(num_pages - 1, 0, -1))
        self.reclaimer: Optional[PageReclaimer] = None

    @property
    def total_slots(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def free_slots(self) -> int:
        """Slots a request can be given now: unused ones plus those of evictable cached pages."""
        return self._available_pages * self.page_size

    @property
    def unused_slots(self) -> int:
        """Slots on the free list (cached pages not counted)."""
        return len(self._free_pages) * self.page_size

    @property
    def _available_pages(self) -> int:
        return len(self._free_pages) + (self.reclaimer.evictable_pages if self.reclaimer is not None else 0)

    def _reserve(self, num_pages: int) -> None:
        """Makes the free list hold at least `num_pages` pages, evicting cached ones if needed."""
        if num_pages > len(self._free_pages) and self.reclaimer is not None:
            self._free_pages.extend(self.reclaimer.evict(num_pages - len(self._free_pages)))
        if num_pages > len(self._free_pages):
            raise MemoryError("KV pool exhausted")  # callers check free_slots / can_grow first

    def free(self, pages: list[int]) -> None:
        """Returns pages to the free list (the prefix cache's duplicates and a released request's own pages)."""
        self._free_pages.extend(reversed(pages))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def slots_of(self, pages: list[int], start: int, end: int) -> list[int]:
        """The KV slots of positions [start, end) of a request holding `pages`."""
        page = self.page_size
        if page == 1:
            return pages[start:end]
        return [pages[p // page] * page + p % page for p in range(start, end)]

    def extra_pages_needed(self, req: Req, new_len: int) -> int:
        return max(0, self.pages_for(new_len) - len(req.pages))

    def can_grow(self, req: Req, new_len: int) -> bool:
        return self.extra_pages_needed(req, new_len) <= self._available_pages

    def grow(self, req: Req, new_len: int, table: "ReqToTokenTable") -> None:
        """Give `req` slots for positions [allocated_len, new_len) and write them into its table row."""
        start = req.allocated_len
        if new_len <= start:
            return
        extra = self.extra_pages_needed(req, new_len)
        self._reserve(extra)
        self._take(req, extra)
        assert req.pool_row is not None
        page = self.page_size
        if page == 1:
            slots = int64_tensor(req.pages[start:new_len])
        else:  # NOTE: numpy: a prompt's positions at once (torch's CPU ops cost more per call at these sizes)
            positions = np.arange(start, new_len, dtype=np.int64)
            slots = torch.from_numpy(np.asarray(req.pages, dtype=np.int64)[positions // page] * page + positions % page)
        table.write(req.pool_row, start, slots)
        req.allocated_len = new_len

    def _take(self, req: Req, num_pages: int) -> None:
        """Moves `num_pages` reserved pages to the end of req.pages (NOTE: in the order pop() x num_pages gives)."""
        if num_pages:
            free = self._free_pages
            req.pages.extend(free[-1:-num_pages - 1:-1])
            del free[-num_pages:]

    def grow_many(self, reqs: list[Req], new_len: list[int], table: "ReqToTokenTable") -> None:
        """`grow` for a decode batch: each request's new slots on the host (a slice of its pages when page_size is 1)
        and one table write for the whole batch (`write_runs`) instead of one host→device copy per request."""
        if not self.try_grow_many(reqs, new_len, table):
            raise MemoryError("KV pool exhausted")  # callers check free slots first; nothing has changed yet

    def try_grow_many(self, reqs: list[Req], new_len: list[int], table: "ReqToTokenTable") -> bool:
        """`grow_many`, or False with nothing changed when the free pool cannot give every request its slots."""
        page = self.page_size  # NOTE: extra_pages_needed inlined: once per request per decode step
        extras = [max(0, -(-length // page) - len(req.pages)) for req, length in zip(reqs, new_len)]
        total = sum(extras)
        if total > self._available_pages:
            return False
        self._reserve(total)
        rows: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        slots: list[int] = []
        for req, length, extra in zip(reqs, new_len, extras):
            start = req.allocated_len
            if length <= start:
                continue
            self._take(req, extra)
            slots.extend(self.slots_of(req.pages, start, length))
            assert req.pool_row is not None
            rows.append(req.pool_row)
            starts.append(start)
            lengths.append(length - start)
            req.allocated_len = length
        table.write_runs(rows, starts, lengths, slots)
        return True

    def shrink(self, req: Req, new_len: int) -> None:
        """Release positions >= new_len; pages still holding a kept position stay with the request."""
        keep = self.pages_for(new_len)
        if keep * self.page_size < req.shared_len:
            raise RuntimeError(f"{req.rid}: shrinking into its pages shared with the radix cache")
        pages = req.pages
        if len(pages) > keep:
            self._free_pages.extend(pages[:keep - 1:-1] if keep else pages[::-1])
            del pages[keep:]
        if new_len < req.allocated_len:
            req.allocated_len = new_len

    def release(self, req: Req) -> None:
        self.shrink(req, 0)


class ReqToTokenTable:
    """Row per admitted request: slot index of each of its positions (on the model's device)."""

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device) -> None:
        # NOTE: the extra last row is the dummy row: all its slots are the dummy page's slot 0.
        self.table = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int64, device=device)
        self.dummy_row = max_requests
        self.max_context_len = max_context_len
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def acquire(self) -> int:
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start:start + slots.numel()] = to_device(slots, self.table.device)

    def write_runs(self, rows: list[int], starts: list[int], lengths: list[int], slots: list[int]) -> None:
        """table[rows[i], starts[i]:starts[i] + lengths[i]] = the next lengths[i] entries of `slots`, for all i: one
        host→device copy and one scatter. NOTE: the flat indices come from numpy per run, not per entry in Python (a
        decode step writes B entries per request)."""
        if not slots:
            return
        lens = np.asarray(lengths, dtype=np.int64)
        first = np.asarray(rows, dtype=np.int64) * self.table.shape[1] + np.asarray(starts, dtype=np.int64)
        flat = np.arange(len(slots), dtype=np.int64) + np.repeat(first - (np.cumsum(lens) - lens), lens)
        host = np.concatenate([flat, np.frombuffer(int64_array(slots), dtype=np.int64)])
        packed = to_device(torch.from_numpy(host), self.table.device)
        self.table.view(-1)[packed[:len(slots)]] = packed[len(slots):]
