"""Speculative decoding with the checkpoint's MTP block (``--speculative mtp``).

- greedy tokens identical with speculation on and off, bf16 and fp8 KV: on the shipped tiny
  Kimi checkpoint (random MTP weights: drafts rejected) and on a "successor" checkpoint built
  from it, whose main model maps each token t to pi(t) and whose MTP block to pi'(t) (pi' = pi on
  even tokens): drafts accepted where pi' agrees, so accepted runs, bonus tokens and rejections
  all occur, and the acceptance is what the construction predicts (the draft reads the right
  next token at the right position);
- the figures: per request (usage) and engine totals, the mean accepted length;
- the refusal for a checkpoint without MTP layers, naming the config key.
"""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_models import add_mtp_layer, build_glm_moe_dsa
from jaxserve import LLM
from jaxserve.config import ConfigError
from jaxserve.engine.sampling_params import SamplingParams

KIMI = "checkpoints/tiny-kimi-k2"
KW = dict(num_pages=64, page_size=4, max_num_seqs=4, max_model_len=96, dtype="float32")
ALWAYS = dict(speculative_policy="always")  # speculation runs: nothing passes vacuously


@pytest.fixture(scope="module")
def successor(tmp_path_factory):
    """tiny-kimi-k2 with every block's output projections zeroed (the residual stream is the
    token's embedding), the LM head rows set so the main model predicts pi(t) after token t,
    and the MTP block (eh_proj = [I, 0]: the next token's normed embedding) predicting pi'(t)."""
    out = tmp_path_factory.mktemp("mtp_successor")
    for f in ("config.json", "generation_config.json"):
        shutil.copy(f"{KIMI}/{f}", out / f)
    w = load_file(f"{KIMI}/model.safetensors")
    n, d = json.load(open(f"{KIMI}/config.json"))["num_hidden_layers"], 64
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = torch.zeros_like(w[k])
        if k.endswith(("model.norm.weight", "enorm.weight", "shared_head.norm.weight")):
            w[k] = torch.ones_like(w[k])
    emb = w["model.embed_tokens.weight"].float()
    v = emb.shape[0]
    rng = np.random.RandomState(0)
    pi = rng.permutation(v)
    odd = np.arange(1, v, 2)
    sigma = np.arange(v)
    sigma[odd] = np.roll(odd, 1)  # fixes the even tokens, moves every odd one
    pi2 = pi[sigma]  # a permutation too, equal to pi exactly on the even tokens
    head = lambda p: emb[np.argsort(p)].to(torch.bfloat16)  # noqa: E731  row p(t) = e_t: argmax after t is p(t)
    w["lm_head.weight"], w[f"model.layers.{n}.shared_head.head.weight"] = head(pi), head(pi2)
    w[f"model.layers.{n}.eh_proj.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], 1).to(torch.bfloat16)
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return str(out), pi, pi2


def run_on_off(llm, prompts, sp):
    spec = llm.engine.spec
    llm.engine.spec = None  # exactly the engine with speculation off
    want = llm.generate(prompts, sp)
    llm.engine.spec = spec
    return want, llm.generate(prompts, sp)


@pytest.mark.parametrize("ckpt,kv_format,k", [("kimi", "bf16", 2), ("successor", "fp8_e4m3", 3),
                                              ("successor", "bf16", 1)])
def test_greedy_tokens_identical_with_mtp(ckpt, kv_format, k, request):
    """k = 1 also with chunked prefill (16-token chunks of a 40-token prompt) and that prompt
    twice (n = 2 greedy: the second shares the first's cached pages)."""
    path = KIMI if ckpt == "kimi" else request.getfixturevalue("successor")[0]
    chunked = dict(prefill_chunk=16, max_num_batched_tokens=16) if k == 1 else {}
    llm = LLM(path, kv_format=kv_format, speculative="mtp", num_speculative_tokens=k, **KW, **ALWAYS, **chunked)
    spec = llm.engine.spec
    rng = np.random.RandomState(5)
    prompts = [[int(x) for x in rng.randint(2, 512, size=m)] for m in ((7, 10, 3, 40) if k == 1 else (7, 10, 3))]
    prompts += prompts[-1:] if k == 1 else []
    sp = SamplingParams(max_tokens=18, ignore_eos=True, logprobs=0)
    want, got = run_on_off(llm, prompts, sp)
    for a, b in zip(want, got):
        assert list(b) == list(a)
        np.testing.assert_allclose([x for x, _ in b.logprobs], [x for x, _ in a.logprobs], atol=2e-3)
    assert spec.drafted > 0 and spec.verify_steps > 0
    usage = [c.usage for c in got]
    assert sum(u.draft_tokens for u in usage) == spec.drafted
    assert sum(u.accepted_draft_tokens for u in usage) == spec.accepted
    snap = llm.engine.snapshot()
    assert (snap.spec_draft_tokens, snap.spec_accepted_tokens) == (spec.drafted, spec.accepted)
    if ckpt == "successor":
        _, pi, pi2 = request.getfixturevalue("successor")
        for p, c in zip(prompts, want):  # the main model is the successor map, the drafts pi'
            seq = p + list(c)
            assert all(seq[i + 1] == pi[seq[i]] for i in range(len(p) - 1, len(seq) - 1))
        assert 0 < spec.accepted < spec.drafted  # pi' = pi on half the tokens: both happen
        if k == 1:  # a draft is accepted exactly when pi'(t) = pi(t) for the token t it follows
            assert 0.2 < spec.accepted / spec.drafted < 0.8
    else:
        assert spec.accepted <= spec.drafted
    assert llm.engine.snapshot().integrity_mismatches == {}
    assert llm.engine.bm.num_used_pages == 0


def test_greedy_tokens_identical_with_glm5_mtp(tmp_path_factory):
    """GLM-5 (DSA): its MTP layer is a full DSA layer with its own indexer; prompts longer than
    index_topk, so every layer, the block's included, attends sparsely."""
    path = tmp_path_factory.mktemp("glm5_mtp")
    build_glm_moe_dsa(path, num_hidden_layers=2, seed=2, indexer_types=["full", "full"])
    add_mtp_layer(path)
    llm = LLM(str(path), kv_format="bf16", speculative="mtp", num_speculative_tokens=2, **KW, **ALWAYS)
    assert llm.runner.cfg.mtp_layers == 1 and llm.engine.cfg.index_topk < 20
    rng = np.random.RandomState(6)
    prompts = [[int(x) for x in rng.randint(2, 256, size=m)] for m in (21, 12)]
    want, got = run_on_off(llm, prompts, SamplingParams(max_tokens=14, ignore_eos=True))
    assert [list(c) for c in got] == [list(c) for c in want]
    assert llm.engine.spec.verify_steps > 0 and llm.engine.spec.drafted > 0 and llm.engine.bm.num_used_pages == 0


def test_mtp_refused_without_mtp_layers(tiny_ckpt, tmp_path):
    """A checkpoint whose config says num_nextn_predict_layers but carries no MTP tensors (what
    transformers saves), and one whose config has none: a ConfigError naming the key."""
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers = 1, but it has no MTP layer tensors"):
        LLM(tiny_ckpt, speculative="mtp", **KW)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{tiny_ckpt}/{f}", tmp_path / f)
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["num_nextn_predict_layers"] = 0
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ConfigError, match=r"no MTP layers \(config.json num_nextn_predict_layers = 0\)"):
        LLM(str(tmp_path), speculative="mtp", **KW)


