"""The quantized linear op (jaxserve.quant.linear) on every (format, backend) path, against
float64 numpy computations on the same stored values.

The numpy side decodes the stored bytes itself (nibbles, e4m3 codes, int8 codes, scales) and
models each path's documented rounding: activations rounded to bf16 (bf16 and tile paths),
weights dequantized in float32 then rounded to bf16 (tile paths), activations quantized per
row to int8 (W8A8: then the whole product is integer and must match exactly), per row per
weight group to int8 (the W4A8 native kernel), or to e4m3 (the GPU fp8 dot), or not at all (the
native CPU kernels' float forms, jaxserve.native). What is left is float32 accumulation, bounded by ``ACC * |x| @ |w|``.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve import native
from jaxserve.quant import quantize
from jaxserve.quant.linear import (BACKENDS, describe, embedding, expert_linear, head_columns, linear, matmul,
                                   path_for, ragged_matmul, tied_head, use_backend)
from jaxserve.quant.paths import PATHS, XLA_PATHS, expert_of_row, family_of, tile_cols
from jaxserve.quant.native_paths import max_rows
from jaxserve.quant.phase import PhaseWeight
from tests.quant_reference import np_dequant32

FORMATS = ["bf16", "fp8_e4m3", "fp8:block128", "int8", "int4:g32", "int4:g128"]
ACC = 2e-6  # float32 accumulation over K <= 4096 terms, relative to |x| @ |w|
BF16 = ml_dtypes.bfloat16


def rand(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def quant_rows(x, qmax, dtype):
    """The activation quantization of the W8A8 / fp8 paths, in numpy float32."""
    s = np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(qmax)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    q = np.clip(x / s, -qmax, qmax)
    return (np.rint(q) if dtype == np.int8 else q).astype(dtype), s


def quant_groups(x, group: int):
    """The W4A8 kernels' activations, in float64: x [M, K] quantized to int8 per row per group
    of ``group`` k-values (quant_rows on each group), times the group's scale."""
    m, k = x.shape
    xp = np.pad(x, ((0, 0), (0, -k % group))).reshape(m, -1, group)
    xq, sx = quant_rows(xp, 127, np.int8)
    return (xq.astype(np.float64) * sx).reshape(m, -1)[:, :k]


def reference(name, x, w32, group: int = 0):
    """-> (expected f64 [M, N], allowed |error|) for path ``name`` on x [M, K], w32 [K, N]
    (``group``: the int4 weight group, for W4A8)."""
    x64 = x.astype(np.float64)
    if name.endswith("w8a8"):
        xq, sx = quant_rows(x, 127, np.int8)
        return None, (xq, sx)  # exact integer check, done by the caller
    if name.endswith("w4a8"):  # activations quantized per row per weight group; exact int dots
        xe, we = quant_groups(x, group), w32.astype(np.float64)
    elif "native" in name:  # stored values decoded to f32 in registers, f32 activations
        xe, we = x64, w32.astype(np.float64)
    elif "fp8-dot" in name:
        xq, sx = quant_rows(x, 448, ml_dtypes.float8_e4m3fn)
        xe, we = xq.astype(np.float64) * sx, w32.astype(np.float64)
    elif "tiles" in name:
        xe, we = x.astype(BF16).astype(np.float64), w32.astype(BF16).astype(np.float64)
    elif "pallas" in name:  # W4A16: bf16 activations, the kernel's result rounded to bf16
        xe, we = x.astype(BF16).astype(np.float64), w32.astype(np.float64)
        ref = xe @ we
        return ref, ACC * (np.abs(xe) @ np.abs(we)) + 2.0**-8 * np.abs(ref) + 1e-30
    elif "bf16" in name:
        xe, we = x.astype(BF16).astype(np.float64), w32.astype(np.float64)
    else:
        xe, we = x64, w32.astype(np.float64)
    return xe @ we, ACC * (np.abs(xe) @ np.abs(we)) + 1e-30


def running(path, rows: int, qw, grouped: bool = False):
    """The path that computes ``rows`` rows: a native path hands more rows than its kernel
    takes (jaxserve.quant.native_paths.max_rows) to the XLA path it stands over, except in the
    grouped-by-expert form (``grouped``: one expert's rows), which its native kernels serve at
    every row count."""
    family = family_of(qw.format)
    if "native" in path.name and not grouped and rows > max_rows().get(family, 0):
        return XLA_PATHS[(family, "cpu")]
    if path.name.startswith("cpu:native-amx-"):  # the tile kernel from amx_rows rows, else the decode one
        amx = rows >= native.status().amx_rows["fp8" if family == "fp8_block" else family]
        small = {"int4": "w4a8", "int8": "w8a8", "bf16": "bf16-w16a32"}.get(family, "fp8-w8a16")
        name = ("cpu:native-amx-w8a8" if family == "int8" else "cpu:amx-tiles") if amx else f"cpu:native-{small}"
        return dataclasses.replace(path, name=name)
    return path


