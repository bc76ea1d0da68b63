"""Glm4MoeForCausalLM and LlamaForCausalLM against transformers, and paged decode vs full forward."""
import numpy as np
import pytest
import torch

from tests.hf_models import build_glm4_moe, build_llama
from jaxserve import LLM

PROMPT = [int(x) for x in np.random.RandomState(3).randint(2, 256, size=19)]
BUILDERS = {
    "glm4_moe": build_glm4_moe,
    "llama": build_llama,
    "llama-untied-bias-llama3rope": lambda p: build_llama(
        p, tie_word_embeddings=False, attention_bias=True, num_key_value_heads=4,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = BUILDERS[request.param](path)
    return request.param, path, ref


def test_logprobs_and_greedy_match_transformers(case):
    name, path, ref = case
    llm = LLM(str(path), kv_format="float32", num_pages=32, page_size=8)
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0], -1).numpy()
    err = np.abs(llm.logprobs(PROMPT) - want).max()
    print(f"{name}: max |logprob error| vs transformers = {err:.2e}")
    assert err <= 1e-4
    ours = llm.generate([PROMPT], max_tokens=16, ignore_eos=True)[0]
    theirs = ref.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ours == theirs[0, len(PROMPT):].tolist()


# Prefill and decode both attend to K/V as the pages store them: equal to float32 rounding, or
# by about one bf16 / fp8 step where that rounding flips a stored value (bf16: 2.5e-4 seen).
@pytest.mark.parametrize("kv_format,bound", [("float32", 2e-5), ("bf16", 1e-3), ("fp8_e4m3", 2e-2)])
def test_paged_decode_equals_full_forward(case, kv_format, bound):
    name, path, _ = case
    llm = LLM(str(path), kv_format=kv_format, num_pages=32, page_size=8)
    full = llm.logprobs(PROMPT)
    table = np.array([[2, 5, 3]], np.int32)
    p = 6
    out = [np.asarray(llm.runner.run(np.array([PROMPT[:p]], np.int32), [0], [p], table))[0]]
    for i, tok in enumerate(PROMPT[p:]):
        out.append(np.asarray(llm.runner.run(np.array([[tok]], np.int32), [p + i], [1], table))[0])
    dec = torch.log_softmax(torch.tensor(np.stack(out[:-1])), -1).numpy()
    err = np.abs(dec - full[p - 1 : -1]).max()
    print(f"{name} kv={kv_format}: paged decode vs full forward max |logprob diff| = {err:.3e}")
    assert err <= bound


@pytest.mark.parametrize("kv_heads", [8, 2], ids=["kv-split-by-head", "kv-replicated"])
def test_glm_eight_devices_equal_one(tmp_path, kv_heads):
    build_glm4_moe(tmp_path, num_hidden_layers=2, num_key_value_heads=kv_heads)
    # float32 KV: with a rounded format a one-ulp sharding difference can flip one stored value's
    # rounding (bf16 on a mesh is compared with that in mind in tests/engine/test_attention_sharded.py).
    one = LLM(str(tmp_path), kv_format="float32", num_pages=16, page_size=8)
    eight = LLM(str(tmp_path), kv_format="float32", num_pages=16, page_size=8, num_devices=8)
    pool = eight.runner.kv[0]["k"]
    assert pool.sharding.is_fully_replicated == (kv_heads == 2)
    assert np.abs(one.logprobs(PROMPT) - eight.logprobs(PROMPT)).max() < 1e-5
    assert one.generate([PROMPT], max_tokens=6) == eight.generate([PROMPT], max_tokens=6)
