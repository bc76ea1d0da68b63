"""Sparse MLA attention (each query row reads only its chosen slots): the Pallas kernel in
interpret mode against the pure-jnp reference, and the reference against a numpy loop.

Every slot no row chose is poisoned with NaN (values and fp8 scales), so a kernel that reads
past its list, or lets a -1 pick through, fails on finiteness. Rows cover a full list, a list
with unused (-1) picks, a list shorter than a chunk and an empty one (padding query); K is not a
multiple of the chunk.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kv.formats import get_kv_format
from pallas_kernels.paged_attention import physical_slots, sparse_attention_mla, sparse_attention_mla_reference

P, S = 24, 8
TOL = {"float32": dict(atol=1e-5, rtol=1e-5), "bf16": dict(atol=2e-2, rtol=2e-2),
       "fp8_e4m3": dict(atol=2e-2, rtol=2e-2)}
Q_DTYPE = {"float32": jnp.float32, "bf16": jnp.bfloat16, "fp8_e4m3": jnp.bfloat16}


def make_slots(rng, n: int, k: int):
    """-> slots [N, K] int32 (distinct physical ids per row, -1 = none), used [P*S] bool."""
    slots = np.stack([rng.choice(np.arange(S, P * S), size=k, replace=False) for _ in range(n)])  # never page 0
    slots[1, k // 2:] = -1  # a query that sees fewer than K tokens
    slots[2, 3:] = -1  # shorter than one chunk
    slots[3, :] = -1  # a padding query: nothing to attend to
    used = np.zeros(P * S, bool)
    used[slots[slots >= 0]] = True
    return slots.astype(np.int32), used


def make_pool(rng, fmt_name: str, width: int, used):
    """Random [P, S, width] pool in the format, NaN in every slot nobody chose -> (values, scales)."""
    fmt = get_kv_format(fmt_name)
    q, s = fmt.quantize(jnp.asarray(rng.standard_normal((P, S, width)).astype(np.float32) * 2.0))
    q = np.asarray(q.astype(jnp.float32)) if not fmt.scaled else np.asarray(q)
    keep = used.reshape(P, S)
    q = np.where(keep[..., None], q, np.nan).astype(np.asarray(jnp.zeros((), fmt.dtype)).dtype)
    if s is not None:
        s = jnp.asarray(np.where(keep, np.asarray(s), np.nan).astype(np.float32))
    return jnp.asarray(q), s


def numpy_sparse_mla(q_lat, q_rope, lat, rope, ls, rs, slots, scale):
    """A plain loop over rows and their chosen slots, float64."""
    flat = lambda x, sc: (np.asarray(x, np.float64).reshape(P * S, -1)  # noqa: E731
                          * (1.0 if sc is None else np.asarray(sc, np.float64).reshape(P * S, 1)))
    lat, rope = flat(lat.astype(jnp.float32), ls), flat(rope.astype(jnp.float32), rs)
    ql, qr = np.asarray(q_lat, np.float64), np.asarray(q_rope, np.float64)
    n, h, r = ql.shape
    out, lse = np.zeros((n, h, r)), np.full((n, h), -np.inf)
    for i in range(n):
        ids = slots[i][slots[i] >= 0]
        if len(ids) == 0:
            continue
        s = (ql[i] @ lat[ids].T + qr[i] @ rope[ids].T) * scale  # [H, k]
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        out[i] = p @ lat[ids] / p.sum(-1, keepdims=True)
        lse[i] = m[:, 0] + np.log(p.sum(-1))
    return out, lse


CASES = [  # (format, heads, K, block_tokens)
    ("float32", 4, 40, 16),
    ("bf16", 8, 40, 32),
    ("bf16", 20, 24, 16),  # heads padded to two blocks of 16
    ("fp8_e4m3", 16, 56, 32),
]


@pytest.mark.parametrize("fmt,heads,k,block_tokens", CASES)
def test_kernel_matches_reference_and_numpy(fmt, heads, k, block_tokens):
    rng = np.random.default_rng(heads * 100 + k)
    r, dr, n = 32, 16, 5
    slots, used = make_slots(rng, n, k)
    lat, ls = make_pool(rng, fmt, r, used)
    rope, rs = make_pool(rng, fmt, dr, used)
    q_lat = jnp.asarray(rng.standard_normal((n, heads, r)) * 0.3, Q_DTYPE[fmt])
    q_rope = jnp.asarray(rng.standard_normal((n, heads, dr)) * 0.3, Q_DTYPE[fmt])
    scale = (r + dr) ** -0.5
    args = (q_lat, q_rope, lat, rope, ls, rs, jnp.asarray(slots))
    out, lse = sparse_attention_mla(*args, scale=scale, interpret=True, block_tokens=block_tokens)
    assert out.shape == (n, heads, r) and out.dtype == q_lat.dtype and lse.shape == (n, heads)
    out32, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.isfinite(out32).all(), "NaN/inf from an unchosen slot leaked into the output"
    assert (out32[3] == 0).all() and np.isneginf(lse[3]).all()  # the empty row
    ref_out, ref_lse = sparse_attention_mla_reference(*args, scale=scale)
    np.testing.assert_allclose(out32, np.asarray(ref_out, np.float32), **TOL[fmt])
    np.testing.assert_allclose(lse[[0, 1, 2, 4]], np.asarray(ref_lse)[[0, 1, 2, 4]], atol=2e-3, rtol=1e-3)
    np.testing.assert_array_equal(np.isneginf(np.asarray(ref_lse)), np.isneginf(lse))
    want_out, want_lse = numpy_sparse_mla(q_lat, q_rope, lat, rope, ls, rs, slots, scale)
    np.testing.assert_allclose(np.asarray(ref_out, np.float64), want_out, **TOL[fmt])
    np.testing.assert_allclose(np.asarray(ref_lse)[[0, 1, 2, 4]], want_lse[[0, 1, 2, 4]], atol=2e-3, rtol=1e-3)


def test_physical_slots_against_numpy():
    table = np.array([[5, 2, 9, 30], [3, -1, 4, 6]], np.int32)  # 30: not a page; -1: unmapped
    pos = np.array([[[0, 7, 8, 17, 26, -1]], [[2, 9, 16, 31, 32, 40]]], np.int32)  # [B, T=1, K]
    got = np.asarray(physical_slots(jnp.asarray(table), jnp.asarray(pos), 8, 24))
    want = np.full(pos.shape, -1)
    for b in range(2):
        for j, p in enumerate(pos[b, 0]):
            if 0 <= p < 32 and 0 <= table[b, p // 8] < 24:
                want[b, 0, j] = table[b, p // 8] * 8 + p % 8
    np.testing.assert_array_equal(got, want)
    assert (got[0, 0, :4] == [40, 47, 16, 73]).all() and got[0, 0, 4] == -1 and got[1, 0, 1] == -1


@pytest.mark.parametrize("override,err,match", [
    (dict(slots=np.full((5, 8), P * S, np.int32)), ValueError, "outside"),
    (dict(slots=np.zeros((4, 8), np.int32)), ValueError, "rows"),
    (dict(slots=np.zeros((5, 8), np.float32)), TypeError, "int32"),
    (dict(block_tokens=24), ValueError, "block_tokens"),
])
def test_validation_errors(override, err, match):
    rng = np.random.default_rng(0)
    lat, _ = make_pool(rng, "bf16", 32, np.ones(P * S, bool))
    rope, _ = make_pool(rng, "bf16", 16, np.ones(P * S, bool))
    kw = dict(slots=np.zeros((5, 8), np.int32), block_tokens=16)
    kw.update(override)
    q = jnp.zeros((5, 4, 32), jnp.bfloat16)
    with pytest.raises(err, match=match):
        sparse_attention_mla(q, jnp.zeros((5, 4, 16), jnp.bfloat16), lat, rope, None, None, jnp.asarray(kw["slots"]),
                             scale=0.1, interpret=True, block_tokens=kw["block_tokens"])
