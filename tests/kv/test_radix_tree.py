"""RadixTree and the allocator's eviction hook, without a model: whole-page matches, splits, locks, LRU eviction."""
from __future__ import annotations

import pytest
import torch

from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.kv.radix_tree import RadixTree
from blockspec.request import Req, SamplingParams


def test_match_is_whole_pages_and_splits_nodes() -> None:
    tree = RadixTree(page_size=2)
    assert tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == 0
    pages, node = tree.match([1, 2, 3, 9, 9])  # NOTE: [1, 2] only: the second page differs at its second token
    assert pages == [10] and node.key == [1, 2]
    assert tree.match([1, 2, 3])[0] == [10]  # a partial last page never matches
    assert tree.match([7, 8])[0] == []
    assert tree.insert([1, 2, 3, 4, 7, 8], [20, 21, 22]) == 4  # the first 4 tokens keep the tree's pages
    assert tree.match([1, 2, 3, 4, 7, 8, 0])[0] == [10, 11, 22]
    assert tree.match([1, 2, 3, 4, 5, 6])[0] == [10, 11, 12]
    assert tree.num_pages == 4 and tree.evictable_pages == 4
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3], [10, 11])


def test_insert_and_match_is_insert_then_match() -> None:
    tree = RadixTree(page_size=2)
    assert tree.insert_and_match([1, 2, 3, 4, 5, 6], [10, 11, 12])[0] == 0
    present, pages, node = tree.insert_and_match([1, 2, 3, 4, 7, 8], [20, 21, 22])
    assert (present, pages, node.key) == (4, [10, 11, 22], [7, 8])
    present, pages, node = tree.insert_and_match([1, 2], [30])  # ends inside a node: split there, as match would
    assert (present, pages, node.key) == (2, [10], [1, 2])
    assert tree.match([1, 2, 0])[1] is node and tree.num_pages == 4


def test_locks_protect_and_eviction_is_least_recently_used() -> None:
    tree = RadixTree(page_size=1)
    tree.insert([1, 2, 3], [11, 12, 13])
    tree.insert([1, 2, 4], [11, 12, 14])
    tree.insert([5, 6], [15, 16])
    _, node = tree.match([1, 2, 3])
    tree.lock(node)
    assert tree.locked_pages == 3 and tree.evictable_pages == 3
    tree.match([5, 6])  # more recent than [1, 2, 4]
    assert tree.evict(1) == [14]
    assert sorted(tree.evict(10)) == [15, 16]  # the locked path stays
    assert tree.num_pages == 3 and tree.evictable_pages == 0 and tree.evicted_pages == 3
    with pytest.raises(RuntimeError, match="flush"):
        tree.reset()
    tree.unlock(node)
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(node)
    assert sorted(tree.reset()) == [11, 12, 13] and tree.num_pages == 0


def test_split_keeps_lock_counts() -> None:
    tree = RadixTree(page_size=1)
    tree.insert([1, 2, 3, 4], [1, 2, 3, 4])
    _, deep = tree.match([1, 2, 3, 4])
    tree.lock(deep)
    _, shallow = tree.match([1, 2])  # splits the locked node
    assert shallow.lock_ref == deep.lock_ref == 1 and tree.locked_pages == 4
    tree.unlock(deep)
    assert tree.locked_pages == 0 and sorted(tree.evict(4)) == [1, 2, 3, 4]


def test_allocator_counts_evictable_pages_as_free_and_evicts_on_demand() -> None:
    allocator = PageAllocator(num_pages=5, page_size=2)  # 4 usable pages
    table = ReqToTokenTable(2, 16, torch.device("cpu"))
    tree = RadixTree(page_size=2)
    allocator.reclaimer = tree
    owner = Req([1, 2, 3, 4], SamplingParams())
    owner.pool_row = table.acquire()
    allocator.grow(owner, 4, table)
    tree.insert([1, 2, 3, 4], owner.pages)  # the tree adopts both pages
    owner.pages = []
    assert allocator.unused_slots == 4 and allocator.free_slots == 8
    other = Req([9] * 8, SamplingParams())
    other.pool_row = table.acquire()
    assert allocator.can_grow(other, 8)
    allocator.grow(other, 8, table)  # needs all four pages: both cached ones are evicted
    assert tree.num_pages == 0 and allocator.free_slots == 0
    late = Req([5, 6], SamplingParams())
    late.pool_row = owner.pool_row
    assert not allocator.can_grow(late, 2)
    with pytest.raises(MemoryError):
        allocator.grow(late, 2, table)


