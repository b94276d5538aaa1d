"""PageAllocator / ReqToTokenTable bookkeeping: a batch's runs written at once equal per-entry writes; grow_many hands
out the same pages and table entries as `grow` one request at a time, each entry the slot of its position's page
(randomised lengths, page sizes 1 and 4); shrink returns pages in the order grow takes them back."""
from __future__ import annotations

import random

import pytest
import torch

from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.request import Req, SamplingParams


def test_write_runs_equals_entry_by_entry() -> None:
    rng = random.Random(0)
    table, expected = ReqToTokenTable(6, 40, torch.device("cpu")), torch.zeros((7, 40), dtype=torch.int64)
    for _ in range(50):
        rows, starts, lengths, slots = [], [], [], []
        for row in rng.sample(range(7), rng.randint(0, 4)):
            start, length = rng.randrange(40), rng.randint(0, 5)
            length = min(length, 40 - start)
            values = [rng.randrange(1000) for _ in range(length)]
            rows.append(row)
            starts.append(start)
            lengths.append(length)
            slots.extend(values)
            expected[row, start:start + length] = torch.tensor(values, dtype=torch.int64)
        table.write_runs(rows, starts, lengths, slots)
        assert torch.equal(table.table, expected)


def admitted(allocator: PageAllocator, table: ReqToTokenTable, count: int) -> list[Req]:
    reqs = [Req([1, 2, 3], SamplingParams()) for _ in range(count)]
    for req in reqs:
        req.pool_row = table.acquire()
    return reqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_grow_many_matches_grow_one_by_one(page_size: int) -> None:
    rng = random.Random(page_size)
    sides = []
    for _ in range(2):
        allocator, table = PageAllocator(500, page_size), ReqToTokenTable(5, 96, torch.device("cpu"))
        sides.append((allocator, table, admitted(allocator, table, 5)))
    for _ in range(40):
        lengths = [rng.randint(0, 90) for _ in range(5)]
        (a, ta, ra), (b, tb, rb) = sides
        a.grow_many(ra, lengths, ta)
        for req, length in zip(rb, lengths):
            b.grow(req, length, tb)
        assert [r.pages for r in ra] == [r.pages for r in rb] and a._free_pages == b._free_pages
        assert [r.allocated_len for r in ra] == [r.allocated_len for r in rb]
        for req in ra:
            assert torch.equal(ta.table[req.pool_row, :req.allocated_len], tb.table[req.pool_row, :req.allocated_len])
            slots = [req.pages[p // page_size] * page_size + p % page_size for p in range(req.allocated_len)]
            assert ta.table[req.pool_row, :req.allocated_len].tolist() == slots
        keep = [rng.randint(0, 90) for _ in range(5)]
        for allocator, _, reqs in sides:
            for req, length in zip(reqs, keep):
                allocator.shrink(req, length)


def test_shrink_frees_in_the_order_grow_takes_back() -> None:
    allocator, table = PageAllocator(20, 1), ReqToTokenTable(1, 32, torch.device("cpu"))
    (req,) = admitted(allocator, table, 1)
    allocator.grow(req, 10, table)
    pages = list(req.pages)
    allocator.shrink(req, 4)
    assert req.pages == pages[:4] and req.allocated_len == 4
    allocator.grow(req, 10, table)
    assert req.pages == pages
    allocator.release(req)
    assert req.pages == [] and req.allocated_len == 0 and allocator.unused_slots == allocator.total_slots
