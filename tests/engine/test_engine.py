"""The engine: continuous batching, chunked prefill, preemption, prefix caching, sampling,
stopping, streaming, abort, and no compilation after warm-up."""
import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.bench.measure import CompileWatch
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.executor.buckets import pick_bucket, token_buckets
from jaxserve.executor.guard import RecompilationError
from jaxserve.step_batch import StepBatch

RNG = np.random.RandomState(11)
PROMPTS = [[int(x) for x in RNG.randint(2, 256, size=n)] for n in (5, 23, 12, 40, 9, 31)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SMALL = dict(num_pages=64, page_size=8, max_num_seqs=8, max_prefill_seqs=2, prefill_chunk=32,
             max_num_batched_tokens=64, max_model_len=128)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, kv_format="float32", **SMALL)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt run by itself: the reference for every batching test."""
    return [list(llm.generate([p], GREEDY)[0]) for p in PROMPTS]


def free_pages_back(llm):
    return llm.engine.bm.num_used_pages == 0 and not llm.engine.has_unfinished()


def test_continuous_batching_with_arrivals_mid_run(llm, alone):
    eng = llm.engine
    rids = {eng.add_request(PROMPTS[i], GREEDY): i for i in (0, 1, 2)}
    got, steps = {}, 0
    while eng.has_unfinished():
        steps += 1
        if steps == 3:  # arrivals while others decode
            rids.update({eng.add_request(PROMPTS[i], GREEDY): i for i in (3, 4, 5)})
        for out in eng.step():
            if out.finished:
                got[rids[out.request_id]] = list(out.completion)
    assert [got[i] for i in range(len(PROMPTS))] == alone
    assert free_pages_back(llm)


def test_chunked_prefill_equals_one_chunk(tiny_ckpt, alone):
    chunky = LLM(tiny_ckpt, kv_format="float32", **dict(SMALL, prefill_chunk=16, max_num_batched_tokens=16))
    assert [list(c) for c in chunky.generate(PROMPTS, GREEDY)] == alone


def test_preemption_resumes_with_the_same_tokens(tiny_ckpt, alone):
    # 14 usable pages of 8 tokens: six requests of up to 52 tokens cannot all stay resident.
    tight = LLM(tiny_ckpt, kv_format="float32", **dict(SMALL, num_pages=15, max_model_len=64))
    outs = tight.generate(PROMPTS, GREEDY)
    assert tight.engine.snapshot().preemptions > 0, "the pool was meant to force preemption"
    assert [list(c) for c in outs] == alone
    assert all(c.finish_reason == "length" for c in outs)
    assert free_pages_back(tight)


def test_prefix_cache_hit_gives_the_same_tokens_and_reports_cached(llm, alone):
    first = llm.generate([PROMPTS[3]], GREEDY)[0]
    again = llm.generate([PROMPTS[3]], GREEDY)[0]
    assert list(first) == list(again) == alone[3]
    assert again.usage.cached_tokens == (len(PROMPTS[3]) - 1) // 8 * 8 > 0
    hit = llm.generate([PROMPTS[3] + [7, 8, 9]], GREEDY)[0]
    assert hit.usage.cached_tokens >= 32 and hit.usage.prompt_tokens == len(PROMPTS[3]) + 3


def test_prefix_cache_hit_equals_cold_run(tiny_ckpt, llm):
    longer = PROMPTS[3] + [7, 8, 9]
    llm.generate([PROMPTS[3]], GREEDY)
    hit = llm.generate([longer], GREEDY)[0]
    cold = LLM(tiny_ckpt, kv_format="float32", enable_prefix_caching=False, **SMALL).generate([longer], GREEDY)[0]
    assert hit.usage.cached_tokens > 0 and cold.usage.cached_tokens == 0
    assert list(hit) == list(cold)


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True)
    alone = list(llm.generate([PROMPTS[2]], sp)[0])
    other = SamplingParams(max_tokens=7, temperature=1.3, seed=99, ignore_eos=True)
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], [other, sp, GREEDY])
    assert list(mixed[1]) == alone
    unseeded = llm.generate([PROMPTS[2]] * 2, SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
    assert list(unseeded[0]) != list(unseeded[1])  # different engine-drawn seeds


def test_stop_conditions(llm, alone):
    ref = alone[1]
    stop_tok = ref[5]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, stop_token_ids=(stop_tok,), ignore_eos=True))[0]
    assert list(out) == ref[: ref.index(stop_tok) + 1] and out.finish_reason == "stop"
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert list(out) == ref[:4] and out.finish_reason == "length"


def test_logprobs_and_penalties(llm, alone):
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3))[0]
    assert list(out) == alone[1][:5] and len(out.logprobs) == 5
    full = llm.logprobs(PROMPTS[1] + list(out))
    for i, (lp, top) in enumerate(out.logprobs):
        want = full[len(PROMPTS[1]) - 1 + i]
        assert abs(lp - want[out[i]]) < 1e-4
        assert list(top) == list(np.argsort(-want)[:3])  # top-3 ids, best first
    pen = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                                                    frequency_penalty=1.0))[0]
    assert list(pen) != alone[1]
    assert len(set(pen)) >= len(set(alone[1]))


def test_streaming_deltas_add_up(llm, alone):
    outs = list(llm.generate_stream([PROMPTS[0], PROMPTS[5]], GREEDY))
    by = {}
    for o in outs:
        by.setdefault(o.request_id, []).append(o)
    assert len(by) == 2
    for deltas, ref in zip(by.values(), (alone[0], alone[5])):
        ids = [t for d in deltas for t in d.new_token_ids]
        assert ids == ref and deltas[-1].finished and list(deltas[-1].completion) == ref
        assert sum(d.finished for d in deltas) == 1


def test_streamed_logprobs_are_one_per_new_token_and_add_up(llm):
    """RequestOutput.new_logprobs: one (logprob, top) per token of the delta, together the
    completion's; None when the request asked for none."""
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    by = {}
    for d in llm.generate_stream([PROMPTS[2], PROMPTS[3]], [sp, GREEDY]):
        by.setdefault(d.request_id, []).append(d)
    with_lp, without = sorted(by.values(), key=lambda ds: ds[-1].completion.logprobs is None)
    assert len(with_lp[-1].completion.logprobs) == 6
    assert all(len(d.new_logprobs or []) == len(d.new_token_ids) for d in with_lp)
    assert [x for d in with_lp for x in d.new_logprobs or []] == with_lp[-1].completion.logprobs
    assert all(d.new_logprobs is None for d in without)