class ScanningTree(RadixTree):
    """The eviction the lazy heap replaced: every unlocked leaf of the tree, least recently used first."""

    def evict(self, num_pages: int) -> list[int]:
        freed: list[int] = []
        while len(freed) < num_pages:
            leaves = [n for n in self._all_nodes() if not n.children and n.lock_ref == 0]
            if not leaves:
                break
            leaf = min(leaves, key=lambda n: n.last_access)
            del leaf.parent.children[tuple(leaf.key[:self.page_size])]
            freed.extend(leaf.pages)
            self.num_pages -= len(leaf.pages)
        self.evicted_pages += len(freed)
        return freed

    def _all_nodes(self) -> list:
        stack, nodes = list(self.root.children.values()), []
        while stack:
            nodes.append(stack.pop())
            stack.extend(nodes[-1].children.values())
        return nodes


class EagerlyRebuiltTree(RadixTree):
    candidate_slack = 0  # NOTE: the heap is rebuilt often, during evictions too


@pytest.mark.parametrize("fast_tree", [RadixTree, EagerlyRebuiltTree])
@pytest.mark.parametrize("page_size", [1, 2])
def test_lazy_eviction_heap_evicts_what_a_full_scan_would(page_size: int, fast_tree: type) -> None:
    """Random inserts, matches, locks, unlocks and evictions on two trees in lockstep: the same pages leave."""
    import random

    rng = random.Random(page_size)
    fast, slow = fast_tree(page_size), ScanningTree(page_size)
    locked: list[tuple] = []
    next_page = 0
    for _ in range(3000):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(page_size * rng.randint(1, 6))]
        if op < 0.35:
            pages = list(range(next_page, next_page + len(tokens) // page_size))
            next_page += len(pages)
            assert fast.insert(tokens, pages) == slow.insert(tokens, pages)
        elif op < 0.6:
            (fast_pages, fast_node), (slow_pages, slow_node) = fast.match(tokens), slow.match(tokens)
            assert fast_pages == slow_pages
            if fast_node is not fast.root and rng.random() < 0.5:
                fast.lock(fast_node)
                slow.lock(slow_node)
                locked.append((fast_node, slow_node))
        elif op < 0.8 and locked:
            fast_node, slow_node = locked.pop(rng.randrange(len(locked)))
            fast.unlock(fast_node)
            slow.unlock(slow_node)
        else:
            want = rng.randint(1, 8)
            assert fast.evict(want) == slow.evict(want)
        assert (fast.num_pages, fast.evictable_pages) == (slow.num_pages, slow.evictable_pages)
        assert fast.num_candidates <= 4 * fast.num_nodes + fast.candidate_slack + 1
    assert fast.evicted_pages == slow.evicted_pages > 100


def test_eviction_heap_stays_bounded_without_evictions() -> None:
    tree = RadixTree(page_size=1)
    for i in range(50):
        tree.insert([i, 1, 2], [3 * i, 3 * i + 1, 3 * i + 2])
    for _ in range(20_000):
        tree.match([7, 1, 2])
    assert tree.num_nodes == 50 and tree.num_candidates <= 4 * 50 + 1025
    assert tree.evict(3) == [0, 1, 2]  # still least recently used first: [0, 1, 2] was inserted first


def test_rebuilding_the_heap_during_an_eviction_loses_no_candidate() -> None:
    """An eviction that bares a parent while the heap is rebuilt still finds it (a review's reproduction)."""
    tree = RadixTree(page_size=1)
    tree.insert([0], [1])
    tree.insert([0, 1], [1, 2])
    tree.insert([0, 1, 2], [1, 2, 3])
    tree.insert([5], [4])
    for _ in range(tree.candidate_slack + 10):
        tree.match([5])
    _, node = tree.match([5])
    tree.lock(node)
    assert tree.evictable_pages == 3 and sorted(tree.evict(3)) == [1, 2, 3]