def test_mtp_block_in_the_decode_weight_format():
    """int8 decode weights: the block's matmul weights (eh_proj, its layer, the head) are stored
    in the decode format like every layer's, and greedy output is still the same on and off."""
    llm = LLM(KIMI, decode_weights="int8", speculative="mtp", num_speculative_tokens=2, **KW, **ALWAYS)
    rows = {r.name: r.format for r in llm.runner.weight_path_rows()["decode"]}
    mtp = {n: f for n, f in rows.items() if n.startswith("mtp/")}
    for name in ("mtp/eh_proj", "mtp/head", "mtp/layer/attn/q_b", "mtp/layer/mlp/w_up"):
        assert mtp[name] == rows["layers/1/attn/q_b"] != "bf16", (name, mtp)
    prompts = [[5, 9, 77, 300, 41], [8, 8, 200]]
    want, got = run_on_off(llm, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [list(c) for c in got] == [list(c) for c in want]
    assert llm.engine.spec.drafted > 0 and llm.engine.spec.verify_steps > 0


def test_auto_off_counts_the_draft_call_in_a_verify_step():
    """The cost a verify step is weighed against: its verify call and, with MTP, its draft call,
    in decode calls of the same bucket (the engine's step records)."""
    from jaxserve.engine.outputs import StepRecord
    from jaxserve.engine.speculative.decoder import SpeculativeDecoder
    from jaxserve.engine.speculative.mtp import MtpProposer

    dec = SpeculativeDecoder(MtpProposer(2), 512, 64, None, 0.3)
    assert dec.cost_ratio(4) == 1.0  # nothing measured yet
    for phase, seconds in (("decode", 0.010), ("verify", 0.015), ("draft", 0.005)):
        dec.observe(StepRecord(phase, 3, 3, 4, 1, 3, 9.0))  # a program's first call (compiling) is not counted
        dec.observe(StepRecord(phase, 3, 3, 4, 1, 3, seconds))
    assert dec.cost_ratio(4) == pytest.approx(2.0)
    assert MtpProposer(3).propose([1, 2, 3], 2) == [0, 0]  # placeholders: slots the draft program fills
