"""Where a request should run: prefix-hash affinity, session affinity and power of two choices.

Plain Python, no gRPC: the router's policy (``policy.py``) feeds these the live workers.

- ``prefix_chain`` hashes a prompt per page-size block exactly as a worker's prefix cache does
  (``engine.prefix_cache.hash_page``), so the router can tell which worker already holds a
  prompt's leading pages without asking it.
- ``PrefixIndex`` remembers which workers computed which chain hashes, in bounded memory (an
  LRU over hashes; each entry is one int bitmask of worker slots). It is a guess: a worker may
  have evicted the pages since, and ``usage.cached_tokens`` tells the truth afterwards.
- ``SessionAffinity`` pins a session to the worker its rendezvous hash picks, for a soft TTL
  refreshed by every request: a worker that joins later does not steal live sessions, a dead or
  full one gives its sessions to the next in rendezvous order.
- ``two_choices`` is power-of-two-choices over any load function.
"""
from __future__ import annotations

import collections
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from jaxserve.engine.prefix_cache import hash_page, page_tokens

W = TypeVar("W")


def prefix_chain(token_ids: Sequence[int], page_size: int, hit_pages_only: bool = True) -> list[int]:
    """Chain hashes of the prompt's leading full pages. hit_pages_only: only the pages a
    worker could serve from its cache (the last token is always computed, as ``match_prefix``
    rules); False: every full page, i.e. what the worker holds once the prompt is computed."""
    n = (len(token_ids) - 1) // page_size if hit_pages_only else len(token_ids) // page_size
    chain, parent = [], None
    for i in range(max(n, 0)):
        parent = hash_page(parent, page_tokens(token_ids, i, page_size))
        chain.append(parent)
    return chain


class PrefixIndex:
    """chain hash -> bitmask of worker slots that computed it; at most `max_entries` hashes
    (least recently used dropped first)."""

    def __init__(self, max_entries: int = 100_000):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._holders: collections.OrderedDict[int, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, chain: Sequence[int], slot: int) -> None:
        """Worker `slot` holds every page of `chain`."""
        bit = 1 << slot
        for h in chain:
            self._holders[h] = self._holders.get(h, 0) | bit
            self._holders.move_to_end(h)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def longest(self, chain: Sequence[int], candidates: int) -> tuple[int, int]:
        """(pages matched, bitmask of the candidate slots holding that many leading pages):
        the candidates with the longest cached prefix; (0, candidates) when none holds any."""
        best, depth = candidates, 0
        for h in chain:
            holders = best & self._holders.get(h, 0)
            if not holders:
                break
            self._holders.move_to_end(h)
            best, depth = holders, depth + 1
        return depth, best

    def forget(self, slot: int) -> None:
        """A worker lost its cache (it died or restarted): drop its bit everywhere."""
        bit = 1 << slot
        for h in [h for h, m in self._holders.items() if m & bit]:
            mask = self._holders[h] & ~bit
            if mask:
                self._holders[h] = mask
            else:
                del self._holders[h]


def rendezvous_order(key: str, names: Sequence[str]) -> list[str]:
    """`names` by descending rendezvous (highest random weight) score for `key`: each key's
    first choice moves only when that name leaves, and then its keys spread over the rest."""
    def score(name: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest()

    return sorted(names, key=score, reverse=True)


class SessionAffinity:
    """session id -> pinned worker name, kept `ttl_s` after the session's last request."""

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError(f"session TTL must be > 0 and max_entries >= 1, got {ttl_s}, {max_entries}")
        self.ttl_s, self.max_entries, self.clock = ttl_s, max_entries, clock
        self._pins: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def choose(self, session: str, names: Sequence[str], usable: Callable[[str], bool] = lambda n: True) -> str | None:
        """The worker for `session` among `names`: its live pin if that worker is still
        usable, else the first usable one in rendezvous order (else the first in that order:
        a full worker queues, which beats losing the cache). None when `names` is empty."""
        if not names:
            return None
        now = self.clock()
        pin = self._pins.get(session)
        if pin is not None and pin[1] > now and pin[0] in names and usable(pin[0]):
            chosen = pin[0]
        else:
            order = rendezvous_order(session, names)
            chosen = next((n for n in order if usable(n)), order[0])
        self._pins[session] = (chosen, now + self.ttl_s)
        self._pins.move_to_end(session)
        while len(self._pins) > self.max_entries:
            self._pins.popitem(last=False)
        return chosen

    def pinned(self, session: str) -> str | None:
        pin = self._pins.get(session)
        return pin[0] if pin is not None and pin[1] > self.clock() else None


def two_choices(candidates: Sequence[W], load: Callable[[W], float], rng: random.Random | None = None) -> W:
    """Power of two choices: the less loaded of two distinct random candidates."""
    if not candidates:
        raise ValueError("no candidates")
    if len(candidates) == 1:
        return candidates[0]
    a, b = (rng or random).sample(list(candidates), 2)
    return a if load(a) <= load(b) else b
