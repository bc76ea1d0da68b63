"""The mock engine's arithmetic, checked by hand: what the server tests on it rely on."""
import math

import pytest

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.testing import MockEngine, MockLLM, char_ids, greedy_ids


def run(engine, prompt, **kw):
    rid = engine.add_request(prompt, SamplingParams(**kw))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_greedy_tokens_step_by_one_and_text_is_one_character_per_id():
    llm = MockLLM(num_pages=16, page_size=4)
    outs = run(llm.engine, char_ids("abc"), max_tokens=3)
    done = outs[-1].completion
    assert list(done) == char_ids("def") == greedy_ids(char_ids("c")[0], 3) and done.text == "def"
    assert done.finish_reason == "length" and outs[0].started and outs[0].prompt_tokens == 3
    assert "".join(o.new_text for o in outs) == "def"
    assert llm.engine.snapshot().kv_pages_used == 0  # every page back


def test_sampled_tokens_step_by_one_plus_the_seed_mod_7_with_logprobs():
    engine = MockEngine(num_pages=16, page_size=4)
    done = run(engine, [100], max_tokens=3, temperature=0.7, seed=12, logprobs=2)[-1].completion
    assert list(done) == [106, 112, 118]  # 1 + 12 % 7 = 6
    assert done.logprobs[0] == (pytest.approx(-math.log(2)), {106: -math.log(2), 107: -2 * math.log(2)})


def test_stops_eos_and_the_prefix_cache_are_the_engines():
    engine = MockEngine(num_pages=16, page_size=4)
    assert run(engine, [40], max_tokens=9, stop_token_ids=[43])[-1].completion == [41, 42, 43]
    assert run(engine, [0], max_tokens=5)[-1].completion.finish_reason == "stop"  # 0 + 1 = EOS
    assert list(run(engine, [0], max_tokens=3, ignore_eos=True)[-1].completion) == [1, 2, 3]
    prompt = list(range(200, 209))
    run(engine, prompt, max_tokens=1)
    assert run(engine, prompt, max_tokens=1)[0].cached_tokens == 8  # two full pages of 4
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([49152], SamplingParams())


def test_abort_and_an_injected_step_failure():
    engine = MockEngine(num_pages=16, page_size=4)
    rid = engine.add_request([5], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.abort(rid) and engine.step()[-1].finish_reason == "abort"
    engine.fail_next_step(RuntimeError("boom"))
    engine.add_request([5], SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    assert engine.step()[-1].completion == [6]  # once only
