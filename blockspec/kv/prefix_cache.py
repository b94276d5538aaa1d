"""PrefixCache: what the scheduler asks of the radix tree: a prefix to reuse at admission, the KV to keep at release.

Invariants, for every admitted request:
- `req.pages[:req.shared_len // page_size]` are tree pages, locked through the tree node the cache holds for the
  request (`locked`): read, never written (a request writes KV only at positions >= kv_len >= shared_len, and
  shared_len is a whole number of pages).
- The rest of `req.pages` belong to the request; `release` hands the full pages of its valid KV to the tree and frees
  the others.
- A request's KV is valid for positions < min(kv_len, len(all_ids)): `kv_len` can run past the committed tokens when
  a finish condition cut a verified block short, and a step still in flight writes only at positions >= kv_len.
- Under DFlash the draft KV pool is indexed by the same slots, so a cached page carries the draft KV of its tokens
  too (materialised from the target's aux hidden states when they were first computed).

With the cache disabled every method keeps the old behaviour: nothing is matched, release frees every page.
"""
from __future__ import annotations

from typing import Any, Optional

from blockspec.host_tensors import int64_tensor
from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.kv.radix_tree import RadixNode, RadixTree
from blockspec.outputs import ExtendChunk
from blockspec.request import Req

IN_BATCH_MIN_SHARED = 32  # NOTE: uncached prompt tokens a waiting request must share with a step's extend to wait


