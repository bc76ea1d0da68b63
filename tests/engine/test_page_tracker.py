"""PageTracker.check against injected faults, driven through a real BlockManager.

Every check call goes through one jitted function on fixed shapes ([B, M] = [4, 8],
8 pages) so the file compiles it once.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kv import page_tracker as pt
from jaxserve.engine.block_manager import BlockManager
from jaxserve.kv.page_tracker import (
    CAUSE_NAMES, NOT_OWNED, OK, OUT_OF_RANGE, STALE_GENERATION, IntegrityError,
    NoOpTracker, PageTracker, TrackerStats, integrity_errors)
from jaxserve.executor.buckets import pad_updates

P, B, M, PS = 8, 4, 8, 2
TRACKER = PageTracker()
_check = jax.jit(TRACKER.check)
_redirect = jax.jit(TRACKER.redirect)
_apply = jax.jit(TRACKER.apply_updates)


def batch(rows):
    """rows: [(page_table, expected)] -> padded int32[B, M] x2 and num_pages_used[B]."""
    tables = np.zeros((B, M), np.int32)
    expected = np.zeros((B, M), np.int32)
    used = np.zeros(B, np.int32)
    for b, (t, e) in enumerate(rows):
        tables[b, :len(t)], expected[b, :len(e)], used[b] = t, e, len(t)
    return tables, expected, used


def sync(bm, gen):
    """Apply the manager's pending bumps to the device copy, as the runner does."""
    gen = _apply(gen, *pad_updates(*bm.take_generation_updates()))
    assert np.asarray(gen).tolist() == bm.generation.tolist()
    return gen


def run_check(gen, rows):
    ok, cause = _check(gen, *batch(rows))
    return np.asarray(ok)[:len(rows)].tolist(), np.asarray(cause)[:len(rows)].tolist()


def row(bm, sid):
    return bm.page_table(sid), bm.expected_generations(sid)


@pytest.fixture
def bm_gen():
    return BlockManager(P, PS), TRACKER.init(P)


def test_use_after_free_is_stale_new_owner_ok(bm_gen):
    bm, gen = bm_gen
    bm.allocate_prompt("old", [1, 2, 3])
    stale = row(bm, "old")  # a runner bug keeps this table after the request is freed
    bm.free("old")
    bm.allocate_prompt("x", [7] * 10)  # 5 pages: takes the 5 never-used, then the old ones
    bm.allocate_prompt("new", [4, 5, 6])  # ...so "new" reuses both of old's pages
    assert set(bm.page_table("new")) == set(stale[0])
    gen = sync(bm, gen)
    ok, cause = run_check(gen, [stale, row(bm, "new"), row(bm, "x")])
    assert ok == [False, True, True]
    assert cause == [STALE_GENERATION, OK, OK]


def test_freed_not_reallocated_is_not_owned(bm_gen):
    bm, gen = bm_gen
    bm.allocate_prompt("a", [1, 2, 3])
    bm.allocate_prompt("b", [4, 5])
    stale = row(bm, "a")
    bm.free("a")
    gen = sync(bm, gen)
    assert run_check(gen, [stale, row(bm, "b")]) == ([False, True], [NOT_OWNED, OK])


def test_evictable_cached_page_is_not_owned(bm_gen):
    bm, gen = bm_gen
    bm.allocate_prompt("a", [1, 2, 3])
    bm.commit_full_pages("a", [1, 2, 3])
    stale = row(bm, "a")
    bm.free("a")  # first page stays cached (evictable) but nobody owns it
    assert bm.is_cached(stale[0][0])
    gen = sync(bm, gen)
    assert run_check(gen, [(stale[0][:1], stale[1][:1])])[1] == [NOT_OWNED]


def test_shared_prefix_rows_both_ok(bm_gen):
    bm, gen = bm_gen
    bm.allocate_prompt("a", [1, 2, 3])
    bm.commit_full_pages("a", [1, 2, 3])
    bm.allocate_prompt("b", [1, 2, 9])
    bm.free("a")  # b still holds the shared page: its generation must not move
    gen = sync(bm, gen)
    assert run_check(gen, [row(bm, "b")]) == ([True], [OK])


def test_out_of_range_caught_where_naive_gather_clips(bm_gen):
    bm, gen = bm_gen
    bm.allocate_prompt("x", [0] * (2 * (P - 1)))  # owns every page, the last one too
    gen = sync(bm, gen)
    last_gen = int(gen[P - 1])
    bad_hi = ([P], [last_gen])  # one past the end
    bad_neg = ([-1], [last_gen])  # wraps to the last page in numpy-style indexing
    # A naive check would gather the last page's generation and pass both rows.
    assert int(gen[jnp.asarray(P)]) == last_gen and int(gen[jnp.asarray(-1)]) == last_gen
    ok, cause = run_check(gen, [bad_hi, bad_neg, ([-7, 3], [0, 0])])
    assert ok == [False] * 3 and cause == [OUT_OF_RANGE] * 3


