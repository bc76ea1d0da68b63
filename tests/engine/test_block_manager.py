"""BlockManager: a stateful property test over random request traffic, plus unit tests.

The property test drives allocate / extend / write+commit / finish / abort / preempt /
resume / pressure in random interleavings and, after every step, checks the page
invariants on the host and runs the real jitted ``PageTracker.check`` on all live
sequences with a device generation array kept in sync only through
``take_generation_updates`` (exactly what the runner does).
"""
import ast
import pathlib

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jaxserve.engine.block_manager as bm_mod
from jaxserve.engine import prefix_cache
from jaxserve.engine.block_manager import BlockManager, NoFreePagesError, hash_page
from jaxserve.kv.page_tracker import PageTracker

N_PAGES = 16  # page 0 is null, so 15 usable: small enough that pressure is common
PS = 4
TRACKER = PageTracker()
_check = jax.jit(TRACKER.check)
_apply = jax.jit(TRACKER.apply_updates)
# Prefixes that requests share, so prefix hits (and near-misses) are frequent.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 8]


def snapshot(bm):
    """Everything that all-or-nothing must leave untouched."""
    return (
        list(bm._free), list(bm._evictable), bm.refcount.tolist(), bm.generation.tolist(),
        bm.generations.pending(), {p: (e.page_hash, e.parent_hash, e.token_ids) for p, e in bm._cached.items()},
        dict(bm._hash_to_page),
        {k: (list(s.pages), list(s.expected), s.num_cached_tokens, list(s.block_hashes))
         for k, s in bm._seqs.items()},
    )