class InBatchPrefixes:
    """The prompt tokens one extend step computes. A waiting request whose uncached prompt starts with at least
    IN_BATCH_MIN_SHARED of them (and a whole page), and with at least half of it, waits one step and then reads them
    from the cache, instead of computing them a second time in the same step: a cold burst sharing a new system
    prompt or few-shot examples prefills it once. (SGLang calls this in-batch prefix caching.)"""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.tree = RadixTree(page_size)  # NOTE: a scratch tree: its page ids are placeholders, never KV

    def computing(self, req: Req, end: int) -> None:
        """This step computes `req`'s KV up to `end` (all of it before `end` is cached or computed by then)."""
        length = end // self.page_size * self.page_size
        if length:
            self.tree.insert(req.all_ids[:length], range(length // self.page_size))

    def should_wait(self, req: Req) -> bool:
        """`req` (attached: shared_len is its cache hit) shares enough still-uncached tokens with this step."""
        pages, _ = self.tree.match(req.all_ids[:-1])
        saved = len(pages) * self.page_size - req.shared_len
        return saved >= max(IN_BATCH_MIN_SHARED, self.page_size) and 2 * saved >= len(req.all_ids) - req.shared_len


class PrefixCache:
    def __init__(self, allocator: PageAllocator, table: ReqToTokenTable, enabled: bool) -> None:
        """NOTE: one radix tree per KV pool: a second scheduler over the same pool (the start-up warm-up's) shares the
        tree that is the allocator's reclaimer; only the hit counters are this cache's own."""
        self.allocator = allocator
        self.table = table
        self.page_size = allocator.page_size
        self.tree: RadixTree | None = None
        if enabled:
            existing = allocator.reclaimer
            if existing is not None and not isinstance(existing, RadixTree):
                raise RuntimeError(f"the KV pool already has a reclaimer of another kind: {type(existing).__name__}")
            self.tree = existing if existing is not None else RadixTree(allocator.page_size)
            allocator.reclaimer = self.tree
        elif allocator.reclaimer is not None:
            raise RuntimeError("a scheduler without the radix cache over a pool that has one")
        self.lookup_tokens = 0  # tokens admitted requests needed KV for (retracted ones: those not computed before)
        self.hit_tokens = 0  # of those, tokens whose KV came from the cache
        self.locked: dict[Req, RadixNode] = {}  # NOTE: the tree node each request's shared pages are locked through

    @property
    def enabled(self) -> bool:
        return self.tree is not None

    # ---- admission ---------------------------------------------------------------------------
    def attach(self, req: Req) -> None:
        """Before admission: `req` takes the longest cached prefix of its tokens but the last (whole pages): those
        pages, locked, become the start of req.pages and req.kv_len starts after them. `PageAllocator.grow` then
        writes the whole table row. Undo with `detach` when the request is not admitted after all."""
        if self.tree is None:
            return
        assert req.pool_row is None and not req.pages and req.kv_len == 0
        # NOTE: the last token is always computed: its logits give the first token and, under DFlash, its target
        # hidden state seeds the first draft block.
        pages, node = self.tree.match(req.all_ids[:-1])
        self.tree.lock(node)
        self.locked[req], req.pages = node, list(pages)
        req.kv_len = req.shared_len = len(pages) * self.page_size

    def in_batch(self, chunks: list[ExtendChunk]) -> Optional[InBatchPrefixes]:
        """With the cache on: the prefixes a step computes, starting with the planned `chunks`."""
        if self.tree is None:
            return None
        prefixes = InBatchPrefixes(self.page_size)
        for chunk in chunks:
            prefixes.computing(chunk.req, chunk.req.kv_len + chunk.length)
        return prefixes

    def detach(self, req: Req) -> None:
        if self.tree is None:
            return
        self._unlock(req)
        req.pages, req.kv_len, req.shared_len = [], 0, 0

    def admitted(self, req: Req) -> None:
        """Counts the admission of an attached request (hit rate, cached_tokens)."""
        if self.tree is None:
            return
        new = max(0, len(req.all_ids) - req.computed_len)
        hit = max(0, req.shared_len - req.computed_len)
        self.lookup_tokens += new
        self.hit_tokens += hit
        req.cached_tokens += hit

    # ---- caching computed KV -----------------------------------------------------------------
    def cache_prefill(self, req: Req) -> None:
        """After an extend chunk: the full pages of `req`'s KV join the tree (later arrivals share them while it
        runs) and become its shared pages. Pages the tree already had for those tokens (computed by a request
        admitted at the same time) replace the request's copies, which are freed.

        NOTE: its table row may change and its page copies be freed although a decode step launched behind its
        extend (StepExecutor.extend_run_ahead) may still be in flight: that step reads the row and writes only at or
        past kv_len, and the device runs every step in launch order on one stream, so it saw the row as it was."""
        if self.tree is None or req.finished:
            return
        length = self._valid_full_pages(req) * self.page_size
        if length <= req.shared_len:
            return
        tokens, ps = req.all_ids[:length], self.page_size
        present, pages, node = self.tree.insert_and_match(tokens, req.pages[:length // ps])
        assert len(pages) * ps == length
        first, last = req.shared_len // ps, present // ps
        if last > first:
            self.allocator.free(req.pages[first:last])
            req.pages[first:last] = pages[first:last]
            assert req.pool_row is not None
            slots = self.allocator.slots_of(pages, first * ps, last * ps)
            self.table.write(req.pool_row, first * ps, int64_tensor(slots))
        self.tree.lock(node)
        self._unlock(req)
        self.locked[req], req.shared_len = node, length

    def release(self, req: Req) -> None:
        """A finished, aborted or retracted request gives its pages back: the full pages of its valid KV to the
        tree (tokens already cached keep the tree's pages; the request's copies are freed), the rest to the free
        list."""
        ps = self.page_size
        shared = req.shared_len // ps
        keep = shared
        if self.tree is not None:
            keep = max(shared, self._valid_full_pages(req))
            if keep > shared:
                present = self.tree.insert(req.all_ids[:keep * ps], req.pages[:keep])
                assert present >= req.shared_len
                self.allocator.free(req.pages[shared:present // ps])
        self.allocator.free(req.pages[keep:])
        self._unlock(req)
        req.computed_len = max(req.computed_len, min(req.kv_len, len(req.all_ids)))
        req.pages, req.shared_len, req.allocated_len = [], 0, 0

    # ---- whole cache -------------------------------------------------------------------------
    def flush(self) -> None:
        """Frees every cached page; no request may hold any (the scheduler checks it is idle)."""
        if self.tree is not None:
            self.allocator.free(self.tree.reset())

    def stats(self) -> dict[str, Any]:
        """/server_info and /metrics: hit rate over admissions, token counts, evictions since start."""
        tree = self.tree
        return {
            "enabled": tree is not None,
            "cache_hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            "cached_tokens_total": self.hit_tokens,
            "prompt_tokens_total": self.lookup_tokens,
            "evicted_tokens_total": tree.evicted_pages * self.page_size if tree else 0,
            "tree_tokens": tree.num_tokens if tree else 0,
            "evictable_tokens": tree.evictable_pages * self.page_size if tree else 0,
        }

    # ---- internals ---------------------------------------------------------------------------
    def _valid_full_pages(self, req: Req) -> int:
        return min(req.kv_len, len(req.all_ids)) // self.page_size

    def _unlock(self, req: Req) -> None:
        node = self.locked.pop(req, None)
        if node is not None:
            assert self.tree is not None
            self.tree.unlock(node)
