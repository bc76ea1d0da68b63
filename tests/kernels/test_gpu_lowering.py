"""Every kernel configuration lowers for NVIDIA GPUs (Triton backend), checked on a CPU-only host.

`jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",))` runs the Pallas -> Triton IR
lowering without a GPU, so a jax upgrade or a kernel edit that breaks GPU users fails here.
Lowering does not run the Triton compiler, so rules it would only enforce on the GPU (tl.dot
dims >= 16, one dtype per dot, no fp8 operand) are checked on the kernel jaxpr as well.
Shapes are production-like (GLM-4.6 GQA, Kimi K2 MLA and experts, GLM-5 sparse MLA), given as ShapeDtypeStructs.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jex

from pallas_kernels.int4_matmul import int4_grouped_matmul, int4_matmul
from pallas_kernels.paged_attention import paged_attention_gqa, paged_attention_mla, sparse_attention_mla

S = jax.ShapeDtypeStruct
TRITON_CALL = "__gpu$xla.gpu.triton"
B, P, M = 8, 100, 64  # P not a power of two on purpose: only loaded tiles must be


def _gqa_case(dtype, page_size, kvh, group, splits):
    d = 128
    pages = S((kvh, P, page_size, d), dtype)
    sc = S((kvh, P, page_size), jnp.float32) if jnp.dtype(dtype).itemsize == 1 else None
    args = (S((B, kvh * group, d), jnp.bfloat16), pages, pages, sc, sc, S((B, M), jnp.int32), S((B,), jnp.int32))
    return functools.partial(paged_attention_gqa, scale=d ** -0.5, num_splits=splits), args


def _mla_case(dtype, page_size, heads, splits):
    r, dr = 512, 64
    sc = S((P, page_size), jnp.float32) if jnp.dtype(dtype).itemsize == 1 else None
    args = (S((B, heads, r), jnp.bfloat16), S((B, heads, dr), jnp.bfloat16), S((P, page_size, r), dtype),
            S((P, page_size, dr), dtype), sc, sc, S((B, M), jnp.int32), S((B,), jnp.int32))
    return functools.partial(paged_attention_mla, scale=(128 + dr) ** -0.5, num_splits=splits), args


def _sparse_mla_case(dtype, page_size, heads, topk):
    """GLM-5's DSA decode: latent 512 + rope 64, each query row's index_topk chosen slots."""
    r, dr = 512, 64
    sc = S((P, page_size), jnp.float32) if jnp.dtype(dtype).itemsize == 1 else None
    args = (S((B, heads, r), jnp.bfloat16), S((B, heads, dr), jnp.bfloat16), S((P, page_size, r), dtype),
            S((P, page_size, dr), dtype), sc, sc, S((B, topk), jnp.int32))
    return functools.partial(sparse_attention_mla, scale=(192 + dr) ** -0.5), args


def _int4_case(group, dtype, m=8, k=7168, n=2048, tile=None):
    """Weights as jaxserve.quant.int4.Int4GroupFormat(group) stores them (tile = group);
    tile=group states it explicitly, as jaxserve.quant.paths does."""
    args = (S((m, k), dtype), S((k // 2, n), jnp.uint8), S((k // group, n), jnp.float32))
    return functools.partial(int4_matmul, group=group, tile=tile), args


def _grouped_case(group, dtype, experts=384, m=64, k=7168, n=2048, tile=None, scale_dtype=jnp.float32):
    args = (S((m, k), dtype), S((experts, k // 2, n), jnp.uint8), S((experts, k // group, n), scale_dtype),
            S((experts,), jnp.int32))
    return functools.partial(int4_grouped_matmul, group=group, tile=tile), args


CASES = {
    # GLM-4.6: 96 query heads / 8 KV heads -> group 12 (padded to 16 in the kernel).
    "gqa-bf16-s16-g12": _gqa_case(jnp.bfloat16, 16, 8, 12, 1),
    "gqa-fp8-s16-g12-split4": _gqa_case(jnp.float8_e4m3fn, 16, 8, 12, 4),
    "gqa-fp8e5m2-s8-g4": _gqa_case(jnp.float8_e5m2, 8, 2, 4, 1),
    "gqa-bf16-s64-g8-split2": _gqa_case(jnp.bfloat16, 64, 1, 8, 2),
    # Kimi K2 / DeepSeek-V3 absorbed MLA: kv_lora_rank 512, rope 64.
    "mla-bf16-s16-h16": _mla_case(jnp.bfloat16, 16, 16, 1),
    "mla-fp8-s16-h64-split4": _mla_case(jnp.float8_e4m3fn, 16, 64, 4),
    "mla-fp8-s8-h8": _mla_case(jnp.float8_e4m3fn, 8, 8, 1),
    # GLM-5 sparse attention (DSA): 64 heads (8 a device at tp=8, padded to 16), index_topk 2048.
    "sparse-mla-bf16-s16-h16-k2048": _sparse_mla_case(jnp.bfloat16, 16, 16, 2048),
    "sparse-mla-fp8-s64-h8-k2048": _sparse_mla_case(jnp.float8_e4m3fn, 64, 8, 2048),
    "sparse-mla-fp8-s16-h64-k100": _sparse_mla_case(jnp.float8_e4m3fn, 16, 64, 100),  # K padded to 128
    "int4-g32-bf16": _int4_case(32, jnp.bfloat16),  # inner step G/2 = 16
    "int4-g64-f16": _int4_case(64, jnp.float16),
    "int4-g128-bf16-m1": _int4_case(128, jnp.bfloat16, m=1),
    "int4-g32-tile32-bf16": _int4_case(32, jnp.bfloat16, tile=32),  # as jaxserve.quant.paths calls it
    "int4-grouped-g32-bf16": _grouped_case(32, jnp.bfloat16),
    "int4-grouped-g32-tile32-bf16-bf16scales": _grouped_case(32, jnp.bfloat16, tile=32, scale_dtype=jnp.bfloat16),
    "int4-grouped-g128-bf16": _grouped_case(128, jnp.bfloat16, experts=8, k=2048, n=7168),
    "int4-grouped-g128-tile128-f16": _grouped_case(128, jnp.float16, experts=8, k=2048, n=7168, tile=128),
}


def _subjaxprs(params):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else [v]:
            if isinstance(x, jex.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jex.Jaxpr):
                yield x


def _kernel_dots(jaxpr, in_kernel=False):
    """Yield the operand avals of every dot_general inside a pallas_call kernel."""
    for eqn in jaxpr.eqns:
        inside = in_kernel or eqn.primitive.name == "pallas_call"
        if in_kernel and eqn.primitive.name == "dot_general":
            yield [v.aval for v in eqn.invars]
        for sub in _subjaxprs(eqn.params):
            yield from _kernel_dots(sub, inside)


def _target_gpu():
    """Newer jax (0.12) reads the target GPU's compute capability from the device, and on a
    host without one from an abstract device set with ``use_abstract_mesh``; older jax needs
    nothing. The target is the production GPU, an H200."""
    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_for_cuda_with_triton(name):
    f, args = CASES[name]
    with _target_gpu():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert TRITON_CALL in text, "expected a Triton custom call (not Mosaic GPU)"
    assert "mosaic_gpu" not in text


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_dots_follow_triton_rules(name):
    f, args = CASES[name]
    dots = list(_kernel_dots(jax.make_jaxpr(f)(*args).jaxpr))
    assert dots, "no dot found inside the kernel"
    for a, b in dots:
        for dim in a.shape + b.shape:
            assert dim >= 16 and dim & (dim - 1) == 0, f"tl.dot needs power-of-two dims >= 16: {a.shape} x {b.shape}"
        assert a.dtype == b.dtype, f"mixed-dtype dot {a.dtype} x {b.dtype}"
        assert jnp.dtype(a.dtype).itemsize >= 2, f"fp8/int8 operand in a dot: {a.dtype}"
