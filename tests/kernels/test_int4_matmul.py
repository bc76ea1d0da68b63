"""INT4 (W4A16) format and kernels: packing layout, quantization error bound, kernels (interpret
mode) vs the dequantized reference, and input validation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4_matmul import (
    dequantize_int4,
    int4_grouped_matmul,
    int4_grouped_matmul_reference,
    int4_matmul,
    int4_matmul_reference,
    quantize_int4,
    unpack_int4,
)

REL_TOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-4}


def _rel_err(y, ref):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-6)


@pytest.mark.parametrize("tile", [None, 32])
def test_packing_layout_low_nibble_first_half_of_tile(tile):
    """Packed row t*T/2 + j: low nibble = row t*T + j, high nibble = row t*T + T/2 + j (T = tile,
    None = all of K), two's complement nibbles."""
    k, group = 64, 32
    t = k if tile is None else tile
    q = np.tile(np.arange(-8, 8), k // 16)[:, None].astype(np.float32)  # every int4 value, N = 1
    packed, scales = quantize_int4(jnp.asarray(q * 0.5), group, tile=tile)
    assert packed.shape == (k // 2, 1) and packed.dtype == jnp.uint8 and scales.shape == (k // group, 1)
    np.testing.assert_allclose(np.asarray(scales), 4.0 / 7)  # amax 4 -> 7 * scale
    codes = np.round(q[:, 0] * 0.5 / (4.0 / 7)).astype(np.int64)
    blocks = codes.reshape(k // t, 2, t // 2)
    expect = ((blocks[:, 0] & 0xF) | ((blocks[:, 1] & 0xF) << 4)).reshape(-1)
    np.testing.assert_array_equal(np.asarray(packed)[:, 0], expect)
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, tile))[:, 0], codes)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_dequantize_error_bound(group, scale_dtype):
    rng = np.random.default_rng(group)
    w = rng.standard_normal((256, 48)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero column: scale 0, no NaN
    packed, scales = quantize_int4(jnp.asarray(w), group, scale_dtype)
    assert scales.dtype == scale_dtype
    deq = np.asarray(dequantize_int4(packed, scales, group))
    bound = np.repeat(np.asarray(scales, np.float32), group, axis=0) / 2
    assert np.isfinite(deq).all()
    assert (np.abs(deq - w) <= bound * (1 + 1e-6) + 1e-7).all()
    assert (np.abs(np.asarray(unpack_int4(packed))) <= 8).all()


@pytest.mark.parametrize("group,tile,dtype,m,k,n", [
    (32, None, jnp.bfloat16, 5, 128, 64),
    (64, None, jnp.float32, 20, 256, 96),
    (128, None, jnp.bfloat16, 16, 256, 32),
    (32, 32, jnp.bfloat16, 16, 192, 64),  # jaxserve.quant's layout (tile = group), K not a power of two
    (128, 128, jnp.float32, 3, 256, 32),
])
def test_int4_matmul_matches_reference(group, tile, dtype, m, k, n):
    rng = np.random.default_rng(m + k + n)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    packed, scales = quantize_int4(w, group, tile=tile)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    y = int4_matmul(x, packed, scales, group=group, tile=tile, interpret=True)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = int4_matmul_reference(x, packed, scales, group=group, tile=tile)
    assert _rel_err(y, ref) < REL_TOL[dtype]
    if dtype == jnp.float32:  # and the reference itself is x @ (the weights within scale / 2)
        assert _rel_err(ref, x @ w) < 0.2


@pytest.mark.parametrize("group,tile,dtype,sizes", [
    (32, None, jnp.bfloat16, [5, 0, 19, 3]),  # an empty expert, a row block spanning 3 experts, unused tail rows
    (64, 64, jnp.float32, [0, 0, 16, 8]),
])
def test_int4_grouped_matmul_matches_ragged_dot(group, tile, dtype, sizes):
    rng = np.random.default_rng(group)
    e, k, n, m = len(sizes), 128, 64, 30
    w = jnp.asarray(rng.standard_normal((e, k, n)), jnp.float32)
    packed, scales = jax.vmap(lambda wi: quantize_int4(wi, group, tile=tile))(w)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    y = int4_grouped_matmul(x, packed, scales, gs, group=group, tile=tile, interpret=True)
    ref = int4_grouped_matmul_reference(x, packed, scales, gs, group=group, tile=tile)
    assert y.shape == (m, n)
    assert _rel_err(y, ref) < REL_TOL[dtype]
    assert (np.asarray(y, np.float32)[sum(sizes):] == 0).all()  # rows past the experts: 0


def _qw(k=128, n=32, group=32):
    return quantize_int4(jnp.ones((k, n), jnp.float32), group)


@pytest.mark.parametrize("call,err,match", [
    (lambda: int4_matmul(jnp.ones((4, 96)), *_qw(96), group=32), ValueError, "multiple of 2 \\* group"),
    (lambda: quantize_int4(jnp.ones((96, 32)), 32), ValueError, "multiple of 2 \\* group"),
    (lambda: int4_matmul(jnp.ones((4, 128)), *_qw(), group=24), ValueError, "power of two"),
    (lambda: int4_matmul(jnp.ones((4, 128)), *_qw(group=16), group=16, tile=16), ValueError, "inner step 8"),
    (lambda: int4_matmul(jnp.ones((4, 128)), *_qw(), group=32, tile=48), ValueError, "tile=48"),
    (lambda: int4_matmul(jnp.ones((4, 128)), _qw()[0].astype(jnp.int8), _qw()[1], group=32), TypeError, "uint8"),
    (lambda: int4_matmul(jnp.ones((4, 128)), _qw()[0], _qw()[1][:2], group=32), ValueError, "scales: expected"),
    (lambda: int4_matmul(jnp.ones((4, 128), jnp.int32), *_qw(), group=32), TypeError, "x: dtype"),
    (lambda: int4_matmul(jnp.ones((4, 256)), *_qw(), group=32), ValueError, "packed: expected shape"),
    (lambda: int4_matmul(jnp.ones((4, 128)), *_qw(n=24), group=32), ValueError, "multiple of 16"),
    (lambda: int4_grouped_matmul(jnp.ones((4, 128)), *_qw(), jnp.array([4], jnp.int32), group=32),
     ValueError, "rank 3"),
    (lambda: int4_grouped_matmul(jnp.ones((4, 128)), _qw()[0][None], _qw()[1][None], jnp.array([5], jnp.int32),
                                 group=32), ValueError, "exceeds"),
    (lambda: int4_grouped_matmul(jnp.ones((4, 128)), _qw()[0][None], _qw()[1][None], jnp.array([-1], jnp.int32),
                                 group=32), ValueError, ">= 0"),
])
def test_validation_errors(call, err, match):
    with pytest.raises(err, match=match):
        call()
