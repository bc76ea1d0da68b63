"""Speculative decoding (n-gram drafts, verify program, lossless acceptance, page rollback).

- greedy tokens (and log-probs, closely) identical with speculation on and off, every family,
  bf16 and fp8 KV, with drafts both accepted and rejected, stops inside accepted runs;
- the sampled acceptance rule reproduces the target distribution (processed by temperature,
  top-k, top-p as the sampler does) on a tiny model's logits, where the naive rules do not;
- a rolled-back page that the request's own table still maps fails the integrity check.
"""
import numpy as np
import pytest

from tests.hf_models import build_glm_moe_dsa, build_llama
from jaxserve import LLM
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.speculative.ngram import NgramProposer
from jaxserve.kv.page_tracker import NOT_OWNED, STALE_GENERATION, PageTracker

KIMI = "checkpoints/tiny-kimi-k2"
KW = dict(num_pages=96, page_size=4, max_num_seqs=4, max_model_len=128, dtype="float32")
SPEC = dict(speculative="ngram", num_speculative_tokens=3, speculative_policy="always")  # speculation runs: nothing passes vacuously


def repeating_prompts(vocab: int):
    rng = np.random.RandomState(7)
    out = []
    for n in (6, 9, 5):
        motif = [int(x) for x in rng.randint(2, vocab, size=n)]
        out.append(motif * 4 + motif[:3])
    return out


def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(k=3, n_max=3, n_min=1)
    assert p.propose([5, 6, 7, 8, 9, 5, 6, 7], 10) == [8, 9, 5]  # 3-gram [5, 6, 7] seen at 0
    assert p.propose([1, 2, 9, 1, 3, 9, 1, 2, 4, 9, 1], 10) == [2, 4, 9]  # 2-gram [9, 1]: latest at 5
    assert p.propose([1, 2, 3, 4], 10) == []
    assert p.propose([5, 6, 5, 6, 5], 1) == [6]  # limited by the request's remaining tokens
    assert p.propose([5, 6, 5], 0) == []


def _family(name, tmp_path_factory):
    if name == "kimi":
        return KIMI
    path = tmp_path_factory.mktemp(f"spec_{name}")
    extra = {"indexer_types": ["full", "shared"]} if name == "dsa" else {}
    {"llama": build_llama, "dsa": build_glm_moe_dsa}[name](path, num_hidden_layers=2, seed=2, **extra)
    return str(path)


@pytest.mark.parametrize("family,kv_format", [("kimi", "bf16"), ("kimi", "fp8_e4m3"), ("llama", "fp8_e4m3"),
                                              ("dsa", "bf16")])
def test_greedy_tokens_identical_with_speculation(family, kv_format, tmp_path_factory):
    """One engine (its prefill and decode programs shared): each run first with its speculative
    decoder set aside (exactly the engine with speculation off), then on, whose prompts then hit
    the prefix cache the first run filled."""
    llm = LLM(_family(family, tmp_path_factory), kv_format=kv_format, **KW, **SPEC)
    spec = llm.engine.spec
    prompts = repeating_prompts(llm.engine.cfg.vocab_size)
    sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0)
    stop = None
    for params in (sp, "stop"):
        llm.engine.spec = None
        want = llm.generate(prompts, params if params != "stop" else stop)
        llm.engine.spec = spec
        got = llm.generate(prompts, params if params != "stop" else stop)
        for a, b in zip(want, got):
            assert list(b) == list(a)
            if params == sp:
                np.testing.assert_allclose([x for x, _ in b.logprobs], [x for x, _ in a.logprobs], atol=2e-3)
        # A stop token that speculation emits inside an accepted run: the same cut, nothing after it.
        stop = stop or SamplingParams(max_tokens=20, stop_token_ids=(want[0][12],), ignore_eos=True)
    assert 0 < spec.accepted <= spec.drafted
    if family == "kimi":
        assert spec.accepted < spec.drafted  # rejections too (the llama model copies every draft)
    usage = [c.usage for c in got]  # the stop run's: its drafts per request, in usage
    assert all(0 <= u.accepted_draft_tokens <= u.draft_tokens for u in usage) and sum(u.draft_tokens for u in usage)
    snap = llm.engine.snapshot()
    assert (snap.spec_draft_tokens, snap.spec_accepted_tokens) == (spec.drafted, spec.accepted)
    assert sum(c.usage.cached_tokens for c in got) > 0
    assert llm.engine.snapshot().integrity_mismatches == {}
    assert llm.engine.bm.num_used_pages == 0  # every page, rolled-back ones included, came back


