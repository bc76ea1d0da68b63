"""KV handoff device functions (jaxserve.kv.handoff) against numpy: the digest, the gather +
bf16 -> fp8 conversion, the digest-checked scatter, the byte serialization; and the engine
path between two in-process engines (the device_put transport): exact tokens, own page ids
and fresh generations on the receiving side, a bad digest failing closed or recomputed."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax.numpy as jnp

from jaxserve.kv import handoff
from jaxserve.kv.formats import get_kv_format

BF16, FP8 = get_kv_format("bf16"), get_kv_format("fp8_e4m3")


def numpy_digest(leaves) -> np.ndarray:
    """The documented checksum, written out in numpy (uint64 arithmetic reduced mod 2^32)."""
    lanes = [0, 0]
    mult, salt = (0x9E3779B1, 0x85EBCA77), (0x7F4A7C15, 0xC2B2AE3D)
    for k, leaf in enumerate(leaves):
        a = np.asarray(leaf)
        u = (a.view(np.uint32) if a.dtype.itemsize == 4 else a.astype(np.uint32)).reshape(-1).astype(np.uint64)
        pos = (np.arange(u.size, dtype=np.uint64) + ((k * 0x632BE5AB) & 0xFFFFFFFF)) % 2**32
        for lane in range(2):
            m = ((pos * mult[lane] + salt[lane]) % 2**32) | 1
            lanes[lane] = int((lanes[lane] + int(((u * m) % 2**32).sum() % 2**32)) % 2**32)
    return np.array(lanes, np.uint32)


def _leaves(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (3, 4, 5), dtype=np.uint8), rng.integers(0, 2**16, (2, 7), dtype=np.uint16),
            rng.standard_normal((4, 3)).astype(np.float32)]


def test_digest_matches_numpy_and_catches_any_change():
    leaves = _leaves()
    got = np.asarray(handoff.digest([jnp.asarray(x) for x in leaves]))
    np.testing.assert_array_equal(got, numpy_digest(leaves))
    assert handoff.parse_digest(handoff.digest_hex(got)).tolist() == got.tolist()
    flipped = [x.copy() for x in leaves]
    flipped[0][1, 2, 3] ^= 0x01  # one bit
    swapped = [x.copy() for x in leaves]
    swapped[1][0, [0, 1]] = swapped[1][0, [1, 0]]  # two elements trade places
    reshaped = [leaves[0].reshape(4, 3, 5), *leaves[1:]]  # the same bytes in another shape
    for bad in (flipped, swapped):
        assert not np.array_equal(np.asarray(handoff.digest([jnp.asarray(x) for x in bad])), got)
    moved = [leaves[1], leaves[0], leaves[2]]  # the same arrays in another order
    assert not np.array_equal(np.asarray(handoff.digest([jnp.asarray(x) for x in moved])), got)
    assert np.array_equal(np.asarray(handoff.digest([jnp.asarray(x) for x in reshaped])), got)  # bytes, not shapes


def _pools(rng, num_pages=6, page=4):
    """One GQA layer [KVH=2, P, S, D=8] (headed) and one MLA-style layer [P, S, X=16], bf16 bits."""
    def bits(shape):
        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).view(np.uint16)

    gqa = {"k": bits((2, num_pages, page, 8)), "v": bits((2, num_pages, page, 8))}
    mla = {"latent": bits((num_pages, page, 16))}
    return (gqa, mla), ({"k": 1, "v": 1}, {"latent": 0})


def _fp8_axes(axes):
    return tuple({**ax, **{k + "_scale": v for k, v in ax.items()}} for ax in axes)


def test_gather_convert_bf16_to_fp8_matches_numpy_and_zeroes_padding():
    rng = np.random.default_rng(1)
    pools, axes = _pools(rng)
    pages, n = np.array([4, 2, 5, 0], np.int32), 3  # three real pages, one padding entry
    jpools = tuple({k: jnp.asarray(v) for k, v in layer.items()} for layer in pools)
    out, d = handoff.gather_convert(jpools, jnp.asarray(pages), n, BF16, FP8, axes, _fp8_axes(axes))
    np.testing.assert_array_equal(np.asarray(d), numpy_digest(jax_leaves(out)))
    for layer, conv, ax in zip(pools, out, axes):
        for name, a in ax.items():
            x = np.take(layer[name], pages[:n], axis=a).view(ml_dtypes.bfloat16).astype(np.float32)
            scale = (np.abs(x).max(-1) / np.float32(448)).astype(np.float32)
            q = (x / np.where(scale > 0, scale, 1)[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            got_q = np.take(np.asarray(conv[name]), range(n), axis=a).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            got_s = np.take(np.asarray(conv[name + "_scale"]), range(n), axis=a)
            np.testing.assert_allclose(got_s, scale, rtol=2e-7)
            assert np.all(np.abs(got_q - q) <= np.abs(q) / 8 + 2.0**-9)  # at most one e4m3 step apart
            # The pages as the fp8 pool will read them: within fp8's error of the bf16 values.
            np.testing.assert_allclose(got_q * got_s[..., None], x, rtol=0.07, atol=1e-6)
            assert not np.take(np.asarray(conv[name]), [n], axis=a).any()  # the padding page is zero


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_same_format_export_is_a_bit_copy_and_scatter_checks_the_digest():
    rng = np.random.default_rng(2)
    src, axes = _pools(rng)
    pages = np.array([1, 3, 0, 0], np.int32)
    jsrc = tuple({k: jnp.asarray(v) for k, v in layer.items()} for layer in src)
    payload, d = handoff.gather_convert(jsrc, jnp.asarray(pages), 2, BF16, BF16, axes, axes)
    for layer, got, ax in zip(src, payload, axes):
        for name, a in ax.items():
            np.testing.assert_array_equal(np.take(np.asarray(got[name]), [0, 1], axis=a),
                                          np.take(layer[name], [1, 3], axis=a))
    dst, _ = _pools(np.random.default_rng(3))
    jdst = tuple({k: jnp.asarray(v) for k, v in layer.items()} for layer in dst)
    where = jnp.asarray([5, 2, 6, 6], np.int32)  # own page ids; 6 = out of range (padding): dropped
    bad = np.asarray(d).copy()
    bad[1] ^= 1
    same, ok, _ = handoff.verify_scatter(jdst, payload, where, jnp.asarray(bad), axes)
    assert not bool(ok)
    for a, b in zip(jax_leaves(same), jax_leaves(jdst)):
        np.testing.assert_array_equal(a, b)  # a wrong digest writes nothing
    new, ok, got = handoff.verify_scatter(jdst, payload, where, d, axes)
    assert bool(ok) and np.array_equal(np.asarray(got), np.asarray(d))
    for layer, old, orig, ax in zip(new, dst, src, axes):
        for name, a in ax.items():
            want = old[name].copy()
            idx = [slice(None)] * want.ndim
            for dst_page, src_page in ((5, 1), (2, 3)):
                idx[a] = dst_page
                want[tuple(idx)] = np.take(orig[name], src_page, axis=a)
            np.testing.assert_array_equal(np.asarray(layer[name]), want)


def test_bytes_round_trip_and_length_check():
    import jax

    rng = np.random.default_rng(4)
    leaves = [rng.integers(0, 255, (2, 4, 3, 5), dtype=np.uint8), rng.standard_normal((2, 4, 3)).astype(np.float32)]
    leaves[0][:, 3] = 0
    leaves[1][:, 3] = 0  # page 3 is padding
    p = handoff.KvPayload("fp8_e4m3", 3, 4, leaves)
    data = handoff.to_bytes(p, [1, 1])
    assert len(data) == p.nbytes == 2 * 3 * 3 * 5 + 2 * 3 * 3 * 4
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    back = handoff.from_bytes(data, specs, [1, 1], 3, "fp8_e4m3")
    for a, b in zip(back.leaves, leaves):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="bytes"):
        handoff.from_bytes(data[:-1], specs, [1, 1], 3, "fp8_e4m3")
