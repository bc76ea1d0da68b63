"""jaxserve's AMX kernels (calls of many rows on CPUs with AMX) against numpy.

AMX-BF16 (bf16, int4 groups, fp8 weights): the stored weights decoded by numpy to float32
(values * scales in float32), rounded to bf16 (nearest even, ml_dtypes), the activations
rounded to bf16 likewise, the product in float64: only the kernel's float32 accumulation
differs. AMX-INT8 (int8 per channel, W8A8): the activations quantized here per row (d =
amax / 127, rint(x / d) in float32), the integer dots in int64, the scales in float64. Odd
shapes: K and N not multiples of a tile (32 / 64 k, 16 columns), rows 17, 33, 130 (a partial
16-row tile, a 32-row block plus one row, several blocks), 300 rows of a 2000-deep weight (two
row ranges: a strip packed twice; whole tiles stored straight to y beside partial ones); M = 1
and 5 reach the AMX kernels in a subprocess with JAXSERVE_NATIVE_AMX_ROWS=1, as does int4's
bf16-tile kernel (off by default: int4 runs the W4A8 VNNI kernel at every row count). Skipped where the kernels run without AMX.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve import native
from jaxserve.quant import quantize
from jaxserve.quant.native_paths import KERNELS
from jaxserve.quant.paths import family_of
from tests.quant_reference import np_dequant32

ACC = 3e-6  # float32 accumulation, relative to the sum of |terms|

needs_amx = pytest.mark.skipif(native.status().isa != "amx", reason=f"AMX kernels not in use: {native.status().reason}")


def rand(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def bf16(a):
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def check(y, ref, mag):
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape
    err = np.abs(y - ref) / (ACC * mag + 1e-30)
    assert np.all(err <= 1), np.max(err)


def quant_rows(x):
    d = (np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    d = np.where(d > 0, d, np.float32(1)).astype(np.float32)
    return np.clip(np.rint((x / d).astype(np.float32)), -127, 127).astype(np.int64), d


SHAPES = [(17, 200, 77), (33, 1000, 200), (130, 131, 300), (16, 96, 64), (40, 577, 33), (300, 2000, 50)]
BF16_FORMATS = ["bf16", "int4:g32", "int4:g128", "fp8_e4m3", "fp8:block128"]


def check_bf16_tiles(fmt, m, k, n):
    qw = quantize(rand((k, n), seed=k + n, scale=0.05), fmt)
    x = rand((m, k), seed=m)
    xb, wb = bf16(x), bf16(np_dequant32(qw))
    y = jax.jit(KERNELS[family_of(fmt)][1])(jnp.asarray(x), qw)
    check(y, xb @ wb, np.abs(xb) @ np.abs(wb))


def check_w8a8(m, k, n):
    qw = quantize(rand((k, n), seed=k + n, scale=0.05), "int8")
    x = rand((m, k), seed=m)
    xq, xs = quant_rows(x)
    q = np.asarray(qw.values).astype(np.int64)
    scale = xs.astype(np.float64) * np.asarray(qw.scales, np.float64)
    y = jax.jit(KERNELS["int8"][1])(jnp.asarray(x), qw)
    check(y, scale * (xq @ q), scale * (np.abs(xq) @ np.abs(q)))


def check_exact(m, k, n):
    rng = np.random.default_rng(k)
    xq = rng.integers(-128, 128, (m, k), dtype=np.int8)
    q = rng.integers(-128, 128, (k, n), dtype=np.int8)
    xq[0], q[:, 0] = -128, -128  # 2500 * 128^2 > 2^24
    got = np.asarray(jax.jit(native.w8a8_s32)(jnp.asarray(xq), jnp.asarray(q)))
    np.testing.assert_array_equal(got, xq.astype(np.int64) @ q.astype(np.int64))


@needs_amx
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("fmt", BF16_FORMATS)
def test_bf16_tiles_against_numpy(fmt, m, k, n):
    fam = "fp8" if family_of(fmt).startswith("fp8") else family_of(fmt)
    if fam not in native.status().amx_rows:
        pytest.skip(f"{fmt}: no AMX kernel by default here (test_every_format_on_the_tiles_from_one_row)")
    check_bf16_tiles(fmt, m, k, n)


@needs_amx
@pytest.mark.parametrize("m,k,n", SHAPES + [(20, 1027, 65)])
def test_w8a8_tiles_against_numpy(m, k, n):
    check_w8a8(m, k, n)


@needs_amx
@pytest.mark.parametrize("m,k,n", [(17, 2500, 70), (33, 1101, 33), (130, 5, 129), (300, 5000, 40)])
def test_exact_s32_tiles(m, k, n):
    check_exact(m, k, n)


@needs_amx
def test_every_format_on_the_tiles_from_one_row():
    """JAXSERVE_NATIVE_AMX_ROWS=1 sends every call to the AMX kernels (a subprocess): 1 and 5
    rows, and int4's bf16-tile kernel (off by default) on every shape."""
    code = ("import tests.kernels.test_amx_matmul as t\n"
            "for m, k, n in [(1, 200, 77), (5, 1000, 200)] + t.SHAPES:\n"
            "    for f in t.BF16_FORMATS: t.check_bf16_tiles(f, m, k, n)\n"
            "    t.check_w8a8(m, k, n); t.check_exact(m, k, n)\n"
            "print('ok')")
    env = {**os.environ, "JAXSERVE_NATIVE_AMX_ROWS": "1", "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@needs_amx
def test_amx_rows_per_format_from_the_environment():
    """JAXSERVE_NATIVE_AMX_ROWS moves every format's tile threshold ("R") or some ("F=R,...");
    unset, int8 takes the tiles from 8 rows and bf16 and fp8 from 16 (subprocesses: read once)."""
    code = "import json\nfrom jaxserve import native\nprint(json.dumps(native.status().amx_rows))"

    def rows(value):
        env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_NATIVE_AMX_ROWS"} | {"JAX_PLATFORMS": "cpu"}
        if value is not None:
            env["JAXSERVE_NATIVE_AMX_ROWS"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                             check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    assert rows(None) == {"bf16": 16, "int8": 8, "fp8": 16}
    assert rows("4") == {"bf16": 4, "int8": 4, "int4": 4, "fp8": 4}
    assert rows("int8=2,bf16=32") == {"bf16": 32, "int8": 2, "fp8": 16}


@needs_amx
def test_isa_cap_keeps_amx_off():
    env = {**os.environ, "JAXSERVE_NATIVE_ISA": "avx512-vnni", "JAX_PLATFORMS": "cpu"}
    code = "from jaxserve import native; print(native.status().isa)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["avx512-vnni"], out.stderr[-2000:]


def test_rows_rule_per_instruction_set(monkeypatch):
    from jaxserve.quant.native_paths import ALL, AMX_MAX_ROWS, MAX_ROWS, ROWS_ENV, max_rows

    monkeypatch.delenv(ROWS_ENV, raising=False)
    assert max_rows("amx") == AMX_MAX_ROWS and AMX_MAX_ROWS["bf16"] == 64 and AMX_MAX_ROWS["int4"] == 32
    assert AMX_MAX_ROWS["int8"] == ALL  # the W8A8 tiles at every row count, prefill included
    assert max_rows("avx512-vnni") == {**MAX_ROWS, "int4": 32, "int8": 32}
    for isa in ("avx512", "avx2"):  # the AVX2 integer kernels
        assert max_rows(isa) == {**MAX_ROWS, "int4": 32, "int8": 8}
    monkeypatch.setenv(ROWS_ENV, "bf16=4,int8=0")
    assert max_rows("amx")["bf16"] == 4 and max_rows("amx")["int8"] == 0 and max_rows("amx")["int4"] == 32


@needs_amx
def test_registry_names_the_tile_kernels_and_keeps_every_row_native():
    from jaxserve.quant.native_paths import native_path
    from jaxserve.quant.paths import PATHS, XLA_PATHS

    amx_rows = native.status().amx_rows["bf16"]
    names = {f: PATHS[(f, "cpu")].name for f in ("bf16", "int8", "int4", "fp8", "fp8_block")}
    assert names == {"bf16": "cpu:native-amx-bf16", "int8": "cpu:native-amx-w8a8", "int4": "cpu:native-w4a8",
                     "fp8": "cpu:native-amx-fp8-bf16", "fp8_block": "cpu:native-amx-fp8-bf16"}
    assert "AMX-BF16" in PATHS[("bf16", "cpu")].numerics and "W8A8" in PATHS[("int8", "cpu")].numerics
    assert PATHS[("int4", "cpu")].numerics.startswith("<= 32 rows: native avx512-vnni W4A8")
    qw = quantize(rand((64, 48), seed=1), "bf16")
    for rows, native_call in ((1, True), (amx_rows, True), (64, True), (65, False)):
        text = jax.jit(PATHS[("bf16", "cpu")].dense).lower(jnp.zeros((rows, 64), jnp.float32), qw).as_text()
        assert ("jaxserve_bf16_w16a32" in text) == native_call, rows
    q8 = quantize(rand((64, 48), seed=2), "int8")
    for rows in (1, 65, 768):  # int8: the W8A8 tiles at every row count (a prefill step's 768)
        text = jax.jit(PATHS[("int8", "cpu")].dense).lower(jnp.zeros((rows, 64), jnp.float32), q8).as_text()
        assert "jaxserve_int8_w8a16" in text, rows
    assert PATHS[("int8", "cpu")].numerics.startswith("all rows: native kernels")
    cap = amx_rows - 1  # JAXSERVE_NATIVE_ROWS=bf16=<below the tiles' rows>: the decode kernel alone
    capped = native_path("bf16", XLA_PATHS[("bf16", "cpu")], cap, "amx", amx_rows)
    assert capped.name == "cpu:native-bf16-w16a32" and "more rows: cpu:bf16-dot" in capped.numerics
