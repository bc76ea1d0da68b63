"""The rotary tables are computed once per step, not once per layer.

XLA:CPU fused the cos/sin computation into every layer's q and k rotation (evaluated there per
element and head: a sixth of a CPU prefill step's non-matmul time on SmolLM2), until
``rope_cos_sin`` read its tables back through an identity row gather. The optimized HLO of a
4-layer model's prefill and decode programs must hold one cosine and one sine, wherever XLA puts
them."""
import re

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxserve.executor.runner import ModelRunner
from jaxserve.kv.formats import get_kv_format
from jaxserve.models.llama import Llama, parse_config

LAYERS = 4


@pytest.fixture(scope="module")
def runner():
    cfg = parse_config(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
        intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
        hidden_act="silu", bos_token_id=1, eos_token_id=2))
    model = Llama(cfg, jnp.float32, nnx.Rngs(0))
    return ModelRunner(model, get_kv_format("bf16"), num_pages=16, page_size=16, max_pages_per_seq=8)


@pytest.mark.parametrize("phase,batch,tokens", [("prefill", 2, 32), ("decode", 4, 1)])
def test_cos_and_sin_are_evaluated_once_per_step(runner, phase, batch, tokens):
    hlo = runner.lower(phase, batch, tokens).compile().as_text()
    assert len(re.findall(r"\bcosine\(", hlo)) == 1, "cos evaluated in more than one place (per layer?)"
    assert len(re.findall(r"\bsine\(", hlo)) == 1, "sin evaluated in more than one place (per layer?)"