def test_tampered_expected_is_stale(bm_gen):
    bm, gen = bm_gen
    bm.allocate_prompt("a", [1, 2, 3])
    gen = sync(bm, gen)
    pages, exp = row(bm, "a")
    assert run_check(gen, [(pages, [exp[0], exp[1] + 2])])[1] == [STALE_GENERATION]


def test_null_page_is_not_owned(bm_gen):
    bm, gen = bm_gen
    bm.allocate_prompt("a", [1, 2, 3])
    gen = sync(bm, gen)
    pages, exp = row(bm, "a")
    assert run_check(gen, [([pages[0], 0], [exp[0], 0])])[1] == [NOT_OWNED]
    # Even if a bad update made page 0 look owned, it is never a valid mapping.
    assert run_check(gen.at[0].set(1), [([0], [1])])[1] == [NOT_OWNED]


def test_entries_beyond_num_pages_used_ignored(bm_gen):
    bm, gen = bm_gen
    bm.allocate_prompt("a", [1, 2, 3])
    gen = sync(bm, gen)
    pages, exp = row(bm, "a")
    tables, expected, used = batch([(pages, exp)])
    tables[0, 2:] = [P + 5, -3] * (M // 2 - 1)  # garbage past the used entries
    expected[0, 2:] = 99
    tables[1:] = -1  # padding rows with num_pages_used == 0
    ok, cause = _check(gen, tables, expected, used)
    assert np.asarray(ok).all() and (np.asarray(cause) == OK).all()
    used[0] = 3  # now the garbage counts
    assert int(_check(gen, tables, expected, used)[1][0]) == OUT_OF_RANGE


def test_cause_priority(bm_gen):
    bm, gen = bm_gen
    bm.allocate_prompt("a", [1, 2, 3])
    bm.allocate_prompt("b", [4])
    freed = bm.page_table("b")[0]
    bm.free("b")
    gen = sync(bm, gen)
    (p0, p1), (e0, e1) = row(bm, "a")
    stale = (p0, e0 + 2)
    rows = [
        ([stale[0], P, freed], [stale[1], 0, 0]),  # stale + out of range + not owned
        ([stale[0], freed], [stale[1], 0]),  # stale + not owned
        ([p0, p1], [e0, e1 + 4]),  # stale only
    ]
    assert run_check(gen, rows)[1] == [OUT_OF_RANGE, NOT_OWNED, STALE_GENERATION]


def test_redirect_sends_only_failing_rows_to_null_page():
    tables = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M) + 1
    ok = jnp.array([True, False, True, False])
    out = np.asarray(_redirect(tables, ok))
    assert (out[[1, 3]] == 0).all()
    assert (out[[0, 2]] == np.asarray(tables)[[0, 2]]).all()


def test_apply_updates_padding_and_repeats():
    gen = TRACKER.init(P)
    pages, counts = pad_updates(np.array([3, 5], np.int32), np.array([1, 2], np.int32))
    assert pages.shape == (8,) and (pages[2:] == 0).all() and (counts[2:] == 0).all()
    gen = _apply(gen, pages, counts)
    assert np.asarray(gen).tolist() == [0, 0, 0, 1, 0, 2, 0, 0]
    assert pad_updates(np.arange(9, dtype=np.int32), np.ones(9, np.int32))[0].shape == (16,)


def test_noop_tracker_passes_everything():
    noop = NoOpTracker()
    gen = noop.init(P)
    assert gen.shape == (P,)
    tables = jnp.full((B, M), -1, jnp.int32)
    ok, cause = jax.jit(noop.check)(gen, tables, tables, jnp.full((B,), M, jnp.int32))
    assert np.asarray(ok).all() and (np.asarray(cause) == OK).all()
    assert noop.redirect(tables, ok) is tables
    assert noop.apply_updates(gen, jnp.array([1]), jnp.array([1])) is gen
    # The real tracker rejects the same batch.
    assert not np.asarray(_check(gen, tables, tables, jnp.full((B,), M, jnp.int32))[0]).any()


def test_integrity_error_and_stats():
    ok = np.array([True, False, False, True, False])
    cause = np.array([OK, STALE_GENERATION, OUT_OF_RANGE, OK, NOT_OWNED], np.int32)
    errs = integrity_errors(["r0", "r1", "r2", "r3"], ok, cause)  # row 4 is padding
    assert [(e.request_id, e.cause) for e in errs] == [
        ("r1", "stale_generation"), ("r2", "out_of_range_page")]
    assert isinstance(errs[0], RuntimeError) and "r1" in str(errs[0])
    with pytest.raises(ValueError):
        IntegrityError("r", "ok")
    stats = TrackerStats()
    stats.record(ok, cause, num_rows=4)
    stats.record(ok, cause)
    assert stats.checks_run == 2 and stats.rows_checked == 9
    assert stats.mismatches_by_cause == {
        "stale_generation": 2, "out_of_range_page": 2, "page_not_owned": 1}
    assert stats.total_mismatches == 5
    assert CAUSE_NAMES[pt.NOT_OWNED] == "page_not_owned"
