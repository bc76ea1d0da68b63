"""Scheduler: fair share between clients (host-side, no model: the scheduler and the block
manager driven directly, as the engine drives them).

A stateful property test runs random traffic from several clients (arrivals, steps that
finish some prompts' tokens, aborts) under both policies and checks the scheduler's
guarantees after every step: the step's batches respect the decode / prefill / token limits,
page tables match the block manager, nothing is lost or duplicated; and under ``fair``: a
request of a client under its bound is never left waiting behind another client's request
while a slot is free, and no client is over its bound while another client under it waits.
"""
import ast
import collections
import pathlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxserve.engine import fair_share, scheduler as sched_mod
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler, SchedulerConfig
from jaxserve.engine.sequence import Sequence, Status

PS = 4


def make(policy="fair", slots=0, seqs=4, pages=64, tokens=64, rows=4, chunk=32):
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, max_prefill_seqs=rows,
                          prefill_chunk=chunk, client_scheduling=policy, max_slots_per_client=slots)
    return Scheduler(cfg, BlockManager(pages, PS))


_ids = iter(range(10**9))


def seq(client, n=6, first=1):
    return Sequence(f"r{next(_ids)}", list(range(first, first + n)), SamplingParams(max_tokens=8), 0, client=client)


def step(s: Scheduler, finish=()):
    """One scheduler step as the engine runs it: prefill chunks computed, one token sampled
    for each decode row and each chunk that completes its prompt; ``finish``: ids to end."""
    out = s.schedule()
    for ch in out.prefill:
        ch.seq.num_computed += ch.num_tokens
        if ch.completes_prompt and not ch.seq.output_ids:
            ch.seq.output_ids.append(0)
    for q in out.decode:
        q.num_computed = q.total_len
        q.output_ids.append(0)
    for q in list(s.running):
        if q.request_id in finish:
            s.finish(q, "stop")
    return out



def test_module_imports_no_model_code():
    for mod in (sched_mod, fair_share):
        tree = ast.parse(pathlib.Path(mod.__file__).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if n.split(".")[0] in ("jax", "numpy") or "models" in n or "runner" in n]


def test_fifo_admits_in_arrival_order():
    s = make("fifo", seqs=8)
    hog = [seq("hog") for _ in range(6)]
    good = seq("good")
    for q in hog + [good]:
        s.add(q)
    out = step(s)
    assert [ch.seq for ch in out.prefill] == hog[:4]


def test_fair_admits_the_newcomer_before_a_backlog():
    """A client with N queued requests does not hold back another client's one request: it
    is admitted in the first step that admits anything."""
    s = make("fair", seqs=8)
    hog = [seq("hog") for _ in range(20)]
    for q in hog:
        s.add(q)
    good = seq("good")
    s.add(good)
    out = step(s)
    assert good in [ch.seq for ch in out.prefill]
    assert [ch.seq.client for ch in out.prefill].count("good") == 1


def test_fair_alternates_between_clients():
    s = make("fair", seqs=8, rows=8, tokens=256)
    a = [seq("a") for _ in range(4)]
    b = [seq("b") for _ in range(4)]
    for q in a + b:
        s.add(q)
    out = step(s)
    assert [ch.seq.client for ch in out.prefill] == ["a", "b"] * 4


def test_lone_client_uses_every_slot():
    s = make("fair", slots=2, seqs=6, rows=6, tokens=256)
    hog = [seq("hog") for _ in range(10)]
    for q in hog:
        s.add(q)
    step(s)
    assert len(s.running) == 6 and s.num_preemptions == 0


def test_full_batch_gives_way_to_a_client_under_its_bound():
    """The churn case: one client holds every slot (and has more queued); another client's
    request is admitted in the next step, the hog's newest running request preempted."""
    s = make("fair", slots=2, seqs=4, rows=4, tokens=256)
    hog = [seq("hog") for _ in range(12)]
    for q in hog:
        s.add(q)
    step(s)
    step(s)
    assert [q.client for q in s.running] == ["hog"] * 4
    good = seq("good")
    s.add(good)
    out = step(s)
    assert [ch.seq for ch in out.prefill] == [good]
    assert good.status is Status.RUNNING and s.num_preemptions == 1
    assert hog[3].status is Status.WAITING and s.waiting[0] is hog[3]  # the newest gave way, queued first
    out = step(s)  # nothing more is taken from the hog: it holds 3 > 2 but nobody else waits
    assert s.num_preemptions == 1 and len(s.running) == 4


def test_a_client_at_its_bound_waits_while_another_is_present():
    """The churn case between requests: a well-behaved client runs one request at a time. While
    it is present (running, or gone for fewer than ``linger_steps`` steps) the hog stays at its
    bound even with slots free, so it cannot fill the batch in the gap between two requests; once
    the other client has been gone longer than that, the hog may use every slot."""
    s = make("fair", slots=2, seqs=6, rows=6, tokens=256)
    good = seq("good")
    s.add(good)
    step(s)
    hog = [seq("hog") for _ in range(10)]
    for q in hog:
        s.add(q)
    step(s, finish={good.request_id})  # the good request ends; its client stays present
    for _ in range(3):
        step(s)
    assert [q.client for q in s.running] == ["hog"] * 2  # four slots stay free
    s.add(seq("good"))  # its next request finds a slot at once
    out = step(s)
    assert [ch.seq.client for ch in out.prefill] == ["good"] and s.num_preemptions == 0
    for q in [q for q in s.running if q.client == "good"]:
        s.finish(q, "stop")
    for _ in range(fair_share.LINGER_STEPS + 1):
        step(s)
    assert len(s.running) == 6 and {q.client for q in s.running} == {"hog"}


