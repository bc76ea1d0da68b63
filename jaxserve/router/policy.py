"""Which worker a request goes to, from the pool's live workers and the affinity tables.

- A session (``session_id`` or the ``x-session-affinity`` header) wins: its pinned worker, or
  the rendezvous choice among the workers with room for the prompt's pages.
- Otherwise the worker holding the longest cached prefix of the prompt (prefix-hash affinity);
  power of two choices by load breaks ties, and decides alone when nobody holds a prefix.
- Decode workers of a disaggregated pool have no prompt cache to aim at: session affinity, else
  power of two choices among those with room (load counts their used KV).
"""
from __future__ import annotations

import random

from jaxserve.router.affinity import PrefixIndex, SessionAffinity, prefix_chain, two_choices
from jaxserve.router.pool import Worker, WorkerPool


def pages_for(num_tokens: int, page_size: int | None) -> int:
    return -(-num_tokens // page_size) if page_size else 0


class RoutingPolicy:
    def __init__(self, pool: WorkerPool, prefix_entries: int = 100_000, session_ttl_s: float = 600.0,
                 rng: random.Random | None = None):
        self.pool = pool
        self.prefixes = PrefixIndex(prefix_entries)
        self.sessions = SessionAffinity(session_ttl_s)
        self.rng = rng or random.Random()

    def _candidates(self, role: str, exclude) -> list[Worker]:
        return [w for w in self.pool.alive(role) if w not in exclude]

    def pick(self, role: str, ids: list[int] | None, session: str, exclude=()) -> tuple[Worker | None, str]:
        """-> (worker or None when none is up, the reason: "session" | "prefix" | "load")."""
        alive = self._candidates(role, exclude)
        if not alive:
            return None, "none"
        if session:
            return self._by_session(alive, ids, session), "session"
        if ids and role != "decode":
            worker = self._by_prefix(alive, ids)
            if worker is not None:
                return worker, "prefix"
        roomy = [w for w in alive if w.has_room(pages_for(len(ids or ()), w.page_size))]
        return two_choices(roomy or alive, Worker.load, self.rng), "load"

    def _by_session(self, alive: list[Worker], ids, session: str) -> Worker:
        by_name = {w.address: w for w in alive}
        name = self.sessions.choose(session, list(by_name),
                                    lambda a: by_name[a].has_room(pages_for(len(ids or ()), by_name[a].page_size)))
        return by_name[name]

    def _by_prefix(self, alive: list[Worker], ids: list[int]) -> Worker | None:
        """The candidates with the longest cached prefix (two choices among them), or None."""
        best_depth, best = 0, []
        for page_size in {w.page_size for w in alive if w.page_size}:
            group = [w for w in alive if w.page_size == page_size]
            mask = sum(1 << w.slot for w in group)
            depth, holders = self.prefixes.longest(prefix_chain(ids, page_size), mask)
            if depth > best_depth:
                best_depth, best = depth, [w for w in group if holders >> w.slot & 1]
        return two_choices(best, Worker.load, self.rng) if best else None

    def record(self, worker: Worker, ids: list[int] | None) -> None:
        """`worker` has computed `ids` (prompt, or prompt + generated tokens but the last):
        its full pages are now in that worker's prefix cache."""
        if ids and worker.page_size:
            self.prefixes.record(prefix_chain(ids, worker.page_size, hit_pages_only=False), worker.slot)

    def forget(self, worker: Worker) -> None:
        self.prefixes.forget(worker.slot)
