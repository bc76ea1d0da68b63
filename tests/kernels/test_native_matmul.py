"""jaxserve's native CPU kernels (jaxserve.native, XLA FFI custom calls) against float64 numpy
products of the numpy-decoded stored values (tests/quant_reference.py), on odd shapes: K not
a multiple of the group or block, N not a multiple of a vector or a panel, 1-8 rows. The
W8A8 kernel must equal numpy's int64 product exactly. And: the library is built and usable on
any CPU with AVX2/FMA/F16C, the registry runs it for decode-sized batches only, and
JAXSERVE_NATIVE=0 falls back to XLA's paths, saying so.
"""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import native
from jaxserve.quant import quantize
from jaxserve.quant.paths import PATHS, XLA_PATHS
from tests.quant_reference import np_dequant32

ACC = 2e-6  # float32 accumulation, relative to |x| @ |w|


def _cpu_has(*flags):
    text = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return all(f in line.split() for f in flags)


needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status().reason}")


def test_the_library_is_built_and_runs_on_an_avx2_cpu():
    if os.environ.get(native.ENV) == "0" or not _cpu_has("avx2", "fma", "f16c"):
        pytest.skip("native kernels disabled or CPU without AVX2/FMA/F16C")
    assert native.available(), native.status().reason
    assert native.status().isa in ("avx2", "avx512", "avx512-vnni", "amx")


def rand(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def check(y, x, w32):
    x64, w64 = x.astype(np.float64), w32.astype(np.float64)
    ref, bound = x64 @ w64, ACC * (np.abs(x64) @ np.abs(w64)) + 1e-30
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape
    assert np.all(np.abs(y - ref) <= bound), np.max(np.abs(y - ref) / bound)


SHAPES = [(1, 200, 77), (3, 1000, 200), (8, 64, 136), (9, 131, 300),
          (3, 70, 8195),  # wide: bf16's row streams (N >= 8192), K % 4 = 2, a ragged last block
          (11, 37, 8224), (17, 9, 8200)]  # streams of more rows than registers; past their 16, the strips


@needs_native
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8:block128"])  # int4 / int8: test_int_matmul.py
def test_kernel_against_float64_numpy(fmt, m, k, n):
    from jaxserve.quant.native_paths import KERNELS
    from jaxserve.quant.paths import family_of

    fam = "fp8" if family_of(fmt).startswith("fp8") else family_of(fmt)
    if m >= (native.status().amx_rows or {}).get(fam, 1 << 30):  # the AMX-BF16 tiles: bf16 operands
        from tests.kernels.test_amx_matmul import check_bf16_tiles

        return check_bf16_tiles(fmt, m, k, n)
    qw = quantize(rand((k, n), seed=k + n, scale=0.05), fmt)
    x = rand((m, k), seed=m)
    _, kernel = KERNELS[family_of(fmt)]
    y = jax.jit(kernel)(jnp.asarray(x), qw)
    check(y, x, np_dequant32(qw))


@needs_native
@pytest.mark.parametrize("m,k,n", [(1, 2500, 70), (6, 1100, 33)])
def test_w8a8_is_exact_in_int32(m, k, n):
    rng = np.random.default_rng(0)
    xq = rng.integers(-127, 128, (m, k), dtype=np.int8)
    q = rng.integers(-127, 128, (k, n), dtype=np.int8)
    xq[0], q[:, 0] = 127, 127  # row 0 x column 0: 2500 * 127^2 > 2^24, past float32's exact range
    got = np.asarray(jax.jit(native.w8a8_s32)(jnp.asarray(xq), jnp.asarray(q)))
    want = xq.astype(np.int64) @ q.astype(np.int64)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@needs_native
def test_registry_runs_native_for_decode_batches_and_xla_above():
    """Without AMX (JAXSERVE_NATIVE_ISA=avx512-vnni where there is): native up to MAX_ROWS rows."""
    from jaxserve.quant.native_paths import MAX_ROWS, native_path

    isa = "avx512-vnni" if native.status().isa == "amx" else native.status().isa
    path = native_path("int4", XLA_PATHS[("int4", "cpu")], MAX_ROWS["int4"], isa)
    assert path.name == "cpu:native-w4a8"
    qw = quantize(rand((64, 48), seed=1), "int4:g32")
    for rows, native_call in ((MAX_ROWS["int4"], True), (MAX_ROWS["int4"] + 1, False)):
        text = jax.jit(path.dense).lower(jnp.zeros((rows, 64), jnp.float32), qw).as_text()
        assert ("jaxserve_int4_w4a16" in text) == native_call, rows


def test_wide_bf16_weights_take_the_kernel_for_more_rows():
    """A bf16 weight >= WIDE_N wide runs the kernel up to WIDE_ROWS rows (a verify call's rows
    over the tied head), a narrower one only up to MAX_ROWS; XLA's dot above either."""
    from jaxserve.quant.native_paths import MAX_ROWS, WIDE_N, WIDE_ROWS, native_path

    path = native_path("bf16", XLA_PATHS[("bf16", "cpu")], MAX_ROWS["bf16"], "avx512-vnni", wide=WIDE_ROWS["bf16"])
    assert f"<= {WIDE_ROWS['bf16']} on weights >= {WIDE_N} wide" in path.numerics
    cases = [(WIDE_N, WIDE_ROWS["bf16"], True), (WIDE_N, WIDE_ROWS["bf16"] + 1, False),
             (WIDE_N - 32, MAX_ROWS["bf16"], True), (WIDE_N - 32, MAX_ROWS["bf16"] + 1, False)]
    for n, rows, native_call in cases:
        qw = quantize(jnp.zeros((64, n), jnp.float32), "bf16")
        text = jax.jit(path.dense).lower(jnp.zeros((rows, 64), jnp.float32), qw).as_text()
        assert ("jaxserve_bf16_w16a32" in text) == native_call, (n, rows)


def test_disabled_by_env_falls_back_to_xla_and_says_so():
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from jaxserve.quant.paths import PATHS\n"
            "print(PATHS[('int4', 'cpu')].name, PATHS[('bf16', 'cpu')].name)")
    env = {**os.environ, native.ENV: "0", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu:int4-tiles-bf16", "cpu:bf16-dot"]
    assert out.stderr.count("native CPU kernels: disabled by JAXSERVE_NATIVE=0") == 1, out.stderr


@needs_native
def test_fp8_kernel_decodes_every_e4m3_code_exactly():
    """Every e4m3fn code but NaN (subnormals included: XLA's threads run with denormals-are-
    zero, which a decode through f32 subnormals would lose) times one-hot rows of x."""
    import ml_dtypes

    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    bits = np.tile(codes[:, None], (1, 64))
    y = np.asarray(native.fp8_w8a16(jnp.eye(len(codes), dtype=jnp.float32), jnp.asarray(bits),
                                    jnp.ones((1, 1), jnp.float32), len(codes), 64))
    np.testing.assert_array_equal(y, bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
