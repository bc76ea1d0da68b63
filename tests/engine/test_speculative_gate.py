"""The auto policy's batch-level gate: when a decode batch runs as a verify call.

- the decision from constructed numbers: a batch where one drafting row would make the verify
  call lose decodes plainly, a batch with high acceptance verifies (expected tokens against a
  numpy reference);
- the costs from step records (a program's first call not counted), measuring a bucket's
  verify and decode calls first, and the occasional verify of a bucket it keeps declining near
  break-even (never far from it);
- the decoder: "always" keeps every draft whatever the costs; "auto" drops them where the gate
  declines and scores them as a shadow against the tokens decoding emits;
- on a tiny model, "auto" gives the greedy tokens of speculation off, verifying or not.
"""
import types

import numpy as np
import pytest

from tests.hf_models import build_llama
from jaxserve import LLM
from jaxserve.engine.outputs import StepRecord
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.speculative import gate as gate_mod
from jaxserve.engine.speculative.decoder import SpeculativeDecoder
from jaxserve.engine.speculative.gate import Acceptance, BatchGate, batch_progress, expected_tokens, verify_pays
from jaxserve.engine.speculative.ngram import NgramProposer


def reference_expected(a, d):
    """numpy: the mean of 1 + (accepted drafts) over simulated calls, each draft accepted with
    probability a while every one before it was."""
    rng = np.random.default_rng(0)
    ok = rng.random((200_000, d)) < a
    return 1 + np.cumprod(ok, axis=1).sum(axis=1).mean()


@pytest.mark.parametrize("a,d", [(0.0, 4), (0.3, 4), (0.9, 4), (1.0, 3), (0.5, 1)])
def test_expected_tokens_match_a_simulation(a, d):
    assert expected_tokens(a, d) == pytest.approx(reference_expected(a, d), abs=0.02)
    assert expected_tokens(a, 0) == 1.0


def test_one_drafting_row_does_not_make_the_batch_pay():
    """8 rows, a verify call costing 3.4 decode calls (int4 decode past the native kernel's rows):
    one row drafting with high acceptance pays alone at one row (cost 2) but not in the batch,
    where the other 7 rows emit one token each from a call that costs 3.4; every row drafting
    with high acceptance pays; low acceptance everywhere does not."""
    hi, lo = expected_tokens(0.9, 4), expected_tokens(0.3, 4)
    assert hi == pytest.approx(4.0951) and lo == pytest.approx(1.4251)
    assert verify_pays([hi], 2.0)
    assert not verify_pays([hi] + [1.0] * 7, 3.4)  # 11.1 tokens < 8 x 3.4 = 27.2
    assert not verify_pays([lo] + [1.0] * 7, 3.4)
    assert verify_pays([hi] * 8, 3.4)  # 32.8 >= 27.2
    assert not verify_pays([lo] * 8, 3.4)
    assert verify_pays([lo] * 8, 1.4) and not verify_pays([lo] * 8, 1.5)  # break-even at 1.425


def test_acceptance_counts_tried_drafts():
    r = Acceptance()
    r.add(4, 2, 1.0)  # drafts 1, 2 accepted, 3 tried and rejected, 4 never reached
    r.add(4, 4, 1.0)  # every one accepted: 4 tried
    assert (r.hits, r.tries) == (6, 7)
    assert r.rate(0.5, 0.0) == pytest.approx(6 / 7) and r.rate(0.5, 2.0) == pytest.approx(7 / 9)
    r.add(3, 0, 0.5)
    assert (r.hits, r.tries) == (3, 4.5)


def record(costs, phase, batch, seconds, n=3):
    for _ in range(n):  # the first call of each (phase, batch) is not counted
        costs.observe(StepRecord(phase, batch, batch, batch, 1, batch, seconds))


def high(n=20):
    r = Acceptance()
    for _ in range(n):
        r.add(4, 4, 0.8)
    return r


