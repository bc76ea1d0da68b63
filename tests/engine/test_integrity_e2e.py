"""Fault injection end to end: the page tracker fails a bad mapping closed.

Each test breaks the host bookkeeping the way a real bug would (a page released while a
request still maps it, an out-of-range page id, a tampered expected generation) and checks
that the affected request is aborted with an IntegrityError before it emits another token,
while every other request produces exactly the tokens of a clean run.
"""
import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.kv.page_tracker import IntegrityError
from jaxserve.engine.sampling_params import SamplingParams

RNG = np.random.RandomState(21)
A, B, C, D = ([int(x) for x in RNG.randint(2, 256, size=n)] for n in (20, 13, 30, 27))
SP = SamplingParams(max_tokens=10, ignore_eos=True)
CFG = dict(kv_format="float32", num_pages=24, page_size=8, max_num_seqs=4, max_prefill_seqs=2,
           prefill_chunk=32, max_num_batched_tokens=64, max_model_len=64)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, **CFG)


@pytest.fixture(scope="module")
def clean(llm):
    # D is kept out of the prefix cache (no clean run before the fault test uses it), so as
    # the new owner it must take fresh pages: A's.
    return {name: list(llm.generate([p], SP)[0]) for name, p in (("A", A), ("B", B), ("C", C))}


def hand_out_next(bm, pages):
    """Simulate the allocator bug's second half: these released pages are the next ones
    handed out (dropped from the prefix cache if they were cached full pages)."""
    for page in reversed(pages):
        if page in bm._evictable:
            bm._evictable.pop(page)
            del bm._hash_to_page[bm._cached.pop(page).page_hash]
        else:
            bm._free.remove(page)
        bm._free.appendleft(page)


def start(llm, prompts, steps=3):
    eng = llm.engine
    rids = [eng.add_request(p, SP) for p in prompts]
    outs = {r: [] for r in rids}
    for _ in range(steps):
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    return rids, outs


def finish(llm, outs):
    done = {}
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            outs.setdefault(o.request_id, [])
            outs[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = o
    return done


def test_use_after_free_aborts_the_stale_request_and_the_new_owner_is_clean(llm, clean):
    eng = llm.engine
    before = eng.stats.mismatches_by_cause.get("stale_generation", 0)
    (ra, rb), outs = start(llm, [A, B])
    stale = list(eng.get_request(ra).pages)
    emitted = len(outs[ra])
    # The bug: A's pages are released behind the scheduler's back while A still maps them...
    eng.bm.free(ra)
    # ...and the allocator hands them out next.
    hand_out_next(eng.bm, stale)
    rc = eng.add_request(D, SP)
    for o in eng.step():
        outs[o.request_id] = outs.get(o.request_id, []) + o.new_token_ids
    new_owner_pages = set(eng.get_request(rc).pages) | set(eng.get_request(rb).pages)
    assert new_owner_pages & set(stale), "the fault must hand A's pages to a new owner"
    done = finish(llm, outs)
    err = eng.get_request(ra).error
    assert isinstance(err, IntegrityError) and err.cause == "stale_generation"
    assert eng.get_request(ra).finish_reason == "abort" and len(outs[ra]) == emitted  # no token after the fault
    assert list(done[rb].completion) == clean["B"]
    assert list(done[rc].completion) == list(llm.generate([D], SP)[0])  # clean run of the new owner
    assert eng.stats.mismatches_by_cause["stale_generation"] == before + 1
    assert eng.bm.num_used_pages == 0


def test_out_of_range_page_id_is_caught_not_clipped(llm, clean):
    eng = llm.engine
    (ra, rb), outs = start(llm, [A, B])
    emitted = len(outs[ra])
    eng.get_request(ra).pages[0] = eng.bm.num_pages + 3  # would clip to the last page in a plain gather
    done = finish(llm, outs)
    assert done[ra].error.cause == "out_of_range_page" and len(outs[ra]) == emitted
    assert list(done[rb].completion) == clean["B"]
    assert eng.bm.num_used_pages == 0


def test_tampered_expected_generation_is_caught(llm, clean):
    eng = llm.engine
    (ra, rb), outs = start(llm, [A, B])
    emitted = len(outs[ra])
    eng.get_request(ra).expected[1] += 2
    done = finish(llm, outs)
    assert done[ra].error.cause == "stale_generation" and len(outs[ra]) == emitted
    assert list(done[rb].completion) == clean["B"]


def test_n_faults_n_aborts(llm, clean):
    eng = llm.engine
    base = eng.stats.total_mismatches
    rids, outs = start(llm, [A, B, C], steps=4)
    emitted = {r: len(outs[r]) for r in rids}
    eng.get_request(rids[0]).pages[-1] = -1  # negative ids wrap in a plain gather
    eng.get_request(rids[2]).expected[0] -= 2
    done = finish(llm, outs)
    aborted = [r for r in rids if done[r].finish_reason == "abort"]
    assert aborted == [rids[0], rids[2]]
    assert all(len(outs[r]) == emitted[r] for r in aborted)
    assert list(done[rids[1]].completion) == clean["B"]
    assert eng.stats.total_mismatches == base + 2


def test_tracker_on_and_off_give_identical_tokens(tiny_ckpt, llm):
    prompts = [A, B, C, A[:9], C[4:]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (10, 3, 14, 6, 8)]
    off = LLM(tiny_ckpt, integrity_check=False, **CFG)
    assert not off.runner.tracker.enabled
    assert [list(c) for c in llm.generate(prompts, params)] == [list(c) for c in off.generate(prompts, params)]
