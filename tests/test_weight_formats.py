"""Weight formats (jaxserve.quant): registry, round-trip error bounds, int4 packing layout,
storage bytes, pytree + sharding, real weights.

Error bounds per element (derived from the formats):
- bf16: |w - deq| <= 2**-8 |w| (8 significant bits, round to nearest: unit roundoff 2**-8);
- fp8 e4m3: <= 2**-4 |w| (3 mantissa bits) or 2**-10 * scale in the subnormal range;
- int4: <= scale / 2 (symmetric grid, |w| <= 7.5 * scale, clipped end at +7.5 -> 7);
- int8: <= scale / 2 (scale = amax / 127, nothing clipped).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from jaxserve.quant import (QuantizedWeight, dequantize, get_weight_format, logical_axes_for, matmul, nbytes,
                            pack_int4, quantize, shardings_for, unpack_int4,
                            weight_format_names)
from jaxserve.quant.fp8 import E4M3, E4M3_MAX

FORMATS = ["bf16", "fp8_e4m3", "fp8:block128", "int8", "int4:g32", "int4:g64", "int4:g128"]
EPS = 1e-5  # float32 rounding slop in scale = amax / 7.5 and q * scale (a few ulps, x15 at the clipped end)


_deq = jax.jit(dequantize, static_argnums=1)  # one fused program per (format, shape): far faster than eager


def deq(qw, dtype=jnp.float32) -> np.ndarray:
    return np.asarray(_deq(qw, dtype))


def rand(shape, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def expanded_scales(qw):
    """Per-element scale [..., K, N] (float64) for the scaled formats."""
    *_, k, n = qw.shape
    s = np.asarray(qw.scales, np.float64)
    if qw.format.startswith("int4"):
        return np.repeat(s, get_weight_format(qw.format).group, axis=-2)[..., :k, :]
    if qw.format == "fp8:block128":
        return np.repeat(np.repeat(s, 128, axis=-2)[..., :k, :], 128, axis=-1)[..., :n]
    return np.broadcast_to(s, qw.shape)


def elementwise_bound(w, qw):
    """Max |w - deq| per element allowed by the format (see module docstring)."""
    a = np.abs(w.astype(np.float64))
    if qw.format == "bf16":
        return 2.0**-8 * a * (1 + EPS) + 1e-30
    s = expanded_scales(qw)
    if qw.format.startswith("fp8"):
        return np.maximum(2.0**-4 * a, 2.0**-10 * s) * (1 + EPS)
    return s / 2 * (1 + EPS) + 1e-30


def rel_fro(w, qw):
    d = deq(qw).astype(np.float64)
    return float(np.linalg.norm(w - d) / np.linalg.norm(w))


# ------------------------------------------------------------------------- registry


def test_registry_names_aliases_and_errors():
    assert weight_format_names() == sorted(FORMATS)
    assert get_weight_format("fp8").name == "fp8_e4m3"
    assert get_weight_format("fp8:channel").name == "fp8_e4m3"
    assert get_weight_format(" INT4:G128 ").name == "int4:g128"
    assert get_weight_format("int4").name == "int4:g128"
    assert get_weight_format("bfloat16").name == "bf16"
    assert get_weight_format(get_weight_format("bf16")) is get_weight_format("bf16")
    assert get_weight_format("int8:channel").name == "int8"
    for bad in ("int4:g48", "fp8:block64", "int8:g32", "fp4"):
        with pytest.raises(ValueError, match="unknown weight format"):
            get_weight_format(bad)
    with pytest.raises(ValueError, match="q_proj.*shape"):
        quantize(np.ones(8, np.float32), "int4:g32", name="q_proj")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(np.full((4, 4), np.nan, np.float32), "fp8")


# ------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(256, 96), (200, 136), (3, 96, 40)])  # aligned, ragged, stacked experts
def test_round_trip_elementwise_bound(fmt, shape):
    w = rand(shape, seed=1)
    w[..., 5, 7] = 40.0  # an outlier: its region's scale grows, the bound must still hold
    qw = quantize(w, fmt)
    d = deq(qw)
    assert d.shape == shape and d.dtype == np.float32
    err = np.abs(w - d)
    assert np.all(err <= elementwise_bound(w, qw)), float(np.max(err / elementwise_bound(w, qw)))
    if fmt.startswith("fp8"):  # also the looser bound: 2^-4 of the channel's / block's largest magnitude
        region_max = expanded_scales(qw) * E4M3_MAX
        assert np.all(err <= 2.0**-4 * region_max * (1 + EPS))


def test_int4_error_grows_with_group_and_padding_is_exact():
    w = rand((512, 128), seed=2)
    errs = [rel_fro(w, quantize(w, f"int4:g{g}")) for g in (32, 64, 128)]
    print("synthetic N(0,1) [512,128] rel fro int4 g32/g64/g128:", [round(e, 4) for e in errs])
    assert errs[0] < errs[1] < errs[2] < 0.125  # measured 0.095 / 0.103 / 0.111
    # K = 96 is not a multiple of 64: K is zero-padded to 128 and the last group holds 32 real rows.
    w96 = w[:96]
    qw = quantize(w96, "int4:g64")
    assert qw.values.shape == (64, 128) and qw.scales.shape == (2, 128)
    np.testing.assert_array_equal(qw.scales[1], np.abs(w96[64:]).max(0) / 7.5)
    q = np.asarray(unpack_int4(qw.values, 64)).reshape(128, 128)
    assert np.all(q[96:] == 0)
    np.testing.assert_array_equal(deq(qw)[:64], deq(quantize(w[:64], "int4:g64")))


def test_fp8_scales_follow_hf_block_layout():
    w = rand((300, 200), seed=3)
    qw = quantize(w, "fp8:block128")
    assert qw.values.dtype == E4M3 and qw.scales.shape == (3, 2)  # [ceil(K/128), ceil(N/128)]
    np.testing.assert_allclose(qw.scales[2, 1], np.abs(w[256:, 128:]).max() / 448, rtol=1e-7)
    # A shipped checkpoint: weight [N, K] e4m3 + weight_scale_inv [ceil(N/128), ceil(K/128)].
    fmt = get_weight_format("fp8:block128")
    adopted = fmt.from_hf_block(np.asarray(qw.values).T, np.asarray(qw.scales).T)
    assert adopted.shape == (300, 200) and adopted.format == "fp8:block128"
    np.testing.assert_array_equal(deq(adopted), deq(qw))
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        fmt.from_hf_block(np.asarray(qw.values).T, np.ones((3, 2), np.float32))
    qc = quantize(w, "fp8_e4m3")
    assert qc.scales.shape == (1, 200)
    np.testing.assert_allclose(qc.scales[0], np.abs(w).max(0) / 448, rtol=1e-7)


# ------------------------------------------------------------------------- int4 layout


def test_int4_packing_layout_by_hand():
    # K = 8, tile 4: packed row j of tile t = q[4t + j] (low nibble) | q[4t + 2 + j] (high nibble).
    q = np.array([1, -1, 7, -8, 0, 3, -2, 5], np.int8)[:, None]
    packed = pack_int4(q, tile=4)
    assert packed.dtype == np.uint8 and packed.shape == (4, 1)
    expect = [(1 & 15) | (7 << 4), (-1 & 15) | ((-8 & 15) << 4), (0 & 15) | ((-2 & 15) << 4), (3 & 15) | (5 << 4)]
    assert packed[:, 0].tolist() == expect
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, 4)).reshape(8, 1), q)


def test_int4_pack_unpack_round_trip():
    q = np.random.default_rng(4).integers(-8, 8, (2, 256, 24)).astype(np.int8)
    for tile in (32, 128, 256):
        back = np.asarray(unpack_int4(pack_int4(q, tile), tile)).reshape(q.shape)
        np.testing.assert_array_equal(back, q)


# ------------------------------------------------------------------------- matmuls


# The matmuls that read these formats are tested per (format, backend) in tests/test_linear.py.


# ------------------------------------------------------------------------- bytes


def test_nbytes_exact_formulas():
    qw = quantize(np.ones((4096, 4096), np.float32), "int4:g128")
    assert nbytes(qw) == 4096 * 4096 // 2 + 4 * (4096 // 128) * 4096  # 0.5 B/param + f32 group scales
    assert nbytes(qw) / 4096**2 == 0.53125
    k, n = 300, 200  # not block/group aligned: padded / partial regions are counted
    w = np.ones((k, n), np.float32)
    assert nbytes(quantize(w, "bf16")) == 2 * k * n
    assert nbytes(quantize(w, "fp8_e4m3")) == k * n + 4 * n
    assert nbytes(quantize(w, "int8")) == k * n + 4 * n
    assert nbytes(quantize(w, "fp8:block128")) == k * n + 4 * 3 * 2
    assert nbytes(quantize(w, "int4:g32")) == 320 * n // 2 + 4 * 10 * n
    assert qw.nbytes == nbytes(qw)


# ------------------------------------------------------------------------- pytree and sharding


def test_pytree_jit_does_not_retrace_for_same_shapes():
    traces = []

    @jax.jit
    def f(x, qw):
        traces.append(qw.format)
        return matmul(x, qw)

    x = jnp.ones((3, 64))
    a, b = quantize(rand((64, 32), seed=10), "int4:g32"), quantize(rand((64, 32), seed=11), "int4:g32")
    assert len(jax.tree_util.tree_leaves(a)) == 2  # packed values + scales; format/shape are aux data
    f(x, a), f(x, b)
    assert traces == ["int4:g32"]
    f(x, quantize(rand((64, 32), seed=10), "fp8_e4m3"))  # another format is another program
    assert traces == ["int4:g32", "fp8_e4m3"]
    assert len(jax.tree_util.tree_leaves(quantize(rand((64, 32)), "bf16"))) == 1  # scales None: no leaf
    out = jax.jit(lambda q: q)(a)  # round-trips through jit as a QuantizedWeight
    assert isinstance(out, QuantizedWeight) and out.format == "int4:g32" and out.shape == (64, 32)


def test_logical_axes_follow_the_weight():
    axes = ("mlp", "embed")  # a down_proj [I, D]: K sharded (row parallel)
    w = rand((256, 256))
    q4 = quantize(w, "int4:g32")
    assert logical_axes_for(q4, "values", axes) == axes  # packed [K/2, N]: tile = group keeps K contiguous
    assert logical_axes_for(q4, "scales", axes) == axes  # [K/32, N]
    qc = quantize(w, "fp8_e4m3")
    assert logical_axes_for(qc, "scales", axes) == (None, "embed")  # [1, N]
    qb = quantize(w, "fp8:block128")
    assert logical_axes_for(qb, "scales", axes) == axes
    assert logical_axes_for(quantize(w, "bf16"), "scales", axes) is None
    ragged = rand((96, 200))  # K padded to 128 for g64, N = 200 not a multiple of 128
    assert logical_axes_for(quantize(ragged, "int4:g64"), "values", axes) == (None, "embed")
    assert logical_axes_for(quantize(ragged, "fp8:block128"), "scales", axes) == (None, None)
    experts = quantize(rand((4, 64, 32)), "int4:g32")
    assert logical_axes_for(experts, "scales", ("expert", "embed", None)) == ("expert", "embed", None)


def test_sharded_int4_matmul_matches_unsharded():
    from jaxserve.sharding import make_mesh

    mesh = make_mesh(2)
    w, x = rand((256, 64), seed=12), jnp.asarray(rand((4, 256), seed=13))
    qw = quantize(w, "int4:g32")
    placed = jax.device_put(qw, shardings_for(qw, ("mlp", "embed"), mesh, "down_proj"))
    assert placed.values.sharding.spec == jax.sharding.PartitionSpec("model", None)
    np.testing.assert_allclose(np.asarray(jax.jit(matmul)(x, placed)), np.asarray(matmul(x, qw)), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------- real weights

# Relative Frobenius error measured on SmolLM2-135M (itself Q4_1, group 32 along K, dequantized;
# symmetric int4 cannot reproduce its asymmetric grid):
#                     bf16     fp8_e4m3  fp8:block128  int4:g32  int4:g64  int4:g128
# L0  q_proj          0.00128  0.0260    0.0264        0.112     0.125     0.137
# L0  mlp.down_proj   0.00134  0.0264    0.0264        0.099     0.108     0.118
# L15 q_proj          0.00134  0.0262    0.0265        0.100     0.110     0.119
# L15 mlp.down_proj   0.00133  0.0264    0.0264        0.102     0.113     0.126
REAL_BOUNDS = {"bf16": 0.003, "fp8_e4m3": 0.035, "fp8:block128": 0.035, "int8": 0.02, "int4:g32": 0.13, "int4:g64": 0.145,
               "int4:g128": 0.16}


def test_real_smollm2_weights_error_table():
    from jaxserve.checkpoint.gguf import default_model_dir

    path = default_model_dir(progress=False) / "model.safetensors"
    names = [f"model.layers.{i}.{m}.weight" for i in (0, 15) for m in ("self_attn.q_proj", "mlp.down_proj")]
    with safe_open(str(path), "np") as fh:
        mats = {n: fh.get_tensor(n).T for n in names}  # HF [out, in] -> ours [in, out]
    print("\nrelative Frobenius error, SmolLM2-135M:\n" + " " * 40 + " ".join(f"{f:>13}" for f in FORMATS))
    for name, w in mats.items():
        errs = {f: rel_fro(w, quantize(w, f, name=name)) for f in FORMATS}
        print(f"{name:40}" + " ".join(f"{errs[f]:13.5f}" for f in FORMATS))
        for f, e in errs.items():
            assert e < REAL_BOUNDS[f], (name, f, e)
        assert errs["bf16"] < errs["int8"] < errs["fp8_e4m3"] < errs["int4:g32"] < errs["int4:g64"] < errs["int4:g128"]
    assert math.isclose(nbytes(quantize(mats[names[0]], "int4:g64")), 576 * 576 / 2 + 4 * 9 * 576)
