"""The native CPU matmul paths: jaxserve.native's kernels, XLA's where they do not pay.

A native path multiplies the stored weight bytes as they are (int4 groups, fp8 e4m3 with
channel or block scales, int8 per channel, bf16). The decode kernels (few rows) decode bf16
and fp8 to float32 in registers, with float32 activations and float32 accumulation; int4 and
int8 run integer dots on every instruction set (W4A8: activations quantized to int8 per row
per weight group; W8A8: per row), exact in int32, scaled in float32: with AVX512-VNNI
(vpdpbusd) where cpuid has it, else with AVX2 (vpmaddubsw + vpmaddwd), the same numerics to
the bit. With AMX, calls of many rows run tile kernels (``AMX``: AMX-BF16 for bf16, int4 and
fp8 decoded to bf16 tiles, AMX-INT8 W8A8 for int8). Which formats get a native path, and up
to how many rows, is ``max_rows()``: per instruction set (``AMX_MAX_ROWS`` with AMX,
``MAX_ROWS`` updated by ``VNNI_ROWS`` or ``MADD_ROWS`` without), measured side by side
against XLA's paths (BENCHMARKS.md, "Native CPU kernels (issue 28)" and "AVX2 integer
kernels"); above it the XLA formulation the path replaces (``fallback``) runs. The choice is
made at trace time from the batch's static row count, so a compiled program holds exactly
one of the two.

The grouped-by-expert (ragged MoE) form runs the native grouped kernels at every row count:
each expert that has rows runs the dense kernel on its rows and its own weight bytes, and an
expert without rows is not read. XLA:CPU's ragged dot computes every row against every expert
(measured 26x to 330x slower on 64 experts of 1024 x 512, 8 to 8,192 routed rows,
``bench/native_grouped.py``), so no row count is left to it.
"""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxserve import native
from jaxserve.quant.qweight import QuantizedWeight

ALL = 1 << 30  # "every row count"
# Formats with a native path and the most rows it serves, per instruction set (measured, see
# the module docstring); JAXSERVE_NATIVE_ROWS="int8=8,bf16=1" overrides entries (for measuring;
# 0 = XLA's path). Without AMX the decode kernels serve the decode buckets:
MAX_ROWS = {"int4": 8, "fp8": 8, "fp8_block": 8, "bf16": 4, "int8": 4}
# With AVX512-VNNI the W4A8 kernel beat XLA's dequantizing int4 path up to 32 rows (3.2x at 16,
# 3.3x at 32 with AMX off; level at 64), so it serves int4 there; the W8A8 walk beat XLA's W8A8
# dot up to 32 rows on a Zen 4 (the decode skeleton: 14.3 against 24.5 ms at 16 rows, 27.5
# against 43.2 at 32) and lost from 48 (70.7 against 50.9). (A Sapphire Rapids with AMX off,
# which no deployment runs, had it losing from 16: 16.7 against 13.5 ms.)
VNNI_ROWS = {"int4": 32, "int8": 32}
# Without AVX512-VNNI the integer kernels run on AVX2 (vpmaddubsw): on a 2-core AMD EPYC
# (Zen 2, AVX2 only) int4 W4A8 beat XLA's int4 path at every row count to 32 (1.87x against
# 1.61x float32 there), int8 W8A8 beat XLA's W8A8 dot to 8 rows (3.46x against 3.05x) and lost
# at 16 (2.47x against 2.73x):
MADD_ROWS = {"int4": 32, "int8": 8}
# With AMX the tile kernels take calls of native.status().amx_rows[family] rows and more, the
# decode kernels the fewer: they beat XLA's paths up to 64 rows (bf16 1.4x at 32, fp8 2.6x at
# 64, int8 1.2x at 32-64), bf16 and fp8 level or behind at 256, so XLA's take over above 64
# (int4: W4A8, 32). int8's W8A8 tiles serve every row count: with calls of many rows on XLA's
# pool (the native library's PoolRows) they ran a SmolLM2 layer's matmuls 1.3-1.7x faster than
# XLA's W8A8 dot from 64 to 768 rows, and an int8 prefill step of 8 x 96 tokens in 236 against
# 271 ms (BENCHMARKS.md, "Prefill on the AMX tiles, and the helper threads out of its way").
AMX_MAX_ROWS = {"int4": 32, "fp8": 64, "fp8_block": 64, "bf16": 64, "int8": ALL}
# On AVX-512 without AMX, bf16 weights at least WIDE_N wide (a tied head) run the kernel's row
# streams, which read the weight once for up to 16 rows: on a 576 x 49152 head (Zen 4, 2 cores)
# 3.6-4.1 ms against XLA's 4.4-5.1 ms from 8 to 11 rows, level or behind from 12 (a verify call
# of k + 1 rows at one request runs there). Narrower bf16 weights keep MAX_ROWS.
WIDE_N = 8192
WIDE_ROWS = {"bf16": 11}
ROWS_ENV = "JAXSERVE_NATIVE_ROWS"