def pad_rows(rows, width, fill):
    out = np.full((width, width), fill, dtype=np.int32)
    for b, row in enumerate(rows):
        out[b, :len(row)] = row
    return out


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(N_PAGES, PS)
        self.gen = TRACKER.init(N_PAGES)  # the device copy
        self.tokens = {}  # live seq id -> all its tokens (prompt + generated)
        self.written = {}  # live seq id -> tokens whose KV has been written
        self.content = {}  # page -> token prefix its KV was computed from (shadow KV)
        self.preempted = []  # token lists waiting to be resumed
        self.next_id = 0

    # ---- helpers --------------------------------------------------------------------

    def _allocate(self, tokens):
        sid, self.next_id = self.next_id, self.next_id + 1
        before = snapshot(self.bm)
        could = self.bm.can_allocate(len(tokens))
        try:
            alloc = self.bm.allocate_prompt(sid, tokens)
        except NoFreePagesError:
            assert not could, "can_allocate said yes, allocate_prompt said no"
            assert snapshot(self.bm) == before
            self._preempt_newest()
            return None
        n_cached = alloc.num_cached_tokens
        assert len(alloc.pages) == -(-len(tokens) // PS)
        assert n_cached % PS == 0 and 0 <= n_cached <= len(tokens) - 1
        for i in range(n_cached // PS):
            # A hit must hold KV computed from exactly this request's prefix.
            assert self.content[alloc.pages[i]] == tuple(tokens[:(i + 1) * PS])
        self.tokens[sid] = list(tokens)
        self.written[sid] = n_cached
        return sid

    def _preempt_newest(self):
        """What a scheduler does under pressure: free the newest request, retry later."""
        if self.tokens:
            self._free(max(self.tokens), "preempt")

    def _free(self, sid, how):
        self.bm.free(sid)
        tokens = self.tokens.pop(sid)
        self.written.pop(sid)
        if how == "preempt":
            self.preempted.append(tokens)

    def _pick(self, k):
        live = sorted(self.tokens)
        return live[k % len(live)]

    # ---- rules ----------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.sampled_from([8, 5, 4, 8, 3, 0]),
          suffix=st.lists(st.integers(0, 3), max_size=6), prefill=st.booleans())
    def allocate(self, prefix, cut, suffix, prefill):
        sid = self._allocate((prefix[:cut] + suffix) or [0])
        if prefill and sid is not None:  # usually the prompt's KV is written at once
            self._write_and_commit(sid)

    @rule(n=st.integers(2 * PS, N_PAGES * PS // 2), seed=st.integers(0, 2**16))
    def pressure(self, n, seed):
        """A long prompt of fresh tokens: forces eviction, often fails for lack of room."""
        self._allocate(np.random.default_rng(seed).integers(100, 200, n).tolist())

    @precondition(lambda self: self.preempted)
    @rule()
    def resume(self):
        self._allocate(self.preempted.pop(0))

    @precondition(lambda self: self.tokens)
    @rule(k=st.integers(0, 99), new=st.lists(st.integers(0, 3), min_size=1, max_size=2 * PS))
    def extend(self, k, new):
        sid = self._pick(k)
        before = snapshot(self.bm)
        total = len(self.tokens[sid]) + len(new)
        try:
            added = self.bm.append_slots(sid, total)
        except NoFreePagesError:
            assert snapshot(self.bm) == before
            self._preempt_newest()
            return
        assert len(self.bm.page_table(sid)) == -(-total // PS)
        assert self.bm.page_table(sid)[len(self.bm.page_table(sid)) - len(added):] == added
        self.tokens[sid] += new

    @precondition(lambda self: self.tokens)
    @rule(k=st.integers(0, 99))
    def write_and_commit(self, k):
        self._write_and_commit(self._pick(k))

    def _write_and_commit(self, sid):
        """The runner writes KV for the unwritten tokens, then commits full pages."""
        tokens, pages = self.tokens[sid], self.bm.page_table(sid)
        for i in range(self.written[sid] // PS, len(pages)):
            if i * PS >= len(tokens):
                break
            # Writing into a page someone else maps would corrupt their KV.
            assert self.bm.refcount[pages[i]] == 1
            self.content[pages[i]] = tuple(tokens[:min(len(tokens), (i + 1) * PS)])
        self.written[sid] = len(tokens)
        self.bm.commit_full_pages(sid, tokens)

    @precondition(lambda self: self.tokens)
    @rule(k=st.integers(0, 99), how=st.sampled_from(["finish", "abort", "preempt"]))
    def free(self, k, how):
        self._free(self._pick(k), how)

    @rule(tokens=st.sampled_from(PREFIXES), drain=st.booleans())
    def reset_prefix_cache(self, tokens, drain):
        """Refused (nothing changed) while a sequence holds pages; else no page stays cached:
        the next prompt hits nothing. ``drain`` finishes every live sequence first."""
        for sid in list(self.tokens) if drain else []:
            self._free(sid, "finish")
        before = snapshot(self.bm)
        if self.tokens:
            assert self.bm.reset_prefix_cache() is False
            assert snapshot(self.bm) == before
            return
        assert self.bm.reset_prefix_cache() is True
        assert self.bm.num_evictable_pages == 0 and not any(self.bm.is_cached(p) for p in range(N_PAGES))
        assert self.bm.num_free_pages == N_PAGES - 1
        sid = self._allocate(tokens)
        assert sid is not None and self.bm.num_cached_tokens(sid) == 0

    # ---- invariants -----------------------------------------------------------------

    @invariant()
    def pages_consistent(self):
        bm = self.bm
        mapped = np.zeros(N_PAGES, dtype=np.int32)
        for sid in self.tokens:
            table = bm.page_table(sid)
            assert 0 not in table  # the null page is never handed out
            assert len(set(table)) == len(table)
            mapped[table] += 1
        assert mapped.tolist() == bm.refcount.tolist()
        for p in np.flatnonzero(mapped > 1):
            assert bm.is_cached(int(p)), "only cached prefix pages may be shared"
        free, evictable = set(bm._free), set(bm._evictable)
        used = set(np.flatnonzero(bm.refcount > 0).tolist())
        assert not (free & evictable) and not (free & used) and not (evictable & used)
        assert free | evictable | used == set(range(1, N_PAGES))
        assert len(bm._free) + bm.num_evictable_pages + bm.num_used_pages == N_PAGES - 1
        assert bm.num_used_pages == len(used)
        assert all(bm.is_cached(p) for p in evictable)
        assert bm.refcount[0] == 0 and bm.generation[0] == 0
        assert ((bm.generation % 2 == 1) == (bm.refcount > 0)).all()

    @invariant()
    def device_check_passes(self):
        upd = self.bm.take_generation_updates()
        pages = np.zeros(N_PAGES, np.int32)  # fixed padded length: compile once
        counts = np.zeros(N_PAGES, np.int32)
        pages[:len(upd.pages)], counts[:len(upd.counts)] = upd.pages, upd.counts
        self.gen = _apply(self.gen, pages, counts)
        assert np.asarray(self.gen).tolist() == self.bm.generation.tolist()
        live = sorted(self.tokens)
        tables = [self.bm.page_table(s) for s in live]
        expected = [self.bm.expected_generations(s) for s in live]
        used = np.zeros(N_PAGES, np.int32)
        used[:len(live)] = [len(t) for t in tables]
        ok, cause = _check(self.gen, pad_rows(tables, N_PAGES, 0),
                           pad_rows(expected, N_PAGES, 0), used)
        assert np.asarray(ok).all(), (live, np.asarray(cause))


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


# ---- unit tests -----------------------------------------------------------------------


@pytest.mark.parametrize("mod", [bm_mod, prefix_cache])
def test_module_imports_no_jax(mod):
    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [n for n in names if n.split(".")[0] in ("jax", "jaxlib", "flax")]


def test_hash_is_stable_and_chained():
    assert hash_page(None, [1, 2]) == hash_page(None, [1, 2])
    assert hash_page(None, [1, 2]) != hash_page(hash_page(None, [0]), [1, 2])
    assert hash_page(None, [1, 2]) != hash_page(None, [2, 1])


def test_prefix_hit_shares_pages_and_keeps_generation():
    bm = BlockManager(16, 4)
    a = bm.allocate_prompt("a", list(range(10)))
    assert a.num_cached_tokens == 0
    bm.commit_full_pages("a", list(range(10)))  # pages 0, 1 full; page 2 partial
    gen_before = bm.generation.copy()
    b = bm.allocate_prompt("b", list(range(8)) + [99, 98, 97])
    assert b.num_cached_tokens == 8
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    assert bm.refcount[a.pages[0]] == 2
    # The second sharer does not bump: both expect the generation the first one got.
    assert (bm.generation[a.pages[:2]] == gen_before[a.pages[:2]]).all()
    assert bm.expected_generations("b")[:2] == bm.expected_generations("a")[:2]
    assert bm.num_cached_tokens("b") == 8


def test_whole_prompt_never_reported_cached():
    bm = BlockManager(16, 4)
    bm.allocate_prompt("a", list(range(8)))
    bm.commit_full_pages("a", list(range(8)))
    b = bm.allocate_prompt("b", list(range(8)))  # identical, page-aligned prompt
    assert b.num_cached_tokens == 4  # the last page is recomputed for its last token
    c = bm.allocate_prompt("c", list(range(9)))
    assert c.num_cached_tokens == 8


def test_partial_pages_are_never_cached():
    bm = BlockManager(16, 4)
    bm.allocate_prompt("a", list(range(7)))
    bm.commit_full_pages("a", list(range(7)))
    assert bm.allocate_prompt("b", list(range(7)) + [50, 51]).num_cached_tokens == 4


def test_hash_collision_does_not_share(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_page", lambda parent, tokens: 12345)
    bm = BlockManager(16, 4)
    bm.allocate_prompt("a", [1, 2, 3, 4, 5])
    bm.commit_full_pages("a", [1, 2, 3, 4, 5])
    b = bm.allocate_prompt("b", [9, 9, 9, 9, 5])  # same hash, different tokens
    assert b.num_cached_tokens == 0 and b.pages[0] != bm.page_table("a")[0]
    c = bm.allocate_prompt("c", [1, 2, 3, 4, 5])  # same hash, same tokens: a real hit
    assert c.num_cached_tokens == 4 and c.pages[0] == bm.page_table("a")[0]
    # Second block collides with the first block's entry: parent hash differs -> no hit.
    bm.allocate_prompt("d", [1, 2, 3, 4, 1, 2, 3, 4, 0])
    assert bm.num_cached_tokens("d") == 4


def test_all_or_nothing_when_pool_full():
    bm = BlockManager(5, 4)  # 4 usable pages
    bm.allocate_prompt("a", list(range(8)))
    bm.commit_full_pages("a", list(range(8)))
    bm.allocate_prompt("b", [50] * 5)
    before = snapshot(bm)
    with pytest.raises(NoFreePagesError) as err:
        bm.allocate_prompt("c", list(range(8)) + [1] * 5)  # 2 hits + 2 new > 0 free
    assert isinstance(err.value, RuntimeError) and err.value.needed == 2
    assert snapshot(bm) == before and not bm.has_seq("c")
    with pytest.raises(NoFreePagesError):
        bm.append_slots("b", 13)
    assert snapshot(bm) == before
    assert bm.append_slots("b", 8) == []  # still within its two pages


def test_hit_on_evictable_page_counts_against_room():
    bm = BlockManager(4, 2)  # 3 usable pages
    bm.allocate_prompt("a", [1, 2, 3])
    bm.commit_full_pages("a", [1, 2, 3])
    bm.free("a")
    bm.allocate_prompt("x", [9, 9, 9, 9])  # free list empty, one evictable page left
    assert bm.num_free_pages == 1
    before = snapshot(bm)
    # The hit revives the only evictable page, so there is none left for the new one.
    with pytest.raises(NoFreePagesError):
        bm.allocate_prompt("b", [1, 2, 5])
    assert snapshot(bm) == before
    bm.free("x")
    assert bm.allocate_prompt("b", [1, 2, 5]).num_cached_tokens == 2


def test_lru_eviction_order():
    bm = BlockManager(7, 2)  # 6 usable pages
    for sid, base in (("a", 10), ("b", 20)):
        toks = [base, base + 1, base + 2, base + 3]
        bm.allocate_prompt(sid, toks)
        bm.commit_full_pages(sid, toks)
    pa, pb = bm.page_table("a"), bm.page_table("b")
    bm.free("a")
    bm.free("b")  # release order: a[1], a[0], b[1], b[0]
    assert bm.num_evictable_pages == 4 and bm.num_free_pages == 6
    bm.allocate_prompt("c", [0] * 5)  # 3 pages: 2 free, then evict 1 (oldest: a's tail)
    assert not bm.is_cached(pa[1]) and bm.is_cached(pa[0])
    assert all(bm.is_cached(p) for p in pb)
    bm.allocate_prompt("d", [1] * 3)  # evicts a[0], then b[1]
    assert not bm.is_cached(pa[0]) and not bm.is_cached(pb[1]) and bm.is_cached(pb[0])
    # The surviving prefix page is still a verified hit, revived from evictable.
    bm.free("c")
    e = bm.allocate_prompt("e", [20, 21, 7])
    assert e.num_cached_tokens == 2 and e.pages[0] == pb[0]


def test_hit_on_lru_page_is_not_evicted_by_same_allocation():
    bm = BlockManager(5, 2)  # 4 usable pages
    for sid, toks in (("a", [1, 2, 3]), ("c", [5, 6, 7])):
        bm.allocate_prompt(sid, toks)
        bm.commit_full_pages(sid, toks)
    p1, p3 = bm.page_table("a")[0], bm.page_table("c")[0]
    bm.free("a")
    bm.free("c")  # evictable, oldest first: p1, p3; both partial pages free
    bm.allocate_prompt("x", [9, 9, 9])  # empties the free list
    # Hits the LRU-oldest page and needs one new page: the hit must be acquired
    # before eviction runs, or eviction would pick the very page being reused.
    b = bm.allocate_prompt("b", [1, 2, 8])
    assert b.num_cached_tokens == 2 and b.pages == [p1, p3]
    assert bm.is_cached(p1) and not bm.is_cached(p3)


def test_generations_and_updates():
    bm = BlockManager(4, 2)
    a = bm.allocate_prompt("a", [1, 2, 3])
    assert bm.expected_generations("a") == [1, 1]
    bm.free("a")
    bm.allocate_prompt("b", [5, 6, 7, 8, 9])  # reuses both pages and one more
    upd = bm.take_generation_updates()
    counts = dict(zip(upd.pages.tolist(), upd.counts.tolist()))
    assert counts == {a.pages[0]: 3, a.pages[1]: 3, 3: 1}
    assert upd.pages.dtype == np.int32 and upd.counts.dtype == np.int32
    assert len(bm.take_generation_updates().pages) == 0
    assert bm.expected_generations("b") == [int(bm.generation[p]) for p in bm.page_table("b")]


def test_prefix_caching_disabled():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    bm.allocate_prompt("a", [1, 2, 3])
    bm.commit_full_pages("a", [1, 2, 3])
    assert bm.allocate_prompt("b", [1, 2, 3]).num_cached_tokens == 0
    bm.free("a")
    assert bm.num_evictable_pages == 0 and bm.num_free_pages == 5


def test_bad_arguments():
    bm = BlockManager(4, 2)
    with pytest.raises(ValueError):
        bm.allocate_prompt("a", [])
    bm.allocate_prompt("a", [1])
    with pytest.raises(ValueError):
        bm.allocate_prompt("a", [1])
    with pytest.raises(KeyError):
        bm.page_table("nope")
    with pytest.raises(ValueError):
        BlockManager(1, 2)


def test_reset_prefix_cache_frees_cached_pages():
    bm = BlockManager(8, 4)
    tokens = list(range(1, 10))
    bm.allocate_prompt("a", tokens)
    bm.commit_full_pages("a", tokens)
    assert bm.reset_prefix_cache() is False  # "a" holds pages
    bm.free("a")
    assert bm.num_evictable_pages == 2
    assert bm.reset_prefix_cache() is True
    assert bm.num_evictable_pages == 0 and bm.num_free_pages == 7
    assert bm.allocate_prompt("b", tokens).num_cached_tokens == 0
