"""Batch-invariant mode's ops (``quant.linear.fixed_row_tiles``): a row's result must not depend
on how many rows share the call, bitwise, for plain and quantized weights, dense and routed
experts; and the tiled result must still be the same product (checked against the whole-batch
op, which tests/test_linear.py checks against numpy)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.sampler import sample_rows
from jaxserve.quant import quantize
from jaxserve.quant.linear import expert_linear, fixed_row_tiles, linear
from jaxserve.quant.phase import PhaseWeight

ROWS = (1, 3, 8, 17, 64)
K, N, E = 256, 384, 4


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def weight(fmt, shape, seed):
    w = jnp.asarray(rand(shape, seed))
    return w if fmt is None else PhaseWeight(quantize(w, fmt), shape)


@pytest.mark.parametrize("fmt", [None, "bf16", "int8", "int4:g32"])
def test_linear_rows_do_not_depend_on_the_batch(fmt):
    w = weight(fmt, (K, N), 1)
    x = rand((64, K), 2)
    probe = rand((K,), 3)
    f = jax.jit(lambda a: linear(a, w))
    with fixed_row_tiles(8):
        got = []
        for m in ROWS:
            a = x[:m].copy()
            a[m // 2] = probe
            got.append(np.asarray(f(jnp.asarray(a)))[m // 2])
    for m, g in zip(ROWS, got):
        assert np.array_equal(g, got[0]), f"row result changed with {m} rows ({fmt})"
    # The tiles compute what one untiled call of a tile's row count does (the same matmul path:
    # a native kernel serves small row counts only, jaxserve.quant.native_paths).
    tile = np.zeros((8, K), np.float32)
    tile[0] = probe
    whole = np.asarray(jax.jit(lambda a: linear(a, w))(jnp.asarray(tile)))[0]
    np.testing.assert_allclose(got[0], whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())


@pytest.mark.parametrize("fmt", [None, "bf16", "int8"])
def test_expert_rows_do_not_depend_on_the_batch(fmt):
    w = weight(fmt, (E, K, N), 4)
    probe = rand((K,), 5)
    got = []
    with fixed_row_tiles(8):
        f = jax.jit(lambda a, s: expert_linear(a, w, s))
        for m in (1, 7, 30):
            rng = np.random.default_rng(m)
            sizes = np.bincount(rng.integers(0, E, m), minlength=E).astype(np.int32)
            e = int(np.argmax(sizes))  # the probe row goes first among expert e's rows
            a = rand((m, K), 6 + m)
            at = int(sizes[:e].sum())
            a[at] = probe
            got.append((e, np.asarray(f(jnp.asarray(a), jnp.asarray(sizes)))[at]))
        ref = {}
        for e, g in got:
            one = np.zeros(E, np.int32)
            one[e] = 1
            ref.setdefault(e, np.asarray(f(jnp.asarray(probe[None]), jnp.asarray(one)))[0])
            assert np.array_equal(g, ref[e]), f"expert {e} row changed with the batch ({fmt})"
    s = np.array([1, 0, 0, 0], np.int32)
    whole = np.asarray(jax.jit(lambda a: expert_linear(a, w, jnp.asarray(s)))(jnp.asarray(probe[None])))[0]
    np.testing.assert_allclose(ref[0] if 0 in ref else whole, whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())


def test_per_row_sampler_matches_the_batched_one_and_numpy():
    """The per-row sampler (batch-invariant mode) computes what the batched one does. Its
    invariance across batch sizes is checked end to end (tests/engine/test_schedule_invariance.py
    fails without it: a [B, V] softmax's last bits move with B inside the engine's program)."""
    v, b = 4096, 8
    logits = rand((b, v), 7) * 4
    z32, i32 = np.zeros(b, np.float32), np.zeros(b, np.int32)
    temp = np.where(np.arange(b) % 2, 0.7, 0.0).astype(np.float32)
    seeds = np.arange(b, dtype=np.int32)
    outs = [sample_rows(logits, np.arange(b, dtype=np.int32), temp, i32, np.ones(b, np.float32), z32, seeds, i32,
                        all_greedy=False, penalties=False, num_logprobs=4, per_row=per_row) for per_row in (False, True)]
    (tok0, lp0, ids0, tlp0), (tok1, lp1, ids1, tlp1) = [[np.asarray(a) for a in o] for o in outs]
    assert np.array_equal(tok0, tok1) and np.array_equal(ids0, ids1)
    np.testing.assert_allclose(lp1, lp0, atol=1e-6)
    x = logits.astype(np.float64)
    ref = x - (np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x.max(-1, keepdims=True))
    np.testing.assert_allclose(lp1, ref[np.arange(b), tok1], atol=1e-5)
    assert np.array_equal(tok1[temp == 0], np.argmax(logits, -1)[temp == 0])