def max_rows(isa: str | None = None) -> dict[str, int]:
    """The rows each format's native path serves for the kernels' instruction set (that of
    jaxserve.native unless given), with the JAXSERVE_NATIVE_ROWS overrides."""
    if isa is None and native.available():
        isa = native.status().isa
    out = dict(AMX_MAX_ROWS if isa == "amx" else MAX_ROWS)
    if isa == "avx512-vnni":
        out.update(VNNI_ROWS)
    elif isa != "amx":
        out.update(MADD_ROWS)
    out.update(row_overrides())
    return out


def row_overrides() -> dict[str, int]:
    """JAXSERVE_NATIVE_ROWS as {family: rows}."""
    out = {}
    for part in filter(None, (p.strip() for p in os.environ.get(ROWS_ENV, "").split(","))):
        fam, _, rows = part.partition("=")
        if fam not in KERNELS or not rows.strip().isdigit():
            raise ValueError(f"{ROWS_ENV}: {part!r} is not FAMILY=ROWS with FAMILY one of {sorted(KERNELS)}")
        out[fam] = int(rows)
    return out


NUMERICS = "{kind}: stored bytes decoded to f32 in registers, f32 activations, f32 accumulation"
# What the integer kernels (jaxserve.native: VNNI on isa "avx512-vnni", and "amx" below its tile
# rows; AVX2 elsewhere) do instead of NUMERICS.
INT_NUMERICS = {
    "int4": ("W4A8", "activations quantized to int8 per row per weight group (d = amax/127, rint(x/d)), "
                     "int4 x int8 group dots exact in int32, times the weight and activation scales, f32 accumulation"),
    "int8": ("W8A8", "activations quantized to int8 per row (d = amax/127, rint(x/d)), int8 x int8 dots "
                     "exact in int32, times the weight and activation scales in f32"),
}
# The AMX tile kernels (isa "amx", from native.status().amx_rows[family] rows): the name's tail,
# numerics. int4 has none by default: its bf16 tiles lost to the W4A8 VNNI kernel at every row
# count measured (BENCHMARKS.md, issue 28, 2026-12-02), so it runs W4A8 at every row count.
_TILES = "decoded to f32 (times the scale) and rounded to bf16, activations rounded to bf16, bf16 x bf16 " \
         "products accumulated in f32 (AMX-BF16)"
AMX = {
    "bf16": ("bf16", "bf16 weights as they are, activations rounded to bf16, f32 accumulation (AMX-BF16)"),
    "int4": ("int4-bf16", "int4 nibbles " + _TILES),
    "fp8": ("fp8-bf16", "e4m3 weights " + _TILES),
    "fp8_block": ("fp8-bf16", "e4m3 weights " + _TILES),
    "int8": ("w8a8", INT_NUMERICS["int8"][1] + " (AMX-INT8; weights more than 16384 deep from 16 rows)"),
}


def int4_dense(x, qw: QuantizedWeight):
    kp = 2 * qw.values.shape[-2]
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kp - x.shape[1])))
    return native.int4_w4a16(xp, qw.values, qw.scales, qw.fmt.group)


def fp8_dense(x, qw: QuantizedWeight):
    bk, bn = qw.fmt.scale_block
    # the e4m3 array as it is: a bitcast to uint8 here would be a copy of the weight per call
    return native.fp8_w8a16(x, qw.values, qw.scales, bk or qw.shape[0], max(bn, 1))


def int8_dense(x, qw: QuantizedWeight):
    return native.int8_w8a16(x, qw.values, qw.scales)


def bf16_dense(x, qw: QuantizedWeight):
    return native.bf16_w16a32(x, qw.values)


KERNELS = {"int4": ("w4a16", int4_dense), "fp8": ("fp8-w8a16", fp8_dense), "fp8_block": ("fp8-w8a16", fp8_dense),
           "int8": ("w8a16", int8_dense), "bf16": ("bf16-w16a32", bf16_dense)}


def int4_grouped(x, qw: QuantizedWeight, sizes):
    kp = 2 * qw.values.shape[-2]
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kp - x.shape[1])))
    return native.int4_grouped(xp, qw.values, qw.scales, sizes, qw.fmt.group)


def fp8_grouped(x, qw: QuantizedWeight, sizes):
    bk, bn = qw.fmt.scale_block
    return native.fp8_grouped(x, qw.values, qw.scales, sizes, bk or qw.shape[-2], max(bn, 1))


def int8_grouped(x, qw: QuantizedWeight, sizes):
    return native.int8_grouped(x, qw.values, qw.scales, sizes)