def test_abort_frees_pages_at_once(llm):
    eng = llm.engine
    rid = eng.add_request(PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.bm.num_used_pages > 0
    assert eng.abort(rid)
    assert eng.bm.num_used_pages == 0 and eng.has_unfinished()  # its final output is pending
    assert not eng.abort(rid)
    [out] = eng.step()
    assert out.finished and out.finish_reason == "abort" and out.completion.usage.prompt_tokens == len(PROMPTS[3])
    assert not eng.has_unfinished() and eng.get_request(rid).finish_reason == "abort"


def test_bad_requests_are_refused_and_lose_nothing(llm):
    eng = llm.engine
    with pytest.raises(ValueError, match="exceeds the maximum context"):
        llm.generate([PROMPTS[0], [1] * 120], GREEDY)
    assert not eng.has_unfinished() and eng.bm.num_used_pages == 0  # the good prompt was not left queued
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


# Finite / positive as float64 but not as the float32 the sampler uses (or out of the range
# where logits divided or multiplied by them stay finite): refused, naming field and limit.
FLOAT32_CASES = [
    (dict(temperature=1e300), r"temperature must be 0 \(greedy\) or in \[1e-06, 3.403e\+38\]"),
    (dict(temperature=1e-7), r"temperature .*\[1e-06,"),
    (dict(repetition_penalty=1e-300), r"repetition_penalty must be in \[1e-06, 1e\+06\]"),
    (dict(repetition_penalty=1e7), r"repetition_penalty must be in \[1e-06, 1e\+06\]"),
    (dict(top_p=1e-50), r"top_p must be in \(0, 1\] in float32 .*1e-50, which is 0.0 as a float32"),
]


@pytest.mark.parametrize("kw, message", FLOAT32_CASES)
def test_float_parameters_are_checked_as_the_float32_they_become(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_float_parameters_at_their_limits_are_accepted():
    for kw in (dict(temperature=1e-6), dict(temperature=3.4e38), dict(repetition_penalty=1e-6),
               dict(repetition_penalty=1e6), dict(top_p=1e-30), dict(min_p=1.0), dict(frequency_penalty=-2.0)):
        SamplingParams(**kw)


def test_prefill_token_buckets():
    assert token_buckets(16, 128) == [16, 32, 48, 64, 96, 128]
    assert token_buckets(16, 100) == [16, 32, 48, 64, 96, 128]  # covers a chunk that is not a power of two
    assert token_buckets(16, 16) == [16]
    assert [pick_bucket(n, token_buckets(16, 128)) for n in (1, 16, 17, 33, 49, 65, 97, 128)] == \
        [16, 16, 32, 48, 64, 96, 128, 128]
    with pytest.raises(ValueError):
        pick_bucket(129, token_buckets(16, 128))


def test_no_compilation_after_warmup(tiny_ckpt):
    # prefill_chunk 64: token buckets 16/32/48/64, so the 40-token prompt runs in the 48 bucket.
    llm = LLM(tiny_ckpt, kv_format="fp8_e4m3", **dict(SMALL, prefill_chunk=64))
    assert llm.engine.prefill_token_buckets == [16, 32, 48, 64]
    llm.warmup()
    llm.runner.strict = True
    mixed = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 12, 7, 20, 1, 9)]
    llm.generate(PROMPTS, mixed)
    with CompileWatch() as cw:
        llm.generate([PROMPTS[3]] * 3, GREEDY)  # prefix hits: short prefill chunks
        llm.generate(PROMPTS * 2, mixed * 2)  # many pages released at once: large generation updates
    assert llm.runner.compiles_after_warmup == 0
    # No serving program, sampler or generation update compiled (jax may still compile a tiny
    # helper of its own, e.g. "stage", once per process).
    serving = {n: c for n, c in cw.names.items() if any(k in n for k in ("step", "apply_updates", "sample_rows"))}
    assert not serving, serving
    with pytest.raises(RecompilationError):
        llm.runner.step(StepBatch.zeros("decode", 3, 1, llm.runner.max_pages_per_seq))


def test_no_compilation_after_warmup_with_an_odd_page_table_width(tiny_ckpt):
    """max_model_len / page_size = 12 pages: tables must be filled at the compiled width (16)."""
    llm = LLM(tiny_ckpt, kv_format="bf16", **dict(SMALL, max_model_len=96))
    llm.warmup()
    llm.runner.strict = True
    llm.generate(PROMPTS[:3], GREEDY)
    assert llm.runner.compiles_after_warmup == 0
