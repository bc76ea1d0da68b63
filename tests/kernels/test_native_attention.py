"""jaxserve's native paged GQA attention kernel (``jaxserve.native.gqa_paged``) against a float64
numpy reference of its definition: every stored K/V value decoded in numpy (bf16 and e4m3 bits
through ml_dtypes, e4m3 times its vector's scale), query t of row b at position cached + t
attending to the row's positions <= its own below cached + new, read through the page table.
Odd head sizes (not a multiple of either vector width), several queries per row and per KV
head (more than the kernel weighs at once), pages that straddle its blocks of positions, padding rows and queries, unused pages poisoned with NaN (a read of one shows), and a
bad page id (its keys left out, nothing read out of bounds). Both instruction sets: the AVX2
copy runs in a subprocess where the machine has AVX-512. And the "native" backend inside the
engine gives the XLA backend's greedy tokens."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve import native

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status().reason}")

CASES = [  # B, T, H, KVH, D, page size, pages, table width
    (3, 1, 9, 3, 64, 16, 40, 8),
    (2, 5, 4, 2, 24, 8, 30, 9),
    (4, 9, 8, 1, 128, 4, 64, 20),
    (1, 3, 6, 6, 13, 16, 6, 3),
    (2, 2, 14, 2, 48, 12, 30, 12),  # 7 queries a KV head; pages of 12 straddle the 32-position blocks
    (2, 37, 6, 2, 32, 16, 40, 10),  # a prefill chunk: three items of up to 16 queries a (row, KV head)
]


def make_pools(rng, fmt: str, shape):
    """Random K/V pools [KVH, P, S, D] as the engine stores them -> (k, v, k_scale, v_scale, k64, v64)."""
    out = []
    for _ in range(2):
        x = rng.standard_normal(shape).astype(np.float32) * 2
        if fmt == "float32":
            out.append((x, None, x.astype(np.float64)))
        elif fmt == "bf16":
            b = x.astype(ml_dtypes.bfloat16)
            out.append((b.view(np.uint16), None, b.astype(np.float64)))
        else:
            scale = (np.abs(x).max(-1) / 448.0).astype(np.float32)
            q = (x / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
            out.append((q.view(np.uint8), scale, q.astype(np.float64) * scale[..., None].astype(np.float64)))
    (k, ks, k64), (v, vs, v64) = out
    return k, v, ks, vs, k64, v64


def reference(q, k64, v64, table, cached, new, scale):
    """float64 attention by definition: q [B, T, H, D] -> [B, T, H, D]."""
    b_, t_, h_, d_ = q.shape
    kvh, p_, s_ = k64.shape[:3]
    g = h_ // kvh
    out = np.zeros((b_, t_, h_, d_))
    for b in range(b_):
        total = cached[b] + new[b]
        for t in range(t_):
            see = [p for p in range(min(cached[b] + t + 1, total))]
            keep = [p for p in see if 0 <= table[b, p // s_] < p_]
            if not keep:
                continue
            for h in range(h_):
                kh = h // g
                ks = np.stack([k64[kh, table[b, p // s_], p % s_] for p in keep])
                vs = np.stack([v64[kh, table[b, p // s_], p % s_] for p in keep])
                sc = ks @ q[b, t, h].astype(np.float64) * scale
                w = np.exp(sc - sc.max())
                out[b, t, h] = (w / w.sum()) @ vs
    return out


def run_case(fmt: str, case, seed: int = 0, bad_page: bool = False):
    b, t, h, kvh, d, s, p, m = case
    rng = np.random.default_rng(seed)
    k, v, ks, vs, k64, v64 = make_pools(rng, fmt, (kvh, p, s, d))
    table = rng.permutation(p)[: b * m].reshape(b, m) if b * m <= p else rng.integers(0, p, (b, m))
    table = table.astype(np.int32)
    cached = rng.integers(0, m * s - t, b).astype(np.int32)
    new = rng.integers(1, t + 1, b).astype(np.int32)
    if b > 1:
        new[-1], cached[-1] = 0, 0  # a padding row
    used = np.zeros(p, bool)
    for r in range(b):
        used[table[r, : -(-(cached[r] + new[r]) // s)]] = True
    for pool in (k, v):  # pages no row reads: NaN (e4m3 and bf16 bit patterns of NaN too)
        pool[:, ~used] = {np.float32: np.nan, np.uint16: 0x7FC0, np.uint8: 0x7F}[pool.dtype.type]
    if bad_page:
        table[0, 0] = p + 5  # out of range: those keys are left out
        table[0, 1] = -1
    q = (rng.standard_normal((b, t, h, d)) * 0.7).astype(np.float32)
    scale = 1.0 / np.sqrt(d)
    got = jax.jit(native.gqa_paged, static_argnums=8)(
        q, k, v, None if ks is None else jnp.asarray(ks), None if vs is None else jnp.asarray(vs),
        table, cached, new, float(scale))
    want = reference(q, k64, v64, table, cached, new, scale)
    got = np.asarray(got)
    valid = np.arange(t)[None, :] < new[:, None]  # padding queries' outputs are discarded
    assert np.isfinite(got[valid]).all()
    assert not got[~valid].any()  # ... and not computed: zeros
    np.testing.assert_allclose(got[valid], want[valid], rtol=0, atol=2e-5 * max(1.0, np.abs(want).max()))


@needs_native
@pytest.mark.parametrize("fmt", ["float32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("case", CASES)
def test_gqa_paged_matches_numpy(fmt, case):
    run_case(fmt, case)


@needs_native
def test_a_querys_bits_do_not_depend_on_the_step_it_is_in():
    """Each query of a 37-query step (the kernel's items: up to 16 queries) against the same
    query alone, as a one-query step at its own position: the same bits."""
    b, t, h, kvh, d, s, p, m = CASES[-1]
    rng = np.random.default_rng(5)
    k, v, _, _, _, _ = make_pools(rng, "bf16", (kvh, p, s, d))
    table = rng.permutation(p)[: b * m].reshape(b, m).astype(np.int32)
    cached = np.array([20, 3], np.int32)
    new = np.array([t, 30], np.int32)
    q = (rng.standard_normal((b, t, h, d)) * 0.7).astype(np.float32)
    call = jax.jit(native.gqa_paged, static_argnums=8)
    whole = np.asarray(call(q, k, v, None, None, table, cached, new, 0.125))
    for i in (0, 15, 16, 17, 31, 36):
        one = np.asarray(call(q[:, i : i + 1], k, v, None, None, table, cached + i, new - i, 0.125))
        np.testing.assert_array_equal(one[0, 0], whole[0, i])
        if i < new[1]:
            np.testing.assert_array_equal(one[1, 0], whole[1, i])


@needs_native
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_bad_page_ids_are_left_out_not_read(fmt):
    run_case(fmt, CASES[0], seed=3, bad_page=True)


@needs_native
def test_avx2_copy_matches_numpy():
    if native.status().isa == "avx2":
        pytest.skip("this machine runs the AVX2 copy in every test above")
    code = ("from tests.kernels.test_native_attention import CASES, run_case\n"
            "for fmt in ('float32', 'bf16', 'fp8_e4m3'):\n"
            "    for case in CASES: run_case(fmt, case)\n"
            "run_case('fp8_e4m3', CASES[0], seed=3, bad_page=True)\n"
            "from jaxserve import native; print(native.status().isa)\n")
    env = {**os.environ, "JAXSERVE_NATIVE_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "avx2"


@needs_native
def test_rejects_bad_shapes():
    q = jnp.zeros((1, 1, 4, 8), jnp.float32)
    pool = jnp.zeros((3, 4, 2, 8), jnp.float32)  # 4 heads do not divide over 3 KV heads
    with pytest.raises(Exception, match="gqa_paged"):
        native.gqa_paged(q, pool, pool, None, None, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32),
                         jnp.ones((1,), jnp.int32), 1.0).block_until_ready()
