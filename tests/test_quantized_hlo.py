"""The compiled programs compute in the stored formats: no whole dense weight is ever built.

A SmolLM2-135M-shaped model (hidden 576, MLP 1536, vocab 49152, untied head; 2 layers, random
weights) with int4 decode weights: the optimized CPU HLO of its decode program must hold no
buffer as large as any MLP weight or the LM head (the dequantization runs one column tile
of about 1 MiB of bf16 at a time). The attention projections are smaller than one tile.
And the article preset's decode program, lowered for CUDA on this CPU host, runs its int4
matmuls in the Pallas kernel (Triton custom calls), dense and grouped by expert.
"""
import contextlib
import math
import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve.kv.formats import get_kv_format
from jaxserve.models.llama import Llama, parse_config
from jaxserve.executor.runner import ModelRunner

SHAPE = re.compile(r"\b(f32|bf16|f16|s8|s32|u8)\[([\d,]+)\]")


def smollm2_config():
    """SmolLM2-135M's config.json, 2 layers, untied head."""
    return parse_config(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False, rope_theta=100000.0,
        hidden_act="silu", bos_token_id=1, eos_token_id=2))


def buffers(hlo: str) -> list[tuple[str, int, str]]:
    """(dtype, elements, instruction) of every buffer the program materializes: the outputs of
    instructions outside fused computations (parameters and constants excluded)."""
    fused = set(re.findall(r"fusion\(.*calls=%?([\w.\-]+)", hlo))
    out, skip = [], False
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            skip = head.group(2) in fused
            continue
        if skip or " = " not in line or "parameter(" in line or "constant(" in line:
            continue
        lhs = line.split(" = ", 1)[1].split("(", 1)[0] if line.split(" = ", 1)[1].startswith("(") else line.split(" = ", 1)[1]
        m = SHAPE.search(lhs.split(" ", 1)[0] if not lhs.startswith("(") else lhs)
        if m:
            out.append((m.group(1), math.prod(int(d) for d in m.group(2).split(",")), line.strip()[:120]))
    return out


@pytest.fixture(scope="module")
def int4_runner():
    from flax import nnx

    cfg = smollm2_config()
    model = Llama(cfg, jnp.float32, nnx.Rngs(0))
    return ModelRunner(model, get_kv_format("bf16"), num_pages=16, page_size=16, max_pages_per_seq=8,
                       decode_weights="int4:g32", matmul_backend="cpu")


@pytest.fixture(scope="module")
def int4_decode_hlo(int4_runner):
    return int4_runner.lower("decode", 1).compile().as_text()


def test_int4_decode_program_holds_no_dense_weight(int4_decode_hlo):
    hlo = int4_decode_hlo
    bufs = buffers(hlo)
    assert bufs, "no buffers parsed: the HLO format changed"
    smallest = 576 * 1536  # the MLP weights; the LM head is 576 x 49152
    big = [b for b in bufs if b[1] >= smallest and b[0] in ("f32", "bf16", "f16", "s8")]
    print(f"{len(bufs)} buffers; largest float/int8: {max((b for b in bufs if b[0] != 'u8'), key=lambda b: b[1])[:2]}")
    assert not big, big[:5]
    # The same parse sees a dense weight when one is built: the plain float32 model's head
    # is a parameter (never copied), but the bf16 cast of it is a buffer.
    dense = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)))
    text = dense.lower(jax.ShapeDtypeStruct((2, 576), jnp.float32),
                       jax.ShapeDtypeStruct((576, 1536), jnp.float32)).compile().as_text()
    assert any(b[1] >= smallest for b in buffers(text))


def test_int4_decode_program_calls_the_native_kernel(int4_decode_hlo):
    """Where the native CPU kernels run (jaxserve.native), every int4 matmul of the decode
    program is their custom call: 2 layers x 7 projections and the LM head."""
    from jaxserve import native

    if not native.available():
        pytest.skip(f"native kernels: {native.status().reason}")
    calls = re.findall(r'custom_call_target="(jaxserve_\w+)"', int4_decode_hlo)
    assert calls.count("jaxserve_int4_w4a16") == 2 * 7 + 1, calls


def _target_gpu():
    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def test_article_preset_decode_program_calls_the_pallas_int4_kernel():
    from jaxserve.loader import load_model

    _, model = load_model("checkpoints/tiny-kimi-k2")
    runner = ModelRunner(model, get_kv_format("fp8_e4m3"), num_pages=16, page_size=16, max_pages_per_seq=8,
                         prefill_weights="fp8:block128", decode_weights="int4:g32", matmul_backend="gpu",
                         attention_backend="pallas")
    with _target_gpu():
        text = runner.lower("decode", 4, platform="cuda").as_text()
    kernels = re.findall(r'name = "(int4_(?:grouped_)?matmul_g32)"', text) or re.findall(r"int4_(?:grouped_)?matmul_g32", text)
    assert "__gpu$xla.gpu.triton" in text
    assert any("grouped" in k for k in kernels) and any("grouped" not in k for k in kernels), sorted(set(kernels))