def check(path, y, x, qw, w32, grouped: bool = False):
    y = np.asarray(y, np.float64)
    path = running(path, x.shape[0], qw, grouped)
    ref, bound = reference(path.name, x, w32, getattr(qw.fmt, "group", 0))
    if ref is None:  # W8A8: int32 products are exact; only the two scale multiplies round
        xq, sx = bound
        acc = xq.astype(np.int64) @ np.asarray(qw.values).astype(np.int64)
        want = (acc.astype(np.float32) * sx) * np.asarray(qw.scales, np.float32)
        np.testing.assert_allclose(y, want, rtol=3e-7, atol=0)
        return
    assert np.all(np.abs(y - ref) <= bound), (path.name, np.max(np.abs(y - ref) / bound))


def test_every_format_family_has_a_path_on_every_backend():
    for fmt in FORMATS + [None]:
        for backend in BACKENDS:
            assert path_for(fmt, backend).name
    assert describe("int8", "cpu").startswith(("int8 -> cpu:w8a8 (", "int8 -> cpu:native-w8a8 (",
                                               "int8 -> cpu:native-w8a16 (", "int8 -> cpu:native-amx-w8a8 ("))
    assert path_for("int4:g32", "gpu").name == "gpu:pallas-int4"
    assert path_for("fp8_e4m3", "gpu").name == "gpu:fp8-dot"
    assert {b for _, b in PATHS} == {"cpu", "gpu", "interpret"}
    with pytest.raises(ValueError, match="matmul backend"):
        path_for("int8", "tpu")


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_numpy_decode(fmt):
    w = rand((200, 96), seed=1)  # K = 200: partial int4 groups and a partial 128-block
    qw = quantize(w, fmt)
    got = np.asarray(jax.jit(lambda q: q.dequantize(jnp.float32))(qw))
    np.testing.assert_array_equal(got, np_dequant32(qw))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5])
def test_matmul_path_against_float64(fmt, backend, m):
    k, n = 192, 96
    w, x = rand((k, n), seed=2), rand((m, k), seed=3)
    qw = quantize(w, fmt)
    path = path_for(fmt, backend)
    y = jax.jit(functools.partial(matmul, backend=backend))(jnp.asarray(x), qw)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    check(path, y, x, qw, np_dequant32(qw))
    # And the format's own error stays small against the unquantized product.
    exact = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert np.max(np.abs(np.asarray(y) - exact) / scale) < {"int4:g32": 0.1, "int4:g128": 0.12}.get(fmt, 0.03)


@pytest.mark.parametrize("fmt", ["fp8:block128", "int4:g32"])
def test_tiled_dequantization_spans_several_tiles(fmt):
    k, n = 4096, 640  # tile_cols = 128: five tiles, the scale blocks stay aligned
    w, x = rand((k, n), seed=4, scale=0.05), rand((3, k), seed=5)
    qw = quantize(w, fmt)
    assert tile_cols(qw) == 128
    y = jax.jit(functools.partial(matmul, backend="cpu"))(jnp.asarray(x), qw)
    check(path_for(fmt, "cpu"), y, x, qw, np_dequant32(qw))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_ragged_matmul_per_expert(fmt, backend):
    e, k, n = 4, 64, 48
    sizes = np.array([3, 0, 5, 2], np.int32)
    w, x = rand((e, k, n), seed=6), rand((12, k), seed=7)  # 12 rows, 10 routed: the last 2 come out 0
    qw = quantize(w, fmt)
    path = PATHS[(family_of(fmt), backend)]  # on CPU: the native grouped kernel where the kernels load
    y = np.asarray(jax.jit(functools.partial(ragged_matmul, backend=backend))(jnp.asarray(x), qw, jnp.asarray(sizes)))
    w32, start = np_dequant32(qw), 0
    for i, s in enumerate(sizes):
        rows = slice(start, start + s)
        if s:
            one = dict(qw.__dict__, values=np.asarray(qw.values)[i], scales=None if qw.scales is None else np.asarray(qw.scales)[i])
            check(path, y[rows], x[rows], type(qw)(**one), w32[i], grouped=True)
        start += s
    assert np.all(y[start:] == 0)
    with pytest.raises(ValueError, match="stacked experts"):
        ragged_matmul(jnp.asarray(x), quantize(w[0], fmt), jnp.asarray(sizes))


