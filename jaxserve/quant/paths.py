"""The registry of matmul paths: one entry per (weight format family, backend).

Each ``Path`` computes ``x [M, K] @ w [K, N]`` (``dense``) and the routed-expert form
``x [M, K] sorted by expert @ w [E, K, N]`` (``ragged``) from the stored weight, returning
float32. Numerics of each entry are in its ``numerics`` string (shown in the startup log and
in GetModelInfo). Why these formulations on CPU (measured on this machine, BENCHMARKS.md):
XLA:CPU sends s8 x s8 -> s32 and bf16 x bf16 -> f32 dots to YNNPACK (VNNI / AVX512-BF16)
when they have at least 2 rows, but never fuses a dequantization into a dot: a converted
weight is written out whole and read again. So int8 and bf16 weights are multiplied as
stored; fp8 and int4 (which no CPU dot takes) are dequantized one column tile at a time
(``tile_cols``: about 1 MiB of bf16) just before that tile's dot, so the whole
dense weight never exists.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.quant import int4_pallas
from jaxserve.quant.qweight import QuantizedWeight
from jaxserve.sharding import current_kernel_mesh

TILE_BYTES = 1 << 20  # target size of one dequantized bf16 tile


@dataclasses.dataclass(frozen=True)
class Path:
    name: str  # "cpu:w8a8"
    numerics: str  # what is rounded where, and the accumulation type
    dense: Callable  # (x [M, K], qw [K, N]) -> f32 [M, N]
    ragged: Callable  # (x [M, K], qw [E, K, N], group_sizes [E]) -> f32 [M, N]


def family_of(format_name: str | None) -> str:
    if format_name is None:
        return "dense"
    if format_name.startswith("int4"):
        return "int4"
    if format_name.startswith("fp8:block"):
        return "fp8_block"
    if format_name.startswith("fp8"):
        return "fp8"
    return format_name  # "bf16", "int8"


# ----------------------------------------------------------------------------- helpers
def slice_columns(qw: QuantizedWeight, c0: int, c1: int) -> QuantizedWeight:
    """Columns [c0, c1) of a [..., K, N] weight, values and scales (c0 on a scale block)."""
    bn = qw.fmt.scale_block[1] if qw.fmt.scale_block else 1
    if c0 % bn:
        raise ValueError(f"column tile start {c0} is not on a {bn}-column scale block")
    scales = None if qw.scales is None else qw.scales[..., c0 // bn: -(-c1 // bn)]
    return dataclasses.replace(qw, values=qw.values[..., c0:c1], scales=scales, shape=(*qw.shape[:-1], c1 - c0))


def dequantize_columns(qw: QuantizedWeight, cols: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Columns ``cols`` [n] (any order, repeats allowed) of a [K, N] weight -> [K, n] dense."""
    bk, bn = qw.fmt.scale_block or (0, 1)
    k = qw.shape[-2]
    values = jnp.take(qw.values, cols, axis=-1)
    if bn <= 1:  # a scale per column (or none): the gathered columns are a weight of their own
        scales = None if qw.scales is None else jnp.take(qw.scales, cols, axis=-1)
        return qw.fmt.dequantize(dataclasses.replace(qw, values=values, scales=scales, shape=(k, cols.shape[0])),
                                 dtype)
    s = jnp.repeat(jnp.take(qw.scales, cols // bn, axis=-1), bk, axis=-2)[:k]  # block scales
    return (values.astype(jnp.float32) * s).astype(dtype)


def dequantize_tile(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    return qw.fmt.dequantize(qw, dtype)


def tile_cols(qw: QuantizedWeight) -> int:
    """Columns per tile: about TILE_BYTES of bf16, a multiple of 128 (whole scale blocks)."""
    rows = qw.values.size // qw.values.shape[-1] * (2 if qw.format.startswith("int4") else 1)
    return max(128, TILE_BYTES // (2 * rows) // 128 * 128)


def _tiles(qw: QuantizedWeight, fn) -> jax.Array:
    """fn(column tile) for each tile of qw, concatenated along the last axis."""
    n, cols = qw.shape[-1], tile_cols(qw)
    outs = [fn(slice_columns(qw, c0, min(n, c0 + cols))) for c0 in range(0, n, cols)]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)


MIN_ROWS = 2  # XLA:CPU hands a dot to YNNPACK only with >= 2 rows


def pad_rows(x: jax.Array, rows: int | None = None) -> jax.Array:
    """Pad a batch of fewer than ``rows`` (default MIN_ROWS) rows with zero rows."""
    rows = rows or MIN_ROWS
    m = x.shape[0]
    return x if m >= rows else jnp.pad(x, ((0, rows - m), (0, 0)))


def quantize_rows(x: jax.Array, qmax: float, dtype):
    """Symmetric per-row quantization: x [M, K] -> (codes [M, K] in dtype, scale f32 [M, 1])."""
    x = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / qmax
    s = jnp.where(s > 0, s, 1.0)
    q = x / s
    if jnp.issubdtype(dtype, jnp.integer):
        q = jnp.round(q)
    return jnp.clip(q, -qmax, qmax).astype(dtype), s


def _dot(a, b, acc=jnp.float32):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=acc)


def expert_of_row(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 [rows]: the expert each sorted row belongs to (rows past the sum: the last)."""
    ends = jnp.cumsum(group_sizes)
    e = jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right")
    return jnp.minimum(e, group_sizes.shape[0] - 1)


def _ragged(x, w, sizes, acc=jnp.float32):
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=acc)


def _channel_scale_rows(qw: QuantizedWeight, sizes, rows: int) -> jax.Array:
    """Per-channel scales [E, 1, N] -> each sorted row's expert's scales [rows, N]."""
    return jnp.asarray(qw.scales)[expert_of_row(sizes, rows), 0, :]


# ----------------------------------------------------------------------------- cpu
def bf16_dense(x, qw):
    m = x.shape[0]
    return _dot(pad_rows(x).astype(jnp.bfloat16), qw.values)[:m]


def bf16_ragged(x, qw, sizes):
    return _ragged(x.astype(jnp.bfloat16), qw.values, sizes)


def int8_dense(x, qw):
    m = x.shape[0]
    xq, sx = quantize_rows(pad_rows(x), 127.0, jnp.int8)
    return (_dot(xq, qw.values, jnp.int32).astype(jnp.float32) * sx * qw.scales)[:m]


def int8_ragged(x, qw, sizes):
    xq, sx = quantize_rows(x, 127.0, jnp.int8)
    acc = _ragged(xq, qw.values, sizes, jnp.int32).astype(jnp.float32)
    return acc * sx * _channel_scale_rows(qw, sizes, x.shape[0])


def dequant_dense(x, qw):
    """Tile by tile: dequantize [K, cols] to bf16, bf16 x bf16 -> f32 dot."""
    m = x.shape[0]
    xb = pad_rows(x).astype(jnp.bfloat16)
    return _tiles(qw, lambda t: _dot(xb, dequantize_tile(t, jnp.bfloat16)))[:m]


def dequant_ragged(x, qw, sizes):
    xb = x.astype(jnp.bfloat16)
    return _tiles(qw, lambda t: _ragged(xb, dequantize_tile(t, jnp.bfloat16), sizes))


# ----------------------------------------------------------------------------- gpu
def fp8_native_dense(x, qw):
    """W8A8 in e4m3: activations scaled per row into e4m3, e4m3 x e4m3 -> f32 (FP8 tensor cores)."""
    xq, sx = quantize_rows(x, 448.0, jnp.float8_e4m3fn)
    return _dot(xq, qw.values) * sx * qw.scales


def fp8_native_ragged(x, qw, sizes):
    xq, sx = quantize_rows(x, 448.0, jnp.float8_e4m3fn)
    return _ragged(xq, qw.values, sizes) * sx * _channel_scale_rows(qw, sizes, x.shape[0])


def _int4_kernel(interpret: bool):
    """The Pallas int4 kernel (``quant.int4_pallas``: per device under a mesh). A weight the
    kernel refuses (``int4_pallas.plan``, also what the runner reports per weight) runs the
    tile-wise dequantized path instead, by that plan: no error is caught to fall back."""
    def dense(x, qw):
        p = int4_pallas.plan(qw, current_kernel_mesh())
        return dequant_dense(x, qw) if p.refused else int4_pallas.dense(x, qw, interpret, p)

    def ragged(x, qw, sizes):
        p = int4_pallas.plan(qw, current_kernel_mesh())
        return dequant_ragged(x, qw, sizes) if p.refused else int4_pallas.ragged(x, qw, sizes, interpret, p)

    return dense, ragged


def refusal(format_name: str | None, backend: str, qw: QuantizedWeight, mesh=None) -> str | None:
    """Why ``PATHS[(family, backend)]``'s kernel does not take ``qw`` on ``mesh`` (then
    ``FALLBACK[backend]`` runs it); None when it does (every path but the int4 kernel's)."""
    if family_of(format_name) != "int4" or backend not in ("gpu", "interpret"):
        return None
    return int4_pallas.plan(qw, mesh).refused


def _unused(*_):
    raise AssertionError("plain weights never reach a quantized path")


_DEQ = "weights dequantized to bf16 one column tile at a time; activations rounded to bf16; f32 accumulation"
_W8A8 = "int8 weights x int8 activations (per-token amax/127), exact int32 accumulation, scales on the result"
_BF16 = "bf16 weights x activations rounded to bf16, f32 accumulation"
_PALLAS = ("Pallas W4A16 kernel: int4 nibbles enter the dot exactly (activations in bf16), "
           "group scales on the f32 partial sums, result rounded to bf16")


def _registry() -> dict[tuple[str, str], Path]:
    cpu = {
        "dense": Path("xla:dot", "checkpoint dtype, f32 accumulation", _unused, _ragged),
        "bf16": Path("cpu:bf16-dot", _BF16, bf16_dense, bf16_ragged),
        "int8": Path("cpu:w8a8", _W8A8, int8_dense, int8_ragged),
        "fp8": Path("cpu:fp8-tiles-bf16", _DEQ, dequant_dense, dequant_ragged),
        "fp8_block": Path("cpu:fp8-tiles-bf16", _DEQ, dequant_dense, dequant_ragged),
        "int4": Path("cpu:int4-tiles-bf16", _DEQ, dequant_dense, dequant_ragged),
    }
    out = {(f, "cpu"): p for f, p in cpu.items()}
    for backend, interpret in (("gpu", False), ("interpret", True)):
        d, r = _int4_kernel(interpret)
        out.update({
            ("dense", backend): cpu["dense"],
            ("bf16", backend): dataclasses.replace(cpu["bf16"], name=f"{backend}:bf16-dot"),
            ("int8", backend): dataclasses.replace(cpu["int8"], name=f"{backend}:w8a8"),
            ("fp8", backend): Path(f"{backend}:fp8-dot",
                                   "e4m3 weights x e4m3 activations (per-token amax/448), f32 accumulation",
                                   fp8_native_dense, fp8_native_ragged),
            ("fp8_block", backend): dataclasses.replace(cpu["fp8_block"], name=f"{backend}:fp8-tiles-bf16"),
            ("int4", backend): Path(f"{backend}:pallas-int4" + ("-interpret" if interpret else ""), _PALLAS, d, r),
        })
    return out


PATHS: dict[tuple[str, str], Path] = _registry()
# What runs an int4 weight the Pallas kernel refuses (``refusal``), per kernel backend.
FALLBACK: dict[str, Path] = {b: Path(f"{b}:int4-tiles-bf16", _DEQ, dequant_dense, dequant_ragged)
                             for b in ("gpu", "interpret")}


def _with_native(paths: dict[tuple[str, str], Path]) -> dict[tuple[str, str], Path]:
    """Native CPU kernels (jaxserve.quant.native_paths) over the XLA entries they beat."""
    from jaxserve.quant.native_paths import native_cpu_paths

    return {**paths, **native_cpu_paths(paths)}


XLA_PATHS: dict[tuple[str, str], Path] = PATHS  # XLA's own formulations, whatever runs
PATHS = _with_native(XLA_PATHS)