def test_rollback_releases_pages_and_a_stale_one_fails_closed():
    """Block manager + tracker: a page released by ``truncate`` and taken by another owner
    fails the check for a table that still maps it (stale), and for one never reused (not owned)."""
    bm, tracker = BlockManager(num_pages=4, page_size=4, enable_prefix_caching=False), PageTracker()
    gen = tracker.init(4)
    bm.allocate_prompt("a", list(range(10)))  # 3 pages
    table, expected = bm.page_table("a"), bm.expected_generations("a")
    released = bm.truncate("a", 5)  # keep 2 pages
    assert released == table[2:] and bm.page_table("a") == table[:2] and bm.num_free_pages == 1
    gen = tracker.apply_updates(gen, *map(np.asarray, bm.take_generation_updates()))
    check = lambda: tracker.check(gen, np.array([table]), np.array([expected]), np.array([3]))  # noqa: E731
    ok, cause = check()
    assert not bool(ok[0]) and int(cause[0]) == NOT_OWNED
    bm.allocate_prompt("b", [1, 2])  # the only free page: the released one
    assert bm.page_table("b") == released
    gen = tracker.apply_updates(gen, *map(np.asarray, bm.take_generation_updates()))
    ok, cause = check()
    assert not bool(ok[0]) and int(cause[0]) == STALE_GENERATION
    ok, _ = tracker.check(gen, np.array([table[:2]]), np.array([expected[:2]]), np.array([2]))
    assert bool(ok[0])  # the rolled-back table itself is fine


def test_engine_rollback_then_stale_mapping_aborts_only_that_request():
    """Fault injection: after a verify call rolled a page back, the request's own table is put
    back as a buggy rollback would leave it (the released page still mapped); the device check
    aborts that request once it reaches the page, and the other request is untouched."""
    llm = LLM(KIMI, kv_format="bf16", **{**KW, "num_pages": 64}, **SPEC)
    eng = llm.engine
    prompts = repeating_prompts(eng.cfg.vocab_size)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = llm.generate(prompts[1:2], sp)[0]
    a = eng.add_request(prompts[0], sp)
    b = eng.add_request(prompts[1], sp)
    seq, released, injected, outs = eng.get_request(a), None, False, {}
    for _ in range(200):
        for o in eng.step():
            outs[o.request_id] = o
        if released is None and not seq.finished and seq.spec is not None and seq.spec.last_rollback:
            at, released = len(seq.pages), seq.spec.last_rollback[0]  # (page, generation A mapped it at)
        if released is not None and not injected and not seq.finished and len(seq.pages) > at:
            # The request's table maps the released page where the block manager gave a new one.
            seq.pages[at], seq.expected[at], injected = released[0], released[1], True
        if not eng.has_unfinished():
            break
    assert injected, "no verify call rolled a page back (or the request never grew past it)"
    assert outs[a].finish_reason == "abort"
    assert outs[a].error.cause in ("stale_generation", "page_not_owned")
    assert list(outs[b].completion) == list(alone)


TEMP, TOP_K, TOP_P = 0.1, 12, 0.9  # the tiny random model is nearly flat: sharpen it


def _target(logits):
    """numpy reference: the sampler's processed distribution (temperature, top-k, top-p)."""
    x = logits.astype(np.float64) / TEMP
    order = np.argsort(-x)[:TOP_K]
    p = np.exp(x[order] - x[order].max())
    p /= p.sum()
    keep = order[(np.cumsum(p) - p) < TOP_P]
    out = np.zeros_like(x)
    out[keep] = np.exp(x[keep] - x[keep].max())
    return out / out.sum()


def _chi2_pvalue(samples, p):
    from scipy.stats import chisquare

    support = np.flatnonzero(p > 0)
    assert np.isin(samples, support).all(), "a token outside the kept set was emitted"
    counts = np.array([(samples == t).sum() for t in support])
    return chisquare(counts, p[support] * len(samples)).pvalue