def test_expert_of_row():
    got = expert_of_row(jnp.array([2, 0, 3, 1], jnp.int32), 8)
    assert got.tolist() == [0, 0, 2, 2, 2, 3, 3, 3]


@pytest.mark.parametrize("fmt", ["int8", "int4:g32"])
def test_linear_views_and_head_tiles(fmt):
    """Parameters of other shapes: [D, H, hd] (q), [H, v, D] (o, contract=2), and MLA's kv_b
    [R, H, nope + v] read per tile of heads, against numpy einsums on the decoded weights."""
    rng = 10
    x = rand((2, 3, 64), seed=rng)
    q = rand((64, 4, 32), seed=rng + 1)
    pq = PhaseWeight(quantize(q.reshape(64, 128), fmt), q.shape)
    with use_backend("cpu"):
        y = jax.jit(linear)(jnp.asarray(x), pq)
    assert y.shape == (2, 3, 4, 32)
    dq = np_dequant32(pq.qw).reshape(q.shape)
    scale = np.einsum("btd,dhk->bthk", np.abs(x), np.abs(dq))
    assert np.all(np.abs(np.asarray(y) - np.einsum("btd,dhk->bthk", x, dq)) <= 0.02 * scale + 1e-6)
    o = PhaseWeight(quantize(rand((4, 32, 64), seed=rng + 2).reshape(128, 64), fmt), (4, 32, 64))
    with use_backend("cpu"):
        z = jax.jit(lambda a, w: linear(a, w, contract=2))(y, o)
    do = np_dequant32(o.qw).reshape(4, 32, 64)
    ref = np.einsum("bthk,hkd->btd", np.asarray(y), do)
    assert np.all(np.abs(np.asarray(z) - ref) <= 0.02 * np.einsum("bthk,hkd->btd", np.abs(np.asarray(y)), np.abs(do)) + 1e-6)
    # kv_b: R=64, 4 heads of (nope 16 + v 16); one head per tile vs all at once.
    kvb = rand((64, 4, 32), seed=rng + 3)
    pk = PhaseWeight(quantize(kvb.reshape(64, 128), fmt), kvb.shape)
    qn = jnp.asarray(rand((2, 3, 4, 16), seed=rng + 4))

    def uk(w, h0, h1):
        return jnp.einsum("bthn,rhn->bthr", qn[:, :, h0:h1], w[..., :16])

    one = head_columns(pk, 32, uk, heads_per_tile=1)
    ref = np.einsum("bthn,rhn->bthr", np.asarray(qn), np_dequant32(pk.qw).reshape(kvb.shape)[..., :16])
    np.testing.assert_allclose(np.asarray(one), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(head_columns(pk, 32, uk)), ref, rtol=1e-5, atol=1e-5)


def test_plain_weights_keep_the_plain_dot():
    w, x = rand((16, 8), seed=20), rand((3, 16), seed=21)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), jnp.asarray(w))), x @ w, rtol=1e-6, atol=1e-6)
    e = rand((2, 16, 8), seed=22)
    y = expert_linear(jnp.asarray(x), jnp.asarray(e), jnp.array([1, 2], jnp.int32))
    np.testing.assert_allclose(np.asarray(y), np.concatenate([x[:1] @ e[0], x[1:] @ e[1]]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tied_embedding_lookup_and_head(fmt):
    """A tied table [V, D] stored as the head [D, V]: the lookup gathers the tokens' columns
    (numpy-decoded rows), the head is the format's matmul."""
    v, d = 300, 136  # V not a multiple of 128: a partial fp8 block column
    table = rand((v, d), seed=30)
    pw = PhaseWeight(quantize(table.T, fmt), (v, d), transposed=True)
    tokens = jnp.array([[5, 299, 5], [0, 128, 257]], jnp.int32)
    rows = np.asarray(jax.jit(embedding)(tokens, pw))
    np.testing.assert_array_equal(rows, np_dequant32(pw.qw).T[np.asarray(tokens)])
    np.testing.assert_array_equal(np.asarray(pw.dense(jnp.float32)), np_dequant32(pw.qw).T)
    x = rand((3, d), seed=31)
    with use_backend("cpu"):
        y = jax.jit(tied_head)(jnp.asarray(x), pw)
    assert y.shape == (3, v) and y.dtype == jnp.float32
    check(path_for(fmt, "cpu"), y, x, pw.qw, np_dequant32(pw.qw))
