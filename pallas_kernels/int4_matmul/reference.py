"""W4A16 int4 weights: the spec of the layout the kernels read, in pure jnp (unpack,
dequantize, and the reference matmuls the kernels are tested against).

The layout is jaxserve.quant.int4's (``Int4GroupFormat(G)``, the only int4 layout in the
project; its ``quantize`` is the only quantizer: scale = amax / 7.5 per group, see there):
- values: symmetric int4 in [-8, 7], w ~= q * scale, one scale per (group of G input rows,
  output column): scales [K/G, N]. jaxserve stores them as float32; bfloat16 / float16
  scales are accepted too (a cast of those: the kernel multiplies them in f32).
- K here is the padded K (jaxserve pads K up to a multiple of G with zero rows; a caller
  pads x with as many zero columns).
- packed [K/2, N] uint8, rows packed in tiles of T = G rows (tile = group): group t's
  first G/2 rows go in the low nibbles and its last G/2 rows in the high nibbles of packed
  rows [t*G/2, (t+1)*G/2):
      packed[t*G/2 + j] = (q[t*G + j] & 0xF) | ((q[t*G + G/2 + j] & 0xF) << 4),  0 <= j < G/2
  so a kernel multiplies `x[:, lo rows] @ lo + x[:, hi rows] @ hi` (times the group's one
  scale row) after two shifts, with no interleaving; and a contiguous split of the packed
  rows is a contiguous split of K (sharding).
- unpack: view the byte as int8; lo = (b << 4) >> 4, hi = b >> 4 (arithmetic shifts sign-extend).

Grouped (MoE) layout: packed [E, K/2, N], scales [E, K/G, N], tokens sorted by expert,
group_sizes [E] rows per expert (rows past sum(group_sizes) produce 0, as lax.ragged_dot).

``tile`` arguments (here and in kernel.py) only state the layout: None or ``group``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int4_matmul.validate import check_tile

HIGHEST = lax.Precision.HIGHEST


def unpack_int4(packed, group: int):
    """packed [..., K/2, N] uint8 (tile = group) -> int8 values [..., K, N] in [-8, 7]
    (plain row order)."""
    *lead, k2, n = packed.shape
    if group % 2 or (2 * k2) % group:
        raise ValueError(f"group={group} must be even and divide K={2 * k2}")
    b = lax.bitcast_convert_type(packed, jnp.int8).reshape(*lead, 2 * k2 // group, group // 2, n)
    four = jnp.int8(4)
    lo = lax.shift_right_arithmetic(lax.shift_left(b, four), four)
    hi = lax.shift_right_arithmetic(b, four)
    return jnp.stack([lo, hi], axis=-3).reshape(*lead, 2 * k2, n)


def dequantize_int4(packed, scales, group: int, dtype=jnp.float32):
    """packed [..., K/2, N] uint8, scales [..., K/G, N] -> w [..., K, N] in `dtype`."""
    q = unpack_int4(packed, group).astype(jnp.float32)
    s = jnp.repeat(scales.astype(jnp.float32), group, axis=-2)
    return (q * s).astype(dtype)


@functools.partial(jax.jit, static_argnames=("group", "tile"))
def int4_matmul_reference(x, packed, scales, *, group: int, tile: int | None = None):
    """x [M, K] @ deq(packed [K/2, N], scales [K/G, N]) -> [M, N] in x.dtype (f32 math)."""
    check_tile(group, tile)
    w = dequantize_int4(packed, scales, group)
    return jnp.dot(x.astype(jnp.float32), w, precision=HIGHEST).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("group", "tile"))
def int4_grouped_matmul_reference(x, packed, scales, group_sizes, *, group: int, tile: int | None = None):
    """x [M, K] sorted by expert; packed [E, K/2, N]; scales [E, K/G, N]; group_sizes [E]
    -> [M, N] in x.dtype: row r uses expert e with offset_e <= r < offset_e + group_sizes[e]."""
    check_tile(group, tile)
    w = dequantize_int4(packed, scales, group)  # [E, K, N]
    y = lax.ragged_dot(x.astype(jnp.float32), w, group_sizes.astype(jnp.int32), precision=HIGHEST)
    return y.astype(x.dtype)
