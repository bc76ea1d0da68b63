"""INT4 (W4A16) kernels on jaxserve.quant's int4 layout (the project's only one): the packing
layout by hand, kernel (interpret mode) and reference vs an independent numpy decode of
``Int4GroupFormat(G).quantize`` output, kernels vs the reference, and input validation."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quant.int4 import Int4GroupFormat
from pallas_kernels.int4_matmul import (
    dequantize_int4,
    int4_grouped_matmul,
    int4_grouped_matmul_reference,
    int4_matmul,
    int4_matmul_reference,
    unpack_int4,
)

REL_TOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-4}


def _rel_err(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-6)


def _quantize(w, group):
    """The project's int4 quantizer -> (packed uint8 [..., Kp/2, N], scales f32 [..., Kp/G, N])."""
    qw = Int4GroupFormat(group).quantize(np.asarray(w, np.float32))
    return jnp.asarray(qw.values), jnp.asarray(qw.scales)


def _pad_k(x, kp):
    return jnp.pad(x, ((0, 0), (0, kp - x.shape[1])))


def _numpy_decode(packed, scales, group):
    """Independent numpy decode of the documented layout -> float64 [..., Kp, N]: packed row
    t*G/2 + j holds row t*G + j (low nibble) and row t*G + G/2 + j (high nibble), two's
    complement nibbles, times scale row t."""
    b = np.asarray(packed).astype(np.int64)
    lo, hi = b & 0xF, b >> 4
    lo, hi = np.where(lo >= 8, lo - 16, lo), np.where(hi >= 8, hi - 16, hi)
    *lead, k2, n = b.shape
    q = np.zeros((*lead, 2 * k2, n), np.float64)
    half = group // 2
    for t in range(2 * k2 // group):
        q[..., t * group: t * group + half, :] = lo[..., t * half: (t + 1) * half, :]
        q[..., t * group + half: (t + 1) * group, :] = hi[..., t * half: (t + 1) * half, :]
    return q * np.repeat(np.asarray(scales, np.float64), group, axis=-2)


def test_packing_layout_by_hand():
    """Packed row t*G/2 + j: low nibble = row t*G + j, high nibble = row t*G + G/2 + j."""
    k, group = 64, 32
    codes = np.tile(np.arange(-8, 8), k // 16)  # every int4 value, each group holds -8
    # amax of each group is 3.75 -> scale 3.75 / 7.5 = 0.5 exactly; -3.75 / 0.5 = -7.5 -> -8.
    w = np.where(codes == -8, -3.75, codes * 0.5).astype(np.float32)[:, None]
    packed, scales = _quantize(w, group)
    assert packed.shape == (k // 2, 1) and packed.dtype == jnp.uint8 and scales.shape == (k // group, 1)
    np.testing.assert_array_equal(np.asarray(scales), 0.5)
    blocks = codes.reshape(k // group, 2, group // 2)
    expect = ((blocks[:, 0] & 0xF) | ((blocks[:, 1] & 0xF) << 4)).reshape(-1)
    np.testing.assert_array_equal(np.asarray(packed)[:, 0], expect)
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, group))[:, 0], codes)
    np.testing.assert_array_equal(np.asarray(dequantize_int4(packed, scales, group))[:, 0], codes * 0.5)


@pytest.mark.parametrize("group,m,k,n", [
    (32, 5, 200, 48),  # K = 200 -> Kp = 224: 24 zero-padded rows
    (128, 3, 300, 64),  # K = 300 -> Kp = 384
    (128, 17, 256, 32),  # no padding, two row blocks
])
def test_kernel_and_reference_read_the_quantizers_layout(group, m, k, n):
    """Fails if the kernel, the reference or the quantizer diverge from the documented layout:
    all three are checked against an independent float64 numpy decode."""
    rng = np.random.default_rng(group + k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed, scales = _quantize(w, group)
    kp = Int4GroupFormat(group).padded_k(k)
    assert packed.shape == (kp // 2, n) and scales.shape == (kp // group, n)
    wd = _numpy_decode(packed, scales, group)
    # The quantizer wrote the documented layout: the decode is w within scale / 2, pad rows 0.
    bound = np.repeat(np.asarray(scales, np.float64), group, axis=0)[:k] / 2
    assert (np.abs(wd[:k] - w) <= bound * (1 + 1e-6)).all()
    assert (wd[k:] == 0).all()
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ wd[:k]
    xp = _pad_k(jnp.asarray(x), kp)
    y = int4_matmul(xp, packed, scales, group=group, interpret=True)
    ref = int4_matmul_reference(xp, packed, scales, group=group)
    assert _rel_err(y, want) < 1e-5
    assert _rel_err(ref, want) < 1e-5


def test_grouped_kernel_and_reference_read_the_quantizers_layout():
    group, k, n, sizes = 32, 100, 32, [3, 0, 4]  # K = 100 -> Kp = 128
    rng = np.random.default_rng(7)
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    packed, scales = _quantize(w, group)
    wd = _numpy_decode(packed, scales, group)[:, :k]
    m = sum(sizes) + 2  # two unused tail rows
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = np.zeros((m, n))
    off = np.cumsum([0] + sizes)
    for e in range(len(sizes)):
        want[off[e]:off[e + 1]] = x[off[e]:off[e + 1]].astype(np.float64) @ wd[e]
    xp, gs = _pad_k(jnp.asarray(x), 128), jnp.asarray(sizes, jnp.int32)
    y = int4_grouped_matmul(xp, packed, scales, gs, group=group, interpret=True)
    ref = int4_grouped_matmul_reference(xp, packed, scales, gs, group=group)
    assert _rel_err(y, want) < 1e-5
    assert _rel_err(ref, want) < 1e-5


@pytest.mark.parametrize("group,dtype,scale_dtype,m,k,n", [
    (32, jnp.bfloat16, jnp.float32, 5, 128, 64),
    (64, jnp.float32, jnp.float32, 20, 256, 96),
    (128, jnp.bfloat16, jnp.float32, 16, 256, 32),
    (32, jnp.bfloat16, jnp.float32, 16, 192, 64),  # K not a power of two
    (128, jnp.float32, jnp.bfloat16, 3, 256, 32),  # bf16 scales (a cast of the f32 ones) are accepted
])
def test_int4_matmul_matches_reference(group, dtype, scale_dtype, m, k, n):
    rng = np.random.default_rng(m + k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed, scales = _quantize(w, group)
    scales = scales.astype(scale_dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    y = int4_matmul(x, packed, scales, group=group, interpret=True)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = int4_matmul_reference(x, packed, scales, group=group)
    assert _rel_err(y, ref) < REL_TOL[dtype]
    np.testing.assert_array_equal(np.asarray(int4_matmul(x, packed, scales, group=group, tile=group,
                                                         interpret=True)), np.asarray(y))  # tile=group: same
    if dtype == jnp.float32:  # and the reference itself is x @ (the weights within scale / 2)
        assert _rel_err(ref, x @ w) < 0.2


@pytest.mark.parametrize("group,dtype,sizes", [
    (32, jnp.bfloat16, [5, 0, 19, 3]),  # an empty expert, a row block spanning 3 experts, unused tail rows
    (64, jnp.float32, [0, 0, 16, 8]),
])
def test_int4_grouped_matmul_matches_ragged_dot(group, dtype, sizes):
    rng = np.random.default_rng(group)
    e, k, n, m = len(sizes), 128, 64, 30
    w = rng.standard_normal((e, k, n)).astype(np.float32)
    packed, scales = _quantize(w, group)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    y = int4_grouped_matmul(x, packed, scales, gs, group=group, interpret=True)
    ref = int4_grouped_matmul_reference(x, packed, scales, gs, group=group)
    assert y.shape == (m, n)
    assert _rel_err(y, ref) < REL_TOL[dtype]
    assert (np.asarray(y, np.float32)[sum(sizes):] == 0).all()  # rows past the experts: 0


def _qw(k=128, n=32, group=32):
    return _quantize(np.ones((k, n), np.float32), group)


@pytest.mark.parametrize("call,err,match", [
    (lambda: int4_matmul(jnp.ones((4, 100)), *_qw(), group=32), ValueError, "multiple of group=32"),
    (lambda: int4_matmul(jnp.ones((4, 128)), *_qw(), group=24), ValueError, "power of two"),
    (lambda: int4_matmul(jnp.ones((4, 128)), *_qw(group=16), group=16), ValueError, "group=16 .* >= 32"),
    (lambda: int4_matmul(jnp.ones((4, 128)), *_qw(), group=32, tile=48), ValueError, "tile=48"),
    (lambda: int4_matmul(jnp.ones((4, 128)), *_qw(), group=32, tile=128), ValueError, "tile=128"),  # no tile = K
    (lambda: int4_matmul_reference(jnp.ones((4, 128)), *_qw(), group=32, tile=128), ValueError, "tile=128"),
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