def test_gate_measures_then_decides_then_explores():
    g = BatchGate()
    rows = [(high(), 4)] + [(Acceptance(), 0)] * 7
    assert not g.decide([(Acceptance(), 0)] * 8, 8)  # no drafts: nothing to verify
    g.costs.observe(StepRecord("verify", 8, 40, 8, 5, 8, 50.0))  # a first call (compiling): skipped
    assert g.costs.seconds("verify", 8) is None and g.decide(rows, 8)  # verify not measured: verify
    record(g.costs, "verify", 8, 0.034)
    assert g.costs.ratio(8) is None and not g.decide(rows, 8)  # decode not measured: decode
    record(g.costs, "decode", 8, 0.010)
    assert g.costs.ratio(8) == pytest.approx(3.4)
    assert g.decide([(high(), 4)] * 8, 8)
    assert not any(g.decide(rows, 8) for _ in range(gate_mod.FIRST_EXPLORE * 3))  # far from break-even: never
    near = [(Acceptance(750.0, 1000.0), 4)] * 8  # a = 0.75: 8 x 3.05 tokens, 90% of the 27.2 the call must emit
    decisions = [g.decide(near, 8) for _ in range(gate_mod.FIRST_EXPLORE * 3)]
    explored = [i for i, d in enumerate(decisions) if d]  # a verify after 32 declines, then after 64
    assert explored == [gate_mod.FIRST_EXPLORE - 1, 3 * gate_mod.FIRST_EXPLORE - 1]
    record(g.costs, "verify", 1, 0.020)
    record(g.costs, "decode", 1, 0.010)
    assert g.decide(rows[:1], 1)  # the same row alone: 4.1 tokens per call costing 2


def test_a_closed_batch_verifies_only_where_its_end_moves():
    """No request waiting: the batch ends with its longest row, so a verify call must save that
    many steps of plain decoding (batch_progress, each row's tokens still to go). Four rows
    drafting well among eight pay by the token count (the refilling case), not when all eight
    have 40 tokens to go (the end moves one step), and again when the drafting rows are the
    longest ones."""
    hi = expected_tokens(0.9, 4)
    assert batch_progress([hi] * 4 + [1.0] * 4, [40] * 8) == pytest.approx(1.0)
    assert batch_progress([hi] * 4 + [1.0] * 4, [40] * 4 + [10] * 4) == pytest.approx(hi)
    assert batch_progress([hi], [3]) == pytest.approx(hi)  # one row: the tokens it gains
    g = BatchGate()
    record(g.costs, "verify", 8, 0.015)
    record(g.costs, "decode", 8, 0.010)  # a verify call costing 1.5 decode calls
    rows = [(high(), 4)] * 4 + [(Acceptance(), 0)] * 4
    assert g.decide(rows, 8)  # ~4.9 x 4 + 4 tokens >= 8 x 1.5
    assert not g.decide(rows, 8, [40] * 8)
    assert g.decide(rows, 8, [40] * 4 + [10] * 4)


def test_propose_weighs_a_closed_batch_by_its_longest_rows():
    """SpeculativeDecoder.propose: with a request waiting the drafting row verifies (tokens
    count wherever they come from); with none, the row drafting is the shorter one, so the
    batch decodes plainly and keeps the drafts as a shadow."""
    motif = [11, 12, 13, 14, 15]
    dec = SpeculativeDecoder(NgramProposer(3), 100, 512, None, 0.3, "auto")
    record(dec.gate.costs, "verify", 2, 0.012)
    record(dec.gate.costs, "decode", 2, 0.010)
    for waiting, verifies in ((True, True), (False, False)):
        drafting, other = fake_seq(motif * 3, 4), fake_seq(list(range(40, 60)), 4)
        other.params = types.SimpleNamespace(max_tokens=200)  # the longer row drafts nothing
        dec.gate.engine = Acceptance(90.0, 100.0)
        dec.propose([drafting, other], waiting=waiting)
        assert bool(drafting.draft_ids) == verifies, waiting
        assert (drafting.spec.shadow is not None) == (not verifies)


def fake_seq(tokens, generated):
    return types.SimpleNamespace(in_prefill=False, finished=False, spec=None, draft_ids=[], all_ids=list(tokens),
                                 output_ids=list(tokens[-generated:]), params=types.SimpleNamespace(max_tokens=100),
                                 total_len=len(tokens))


