"""Pre-quantized GLM-5 checkpoints (GlmMoeDsaForCausalLM) load in their shipped forms, the DSA
indexer's weights included: FP8 128x128 block-scaled (every Linear, as GLM FP8 checkpoints ship)
and compressed-tensors pack-quantized int4 (routed experts and the indexer's three Linears).

The checkpoints are made with the format helpers of test_prequantized.py (written from each
format's own definition); the reference is transformers on the dequantized weights. The
indexer's wq_b / wk load as quantized matmul weights (their shipped bytes); its weights_proj,
which jaxserve keeps in float32, is dequantized on load (exactly).

index_topk (64) exceeds the prompt, so every layer still scores and takes its top-k but attends
to every visible token: the quantized programs round activations to bf16 on this CPU path, and
past index_topk such a rounding can swap a token at the top-k boundary, a discrete jump that
says nothing about loading (tests/models/test_glm5_dsa.py measures it for lossy KV formats).
The indexer's own matmuls on the loaded weights are checked against numpy instead.
"""
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.hf_models import build_glm_moe_dsa
from jaxserve import LLM
from jaxserve.loader import load_model
from jaxserve.quant.phase import PhaseWeight
from tests.quant_reference import np_dequant32
from tests.test_prequantized import CT_CONFIG, flat_values, make_prequantized

PROMPT = [int(x) for x in np.random.RandomState(0).randint(2, 256, size=40)]
KW = dict(kv_format="float32", num_pages=64, page_size=8)
GLM_LINEAR = re.compile(r"(_proj|_proj_with_mqa|\.indexer\.wq_b|\.indexer\.wk)\.weight$")
GLM_INT4 = re.compile(r"\.mlp\.experts\.|\.indexer\.")
GLM_CT = dict(CT_CONFIG, ignore=["lm_head", r"re:.*self_attn\.(q_a|q_b|kv_a|kv_b|o)_proj.*", "re:.*shared_experts.*",
                                 r"re:.*mlp\.(gate|up|down)_proj.*"])
IDX = "model.layers.0.self_attn.indexer"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_pq_base")
    # q_lora_rank 64: the indexer's wq_b reads the query residual, in whole int4 groups of 32
    build_glm_moe_dsa(path, num_hidden_layers=2, indexer_types=["full", "shared"], q_lora_rank=64, seed=5,
                      index_topk=64)
    return path


@pytest.fixture(scope="module", params=["fp8", "int4"])
def form(request, base, tmp_path_factory):
    kind = request.param
    qdir, ref = make_prequantized(base, tmp_path_factory.mktemp("glm5_pq") / kind, kind, linear=GLM_LINEAR,
                                  int4_scope=GLM_INT4, ct_config=GLM_CT)
    return kind, qdir, ref


def test_logprobs_match_the_dequantized_reference(form, base):
    kind, qdir, ref = form
    lp = LLM(str(qdir), **KW).logprobs(PROMPT)
    err = np.abs(lp - ref_logprobs_of(ref)).max()
    moved = np.abs(lp - ref_logprobs_of(base)).max()
    print(f"GLM-5 {kind}: max |logprob error| vs transformers on the dequantized weights {err:.2e} "
          f"(vs the unquantized model {moved:.2e})")
    assert err <= BOUND[kind] and moved > 5 * err


def test_indexer_weights_load_as_shipped(form):
    kind, qdir, ref = form
    _, model = load_model(qdir)
    vals = flat_values(model)
    plain = load_file(ref / "model.safetensors")
    fmt = "fp8:block128" if kind == "fp8" else "int4:g32"
    for ours, hf in (("wq_b", "wq_b"), ("wk", "wk")):
        w = vals[f"layers/0/attn/indexer/{ours}"]
        assert isinstance(w, PhaseWeight) and w.qw.format == fmt, ours
        want = plain[f"{IDX}.{hf}.weight"].numpy().T  # the dequantized reference, [in, out]
        assert np.array_equal(np_dequant32(w.qw), want), ours  # the shipped values and scales, exactly
    if kind == "fp8":
        tensors = load_file(qdir / "model.safetensors")
        wk = vals["layers/0/attn/indexer/wk"]
        assert np.array_equal(np.asarray(wk.qw.values).view(np.uint8),
                              tensors[f"{IDX}.wk.weight"].T.contiguous().view(torch.uint8).numpy())
    wp = vals["layers/0/attn/indexer/weights_proj"]  # float32 in jaxserve: dequantized on load
    assert not isinstance(wp, PhaseWeight) and np.asarray(wp).dtype == np.float32
    np.testing.assert_allclose(np.asarray(wp), plain[f"{IDX}.weights_proj.weight"].numpy().T, rtol=1e-7, atol=0)
    assert not isinstance(vals["layers/0/attn/indexer/k_norm/scale"], PhaseWeight)
    experts = vals["layers/1/mlp/w_up"]
    assert isinstance(experts, PhaseWeight) and experts.qw.format == fmt
    assert "layers/1/attn/indexer/wq_b" not in vals  # a shared layer holds no indexer


def test_indexer_matmuls_on_the_loaded_weights(form):
    """The indexer's projections through the loaded weights (quantized wq_b [q_lora, IH, D] and
    wk, float32 weights_proj) against numpy on the dequantized reference weights."""
    from jaxserve.quant.linear import linear

    kind, qdir, ref = form
    _, model = load_model(qdir)
    indexer = model.layers[0].attn.indexer
    plain = {k: v.numpy().astype(np.float64) for k, v in load_file(ref / "model.safetensors").items()
             if k.startswith(IDX)}
    rng = np.random.RandomState(2)
    x = rng.randn(3, plain[f"{IDX}.wk.weight"].shape[1]).astype(np.float32)
    q_resid = rng.randn(3, plain[f"{IDX}.wq_b.weight"].shape[1]).astype(np.float32)
    ih = model.cfg.index_n_heads
    for got, want in (
        (linear(q_resid, indexer.wq_b), (q_resid @ plain[f"{IDX}.wq_b.weight"].T).reshape(3, ih, -1)),
        (linear(x, indexer.wk), x @ plain[f"{IDX}.wk.weight"].T),
        (linear(x, indexer.weights_proj, out_dtype=np.float32), x @ plain[f"{IDX}.weights_proj.weight"].T),
    ):
        got = np.asarray(got, np.float64)
        assert got.shape == want.shape
        # bf16 activations and weight tiles on this CPU path: about 2^-8 relative per product
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=0)


# The programs compute in the stored format, whose CPU path rounds activations and weight tiles
# to bf16 (the bound of test_prequantized.py).
BOUND = {"fp8": 0.04, "int4": 0.04}


def ref_logprobs_of(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), -1).numpy()
