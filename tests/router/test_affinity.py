"""The router's routing tables, without gRPC: prefix chains hash pages as the workers' prefix
cache does, the prefix index finds the longest holder in bounded memory, sessions stay pinned
(rendezvous, soft TTL), and two choices prefers the less loaded."""
import collections
import random

import pytest

from jaxserve.engine.block_manager import BlockManager
from jaxserve.router.affinity import PrefixIndex, SessionAffinity, prefix_chain, rendezvous_order, two_choices


@pytest.mark.parametrize("shared", [0, 3, 4, 5, 8, 9, 12, 19, 20, 21, 23])
def test_prefix_index_predicts_the_block_managers_cache_hits(shared):
    """Record what a worker computed; the index's prediction for a second prompt sharing
    `shared` leading tokens equals the pages the worker's block manager really reuses."""
    page = 4
    first = list(range(100, 123))  # 23 tokens: 5 full pages
    second = first[:shared] + [7000 + i for i in range(23 - shared)]
    bm = BlockManager(num_pages=32, page_size=page, enable_prefix_caching=True)
    bm.allocate_prompt("a", first)
    bm.commit_full_pages("a", first)
    bm.free("a")
    idx = PrefixIndex()
    idx.record(prefix_chain(first, page, hit_pages_only=False), slot=0)
    depth, _ = idx.longest(prefix_chain(second, page), 0b1)
    assert depth * page == bm.allocate_prompt("b", second).num_cached_tokens
    assert prefix_chain([1, 2, 3], page) == [] and prefix_chain([], page) == []


def test_prefix_index_longest_holder_and_forget():
    idx = PrefixIndex(max_entries=100)
    a, b = prefix_chain(list(range(41)), 4), prefix_chain(list(range(12)) + [99] * 29, 4)
    idx.record(a, slot=0)
    idx.record(b, slot=1)
    everyone = 0b111
    assert idx.longest(a, everyone) == (10, 0b001)
    assert idx.longest(b, everyone) == (10, 0b010)
    assert idx.longest(a[:3] + [12345], everyone) == (3, 0b011)  # both hold the first 3 pages
    assert idx.longest(a, 0b110) == (3, 0b010)  # the full holder is not a candidate
    assert idx.longest(a, 0b100) == (0, 0b100)  # no candidate holds anything
    assert idx.longest([777], everyone) == (0, everyone)
    idx.forget(0)
    assert idx.longest(a, everyone) == (3, 0b010)


def test_prefix_index_memory_is_bounded_lru():
    idx = PrefixIndex(max_entries=8)
    old, new = prefix_chain(list(range(21)), 4), prefix_chain(list(range(500, 521)), 4)
    idx.record(old, 0)  # 5 hashes
    idx.record(new, 1)  # 5 more: the 2 least recently used of `old` go... its first ones
    assert len(idx) == 8
    assert idx.longest(new, 0b11) == (5, 0b10)
    assert idx.longest(old, 0b11) == (0, 0b11)  # its head was dropped, so no prefix matches
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_sessions_pin_spread_and_move_only_when_needed():
    now = [0.0]
    s = SessionAffinity(ttl_s=10.0, clock=lambda: now[0])
    names = ["w0", "w1", "w2"]
    picks = {f"s{i}": s.choose(f"s{i}", names) for i in range(60)}
    assert all(s.choose(k, names) == v for k, v in picks.items())  # sticky
    assert all(v == rendezvous_order(k, names)[0] for k, v in picks.items())
    assert set(collections.Counter(picks.values())) == set(names)  # spread over every worker
    # A worker joins: pinned sessions stay until their TTL runs out, then rendezvous decides.
    bigger = names + ["w3"]
    assert all(s.choose(k, bigger) == v for k, v in picks.items())
    now[0] = 25.0
    moved = {k: s.choose(k, bigger) for k in picks}
    assert any(v == "w3" for v in moved.values())
    assert all(moved[k] == picks[k] for k in picks if moved[k] != "w3")  # only moves to the newcomer
    # A full or gone worker hands its sessions to the next in rendezvous order.
    victim = next(k for k, v in moved.items() if v == "w3")
    second = rendezvous_order(victim, bigger)[1]
    assert s.choose(victim, bigger, usable=lambda n: n != "w3") == second
    assert s.choose(victim, ["w0", "w1", "w2"]) == second
    assert s.choose("x", []) is None


def test_session_table_is_bounded():
    s = SessionAffinity(ttl_s=10.0, max_entries=5)
    for i in range(20):
        s.choose(f"s{i}", ["a", "b"])
    assert len(s) == 5 and s.pinned("s19") is not None and s.pinned("s0") is None


def test_two_choices_prefers_the_less_loaded():
    rng = random.Random(0)
    load = {"idle": 0.0, "busy": 5.0, "busier": 9.0}
    picks = collections.Counter(two_choices(list(load), load.get, rng) for _ in range(300))
    assert picks["busier"] == 0  # it always loses its pair
    assert picks["idle"] > picks["busy"] > 0
    assert two_choices(["only"], load.get) == "only"
    with pytest.raises(ValueError):
        two_choices([], load.get)
