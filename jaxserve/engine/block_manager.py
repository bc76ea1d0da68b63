"""Host-side KV page manager: free list, refcounts, prefix cache, generation mirror.

Plain Python + numpy (no JAX), so the scheduler and its tests never compile anything.

Pages
    The KV pool has ``num_pages`` pages of ``page_size`` tokens. Page 0 is the NULL page:
    nothing ever owns it and it is never on the free list, so a page table redirected to
    it (after a failed integrity check) never reads live data. Every other page is in
    exactly one of three states:

    * free       -- on ``_free`` (FIFO), holds nothing worth keeping;
    * evictable  -- refcount 0 but holds a FULL page registered in the prefix cache; kept
                    in ``_evictable`` in LRU order and evicted (hash entry dropped) only
                    when the free list is empty and a new page is needed;
    * used       -- refcount > 0, mapped by that many live sequences.

Prefix cache
    Full pages only, keyed by a hash chain ``h_i = hash_page(h_{i-1}, tokens_of_page_i)``
    (blake2b, stable across processes). A hit is VERIFIED against the page's stored
    tokens and parent hash, so a hash collision can never share a page (the hashing and
    the verified match live in ``prefix_cache.py``; this module owns the pages). Pages are
    registered by ``commit_full_pages`` only after their KV has been written.

Generations
    Every page acquisition from free/evictable state and every release bumps the page's
    generation (``page_generations.PageGenerations``, the host mirror of the device array);
    each sequence records the generation current when it mapped each page.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

from jaxserve.engine import prefix_cache
from jaxserve.engine.page_generations import GenerationUpdates, PageGenerations
from jaxserve.engine.prefix_cache import CachedPage, hash_page, match_prefix, page_tokens

NULL_PAGE = 0


class NoFreePagesError(RuntimeError):
    """Not enough free or evictable pages; the manager's state was left unchanged."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"need {needed} free KV pages, only {available} available")
        self.needed = needed
        self.available = available


class Allocation(NamedTuple):
    """Result of ``allocate_prompt``.

    pages: the sequence's page table, ``ceil(len(prompt) / page_size)`` page ids.
    num_cached_tokens: leading prompt tokens whose KV is already in ``pages`` (a multiple
        of page_size, <= len(prompt) - 1); prefill computes only the rest.
    """

    pages: list[int]
    num_cached_tokens: int


@dataclasses.dataclass
class _SeqPages:
    pages: list[int]
    expected: list[int]  # generation of pages[i] when this sequence mapped it
    num_cached_tokens: int
    block_hashes: list[int]  # hash chain of the leading full pages already committed


