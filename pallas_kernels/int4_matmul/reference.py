"""W4A16 int4 weights: the storage format, quantize / dequantize, and pure-jnp matmuls (the spec).

Format (DESIGN.md section 4):
- values: symmetric int4 in [-8, 7], w ~= q * scale, one scale per (group of `group` input
  rows, output column): scales [K/g, N] (float32 or bfloat16).
- packed [K/2, N] uint8, rows packed in tiles of T rows: tile t's first T/2 rows go in the
  low nibbles and its last T/2 rows in the high nibbles of packed rows [t*T/2, (t+1)*T/2):
      packed[t*T/2 + j] = (q[t*T + j] & 0xF) | ((q[t*T + T/2 + j] & 0xF) << 4)
  so a kernel multiplies `x[:, lo rows] @ deq(lo) + x[:, hi rows] @ deq(hi)` after two shifts,
  with no interleaving. `tile=None` means T = K (low nibbles = rows [0, K/2), high = the
  rest: independent of any kernel tile size); `tile=group` is jaxserve.quant's int4 layout
  (a contiguous split of packed rows is a contiguous split of K, for sharding). T must be
  `group` or a multiple of 2 * group, so no scale group straddles the two halves.
- unpack: view the byte as int8; lo = (b << 4) >> 4, hi = b >> 4 (arithmetic shifts sign-extend).

Grouped (MoE) layout: packed [E, K/2, N], scales [E, K/g, N], tokens sorted by expert,
group_sizes [E] rows per expert (rows past sum(group_sizes) produce 0, as lax.ragged_dot).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int4_matmul.validate import check_tile

HIGHEST = lax.Precision.HIGHEST
QMAX = 7  # symmetric: amax maps to 7, so -8 is never produced and rounding error <= scale / 2


def quantize_int4(w, group: int, scale_dtype=jnp.float32, tile: int | None = None):
    """w [K, N] float -> (packed [K/2, N] uint8, scales [K/group, N] scale_dtype).

    Each element's error |w - q * scale| <= scale / 2 (round to nearest, nothing clipped)."""
    k, n = w.shape
    t = check_tile(k, group, tile)
    w32 = w.astype(jnp.float32).reshape(k // group, group, n)
    scale = jnp.max(jnp.abs(w32), axis=1) / QMAX  # [K/g, N]
    if jnp.dtype(scale_dtype) != jnp.float32:
        # Round the scale up past the cast's rounding (relative 2^-9 for bf16) so the
        # stored scale still covers amax: no value rounds past 7.
        scale = scale * (1.0 + 2.0 ** -7)
    scale = scale.astype(scale_dtype)
    s32 = scale.astype(jnp.float32)
    safe = jnp.where(s32 > 0, s32, 1.0)
    q = jnp.clip(jnp.round(w32 / safe[:, None, :]), -8, QMAX).astype(jnp.int32)
    q = q.reshape(k // t, 2, t // 2, n)  # (tile, half, row in half, column)
    packed = ((q[:, 0] & 0xF) | ((q[:, 1] & 0xF) << 4)).astype(jnp.uint8)
    return packed.reshape(k // 2, n), scale


def unpack_int4(packed, tile: int | None = None):
    """packed [..., K/2, N] uint8 -> int8 values [..., K, N] in [-8, 7] (plain row order)."""
    *lead, k2, n = packed.shape
    t = 2 * k2 if tile is None else tile
    if t % 2 or (2 * k2) % t:
        raise ValueError(f"tile={t} must be even and divide K={2 * k2}")
    b = lax.bitcast_convert_type(packed, jnp.int8).reshape(*lead, 2 * k2 // t, t // 2, n)
    four = jnp.int8(4)
    lo = lax.shift_right_arithmetic(lax.shift_left(b, four), four)
    hi = lax.shift_right_arithmetic(b, four)
    return jnp.stack([lo, hi], axis=-3).reshape(*lead, 2 * k2, n)


def dequantize_int4(packed, scales, group: int, dtype=jnp.float32, tile: int | None = None):
    """packed [..., K/2, N] uint8, scales [..., K/g, N] -> w [..., K, N] in `dtype`."""
    q = unpack_int4(packed, tile).astype(jnp.float32)
    s = jnp.repeat(scales.astype(jnp.float32), group, axis=-2)
    return (q * s).astype(dtype)


@functools.partial(jax.jit, static_argnames=("group", "tile"))
def int4_matmul_reference(x, packed, scales, *, group: int, tile: int | None = None):
    """x [M, K] @ deq(packed [K/2, N], scales [K/g, N]) -> [M, N] in x.dtype (f32 math)."""
    w = dequantize_int4(packed, scales, group, tile=tile)
    return jnp.dot(x.astype(jnp.float32), w, precision=HIGHEST).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("group", "tile"))
def int4_grouped_matmul_reference(x, packed, scales, group_sizes, *, group: int, tile: int | None = None):
    """x [M, K] sorted by expert; packed [E, K/2, N]; scales [E, K/g, N]; group_sizes [E]
    -> [M, N] in x.dtype: row r uses expert e with offset_e <= r < offset_e + group_sizes[e]."""
    w = dequantize_int4(packed, scales, group, tile=tile)  # [E, K, N]
    y = lax.ragged_dot(x.astype(jnp.float32), w, group_sizes.astype(jnp.int32), precision=HIGHEST)
    return y.astype(x.dtype)