def test_always_keeps_drafts_and_auto_scores_them_as_a_shadow():
    motif = [11, 12, 13, 14, 15]
    for policy in ("always", "auto"):
        dec = SpeculativeDecoder(NgramProposer(3), 100, 512, None, 0.3, policy)
        record(dec.gate.costs, "verify", 1, 0.035)  # a verify call costing 3.5 decode calls (of at most 4 tokens)
        record(dec.gate.costs, "decode", 1, 0.010)
        seq = fake_seq(motif * 3, 4)
        dec.propose([seq])
        if policy == "always":
            assert seq.draft_ids == [11, 12, 13] and seq.spec.shadow is None
            continue
        assert seq.draft_ids == [] and seq.spec.shadow == ([11, 12, 13], 4)
        for tok in (11, 12):  # plain decoding emits the first two drafts
            seq.output_ids.append(tok)
            seq.all_ids.append(tok)
            dec.propose([seq])
        assert seq.spec.shadow is not None and seq.spec.recent.tries == 0  # still open: 2 of 3 matched
        seq.output_ids.append(99)
        seq.all_ids.append(99)
        dec.propose([seq])
        assert (seq.spec.recent.hits, seq.spec.recent.tries) == (2, 3)  # two accepted, the third rejected
        assert (seq.spec.drafted, seq.spec.verify_steps) == (0, 0)  # usage counts verified drafts only


def test_auto_drafts_nothing_where_no_verify_call_can_pay():
    """A bucket whose verify call costs more decode calls than k + 1 (every draft accepted):
    its rows are not proposed for (no host work) and keep no shadow; another bucket drafts."""
    class Counting(NgramProposer):
        calls = 0

        def propose(self, tokens, limit):
            Counting.calls += 1
            return super().propose(tokens, limit)

    dec = SpeculativeDecoder(Counting(3), 100, 512, None, 0.3, "auto")
    record(dec.gate.costs, "verify", 2, 0.041)  # 4.1 decode calls at 2 rows: past 3 + 1
    record(dec.gate.costs, "decode", 2, 0.010)
    record(dec.gate.costs, "verify", 1, 0.035)  # 3.5 at 1 row
    record(dec.gate.costs, "decode", 1, 0.010)
    assert dec.gate.hopeless(2, 3) and not dec.gate.hopeless(1, 3) and not dec.gate.hopeless(4, 3)
    seqs = [fake_seq([11, 12, 13, 14, 15] * 3, 4) for _ in range(2)]
    dec.propose(seqs)
    assert Counting.calls == 0 and all(s.draft_ids == [] and s.spec.shadow is None for s in seqs)
    dec.propose(seqs[:1])
    assert Counting.calls == 1 and seqs[0].spec.shadow == ([11, 12, 13], 4)


def test_auto_gives_the_greedy_tokens_of_speculation_off(tmp_path, monkeypatch):
    """A tiny Llama (its random weights copy the n-gram drafts): "auto" first verifies (each
    bucket's verify call measured), then with a verify call made to cost 50 decode calls it
    decodes plainly and drafts nothing (no call can pay); both give the tokens of speculation off."""
    build_llama(tmp_path, num_hidden_layers=2, seed=2)
    llm = LLM(str(tmp_path), kv_format="bf16", num_pages=96, page_size=4, max_num_seqs=4, max_model_len=128,
              dtype="float32", speculative="ngram", num_speculative_tokens=3)
    spec = llm.engine.spec
    assert spec.policy == "auto"
    rng = np.random.RandomState(7)
    prompts = [[int(x) for x in rng.randint(2, llm.engine.cfg.vocab_size, size=n)] * 4 for n in (6, 9, 5)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    llm.engine.spec = None
    want = [list(c) for c in llm.generate(prompts, sp)]
    llm.engine.spec = spec
    assert [list(c) for c in llm.generate(prompts, sp)] == want
    assert spec.verify_steps > 0 and spec.accepted > 0
    monkeypatch.setattr(gate_mod, "FIRST_EXPLORE", 10**6)  # no exploring verify call in this run
    for b in (1, 2, 4, 8):
        record(spec.gate.costs, "verify", b, 5.0, n=6)
        record(spec.gate.costs, "decode", b, 0.1, n=6)
    steps = spec.verify_steps
    engine_tries = spec.gate.engine.tries
    assert [list(c) for c in llm.generate(prompts, sp)] == want
    assert spec.verify_steps == steps  # every batch decoded plainly
    assert spec.gate.engine.tries == engine_tries  # ... and drafted nothing to score
    assert llm.engine.bm.num_used_pages == 0 and llm.engine.snapshot().integrity_mismatches == {}