def test_presence_counts_steps():
    p = fair_share.Presence(linger_steps=2)
    a = seq("a")
    assert p.tick([a], []) == {"a"}
    assert p.tick([], []) == {"a"} and p.tick([], []) == {"a"}
    assert p.tick([], []) == frozenset()


def test_fifo_never_preempts_for_a_client():
    s = make("fifo", slots=2, seqs=4, rows=4, tokens=256)
    for _ in range(12):
        s.add(seq("hog"))
    step(s)
    good = seq("good")
    s.add(good)
    for _ in range(3):
        step(s)
    assert good.status is Status.WAITING and s.num_preemptions == 0


def test_page_pressure_takes_from_the_heaviest_client():
    """Out of pages in decode: the newest request of the client holding the most gives way,
    not the newest overall (the other client's)."""
    s = make("fair", seqs=8, rows=8, pages=9, tokens=256, chunk=64)  # 8 usable pages of 4 tokens
    hog = [seq("hog", n=7, first=10 * i + 1) for i in range(3)]  # 2 pages each, full after 1 token
    for q in hog:
        s.add(q)
    step(s)
    good = seq("good", n=7, first=100)
    s.add(good)
    step(s)
    assert len(s.running) == 4 and s.bm.num_free_pages == 0
    step(s)  # every one needs a third page now: two must give way
    assert good.status is Status.RUNNING and good.num_preemptions == 0
    assert [q.status for q in hog].count(Status.WAITING) >= 1
    assert s.num_preemptions >= 1


def test_aborting_a_waiting_request_frees_its_place():
    s = make("fair", seqs=2)
    qs = [seq("hog") for _ in range(5)]
    for q in qs:
        s.add(q)
    step(s)
    for q in qs[2:]:
        s.finish(q, "abort")
    assert not s.waiting and len(s.running) == 2


def test_bad_policy_and_bound_are_refused():
    with pytest.raises(ValueError, match="client_scheduling"):
        SchedulerConfig(client_scheduling="lottery")
    with pytest.raises(ValueError, match="max_slots_per_client"):
        SchedulerConfig(max_slots_per_client=-1)


# ---- stateful property test -----------------------------------------------------------

CLIENTS = ["a", "b", "c"]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.policy = None
        self.s = None
        self.live: dict[str, Sequence] = {}

    def _sched(self):
        if self.s is None:
            self.s = make(self.policy or "fair", slots=2, seqs=4, pages=24, tokens=24, rows=2, chunk=8)
        return self.s

    @rule(policy=st.sampled_from(["fair", "fifo"]))
    def choose_policy(self, policy):
        if self.s is None:
            self.policy = policy

    @rule(client=st.sampled_from(CLIENTS), n=st.integers(1, 20), k=st.integers(1, 3))
    def arrive(self, client, n, k):
        s = self._sched()
        for _ in range(k):
            q = seq(client, n=n, first=1 + 5 * len(self.live) % 50)
            q.params = SamplingParams(max_tokens=4)
            s.add(q)
            self.live[q.request_id] = q

    @rule(k=st.integers(0, 99))
    def abort(self, k):
        if self.live:
            rid = sorted(self.live)[k % len(self.live)]
            self._sched().finish(self.live.pop(rid), "abort")

    @rule()
    def run_step(self):
        s = self._sched()
        waiting_before = collections.Counter(q.client for q in s.waiting)
        out = s.schedule()
        cfg = s.config
        assert len(out.decode) <= cfg.max_num_seqs and len(out.prefill) <= cfg.max_prefill_seqs
        assert sum(ch.num_tokens for ch in out.prefill) <= cfg.max_num_batched_tokens
        assert all(ch.num_tokens <= cfg.prefill_chunk for ch in out.prefill)
        rows = [ch.seq for ch in out.prefill] + out.decode
        assert len({id(q) for q in rows}) == len(rows)
        assert all(q.status is Status.RUNNING for q in rows)
        for q in rows:
            assert q.pages == s.bm.page_table(q.request_id)
        if s.policy.fair and waiting_before:
            self._fair_after_admission(s)
        for ch in out.prefill:
            ch.seq.num_computed += ch.num_tokens
            if ch.completes_prompt and not ch.seq.output_ids:
                ch.seq.output_ids.append(0)
        for q in out.decode:
            q.num_computed = q.total_len
            q.output_ids.append(0)
        for q in list(s.running):
            if len(q.output_ids) >= q.params.max_tokens and not q.in_prefill:
                s.finish(q, "length")
                self.live.pop(q.request_id)

    def _fair_after_admission(self, s):
        """After admission: a free slot never leaves a client under its bound waiting unless
        the step ran out of prefill rows, budget or pages; and a full batch never keeps a
        client over its bound while another client under the bound waits."""
        counts = fair_share.running_counts(s.running)
        policy = s.policy
        under_waiting = {q.client for q in s.waiting if not policy.at_bound(counts[q.client])}
        over = [c for c, n in counts.items() if policy.over_bound(n)]
        if under_waiting and len(s.running) >= s.config.max_num_seqs:
            handed = any(q.kv_import is not None for q in s.running)
            assert not over or handed, (counts, under_waiting)

    @invariant()
    def bookkeeping(self):
        if self.s is None:
            return
        s = self.s
        assert len(s.running) <= s.config.max_num_seqs
        assert {q.request_id for q in s.running} | {q.request_id for q in s.waiting} == set(self.live)
        assert len(s.running) + len(s.waiting) == len(self.live)
        assert all(q.status is Status.WAITING for q in s.waiting)
        for q in s.running:
            assert s.bm.has_seq(q.request_id)
        for q in s.waiting:
            assert not s.bm.has_seq(q.request_id) and not q.pages


TestSchedulerStateful = SchedulerMachine.TestCase
TestSchedulerStateful.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
