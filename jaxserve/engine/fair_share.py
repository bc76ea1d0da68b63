"""Fair share between clients: which waiting request is admitted next, and whose running
request gives way, so that no client can hold the engine while others wait.

A client is whatever ``Sequence.client`` names (the server passes a hashed API key, else the
connection). Two policies:
- ``fifo``: arrival order (a preempted request first), the newest running request gives way
  under page pressure: the engine's behaviour before clients were known.
- ``fair``: the next admitted request is the oldest waiting one of the client with the fewest
  running requests (ties: whose oldest request waits longest); a client holding
  ``max_slots_per_client`` running requests is not admitted more while another client is
  *present* (has a request waiting or running, or had one within the last ``linger_steps``
  scheduler steps: a client sending one request after another stays present between them),
  even if slots are free: so a client that floods the engine cannot fill the batch in the gap
  between another client's requests and make every step of theirs carry its rows. When the
  decode batch is full a client over the bound gives up its newest running request to a waiting
  client under it (preempted, recomputed later, its prefix-cache pages kept). Under page pressure
  the newest request of the client holding the most running requests gives way. A lone client
  (nobody else present) may use every slot.

Deterministic (no clocks, no randomness) and host-side only, like the scheduler that calls it.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Sequence as Seq

from jaxserve.engine.sequence import Sequence

FAIR, FIFO = "fair", "fifo"
LINGER_STEPS = 32
POLICIES = (FAIR, FIFO)


@dataclasses.dataclass(frozen=True)
class SharePolicy:
    policy: str = FAIR
    max_slots_per_client: int = 0  # running requests of one client while others are present; 0 = no bound
    linger_steps: int = LINGER_STEPS  # steps a client stays present after its last request left

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"client_scheduling must be one of {POLICIES}, got {self.policy!r}")
        if self.max_slots_per_client < 0:
            raise ValueError(f"max_slots_per_client must be >= 0, got {self.max_slots_per_client}")
        if self.linger_steps < 0:
            raise ValueError(f"linger_steps must be >= 0, got {self.linger_steps}")

    @property
    def fair(self) -> bool:
        return self.policy == FAIR

    def at_bound(self, running: int) -> bool:
        return self.max_slots_per_client > 0 and running >= self.max_slots_per_client

    def over_bound(self, running: int) -> bool:
        return self.max_slots_per_client > 0 and running > self.max_slots_per_client


def running_counts(running: Iterable[Sequence]) -> collections.Counter:
    """Running requests per client."""
    return collections.Counter(s.client for s in running)


class Presence:
    """The clients present at each scheduler step: with a request waiting or running, or with
    one that left within the last ``linger_steps`` steps. Counted in steps, not time, so the
    scheduler stays deterministic."""

    def __init__(self, linger_steps: int = LINGER_STEPS):
        self.linger_steps = linger_steps
        self.step = 0
        self._last: dict[str, int] = {}  # client -> the last step it had a request in the engine

    def tick(self, waiting: Iterable[Sequence], running: Iterable[Sequence]) -> frozenset[str]:
        """Advance one step; the clients present in it."""
        self.step += 1
        for s in (*waiting, *running):
            self._last[s.client] = self.step
        self._last = {c: t for c, t in self._last.items() if self.step - t <= self.linger_steps}
        return frozenset(self._last)


def next_waiting(waiting: Iterable[Sequence], counts: collections.Counter, policy: SharePolicy,
                 present: frozenset[str] = frozenset()) -> Sequence | None:
    """The waiting request to admit next (None when nothing waits, or when every waiting
    client is at its bound while another client is present); see the module doc."""
    heads: dict[str, tuple[int, Sequence]] = {}  # client -> (queue position, its first waiting request)
    for i, seq in enumerate(waiting):
        if not policy.fair:
            return seq
        heads.setdefault(seq.client, (i, seq))
    others = set(present) | set(heads)
    eligible = [c for c in heads if not policy.at_bound(counts[c]) or not others - {c}]
    if not eligible:
        return None
    best = min(eligible, key=lambda c: (counts[c], heads[c][0]))
    return heads[best][1]


def pressure_victim(candidates: Seq[Sequence], counts: collections.Counter, policy: SharePolicy) -> Sequence:
    """The running request (of ``candidates``, in admission order) that gives up its pages when
    they run out: the newest; under ``fair`` the newest of the client holding the most."""
    if not policy.fair:
        return candidates[-1]
    top = max(counts[s.client] for s in candidates)
    return [s for s in candidates if counts[s.client] == top][-1]


def slot_victims(waiting: Seq[Sequence], running: Seq[Sequence], max_running: int, rows: int,
                 policy: SharePolicy, present: frozenset[str] = frozenset()) -> list[Sequence]:
    """Running requests to preempt now so that the next ``rows`` admissions by ``next_waiting``
    find a slot: one per admission that finds the batch full while its client is under the
    bound and another client is over it (the most loaded client's newest first). A request
    handed over with its KV (``kv_import`` still set) is never chosen."""
    if not policy.fair or policy.max_slots_per_client == 0:
        return []
    counts = running_counts(running)
    queue, free, victims = list(waiting), max_running - len(running), []
    for _ in range(rows):
        cand = next_waiting(queue, counts, policy, present)
        if cand is None or policy.at_bound(counts[cand.client]):
            break
        queue.remove(cand)
        if free > 0:
            free -= 1
        else:
            over = [s for s in running if s not in victims and s.kv_import is None
                    and policy.over_bound(counts[s.client])]
            if not over:
                break
            victim = pressure_victim(over, counts, policy)
            victims.append(victim)
            counts[victim.client] -= 1
        counts[cand.client] += 1
    return victims