def test_sampled_acceptance_follows_the_target_distribution():
    """Many rows, one tiny model's logits at the positions of a verify call: the first emitted
    token follows p0, and after an accepted first draft the second follows p1 (conditioned on
    it); the naive rules (on a rejection resample from the whole target, or: accept the draft if
    a draw equals it, else draw again) fail the same chi-square test and the TV bound."""
    from jaxserve.engine.speculative.verify import verify_rows

    llm = LLM(KIMI, kv_format="bf16", **KW)
    prompt = repeating_prompts(llm.engine.cfg.vocab_size)[0][:12]
    p_first = _target(llm.logprobs(prompt)[-1])
    d0 = int(np.argmax(p_first))  # the likeliest token: accepted and rejected often
    lp = llm.logprobs(prompt + [d0, 7])
    steps = lp[len(prompt) - 1 :]  # [3, V]: after the prompt, after d0, after d0 7
    p0, p1 = _target(steps[0]), _target(steps[1])
    d1 = int(np.argsort(-p1)[0])
    n = 4000
    logits = np.broadcast_to(steps[None], (n, 3, steps.shape[-1])).astype(np.float32)
    drafts = np.tile(np.array([[d0, d1]], np.int32), (n, 1))
    rows, seeds = np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32) + 1000
    f = lambda a: np.full(n, a, np.float32)  # noqa: E731
    out = verify_rows(logits, rows, drafts, np.full(n, 2, np.int32), f(TEMP), np.full(n, TOP_K, np.int32), f(TOP_P),
                      f(0.0), seeds, np.zeros(n, np.int32), all_greedy=False, penalties=False, num_logprobs=0)
    accepted, tokens = np.asarray(out[0]), np.asarray(out[1])
    assert 0.12 < (accepted >= 1).mean() < 0.88  # both branches well sampled
    assert _chi2_pvalue(tokens[:, 0], p0) > 1e-3
    second = tokens[accepted >= 1, 1]
    assert _chi2_pvalue(second, p1) > 1e-3
    again = verify_rows(logits, rows, drafts, np.full(n, 2, np.int32), f(TEMP), np.full(n, TOP_K, np.int32),
                        f(TOP_P), f(0.0), seeds, np.zeros(n, np.int32), all_greedy=False, penalties=False,
                        num_logprobs=0)
    np.testing.assert_array_equal(np.asarray(again[1]), tokens)  # per-row seeds: deterministic

    rng = np.random.default_rng(0)
    draw = lambda: rng.choice(len(p0), size=n, p=p0)  # noqa: E731
    accept = rng.random(n) < p0[d0]
    resample_whole = np.where(accept, d0, draw())  # rejection resamples from p0 itself: d0 over-weighted
    assert _chi2_pvalue(resample_whole, p0) < 1e-6
    assert _chi2_pvalue(np.where(draw() == d0, d0, draw()), p0) < 1e-6  # "accept if equal", redraw otherwise
    tv = 0.5 * np.abs(np.bincount(tokens[:, 0], minlength=len(p0)) / n - p0).sum()
    tv_naive = 0.5 * np.abs(np.bincount(resample_whole, minlength=len(p0)) / n - p0).sum()
    assert tv < 0.03 < tv_naive


def test_openai_usage_reports_accepted_and_rejected_drafts():
    from jaxserve.server.openai_api import usage

    assert "completion_tokens_details" not in usage(5, 8, 0)
    assert usage(5, 8, 0, 6, 4)["completion_tokens_details"] == {"accepted_prediction_tokens": 4,
                                                                 "rejected_prediction_tokens": 2}


def test_chunked_prefill_and_a_shared_prompt_with_speculation(tmp_path_factory):
    """n-gram speculation over 16-token prefill chunks of long repeating prompts, one of them
    twice (n = 2 greedy: the copy decodes over the first's cached pages): the same tokens as
    without speculation, every page back at the end."""
    llm = LLM(_family("llama", tmp_path_factory), kv_format="bf16", **KW, **SPEC, prefill_chunk=16,
              max_num_batched_tokens=16)
    spec = llm.engine.spec
    prompts = repeating_prompts(llm.engine.cfg.vocab_size)[:2]
    prompts += prompts[:1]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    llm.engine.spec = None
    want = llm.generate(prompts, sp)
    llm.engine.spec = spec
    got = llm.generate(prompts, sp)
    assert [list(c) for c in got] == [list(c) for c in want]
    assert max(len(p) for p in prompts) > 32 and 0 < spec.accepted <= spec.drafted
    assert llm.engine.bm.num_used_pages == 0 and llm.engine.snapshot().integrity_mismatches == {}


def _ngram_by_definition(tokens, k, n_max, n_min, limit):
    """The proposer's rule written out: the longest suffix n-gram (n_max down to n_min) seen
    earlier, its latest earlier occurrence, the tokens after it."""
    limit = min(k, limit)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        if limit <= 0:
            break
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s : s + n] == tokens[-n:]:
                return tokens[s + n : s + n + limit]
    return []


def test_ngram_matches_its_definition_on_random_histories():
    rng = np.random.default_rng(5)
    for trial in range(400):
        n_min = int(rng.integers(1, 3))
        n_max = int(rng.integers(n_min, 5))
        p = NgramProposer(k=int(rng.integers(1, 9)), n_max=n_max, n_min=n_min)
        tokens = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(0, 40))).tolist()
        limit = int(rng.integers(0, 10))
        assert p.propose(tokens, limit) == _ngram_by_definition(tokens, p.k, n_max, n_min, limit), (tokens, trial)
