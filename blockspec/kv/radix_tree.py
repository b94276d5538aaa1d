"""RadixTree: token ids → the KV pages that hold them, at page granularity, shared read-only between requests.

A node's key is a run of token ids, a whole number of pages long, and its value the pages whose slots hold the
target KV (and, under DFlash, the draft KV: the draft pool is indexed by the same slots) of those tokens at those
positions, given every token on the path above it. Children are keyed by their first page of token ids. A node is
locked while a request reads it (`lock` counts up to the root); unlocked leaves are evicted least recently used
first, when the allocator runs short of free pages (`evict`).

Eviction candidates live in a lazy heap: a node is pushed with its access time whenever it may have become an
unlocked leaf (created, used, unlocked, or its last child evicted), and an entry is checked when it is popped (still in
the tree, still a leaf, unlocked, not used since). A full batch of long requests evicts every step; scanning the whole
tree each time cost ≈ 5 ms a decode step at 256 rows on an H200 (benchmarks/generation_rate.py, 2026-12-04).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterator, Optional, Sequence


Candidate = tuple[int, int, "RadixNode"]  # (last access, push order, node)


class RadixNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], pages: list[int], parent: Optional["RadixNode"], last_access: int) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access


class RadixTree:
    candidate_slack = 1024  # the eviction heap is rebuilt past 4 entries a node + this many

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._clock = itertools.count(1)  # NOTE: a logical LRU clock: eviction order is deterministic
        self.root = RadixNode([], [], None, 0)
        self.num_pages = 0  # pages held by the tree
        self.locked_pages = 0  # pages of locked nodes (read by some request): never evicted
        self.evicted_pages = 0  # since the engine started (flush_cache does not count)
        self.num_nodes = 0
        self._candidates: list[Candidate] = []  # NOTE: a heap; entries may be stale (checked when popped)
        self._order = itertools.count()

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        return self.num_pages - self.locked_pages

    @property
    def num_candidates(self) -> int:
        """Entries of the eviction heap, stale ones included (at most 4 per node + `candidate_slack`)."""
        return len(self._candidates)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    # ---- lookup and insertion ----------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> tuple[list[int], RadixNode]:
        """The pages of the longest cached prefix of `tokens` (whole pages only) and the node it ends at (a node
        is split so that its key ends exactly there). Marks the path as used now."""
        usable = len(tokens) // self.page_size * self.page_size
        now = next(self._clock)
        node, position, pages = self.root, 0, []
        while position < usable:
            child = node.children.get(self._first_page(tokens, position))
            if child is None:
                break
            common = self._common_length(child.key, tokens, position, usable)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            pages.extend(child.pages)
            position += common
            node = child
        self._offer(node)
        return pages, node

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Caches `tokens` (a whole number of pages) as held by `pages`. Returns how many leading tokens were cached
        already: the tree keeps its own pages for those (the caller still owns `pages` for them) and adopts the
        rest of `pages`."""
        return self.insert_and_match(tokens, pages)[0]

    def insert_and_match(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[int, list[int], RadixNode]:
        """`insert` and then `match(tokens)` in one walk: (tokens cached already, the tree's pages for all of
        `tokens`, the node they end at)."""
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"{len(tokens)} tokens are not {len(pages)} pages of {self.page_size}")
        now = next(self._clock)
        node, position, path_pages = self.root, 0, []
        while position < len(tokens):
            first = self._first_page(tokens, position)
            child = node.children.get(first)
            if child is None:
                leaf = RadixNode(list(tokens[position:]), list(pages[position // self.page_size:]), node, now)
                node.children[first] = leaf
                self.num_pages += len(leaf.pages)
                self.num_nodes += 1
                path_pages.extend(leaf.pages)
                self._offer(leaf)
                return position, path_pages, leaf
            common = self._common_length(child.key, tokens, position, len(tokens))
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            path_pages.extend(child.pages)
            position += common
            node = child
        self._offer(node)
        return position, path_pages, node

    # ---- locks -------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """`node` and every node above it stay cached until `unlock(node)`."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.locked_pages += len(node.pages)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_pages -= len(node.pages)
                if not node.children:
                    self._offer(node)
            assert node.parent is not None
            node = node.parent

    # ---- eviction ----------------------------------------------------------------------------
    def evict(self, num_pages: int) -> list[int]:
        """Removes unlocked leaves, least recently used first, until at least `num_pages` pages are freed (or
        nothing unlocked is left); returns the freed pages."""
        freed: list[int] = []
        heap = self._candidates
        while len(freed) < num_pages and heap:
            last_access, _, leaf = heapq.heappop(heap)
            if leaf.last_access != last_access or not self._evictable_leaf(leaf) or leaf.parent is None:
                continue  # NOTE: stale: used since, locked, no longer a leaf, or gone (it is pushed again when due)
            parent = leaf.parent
            del parent.children[self._first_page(leaf.key, 0)]
            leaf.parent = None
            freed.extend(leaf.pages)
            self.num_pages -= len(leaf.pages)
            self.num_nodes -= 1
            self._offer(parent)
        self.evicted_pages += len(freed)
        return freed

    def reset(self) -> list[int]:
        """Empties the tree and returns every page it held; no node may be locked."""
        if self.locked_pages or any(child.lock_ref for child in self._nodes()):
            raise RuntimeError("radix cache: cannot flush while requests hold cached pages")
        pages = [page for node in self._nodes() for page in node.pages]
        self.root = RadixNode([], [], None, 0)
        self.num_pages = self.num_nodes = 0
        self._candidates = []
        return pages

    # ---- internals ---------------------------------------------------------------------------
    def _offer(self, node: RadixNode) -> None:
        """Pushes `node` as an eviction candidate if it is an unlocked leaf now; rebuilds the heap from the tree
        when stale entries outnumber the nodes (a tree that rarely evicts would otherwise grow it without bound)."""
        if not self._evictable_leaf(node):
            return
        heapq.heappush(self._candidates, (node.last_access, next(self._order), node))
        if len(self._candidates) > 4 * self.num_nodes + self.candidate_slack:
            # NOTE: in place: an `evict` in progress pops from this same list
            self._candidates[:] = [
                (n.last_access, next(self._order), n) for n in self._nodes() if self._evictable_leaf(n)
            ]
            heapq.heapify(self._candidates)

    def _first_page(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    def _common_length(self, key: list[int], tokens: Sequence[int], start: int, end: int) -> int:
        """Tokens of `key` equal to tokens[start:end], counted in whole pages."""
        limit = min(len(key), end - start) // self.page_size * self.page_size
        if key[:limit] == list(tokens[start:start + limit]):  # NOTE: the common case, compared at C speed
            return limit
        ps, same = self.page_size, 0
        while same < limit and key[same:same + ps] == list(tokens[start + same:start + same + ps]):
            same += ps
        return same

    def _split(self, node: RadixNode, length: int) -> RadixNode:
        """Cuts `node` after `length` tokens (a whole number of pages, > 0); returns the new upper node."""
        assert 0 < length < len(node.key) and length % self.page_size == 0
        parent = node.parent
        assert parent is not None
        cut = length // self.page_size
        upper = RadixNode(node.key[:length], node.pages[:cut], parent, node.last_access)
        self.num_nodes += 1
        # NOTE: every lock through `node` passes through `upper`, so it inherits node's count (locked_pages unchanged).
        upper.lock_ref = node.lock_ref
        parent.children[self._first_page(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[length:], node.pages[cut:], upper
        upper.children[self._first_page(node.key, 0)] = node
        return upper

    def _evictable_leaf(self, node: RadixNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
