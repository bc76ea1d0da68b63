"""The KV handoff between two engines in one process (the device_put transport), on the tiny
MLA + MoE model: a prefill-role engine exports a request's pages, a decode-role engine imports
them under its own page ids with fresh generations and continues; tokens equal a single
engine's. Roles hold one phase's weights; the handoff fingerprint tells weights apart."""
from __future__ import annotations

import pytest

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.disagg.handoff_request import KvHandoffError, KvImport
from jaxserve.kv.handoff import digest_hex
from jaxserve.step_batch import StepBatch

ENGINE = dict(num_pages=40, page_size=4, max_num_seqs=4, max_prefill_seqs=2, prefill_chunk=16,
              max_num_batched_tokens=32, max_model_len=64)
PROMPT = [3, 17, 42, 9, 88, 5, 61, 23, 14, 7, 30]  # 3 pages of 4 (the last partial)
PARAMS = [SamplingParams(max_tokens=8, ignore_eos=True),
          SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=11)]


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    from jaxserve import LLM

    p = LLM(tiny_ckpt, kv_format="bf16", role="prefill", **ENGINE)
    d = LLM(tiny_ckpt, kv_format="bf16", role="decode", **ENGINE)
    ref = LLM(tiny_ckpt, kv_format="bf16", **ENGINE)
    return p.engine, d.engine, ref


def export(engine, rid, params, fmt="bf16"):
    engine.add_request(PROMPT, params, rid, export_kv=fmt)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                last = out
    return last


def decode(engine, rid, params, imp):
    engine.add_request(PROMPT, params, rid, kv_import=imp)
    toks = []
    while engine.has_unfinished():
        for out in engine.step():
            toks += out.new_token_ids
            if out.finished:
                assert out.error is None or isinstance(out.error, KvHandoffError)
                last = out
    return toks, last


def test_roles_hold_one_phase(engines):
    p, d, ref = engines
    wp, wd, wr = (e.memory_report()["weight_bytes"] for e in (p, d, ref.engine))
    assert wp["decode"] == 0 and wp["resident"] == wp["prefill"] > 0
    assert wd["prefill"] == wd["decode"] == wd["resident"]  # the decode worker's prefill reads its decode copy
    assert wp["prefill"] == wr["prefill"] and p.handoff_fingerprint() == d.handoff_fingerprint() != ""
    with pytest.raises(ValueError, match="prefill worker"):
        p.add_request(PROMPT, PARAMS[0], "plain")  # a prefill worker does not decode
    with pytest.raises(RuntimeError, match="no decode program"):
        p.runner.step(StepBatch.zeros("decode", 1, 1, p.runner.max_pages_per_seq))


@pytest.mark.parametrize("which", [0, 1])
def test_handoff_tokens_equal_one_engine_and_pages_are_the_receivers(engines, which):
    p, d, ref = engines
    params = PARAMS[which]
    want = list(ref.generate([PROMPT], params)[0])
    out = export(p, f"p{which}", params)
    payload = out.kv_export
    assert out.completion.token_ids == want[:1] and payload.token_ids == PROMPT and payload.num_pages == 3
    assert p.snapshot().kv_pages_used == 0  # the offer is a snapshot: the sender's pages are back
    seen = {}

    def watch(rec):  # after the import step: the request's pages as the receiver mapped them
        seq = d.get_request(f"d{which}")
        if seq is not None and seq.pages and "pages" not in seen:
            seen.update(pages=list(seq.pages), expected=list(seq.expected), gen=d.bm.generation.copy(),
                        cached=[d.bm.is_cached(pg) for pg in seq.pages[:2]])

    remove = d.add_step_observer(watch)
    toks, last = decode(d, f"d{which}", params, KvImport(payload, digest_hex(payload.digest), want[0]))
    remove()
    assert toks == want and last.finish_reason == "length"
    # Own page ids, generations fresh from the receiver's block manager (odd: owned), the two
    # full prompt pages registered in its prefix cache (by the first of the two requests: the
    # second one's copies of the same pages are duplicates, first writer wins).
    assert all(pg != 0 for pg in seen["pages"]) and all(g % 2 == 1 for g in seen["expected"])
    assert [int(seen["gen"][pg]) for pg in seen["pages"]] == seen["expected"]
    assert seen["cached"] == [which == 0] * 2
    assert d.snapshot().kv_pages_used == 0 and d.snapshot().integrity_mismatches == {}


def test_bad_digest_fails_closed_or_recomputes(engines):
    p, d, ref = engines
    params = PARAMS[0]
    want = list(ref.generate([PROMPT], params)[0])
    payload = export(p, "bad", params).kv_export
    good = digest_hex(payload.digest)
    wrong = good[:-1] + ("0" if good[-1] != "0" else "1")
    toks, last = decode(d, "bad-1", params, KvImport(payload, wrong, want[0]))
    assert toks == [] and last.finish_reason == "abort" and last.error.cause == "digest_mismatch"
    toks, last = decode(d, "bad-2", params, KvImport(payload, wrong, want[0], recompute_on_failure=True))
    assert toks == want  # prefilled here instead
    assert d.snapshot().kv_pages_used == 0


def test_fingerprint_covers_weights_and_declared_formats(tiny_ckpt, tmp_path, engines):
    from tests.hf_models import build_deepseek_v3

    from jaxserve import LLM

    p, _, _ = engines
    other = tmp_path / "other"
    build_deepseek_v3(other, num_hidden_layers=2, seed=6)
    assert LLM(str(other), kv_format="bf16", role="decode", **ENGINE).engine.handoff_fingerprint() != \
        p.handoff_fingerprint()
    assert LLM(tiny_ckpt, kv_format="bf16", role="decode", decode_weights="int8",
               **ENGINE).engine.handoff_fingerprint() != p.handoff_fingerprint()


def test_a_speculating_decode_worker_continues_a_handoff_as_one_engine(tiny_ckpt, engines):
    """n-gram speculation on the decode side of a handoff: the imported pages are drafted over,
    verified and rolled back like local ones, and greedy tokens equal one plain engine's."""
    from jaxserve import LLM

    p, _, ref = engines
    prompt = [3, 17, 42, 9, 88, 3, 17, 42, 9, 88, 3, 17]  # repeats: the proposer finds matches at once
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = list(ref.generate([prompt], params)[0])
    spec = LLM(tiny_ckpt, kv_format="bf16", role="decode", speculative="ngram", num_speculative_tokens=3, speculative_policy="always",
               **ENGINE).engine
    p.add_request(prompt, params, "p-spec", export_kv="bf16")
    out = None
    while p.has_unfinished():
        out = next((o for o in p.step() if o.finished), out)
    payload = out.kv_export
    spec.add_request(prompt, params, "d-spec", kv_import=KvImport(payload, digest_hex(payload.digest), want[0]))
    toks = []
    while spec.has_unfinished():
        for o in spec.step():
            toks += o.new_token_ids
            assert o.error is None
    assert toks == want  # the offer's first token is emitted by the decode side too
    assert 0 < spec.spec.accepted < spec.spec.drafted  # drafts accepted and rolled back over imported pages
    assert spec.snapshot().integrity_mismatches == {} and spec.bm.num_used_pages == 0