class BlockManager:
    """Pages, refcounts, prefix cache and generation mirror for one KV pool.

    Sequence ids are any hashable request id. Every mutating call either succeeds or
    raises with the state unchanged.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = np.zeros(num_pages, dtype=np.int32)  # [num_pages]; read-only outside
        self.generations = PageGenerations(num_pages)
        self._free: deque[int] = deque(range(1, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._cached: dict[int, CachedPage] = {}  # page -> contents, for cached pages
        self._hash_to_page: dict[int, int] = {}
        self._seqs: dict[Hashable, _SeqPages] = {}

    # ---- capacity -------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages a new allocation may use: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages with refcount > 0 (the null page is never counted)."""
        return self.num_pages - 1 - self.num_free_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Conservative: ignores prefix hits, which can only lower the need."""
        return self.pages_for(num_tokens) <= self.num_free_pages

    def can_append_slots(self, seq_id: Hashable, new_total_len: int) -> bool:
        seq = self._seq(seq_id)
        return self.pages_for(new_total_len) - len(seq.pages) <= self.num_free_pages

    # ---- allocation -----------------------------------------------------------------

    def allocate_prompt(self, seq_id: Hashable, token_ids: Sequence[int], use_prefix_cache: bool = True) -> Allocation:
        """Map pages for a new sequence's prompt, reusing cached prefix pages (unless
        use_prefix_cache is False, e.g. to score every token of a prompt).

        Raises NoFreePagesError (state unchanged) if the rest does not fit.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has pages")
        n = len(token_ids)
        if n < 1:
            raise ValueError("a prompt needs at least one token")
        hits, hashes = self._match_prefix(token_ids) if use_prefix_cache else ([], [])
        num_new = self.pages_for(n) - len(hits)
        # A hit on an evictable page consumes it just like a new page would.
        available = self.num_free_pages - sum(1 for p in hits if self.refcount[p] == 0)
        if num_new > available:
            raise NoFreePagesError(num_new, available)

        expected = [self._acquire(p) for p in hits]  # before _take_page can evict them
        new_pages = [self._take_page() for _ in range(num_new)]
        expected += [self._acquire(p) for p in new_pages]
        pages = hits + new_pages
        num_cached = len(hits) * self.page_size
        self._seqs[seq_id] = _SeqPages(pages, expected, num_cached, hashes)
        return Allocation(list(pages), num_cached)

    def append_slots(self, seq_id: Hashable, new_total_len: int) -> list[int]:
        """Grow a sequence to hold ``new_total_len`` tokens; returns the pages added.

        Raises NoFreePagesError (state unchanged) if they do not fit.
        """
        seq = self._seq(seq_id)
        num_new = self.pages_for(new_total_len) - len(seq.pages)
        if num_new <= 0:
            return []
        if num_new > self.num_free_pages:
            raise NoFreePagesError(num_new, self.num_free_pages)
        new_pages = [self._take_page() for _ in range(num_new)]
        seq.expected += [self._acquire(p) for p in new_pages]
        seq.pages += new_pages
        return new_pages

    def truncate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Shrink a sequence to the pages ``num_tokens`` tokens need (rejected draft tokens' rollback),
        never below its committed pages; -> the pages released (generations bumped, as by ``free``)."""
        seq = self._seq(seq_id)
        keep = max(self.pages_for(num_tokens), len(seq.block_hashes))
        released = seq.pages[keep:]
        del seq.pages[keep:], seq.expected[keep:]
        for page in reversed(released):
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self.generations.bump(page)
                self._free.append(page)
        return released

    def commit_full_pages(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Register the sequence's newly FULL pages in the prefix cache.

        token_ids: the sequence's tokens (prompt + generated) whose KV has been written.
        Call only after the KV is on device, or a later hit would read garbage.
        """
        seq = self._seq(seq_id)
        if not self.enable_prefix_caching:
            return
        num_full = min(len(token_ids) // self.page_size, len(seq.pages))
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block = page_tokens(token_ids, i, self.page_size)
            h = prefix_cache.hash_page(parent, block)  # looked up at call time, as match_prefix does
            seq.block_hashes.append(h)
            page = seq.pages[i]
            # First writer wins: a duplicate (or a colliding hash) leaves this page
            # uncached, so it goes back to the free list when released.
            if h not in self._hash_to_page and page not in self._cached:
                self._hash_to_page[h] = page
                self._cached[page] = CachedPage(h, parent, block)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's pages (finish, abort or preemption)."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        # Release the tail first: in LRU order it is then evicted before the prefix,
        # which is the part other requests are likely to share.
        for page in reversed(seq.pages):
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self.generations.bump(page)
                if page in self._cached:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix page (they become free pages). Only when no sequence holds
        pages: False, with nothing changed, while one does."""
        if self._seqs:
            return False
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._hash_to_page.clear()
        return True

    # ---- queries --------------------------------------------------------------------

    def page_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq(seq_id).pages)

    def expected_generations(self, seq_id: Hashable) -> list[int]:
        return list(self._seq(seq_id).expected)

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).num_cached_tokens

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def live_seqs(self) -> list[Hashable]:
        return list(self._seqs)

    def is_cached(self, page: int) -> bool:
        """Whether the page holds a full page registered in the prefix cache."""
        return page in self._cached

    @property
    def generation(self) -> np.ndarray:
        """int32 [num_pages]: every page's generation (odd = owned); read-only outside."""
        return self.generations.values

    def take_generation_updates(self) -> GenerationUpdates:
        """Pages whose generation changed since the last call, with bump counts, for the
        runner to apply to the device copy once per step."""
        return self.generations.take_updates()

    # ---- internals ------------------------------------------------------------------

    def _seq(self, seq_id: Hashable) -> _SeqPages:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Longest verified run of cached leading full pages, and their chain hashes."""
        if not self.enable_prefix_caching:
            return [], []
        return match_prefix(self._hash_to_page, self._cached, token_ids, self.page_size)

    def _take_page(self) -> int:
        """A page with refcount 0 for a new owner; evicts the LRU cached page if needed."""
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)
        entry = self._cached.pop(page)
        del self._hash_to_page[entry.page_hash]
        # Back in "free" state: _acquire below sees refcount 0 and does the bump.
        return page

    def _acquire(self, page: int) -> int:
        """Map a page for one more sequence; returns the generation it must expect."""
        assert page != NULL_PAGE
        if self.refcount[page] == 0:
            self._evictable.pop(page, None)
            self.generations.bump(page)
        self.refcount[page] += 1
        return int(self.generation[page])


__all__ = ["Allocation", "BlockManager", "GenerationUpdates", "NULL_PAGE", "NoFreePagesError", "hash_page"]
