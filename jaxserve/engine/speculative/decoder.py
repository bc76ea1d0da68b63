"""Speculative decoding on the engine's side: draft tokens per request before the scheduler
runs, the acceptance of one verify call's logits, the rollback of rejected tokens' pages, and
each request's acceptance figures (and the switch that turns its speculation off while it
does not pay).

A request drafts only while decoding and when its drafts cannot pass its limits: at most
``max_tokens - generated - 1`` and ``max_model_len - length - 1`` of them, so every token a
verify call can emit is one the request may still generate. The scheduler maps slots for the
drafts only where free pages allow (speculation never preempts); after the verify call the
pages past what the request's tokens need are released (``BlockManager.truncate``: the
generation bump makes any page table that still maps one fail the integrity check).

Policy ``always``: every batch with a draft runs as a verify call (tests that need speculation
to run). Policy ``auto``: the batch-level gate (``gate.BatchGate``) decides per step, before the
scheduler maps draft slots, whether the decode batch verifies, from each row's recent acceptance
and the verify call's measured cost in decode calls at the batch's bucket. Where it decodes
plainly, a row's n-gram drafts are kept as a shadow and scored against the tokens decoding then
emits (what a verify call would have accepted: greedy exactly, sampled with the same
probability), so a request's acceptance stays measured while it does not verify. Besides, a
request whose acceptance over ``WINDOW`` drafted tokens stays below ``min_acceptance`` pauses
drafting for ``backoff`` generated tokens (doubling each time, up to ``MAX_BACKOFF``); a window
above it resets the backoff.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxserve.executor.buckets import bucket
from jaxserve.engine.sampler import penalty_inputs
from jaxserve.engine.speculative.gate import POLICIES, Acceptance, BatchGate
from jaxserve.engine.speculative.verify import verify_rows

WINDOW = 16
FIRST_BACKOFF, MAX_BACKOFF = 16, 512


@dataclasses.dataclass
class SpecStats:
    """One request's speculation figures (``Sequence.spec``)."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # ... of which accepted
    verify_steps: int = 0  # verify calls with at least one draft token of this request
    window_drafted: int = 0  # drafts checked (verified or shadowed) since the window began
    window_accepted: int = 0
    recent: Acceptance = dataclasses.field(default_factory=Acceptance)  # what the batch gate reads
    shadow: tuple | None = None  # (drafts not verified, output length when drafted): scored as decoding goes on
    paused_until: int = 0  # no drafts until the request has generated this many tokens
    backoff: int = FIRST_BACKOFF
    pauses: int = 0
    pages_rolled_back: int = 0
    last_rollback: list = dataclasses.field(default_factory=list)  # (page, generation it was mapped at)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify call with drafts (accepted drafts + the one it always emits)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class SpeculativeDecoder:
    def __init__(self, proposer, vocab_size: int, max_model_len: int, block_manager, min_acceptance: float,
                 policy: str = "auto"):
        if policy not in POLICIES:
            raise ValueError(f"speculative_policy must be one of {POLICIES}, got {policy!r}")
        self.proposer, self.k = proposer, proposer.k
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.bm = block_manager
        self.min_acceptance, self.policy = min_acceptance, policy
        self.drafted = self.accepted = self.verify_steps = 0  # engine totals (metrics)
        self.gate = BatchGate()

    def observe(self, rec) -> None:
        """A step observer (``LLMEngine.add_step_observer``): the decode, verify and draft calls' times."""
        self.gate.costs.observe(rec)

    def cost_ratio(self, batch: int) -> float:
        """A verify call's wall time (with its draft call, MTP) in decode calls at this bucket
        (1.0 until both are measured)."""
        return self.gate.costs.ratio(batch) or 1.0

    def totals(self) -> dict:
        """The engine's figures since start, as ``EngineSnapshot`` fields."""
        return dict(spec_draft_tokens=self.drafted, spec_accepted_tokens=self.accepted,
                    spec_verify_steps=self.verify_steps)

    @property
    def verify_tokens(self) -> int:
        """T of the verify programs: the last token and k drafts."""
        return self.k + 1

    def propose(self, running, waiting: bool = True) -> None:
        """Set ``draft_ids`` of every running sequence (empty where it drafts nothing this step,
        and for every row where the auto policy's gate decodes the batch plainly); ``waiting``:
        whether a request waits for a slot (if not, the gate weighs the batch as closed)."""
        decoding = []
        for seq in running:
            seq.draft_ids = []
            if seq.in_prefill or not seq.output_ids or seq.finished:
                continue
            if seq.spec is None:
                seq.spec = SpecStats()
            decoding.append(seq)
            self._score_shadow(seq)
        batch = bucket(len(decoding)) if decoding else 0
        if self.policy == "auto" and decoding and self.gate.hopeless(batch, self.k):
            return
        for seq in decoding:
            if len(seq.output_ids) < seq.spec.paused_until:
                continue
            seq.draft_ids = self.proposer.propose(seq.all_ids, self._to_go(seq) - 1)
        if self.policy == "always" or not decoding:
            return
        remaining = None if waiting else [self._to_go(s) for s in decoding]
        if self.gate.decide([(s.spec.recent, len(s.draft_ids)) for s in decoding], batch, remaining):
            return
        for s in decoding:
            if s.draft_ids and s.spec.shadow is None and not self.proposer.on_device:
                s.spec.shadow = (s.draft_ids, len(s.output_ids))
            s.draft_ids = []

    def _to_go(self, seq) -> int:
        """Tokens the request may still generate: its max_tokens and the context bound."""
        return min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.total_len)

    def _score_shadow(self, seq) -> None:
        """Score a row's shadow drafts once the tokens decoded since show how many a verify call
        would have accepted (a mismatch, or every draft matched)."""
        if seq.spec.shadow is None:
            return
        drafts, start = seq.spec.shadow
        out = seq.output_ids[start : start + len(drafts)]
        m = 0
        while m < len(out) and out[m] == drafts[m]:
            m += 1
        if m < len(out) or m == len(drafts):
            seq.spec.shadow = None
            self._observe(seq.spec, len(seq.output_ids), len(drafts), m)

    def verifies(self, decode, verify_bucket) -> bool:
        """Whether this decode batch runs as a verify call: some row drafted and its bucket
        (None while warm-up has not built it) exists. If not, the drafts are dropped (their
        slots fill as the requests grow)."""
        if verify_bucket is not None and any(s.draft_ids for s in decode):
            return True
        for s in decode:
            s.draft_ids = []
        return False

    def verify(self, decode, run, emit, events, draft=None, constraints=None) -> None:
        """One verify call over every decode row (``run(rows)``: its last token and its drafts,
        KV written for all), the acceptance, then each row's tokens emitted in order
        (``emit(seq, token, logprob, top, now, events)`` -> finished: a stop inside the run ends
        it) and the rejected drafts' pages rolled back. A proposer ``on_device`` has its drafts
        computed first by ``draft(rows)`` (the draft program call). A row with a grammar
        (``constraints``: the engine's ``Constraints``) has its drafts cut before the first one
        the grammar forbids, and every position's mask applied in the acceptance."""
        if self.proposer.on_device:
            self._device_drafts(decode, draft)
            decode = [s for s in decode if not s.finished]  # a row the draft call's check failed is aborted
            if not decode:
                return
        masks = self._grammar_masks(decode, constraints)
        res = run([(s, [s.output_ids[-1]] + s.draft_ids, s.total_len - 1) for s in decode])
        live = [(i, s) for i, s in enumerate(decode) if res.ok[i] and not s.finished]
        now = time.perf_counter()
        accepted = self.accept(res.logits, live, masks) if live else []
        for (_, s), (toks, lps, tops) in zip(live, accepted):
            s.draft_ids = []
            for tok, lp, top in zip(toks, lps, tops):
                if emit(s, tok, lp, top, now, events):
                    break
            if not s.finished:
                s.num_computed = s.total_len - 1  # the last token and the accepted drafts were written
                self.bm.commit_full_pages(s.request_id, s.all_ids[: s.num_computed])
                self.rollback(s)

    def _device_drafts(self, decode, draft) -> None:
        """Fill each row's reserved draft slots from one draft program call: the row's newest
        token and its slots, from the position before it (whose hidden state is stored)."""
        res = draft([(s, [s.output_ids[-1]] + s.draft_ids, s.total_len - 2) for s in decode])
        tokens = np.asarray(res.logits)  # the draft program's first output: int32 [B, k]
        for i, s in enumerate(decode):
            s.draft_ids = tokens[i, : len(s.draft_ids)].tolist() if res.ok[i] else []

    def _grammar_masks(self, decode, constraints) -> dict[int, np.ndarray]:
        """Decode row -> its masks [drafts + 1, words], for the rows a grammar constrains (their
        drafts cut where the grammar forbids one)."""
        masks = {}
        if constraints is None:
            return masks
        for i, s in enumerate(decode):
            if s.grammar is not None:
                s.draft_ids, m = constraints.draft_masks(s, s.draft_ids)
                if m is not None:
                    masks[i] = m
        return masks

    def accept(self, logits, rows, masks=None) -> list[tuple[list[int], list[float], list]]:
        """rows: (logits row, Sequence) of one verify call -> per row (tokens to emit: accepted
        drafts then the correction / bonus token, their log-probs, top log-probs or None).
        masks: logits row -> grammar masks [positions, words] (``_grammar_masks``)."""
        b = bucket(len(rows))
        t = self.verify_tokens
        idx, nd, drafts = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros((b, t - 1), np.int32)
        temp, top_p, min_p = np.zeros(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.float32)
        top_k, seeds, steps = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        for j, (i, s) in enumerate(rows):
            p = s.params
            idx[j], nd[j] = i, len(s.draft_ids)
            drafts[j, : nd[j]] = s.draft_ids
            temp[j], top_p[j], min_p[j], top_k[j] = p.temperature, p.top_p, p.min_p, p.top_k
            seeds[j], steps[j] = s.seed, len(s.output_ids)
        penalties = any(s.params.uses_penalties for _, s in rows)
        extra = penalty_inputs(rows, b, self.vocab_size) if penalties else {}
        n_lp = max(((s.params.logprobs or 0) for _, s in rows), default=0)
        n_lp = 0 if all(s.params.logprobs is None for _, s in rows) else bucket(max(n_lp, 1))
        greedy = all(s.params.greedy for _, s in rows)
        if masks:
            m = np.full((b, t, next(iter(masks.values())).shape[1]), -1, np.int32)
            for j, (i, _) in enumerate(rows):
                if i in masks:
                    m[j, : len(masks[i])] = masks[i]
            extra["masks"] = m
        out = verify_rows(logits, idx, drafts, nd, temp, top_k, top_p, min_p, seeds, steps, **extra,
                          all_greedy=greedy, penalties=penalties, num_logprobs=n_lp)
        accepted, tokens, lp, top_ids, top_lp = map(np.asarray, out)
        res = []
        for j, (_, s) in enumerate(rows):
            n = int(accepted[j]) + 1
            m = s.params.logprobs or 0
            tops = [{int(a): float(c) for a, c in zip(top_ids[j, q, :m], top_lp[j, q, :m])} if n_lp else None
                    for q in range(n)]
            res.append((tokens[j, :n].tolist(), lp[j, :n].tolist(), tops))
            self._record(s, int(nd[j]), n - 1)
        return res

    def _record(self, seq, drafted: int, accepted: int) -> None:
        st = seq.spec
        if st is None or drafted == 0:
            return
        st.drafted += drafted
        st.accepted += accepted
        st.verify_steps += 1
        self.drafted, self.accepted, self.verify_steps = (self.drafted + drafted, self.accepted + accepted,
                                                          self.verify_steps + 1)
        self._observe(st, len(seq.output_ids) + accepted + 1, drafted, accepted)

    def _observe(self, st, generated: int, drafted: int, accepted: int) -> None:
        """One row's drafts checked, by a verify call or as a shadow (auto policy only): the
        gate's acceptance, and the pause once a window of drafts stays below ``min_acceptance``.
        generated: the request's output length once the checked tokens are emitted."""
        if self.policy != "auto":
            return
        self.gate.record(st.recent, drafted, accepted)
        st.window_drafted += drafted
        st.window_accepted += accepted
        if st.window_drafted >= WINDOW:
            if st.window_accepted < self.min_acceptance * st.window_drafted:
                st.paused_until = generated + st.backoff
                st.backoff = min(2 * st.backoff, MAX_BACKOFF)
                st.pauses += 1
            else:
                st.backoff = FIRST_BACKOFF
            st.window_drafted = st.window_accepted = 0

    def rollback(self, seq) -> list[int]:
        """Release the pages past what the request's tokens need (rejected drafts' slots), in the
        block manager and in the request's own page table; -> the pages released."""
        released = self.bm.truncate(seq.request_id, seq.total_len)
        keep = len(self.bm.page_table(seq.request_id))
        if released and seq.spec is not None:
            seq.spec.pages_rolled_back += len(released)
            seq.spec.last_rollback = list(zip(seq.pages[keep:], seq.expected[keep:]))
        del seq.pages[keep:], seq.expected[keep:]
        return released

    def warm(self, logits_for) -> None:
        """Compile the acceptance for every verify bucket (greedy and sampled, no penalties or
        log-probs, as the plain samplers are): ``logits_for(b)`` gives a verify call's logits."""
        t = self.verify_tokens
        for b, logits in logits_for():
            z, f = np.zeros(b, np.int32), np.zeros(b, np.float32)
            for greedy in (True, False):
                verify_rows(logits, z, np.zeros((b, t - 1), np.int32), z, f, z, np.ones(b, np.float32), f, z, z,
                            all_greedy=greedy, penalties=False, num_logprobs=0)
