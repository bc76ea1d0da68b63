"""The native CPU matmul paths: jaxserve.native's kernels for small batches, XLA's below.

A native path multiplies the stored weight bytes as they are (int4 groups, fp8 e4m3 with
channel or block scales, int8 per channel, bf16). bf16 and fp8 are decoded to float32 in
registers, with float32 activations and float32 accumulation. int4 and int8 do the same on
CPUs without AVX512-VNNI; with it they run integer dots (W4A8: activations quantized to int8
per row per weight group; W8A8: per row), exact in int32, scaled in float32. It serves batches of at most
``max_rows`` rows (the decode buckets) and hands larger ones to the XLA formulation it
replaces (``fallback``), whose GEMMs win there. Which formats get one, and up to how many
rows, is ``MAX_ROWS``: the rule measured side by side against XLA's paths on this machine
(BENCHMARKS.md, "Native CPU kernels (issue 28)"). The choice is made at trace time from the
batch's static row count, so a compiled program holds exactly one of the two.

Only the dense form is native; the grouped-by-expert (ragged) form stays XLA's.
"""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxserve import native
from jaxserve.quant.qweight import QuantizedWeight

# Formats with a native path and the most rows it serves (measured, see the module docstring);
# JAXSERVE_NATIVE_ROWS="int8=8,bf16=1" overrides entries (for measuring; 0 = XLA's path).
MAX_ROWS = {"int4": 8, "fp8": 8, "fp8_block": 8, "bf16": 4, "int8": 4}
# Without AVX512-VNNI int8's native kernel is the float W8A16 one: level with XLA's W8A8 dot at
# 1 row and 0.6x of it at 4 (JAXSERVE_NATIVE_ISA=avx512 on the VNNI machine), so XLA's stays.
NO_VNNI_ROWS = {"int8": 0}
ROWS_ENV = "JAXSERVE_NATIVE_ROWS"


def max_rows() -> dict[str, int]:
    """MAX_ROWS for the kernels' instruction set, with the JAXSERVE_NATIVE_ROWS overrides."""
    out = dict(MAX_ROWS)
    if native.available() and native.status().isa != "avx512-vnni":
        out.update(NO_VNNI_ROWS)
    for part in filter(None, (p.strip() for p in os.environ.get(ROWS_ENV, "").split(","))):
        fam, _, rows = part.partition("=")
        if fam not in KERNELS or not rows.strip().isdigit():
            raise ValueError(f"{ROWS_ENV}: {part!r} is not FAMILY=ROWS with FAMILY one of {sorted(KERNELS)}")
        out[fam] = int(rows)
    return out
NUMERICS = "{kind}: stored bytes decoded to f32 in registers, f32 activations, f32 accumulation"
# What the VNNI kernels (jaxserve.native, isa "avx512-vnni") do instead of NUMERICS.
VNNI_NUMERICS = {
    "int4": ("W4A8", "activations quantized to int8 per row per weight group (d = amax/127, rint(x/d)), "
                     "int4 x int8 group dots exact in int32, times the weight and activation scales, f32 accumulation"),
    "int8": ("W8A8", "activations quantized to int8 per row (d = amax/127, rint(x/d)), int8 x int8 dots "
                     "exact in int32, times the weight and activation scales in f32"),
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


def native_path(family: str, fallback, max_rows: int, isa: str):
    """A Path running ``family``'s native kernel for <= max_rows rows, ``fallback`` above."""
    kind, kernel = KERNELS[family]

    def dense(x, qw):
        return kernel(x, qw) if x.shape[0] <= max_rows else fallback.dense(x, qw)

    if isa == "avx512-vnni" and family in VNNI_NUMERICS:
        tag, text = VNNI_NUMERICS[family]
        kind, what = tag.lower(), f"native {isa} {tag} kernel: {text}"
    else:
        what = NUMERICS.format(kind=f"native {isa} {kind} kernel")
    numerics = f"<= {max_rows} rows: {what}; more rows: {fallback.name} ({fallback.numerics})"
    return dataclasses.replace(fallback, name=f"cpu:native-{kind}", numerics=numerics, dense=dense)


def native_cpu_paths(paths: dict) -> dict:
    """The CPU entries of ``paths`` that a native kernel replaces (empty when the kernels
    cannot run here: jaxserve.native says why, once)."""
    if not native.available():
        return {}
    isa = native.status().isa
    return {(f, "cpu"): native_path(f, paths[(f, "cpu")], rows, isa)
            for f, rows in max_rows().items() if rows > 0 and (f, "cpu") in paths}

