"""Paged slot allocation and the req→token table.

A KV slot is `page * page_size + offset`. Page 0 is reserved as the dummy page: padded rows of a
batch write there, so it is never handed to a request. With the radix prefix cache, pages it holds and no request
reads count as free: the allocator evicts them (its `reclaimer`) when the free list runs short.
"""
from __future__ import annotations

from typing import Optional, Protocol

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

    def extra_pages_needed(self, req: Req, new_len: int) -> int:
        return max(0, self.pages_for(new_len) - len(req.pages))

    def can_grow(self, req: Req, new_len: int) -> bool:
        return self.extra_pages_needed(req, new_len) <= self._available_pages

    def grow(self, req: Req, new_len: int, table: "ReqToTokenTable") -> None:
        """Give `req` slots for positions [allocated_len, new_len) and write them into its table row."""
        if new_len <= req.allocated_len:
            return
        extra = self.extra_pages_needed(req, new_len)
        self._reserve(extra)
        for _ in range(extra):
            req.pages.append(self._free_pages.pop())
        if self.page_size == 1:  # NOTE: a page is a slot; converting only the new ones skips a prompt-long pass
            slots = int64_tensor(req.pages[req.allocated_len:new_len])
        else:
            first, ps = req.allocated_len // self.page_size, self.page_size
            positions = torch.arange(req.allocated_len - first * ps, new_len - first * ps)
            pages = int64_tensor(req.pages[first:self.pages_for(new_len)])
            slots = pages[positions // ps] * ps + positions % ps
        assert req.pool_row is not None
        table.write(req.pool_row, req.allocated_len, slots)
        req.allocated_len = new_len

    def grow_many(self, reqs: list[Req], new_len: list[int], table: "ReqToTokenTable") -> None:
        """`grow` for a decode batch: slots computed on the host in Python (a few per request), and one table write
        for the whole batch instead of one host→device copy per request."""
        extras = [self.extra_pages_needed(req, length) for req, length in zip(reqs, new_len)]
        if sum(extras) > self._available_pages:
            raise MemoryError("KV pool exhausted")  # callers check free slots first; nothing has changed yet
        self._reserve(sum(extras))
        page, free = self.page_size, self._free_pages
        rows: list[int] = []
        cols: list[int] = []
        slots: list[int] = []
        for req, length, extra in zip(reqs, new_len, extras):
            start = req.allocated_len
            if length <= start:
                continue
            if extra:
                req.pages.extend(free[-1:-extra - 1:-1])  # NOTE: the same pages, in the same order, as pop() x extra
                del free[-extra:]
            pages = req.pages
            if page == 1:
                slots.extend(pages[start:length])
            else:
                slots.extend(pages[p // page] * page + p % page for p in range(start, length))
            assert req.pool_row is not None
            rows.extend([req.pool_row] * (length - start))
            cols.extend(range(start, length))
            req.allocated_len = length
        table.write_entries(rows, cols, slots)

    def shrink(self, req: Req, new_len: int) -> None:
        """Release positions >= new_len; pages still holding a kept position stay with the request."""
        keep = self.pages_for(new_len)
        if keep * self.page_size < req.shared_len:
            raise RuntimeError(f"{req.rid}: shrinking into its pages shared with the radix cache")
        for page in reversed(req.pages[keep:]):
            self._free_pages.append(page)
        del req.pages[keep:]
        req.allocated_len = min(req.allocated_len, new_len)

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

    def write_entries(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        """table[rows[i], cols[i]] = slots[i] for all i: one host→device copy and one scatter."""
        if not rows:
            return
        host = int64_array(rows)
        host.extend(cols)
        host.extend(slots)
        packed = to_device(int64_tensor(host), self.table.device).view(3, -1)
        self.table[packed[0], packed[1]] = packed[2]
