"""One request's failure inside a step fails that request alone: a batch of 16 with one
request whose detokenizer raises, or whose sampling inputs cannot be packed, finishes the
other 15 with exactly the tokens they get without it, and no page stays held."""
import dataclasses

import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.engine.outputs import RequestFailed
from jaxserve.engine.sampling_params import SamplingParams

RNG = np.random.RandomState(27)
PROMPTS = [[int(x) for x in RNG.randint(2, 256, size=n)] for n in RNG.randint(4, 24, size=16)]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
FAULTY = 7  # the request a fault is injected into


@pytest.fixture(scope="module")
def llm16(tiny_ckpt):
    return LLM(tiny_ckpt, kv_format="float32", num_pages=96, page_size=8, max_num_seqs=16, max_prefill_seqs=4,
               prefill_chunk=32, max_num_batched_tokens=128, max_model_len=64)


class BrokenDetokenizer:
    """Raises on its third token, as a detokenizer bug would."""

    def __init__(self):
        self.n = 0

    def push(self, token_id):
        self.n += 1
        if self.n == 3:
            raise RuntimeError("injected detokenizer failure")
        return ""

    def flush(self):
        return ""


def break_detokenizer(seq):
    seq.detok = BrokenDetokenizer()


def break_sampling(seq):
    """A top_k no int32 holds (the edge refuses it; this reaches the sampler past it)."""
    params = dataclasses.replace(GREEDY)
    object.__setattr__(params, "top_k", 2**31)
    seq.params = params


def run(eng, fault=None):
    rids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    if fault is not None:
        fault(eng.get_request(rids[FAULTY]))
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[r] for r in rids]


@pytest.mark.parametrize("fault,stage", [(break_detokenizer, "detokenize / stop check"), (break_sampling, "sample")])
def test_one_failing_request_of_sixteen_fails_alone(llm16, fault, stage, caplog):
    eng = llm16.engine
    clean = run(eng)
    assert all(o.finish_reason == "length" and len(o.completion.token_ids) == 8 for o in clean)
    with caplog.at_level("ERROR", logger="jaxserve.engine"):
        outs = run(eng, fault)
    bad = outs[FAULTY]
    assert bad.finish_reason == "abort" and isinstance(bad.error, RequestFailed) and bad.error.stage == stage
    others = [i for i in range(16) if i != FAULTY]
    assert [list(outs[i].completion.token_ids) for i in others] == [list(clean[i].completion.token_ids)
                                                                   for i in others]
    assert all(outs[i].finish_reason == "length" and outs[i].error is None for i in others)
    assert eng.bm.num_used_pages == 0 and not eng.has_unfinished()
    assert [r.getMessage() for r in caplog.records if r.name == "jaxserve.engine"] == [
        f"request {bad.request_id} failed in {stage}; aborting it alone"]
