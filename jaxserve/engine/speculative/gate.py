"""Whether a decode batch runs as a verify call (``speculative_policy="auto"``): the batch-level
gate, the calls' measured costs, and each request's recent acceptance.

A verify call costs every row of the batch the same program call, drafting or not, so whether
it pays is a property of the batch: it runs when the tokens it is expected to emit over all its
rows reach what plain decoding emits in the same time, one token per row per decode call times
the verify call's cost in decode calls at that bucket (``verify_pays``). A row's expected tokens
come from its recent per-draft acceptance ``a`` (a draft is accepted with probability ``a`` when
the ones before it were; decayed counts, so it follows the request's latest behaviour): 1 + a +
... + a^drafts (``expected_tokens``); a row without drafts emits 1. Requests new to speculation
start from the engine's acceptance over all requests.

The costs are the engine's own step records: per (phase, padded rows) the median of the last
few calls' wall times, the first call of each skipped (it may include compiling the program). A
bucket whose verify call is not measured yet verifies (to measure it); then one whose decode
call is not measured decodes plainly. A bucket the gate keeps declining near break-even (the
expected tokens at least ``EXPLORE_MARGIN`` of what the call must emit) still verifies once after
``FIRST_EXPLORE`` declined steps (doubling up to ``MAX_EXPLORE``), so a cost measured under a
passing load, or a proposer whose acceptance is only seen by verifying (MTP), is measured again;
far from break-even it never does (such a call would cost several decode calls for little).
Where a bucket's verify call costs more decode calls than a row could emit with every draft
accepted (``hopeless``), its rows do not draft at all: the proposals' host work is saved too.

While no request waits for a slot, the batch is closed: its decoding ends when its longest row
does, so tokens a verify call gives the rows that will finish first buy nothing. Then the call
must also move the batch's end (``batch_progress``: the steps of plain decoding it saves, from
each row's tokens still to go) by at least its cost; eight rows of equal length gain only what
every row gains.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics

POLICIES = ("auto", "always")  # speculative_policy: the gate decides, or every batch with a draft verifies
PRIOR_WEIGHT = 2.0  # the engine's acceptance counts as this many tried drafts of a request's
ROW_DECAY, ENGINE_DECAY = 0.8, 0.98  # per observation: a request's recent calls, the engine's longer history
SAMPLES = 5
FIRST_EXPLORE, MAX_EXPLORE = 32, 1024
EXPLORE_MARGIN = 0.75


def expected_tokens(a: float, drafts: int) -> float:
    """Tokens a verify call is expected to emit for a row with ``drafts`` drafts, each accepted
    with probability ``a`` given the ones before it: the accepted drafts and the one token every
    call emits, 1 + a + ... + a^drafts."""
    return 1.0 + sum(a**i for i in range(1, drafts + 1))


def verify_pays(expected: list[float], cost: float) -> bool:
    """expected: each decode row's expected tokens from the verify call (1.0 for a row without
    drafts); cost: the verify call's wall time in decode calls at the batch's bucket. The
    verify call pays when it emits at least what ``cost`` plain decode calls would (one token
    per row each)."""
    return sum(expected) >= cost * len(expected)


def batch_progress(expected: list[float], remaining: list[int]) -> float:
    """Steps of plain decoding a verify call saves a closed batch: the batch ends after
    max(remaining) decode steps, and after the call after max(remaining - expected)."""
    return max(remaining) - max(r - e for r, e in zip(remaining, expected))


@dataclasses.dataclass
class Acceptance:
    """Decayed counts of drafts tried and accepted: a draft is tried when every draft before it
    was accepted (the first always is), so hits / tries estimates the per-draft acceptance."""

    hits: float = 0.0
    tries: float = 0.0

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        self.hits = decay * self.hits + accepted
        self.tries = decay * self.tries + accepted + (1 if accepted < drafted else 0)

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.hits + weight * prior) / (self.tries + weight)


class StepCosts:
    """Wall time per program call, per (phase, padded rows), from the engine's step records."""

    def __init__(self):
        self.samples: dict[tuple[str, int], collections.deque] = {}

    def observe(self, rec) -> None:
        """A step observer (``LLMEngine.add_step_observer``): decode, verify and draft calls."""
        if rec.phase not in ("decode", "verify", "draft"):
            return
        key = (rec.phase, rec.batch)
        if key not in self.samples:  # the first call of a program may include its compilation
            self.samples[key] = collections.deque(maxlen=SAMPLES)
            return
        self.samples[key].append(rec.seconds)

    def seconds(self, phase: str, batch: int) -> float | None:
        s = self.samples.get((phase, batch))
        return statistics.median(s) if s else None

    def ratio(self, batch: int) -> float | None:
        """A verify call (with its draft call, MTP) in decode calls at this bucket; None until
        both are measured."""
        v, d = self.seconds("verify", batch), self.seconds("decode", batch)
        return (v + (self.seconds("draft", batch) or 0.0)) / d if v and d else None


class BatchGate:
    """The auto policy's decision per decode batch; ``engine``: the acceptance over all requests."""

    def __init__(self):
        self.costs = StepCosts()
        self.engine = Acceptance()
        self.declined: dict[int, int] = {}
        self.explore: dict[int, int] = {}

    def record(self, recent: Acceptance, drafted: int, accepted: int) -> None:
        """One row's drafts checked (by a verify call, or against the tokens plain decoding emitted)."""
        recent.add(drafted, accepted, ROW_DECAY)
        self.engine.add(drafted, accepted, ENGINE_DECAY)

    def row_rate(self, recent: Acceptance) -> float:
        return recent.rate(self.engine.rate(0.5, 1.0))

    def hopeless(self, batch: int, k: int) -> bool:
        """Whether no verify call at this bucket can pay: its measured cost is more decode calls
        than the k + 1 tokens a row emits with every draft accepted (then rows draft nothing)."""
        cost = self.costs.ratio(batch)
        return cost is not None and cost > k + 1

    def decide(self, rows: list[tuple[Acceptance, int]], batch: int, remaining: list[int] | None = None) -> bool:
        """rows: (each decode row's recent acceptance, its draft count); batch: the bucket's
        padded rows; remaining: each row's tokens still to go where the batch is closed (no
        request waiting; None: the batch refills) -> whether the batch runs as a verify call."""
        if not any(d for _, d in rows):
            return False
        if self.costs.seconds("verify", batch) is None:
            return True
        cost = self.costs.ratio(batch)
        if cost is None:  # the plain decode call is not measured at this bucket yet
            return False
        expected = [expected_tokens(self.row_rate(r), d) for r, d in rows]
        if remaining is not None and batch_progress(expected, remaining) < cost:
            return False  # the batch's end would not move: nothing to gain, nothing to measure
        if verify_pays(expected, cost):
            self.declined[batch] = 0
            return True
        if not verify_pays(expected, EXPLORE_MARGIN * cost):
            return False
        self.declined[batch] = self.declined.get(batch, 0) + 1
        if self.declined[batch] >= self.explore.get(batch, FIRST_EXPLORE):
            self.explore[batch] = min(2 * self.explore.get(batch, FIRST_EXPLORE), MAX_EXPLORE)
            self.declined[batch] = 0
            return True
        return False
