"""Speculative decoding with structured outputs: a draft token the grammar forbids is cut before
the verify call, every verify position is masked as the sampler masks one, and greedy output
under a JSON-schema constraint is token-for-token the same with speculation on and off.

A tiny random Llama with the default model's tokenizer (the grammar needs real token text)."""
import json
import shutil
import types

import pytest

from tests.hf_models import build_llama
from jaxserve import LLM
from jaxserve.checkpoint.gguf import default_model_dir
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.structured.spec import StructuredOutput

SCHEMA = json.dumps({"type": "object", "properties": {"answer": {"type": "integer", "maximum": 99},
                                                      "name": {"type": "string", "maxLength": 6}},
                     "required": ["answer", "name"], "additionalProperties": False,
                     "x-guidance": {"whitespace_flexible": False}})  # no runs of spaces: the output completes


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_json")
    src = default_model_dir(progress=False)
    build_llama(path, vocab_size=49152, seed=3, bos_token_id=1, eos_token_id=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, path / f)
    return LLM(str(path), speculative="ngram", num_speculative_tokens=3, speculative_policy="always", num_pages=64, page_size=8, max_num_seqs=2,
               max_model_len=160, dtype="float32")


def test_a_forbidden_draft_is_cut_and_the_matcher_left_as_it_was(llm):
    eng, tok = llm.engine, llm.tokenizer
    seq = types.SimpleNamespace(grammar=eng.constraints.start(StructuredOutput("json_schema", SCHEMA)))
    good, bad = tok.encode('{"', add_special_tokens=False), tok.encode("zzz", add_special_tokens=False)
    kept, masks = eng.constraints.draft_masks(seq, good + bad)
    assert kept == good and masks.shape == (len(good) + 1, (49152 + 31) // 32)
    bit = lambda row, t: (int(row[t >> 5]) >> (t & 31)) & 1  # noqa: E731
    assert all(bit(masks[j], t) for j, t in enumerate(good)) and not bit(masks[-1], bad[0])
    assert eng.constraints.stats.draft_tokens_cut == len(bad)
    whole = tok.encode('{"answer":7,"name":"bob"}', add_special_tokens=False)
    assert all(seq.grammar.matcher.consume_token(t) for t in whole) and seq.grammar.matcher.is_accepting()


def test_greedy_json_identical_with_speculation(llm):
    """The prompt repeats JSON objects (some with keys the schema forbids), so the n-gram drafts
    offer both allowed and forbidden continuations."""
    tok, spec = llm.tokenizer, llm.engine.spec
    text = '{"zzz":5,"answer":7,"name":"bob"} {"answer":12,"name":"al"} {"zzz":1} '
    prompts = [tok.encode(text * 2, add_special_tokens=False), tok.encode(text, add_special_tokens=False)]
    sp = SamplingParams(max_tokens=40, structured=StructuredOutput("json_schema", SCHEMA))
    llm.engine.spec = None
    want = llm.generate(prompts, sp)
    llm.engine.spec = spec
    cut0 = llm.engine.constraints.stats.draft_tokens_cut
    got = llm.generate(prompts, sp)
    assert [list(c) for c in got] == [list(c) for c in want]
    assert spec.drafted > 0 and sum(c.usage.draft_tokens for c in got) > 0
    cut = llm.engine.constraints.stats.draft_tokens_cut - cut0
    print("drafts cut by the grammar:", cut, "accepted / drafted:", spec.accepted, spec.drafted)
    assert cut > 0 and 0 < spec.accepted < spec.drafted
    for c in got:
        assert c.finish_reason == "stop"  # the grammar completed: a JSON object of the schema
        assert set(json.loads(tok.decode(list(c)))) == {"answer", "name"}
