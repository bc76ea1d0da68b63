"""jaxserve's native grouped-by-expert kernels (the ragged MoE matmul, csrc/handlers.cc) for every
format: rows sorted by expert times the stacked weights [E, K, N], each expert's rows against its
own weight only. Checked bit for bit against a per-expert loop of the dense native kernel on
slices of the stacked weight taken in Python, with experts that get no rows, rows past the
routed total (zeros, lax.ragged_dot's rule), sizes summing past M, and odd shapes; against a
float64 numpy product of the numpy-decoded weights; and the registry runs it for the ragged form
at every row count (XLA:CPU's ragged dot multiplies every row by every expert).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import native
from jaxserve.quant import quantize
from jaxserve.quant.native_paths import GROUPED, KERNELS
from jaxserve.quant.paths import PATHS, family_of
from jaxserve.quant.qweight import QuantizedWeight
from tests.quant_reference import np_dequant32

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status().reason}")
FORMATS = ["int4:g32", "int4:g128", "int8", "bf16", "fp8_e4m3", "fp8:block128"]


def rand(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def expert(qw: QuantizedWeight, e: int) -> QuantizedWeight:
    """Expert e's own weight, sliced from the stacked one on the host."""
    return QuantizedWeight(np.asarray(qw.values)[e], None if qw.scales is None else np.asarray(qw.scales)[e],
                           qw.format, tuple(qw.shape[1:]))


def per_expert_loop(x, qw, sizes, fmt):
    dense = jax.jit(KERNELS[family_of(fmt)][1])
    out, off = np.zeros((x.shape[0], qw.shape[-1]), np.float32), 0
    for e, rows in enumerate(sizes):
        rows = int(min(max(rows, 0), x.shape[0] - off))
        if rows:
            out[off : off + rows] = np.asarray(dense(jnp.asarray(x[off : off + rows]), expert(qw, e)))
        off += rows
    return out


CASES = [  # (E, K, N, sizes, M): empty experts, a tail past the routed rows, sizes past M, negatives
    (5, 200, 77, [3, 0, 1, 4, 0], 10),
    (3, 300, 136, [0, 9, 0], 9),
    (4, 130, 33, [2, 5, 7, 1], 11),
    (6, 64, 200, [1, -2, 1, 0, 3, 0], 5),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_equals_the_dense_kernel_per_expert(fmt, case):
    e, k, n, sizes, m = CASES[case]
    qw = quantize(rand((e, k, n), seed=case, scale=0.05), fmt)
    x = rand((m, k), seed=10 + case)
    got = np.asarray(jax.jit(GROUPED[family_of(fmt)])(jnp.asarray(x), qw, jnp.asarray(sizes, jnp.int32)))
    np.testing.assert_array_equal(got, per_expert_loop(x, qw, sizes, fmt))
    routed = min(sum(max(s, 0) for s in sizes), m)
    assert not got[routed:].any() and got[:routed].any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_against_float64_numpy(fmt):
    e, k, n, sizes = 4, 256, 96, [3, 0, 2, 5]
    qw = quantize(rand((e, k, n), seed=3, scale=0.05), fmt)
    x = rand((sum(sizes), k), seed=4)
    w = np_dequant32(qw).astype(np.float64)
    want = np.concatenate([x[o : o + s].astype(np.float64) @ w[i] for i, (o, s) in
                           enumerate(zip(np.cumsum([0] + sizes[:-1]), sizes)) if s])
    bound = np.abs(np.concatenate([np.abs(x[o : o + s]).astype(np.float64) @ np.abs(w[i]) for i, (o, s) in
                                   enumerate(zip(np.cumsum([0] + sizes[:-1]), sizes)) if s]))
    got = np.asarray(jax.jit(GROUPED[family_of(fmt)])(jnp.asarray(x), qw, jnp.asarray(sizes, jnp.int32)), np.float64)
    # int4 / int8 quantize the activations to int8 (W4A8 / W8A8): up to ~1/127 of |x| @ |w|
    tol = 1.2e-2 if fmt.startswith("int") else 2e-6
    assert np.all(np.abs(got - want) <= tol * bound + 1e-30), np.max(np.abs(got - want) / (bound + 1e-30))


@pytest.mark.parametrize("fmt", ["int4:g32", "int8", "bf16", "fp8_e4m3"])
def test_registry_runs_the_grouped_kernel_for_the_ragged_form(fmt):
    qw = quantize(rand((4, 64, 48), seed=1), fmt)
    path = PATHS[(family_of(fmt), "cpu")]
    assert "grouped by expert" in path.numerics
    for rows in (1, 4096):
        text = jax.jit(path.ragged).lower(jnp.zeros((rows, 64), jnp.float32), qw, jnp.zeros((4,), jnp.int32)).as_text()
        assert f"jaxserve_{family_of(fmt).split('_')[0]}_grouped" in text and "ragged_dot" not in text, rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_experts_run_the_grouped_kernel(dtype):
    """Routed experts kept as loaded (no format): the grouped kernel on the float32 or bfloat16
    array as it is, against float64 numpy per expert; the registry's plain path calls it."""
    from jaxserve.quant.linear import expert_linear

    e, k, n, sizes = 5, 200, 77, [3, 0, 1, 4, 0]
    w = jnp.asarray(rand((e, k, n), seed=8, scale=0.05), dtype)
    x = rand((10, k), seed=9)
    got = np.asarray(jax.jit(expert_linear)(jnp.asarray(x), w, jnp.asarray(sizes, jnp.int32)), np.float64)
    w64, off = np.asarray(w.astype(jnp.float32), np.float64), 0
    for i, s in enumerate(sizes):
        want = x[off : off + s].astype(np.float64) @ w64[i]
        bound = 2e-6 * (np.abs(x[off : off + s]).astype(np.float64) @ np.abs(w64[i])) + 1e-30
        assert np.all(np.abs(got[off : off + s] - want) <= bound), i
        off += s
    assert not got[off:].any()
    text = jax.jit(expert_linear).lower(jnp.asarray(x), w, jnp.asarray(sizes, jnp.int32)).as_text()
    kernel = "jaxserve_f32_grouped" if dtype == "float32" else "jaxserve_bf16_grouped"
    assert kernel in text and "ragged_dot" not in text