def bf16_grouped(x, qw: QuantizedWeight, sizes):
    return native.bf16_grouped(x, qw.values, sizes)


# The grouped-by-expert (ragged) form: (x [M, K] sorted by expert, qw [E, K, N], sizes [E]).
GROUPED = {"int4": int4_grouped, "fp8": fp8_grouped, "fp8_block": fp8_grouped, "int8": int8_grouped,
           "bf16": bf16_grouped}


def wide_rows(family: str, isa: str) -> int:
    """The rows ``family``'s native path serves on weights at least WIDE_N wide (0: as any other;
    also where JAXSERVE_NATIVE_ROWS sets the family)."""
    wide = isa in ("avx512", "avx512-vnni") and family not in row_overrides()
    return WIDE_ROWS.get(family, 0) if wide else 0


def native_path(family: str, fallback, max_rows: int, isa: str, amx_rows: int | None = None,
                grouped_rows: int = ALL, wide: int = 0):
    """A Path running ``family``'s native kernel for <= max_rows rows (<= max(max_rows, wide)
    on weights at least WIDE_N wide), ``fallback`` above; with isa "amx" the tile kernel from
    amx_rows rows on (None: none; the C++ side picks by the same count). Its grouped-by-expert
    form runs the native grouped kernel for <= grouped_rows routed rows, ``fallback.ragged`` above."""
    kind, kernel = KERNELS[family]

    def dense(x, qw):
        rows = max(max_rows, wide) if qw.shape[-1] >= WIDE_N else max_rows
        return kernel(x, qw) if x.shape[0] <= rows else fallback.dense(x, qw)

    def ragged(x, qw, sizes):
        return GROUPED[family](x, qw, sizes) if x.shape[0] <= grouped_rows else fallback.ragged(x, qw, sizes)

    small = "avx512-vnni" if isa == "amx" else isa
    if family in INT_NUMERICS:
        tag, text = INT_NUMERICS[family]
        kind, what = tag.lower(), f"native {small} {tag} kernel: {text}"
    else:
        what = NUMERICS.format(kind=f"native {small} {kind} kernel")
    upto = "all rows" if max_rows >= ALL else f"<= {max_rows} rows"
    if wide > max_rows and max_rows < ALL:
        upto += f" (<= {wide} on weights >= {WIDE_N} wide)"
    tail = "" if max_rows >= ALL else f"; more rows: {fallback.name} ({fallback.numerics})"
    if grouped_rows >= ALL:
        tail += "; grouped by expert: the same kernels per expert, on its rows and its bytes only"
    if isa == "amx" and amx_rows is not None and max_rows >= amx_rows:
        amx_kind, amx_text = AMX[family]
        numerics = (f"{upto}: native kernels; < {amx_rows} rows: {what}; >= {amx_rows} rows: "
                    f"native AMX tile kernel: {amx_text}{tail}")
        return dataclasses.replace(fallback, name=f"cpu:native-amx-{amx_kind}", numerics=numerics, dense=dense,
                                   ragged=ragged)
    return dataclasses.replace(fallback, name=f"cpu:native-{kind}", numerics=f"{upto}: {what}{tail}", dense=dense,
                               ragged=ragged)


def plain_path(fallback):
    """Weights kept as loaded: XLA's dots stay (dense: XLA's f32 dot reads float32 at the memory
    bound), the routed experts of a float32 or bfloat16 array run the native grouped kernel
    (f32 or bf16 weights as they are, f32 activations and accumulation), anything else
    ``fallback.ragged``."""
    def ragged(x, w, sizes):
        if w.dtype == jnp.float32:
            return native.f32_grouped(x, w, sizes)
        if w.dtype == jnp.bfloat16:
            return native.bf16_grouped(x, w, sizes)
        return fallback.ragged(x, w, sizes)

    numerics = (f"{fallback.numerics}; grouped by expert (float32 / bfloat16): native kernel per expert, on its "
                f"rows and its bytes only, f32 activations and accumulation")
    return dataclasses.replace(fallback, numerics=numerics, ragged=ragged)


def native_cpu_paths(paths: dict) -> dict:
    """The CPU entries of ``paths`` that a native kernel replaces (empty when the kernels
    cannot run here: jaxserve.native says why, once)."""
    if not native.available():
        return {}
    st = native.status()
    amx = {f: (st.amx_rows or {}).get("fp8" if f == "fp8_block" else f) for f in KERNELS}
    out = {(f, "cpu"): native_path(f, paths[(f, "cpu")], rows, st.isa, amx[f], wide=wide_rows(f, st.isa))
           for f, rows in max_rows().items() if rows > 0 and (f, "cpu") in paths}
    out[("dense", "cpu")] = plain_path(paths[("dense", "cpu")])
    return out
