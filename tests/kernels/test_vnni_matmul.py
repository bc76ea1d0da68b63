"""jaxserve's AVX512-VNNI integer kernels (W4A8 for int4 groups, W8A8 for int8 per channel, the
exact s8 x s8 -> s32 entry) against numpy: the activations quantized independently here
(per row per weight group for int4, per row for int8: scale d = amax / 127, rint of x / d,
round half to even, in float32 as the kernel and jaxserve's XLA W8A8 path do), the stored weights decoded here
from their bytes, the integer dots in int64 and the rest in float64. So the match is tight:
only the kernels' float32 scaling and accumulation differ. Odd shapes: N not a multiple of a
vector or a 64-column panel, K not a multiple of 4 or of the group, 1-9 rows. The float
kernels stay reachable on this CPU with JAXSERVE_NATIVE_ISA=avx512 (checked in a subprocess).
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import native
from jaxserve.quant import get_weight_format, quantize
from jaxserve.quant.native_paths import KERNELS

ACC = 3e-6  # float32 scaling and accumulation, relative to the sum of |terms|

needs_vnni = pytest.mark.skipif(native.status().isa not in ("avx512-vnni", "amx"),  # amx: below its tile rows
                                reason=f"VNNI kernels not in use: {native.status().reason}")


def rand(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def quant_rows(x):
    """int8 codes and float32 scales of x [..., n], one scale over the last axis: d = amax / 127
    (1 where amax is 0), codes rint(x / d) in float32 (jaxserve's W8A8 convention)."""
    d = (np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    d = np.where(d > 0, d, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint((x / d).astype(np.float32)), -127, 127).astype(np.int64)
    return q, d


def int4_codes(qw):
    """The stored nibbles as signed ints [Kp, N] (plain k order)."""
    g = get_weight_format(qw.format).group
    b = np.asarray(qw.values).astype(np.int64).reshape(-1, g // 2, qw.shape[1])
    lo, hi = b & 15, b >> 4
    q = np.stack([lo, hi], axis=1).reshape(-1, qw.shape[1])
    return np.where(q >= 8, q - 16, q)


def check(y, ref, mag):
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape
    err = np.abs(y - ref) / (ACC * mag + 1e-30)
    assert np.all(err <= 1), np.max(err)


SHAPES = [(1, 200, 77), (3, 1000, 200), (5, 96, 64), (8, 64, 136), (9, 130, 300)]
W4_SHAPES = SHAPES + [(13, 160, 700), (17, 64, 129)]  # rows past one shared unpacking (8)


@needs_vnni
@pytest.mark.parametrize("m,k,n", W4_SHAPES)
@pytest.mark.parametrize("fmt", ["int4:g32", "int4:g128"])
def test_w4a8_against_numpy(fmt, m, k, n):
    qw = quantize(rand((k, n), seed=k + n, scale=0.05), fmt)
    g = get_weight_format(fmt).group
    x = rand((m, k), seed=m)
    q = int4_codes(qw)  # [Kp, N]
    kp, t = q.shape[0], q.shape[0] // g
    xp = np.pad(x, ((0, 0), (0, kp - k))).reshape(m, t, g)
    xq, xs = quant_rows(xp)  # [m, t, g], [m, t, 1]
    dots = np.einsum("mtg,tgn->mtn", xq, q.reshape(t, g, n))  # exact int64
    terms = xs.astype(np.float64) * np.asarray(qw.scales, np.float64)[None] * dots
    y = jax.jit(KERNELS["int4"][1])(jnp.asarray(x), qw)
    check(y, terms.sum(axis=1), np.abs(terms).sum(axis=1))


@needs_vnni
@pytest.mark.parametrize("fmt", ["int4:g32", "int4:g128"])
def test_w4a8_rows_do_not_depend_on_the_batch(fmt):
    """A row's W4A8 result is bit for bit the same alone and among 2..17 rows, whichever way
    the kernel groups the rows (one at a time, chunks of 4, chunks sharing one unpacking of the
    weights): what makes a verify call's and a batch's tokens the same as a lone decode's."""
    qw = quantize(rand((256, 900), seed=7, scale=0.05), fmt)
    f = jax.jit(KERNELS["int4"][1])
    x = rand((17, 256), seed=3)
    alone = np.concatenate([np.asarray(f(jnp.asarray(x[i : i + 1]), qw)) for i in range(17)])
    for m in (2, 4, 5, 8, 9, 12, 13, 16, 17):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:m]), qw)), alone[:m], err_msg=f"{m} rows")


@needs_vnni
@pytest.mark.parametrize("m,k,n", SHAPES + [(2, 1027, 65)])
def test_w8a8_against_numpy(m, k, n):
    qw = quantize(rand((k, n), seed=k + n, scale=0.05), "int8")
    x = rand((m, k), seed=m)
    xq, xs = quant_rows(x)
    q = np.asarray(qw.values).astype(np.int64)
    scale = xs.astype(np.float64) * np.asarray(qw.scales, np.float64)  # [m, n]
    y = jax.jit(KERNELS["int8"][1])(jnp.asarray(x), qw)
    check(y, scale * (xq @ q), scale * (np.abs(xq) @ np.abs(q)))


@needs_vnni
@pytest.mark.parametrize("m,k,n", [(1, 2500, 70), (6, 1101, 33), (9, 5, 129)])
def test_exact_s32_with_vnni(m, k, n):
    rng = np.random.default_rng(k)
    xq = rng.integers(-128, 128, (m, k), dtype=np.int8)
    q = rng.integers(-128, 128, (k, n), dtype=np.int8)
    xq[0], q[:, 0] = -128, -128  # the extreme codes: 2500 * 128^2 > 2^24
    got = np.asarray(jax.jit(native.w8a8_s32)(jnp.asarray(xq), jnp.asarray(q)))
    np.testing.assert_array_equal(got, xq.astype(np.int64) @ q.astype(np.int64))


@needs_vnni
def test_registry_says_the_activations_are_quantized():
    from jaxserve.quant.paths import PATHS

    assert "W4A8" in PATHS[("int4", "cpu")].numerics
    if ("int8", "cpu") in PATHS and PATHS[("int8", "cpu")].name.startswith("cpu:native"):
        assert "W8A8" in PATHS[("int8", "cpu")].numerics


@needs_vnni
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_the_float_kernels_still_pass_without_vnni(isa):
    """JAXSERVE_NATIVE_ISA caps the kernels: the float int4 / int8 kernels (f32 activations),
    as CPUs without VNNI run them, against float64 numpy (test_native_matmul) in a subprocess."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "JAXSERVE_NATIVE_ISA": isa, "JAX_PLATFORMS": "cpu"}
    code = f"from jaxserve import native; assert native.status().isa == {isa!r}, native.status()"
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                          os.path.join(here, "test_native_matmul.py"), "-k", "float64_numpy and int"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(here)))
    assert out.returncode == 0 and " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]
