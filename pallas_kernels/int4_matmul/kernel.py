"""Pallas W4A16 matmuls (dense and ragged-by-expert), written for the Triton GPU backend.

Weights in jaxserve.quant.int4's layout (``Int4GroupFormat(G).quantize``; the spec is
reference.py): packed [K/2, N] uint8 with packing tile = group, scales [K/G, N].

One program per (row block [bm], column block [bn]); the K reduction is a `fori_loop` inside
the kernel (Triton has no scratch and no sequential grid axis to accumulate across). Step i
reads scale group i: G/2 packed rows, whose low nibbles are K rows [i*G, i*G + G/2) and
high nibbles K rows [i*G + G/2, (i+1)*G), and the group's one scale row:

    acc += (x[:, lo rows] @ lo_int + x[:, hi rows] @ hi_int) * s[i]

Scales multiply the f32 dot result (one scale per group and column), so the int4 values
enter the dot exactly and no dequantized weight is ever rounded to bf16.

Triton rules followed: power-of-two loads; dot dims >= 16 (M padded to bm = 16, G/2 >= 16);
packed bytes are bitcast to int8 outside the kernel so the shifts are arithmetic (sign
extension) and the dot sees a signed type; the grouped kernel gets expert offsets and each
row tile's expert range as ordinary blocks (no scalar prefetch) and loops over experts.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.int4_matmul import validate

_STATIC = ("group", "interpret", "block_m", "block_n", "num_warps", "num_stages", "out_dtype")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _nn(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _group_product(x_ref, load_w, load_s, k: int, group: int, bm: int, bn: int):
    """x_ref [bm, K] . int4 weights -> [bm, bn] f32, one scale group per step.

    load_w(r) -> packed int8 rows [r, r + G/2) x [bn]; load_s(i) -> [1, bn] scales of group i."""
    half = group // 2
    cdt = x_ref.dtype

    def body(i, acc):
        w = load_w(pl.multiple_of(i * half, half))  # group i's packed rows
        lo = ((w << 4) >> 4).astype(cdt)  # int8 shifts are arithmetic: sign extension
        hi = (w >> 4).astype(cdt)
        lo_row = pl.multiple_of(i * group, half)  # K rows of the low nibbles; high: + G/2
        hi_row = pl.multiple_of(i * group + half, half)
        part = _nn(x_ref[:, pl.ds(lo_row, half)], lo) + _nn(x_ref[:, pl.ds(hi_row, half)], hi)
        return acc + part * load_s(i).astype(jnp.float32)

    return lax.fori_loop(0, k // group, body, jnp.zeros((bm, bn), jnp.float32))


def _dense_kernel(x_ref, w_ref, s_ref, o_ref, *, k, group):
    """Blocks: x [bm, K], w int8 [K/2, bn], s [K/G, bn] -> o [bm, bn]."""
    bm, bn = o_ref.shape
    half = group // 2
    acc = _group_product(
        x_ref,
        lambda r: w_ref[pl.ds(r, half), :],
        lambda i: s_ref[pl.ds(i, 1), :],
        k, group, bm, bn,
    )
    o_ref[...] = acc.astype(o_ref.dtype)


def _grouped_kernel(x_ref, w_ref, s_ref, start_ref, end_ref, tile_ref, o_ref, *, k, group):
    """Blocks: x [bm, K]; w int8 [E, K/2, bn]; s [E, K/G, bn]; expert row offsets start/end [E];
    tile_ref [2] = experts [first, stop) overlapping this row tile -> o [bm, bn]."""
    bm, bn = o_ref.shape
    half = group // 2
    rows = pl.program_id(0) * bm + jnp.arange(bm, dtype=jnp.int32)

    def expert(e, acc):
        start, end = start_ref[e], end_ref[e]

        def add(acc):
            y = _group_product(
                x_ref,
                lambda r: w_ref[e, pl.ds(r, half), :],
                lambda i: s_ref[e, pl.ds(i, 1), :],
                k, group, bm, bn,
            )
            # Rows of this tile that belong to other experts were computed too; drop them.
            mine = (rows >= start) & (rows < end)
            return acc + jnp.where(mine[:, None], y, 0.0)

        return lax.cond(end > start, add, lambda a: a, acc)  # skip empty experts

    acc = lax.fori_loop(tile_ref[0], tile_ref[1], expert, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _params(num_warps: int, num_stages: int):
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _dense(x, packed, scales, *, group, interpret, block_m, block_n, num_warps, num_stages, out_dtype):
    m, k = x.shape
    n = packed.shape[1]
    mp = _cdiv(m, block_m) * block_m
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    w = lax.bitcast_convert_type(packed, jnp.int8)
    out = pl.pallas_call(
        functools.partial(_dense_kernel, k=k, group=group),
        grid=(mp // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k // 2, block_n), lambda i, j: (0, j)),
            pl.BlockSpec((k // group, block_n), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        interpret=interpret,
        compiler_params=_params(num_warps, num_stages),
        name=f"int4_matmul_g{group}",
    )(xp, w, scales)
    return out[:m]


def tile_expert_ranges(group_sizes, rows_padded: int, block_m: int):
    """group_sizes [E] -> (start [E], end [E], tiles [T, 2]): expert row offsets and, per row
    tile, the experts [first, stop) whose rows overlap it."""
    end = jnp.cumsum(group_sizes.astype(jnp.int32))
    start = end - group_sizes.astype(jnp.int32)
    r0 = jnp.arange(0, rows_padded, block_m, dtype=jnp.int32)
    first = jnp.searchsorted(end, r0, side="right")  # first expert ending after r0
    stop = jnp.searchsorted(start, r0 + block_m, side="left")  # experts starting before r1
    return start, end, jnp.stack([first, jnp.maximum(stop, first)], axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _grouped(x, packed, scales, group_sizes, *, group, interpret, block_m, block_n, num_warps, num_stages,
             out_dtype):
    m, k = x.shape
    e, _, n = packed.shape
    mp = _cdiv(m, block_m) * block_m
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    w = lax.bitcast_convert_type(packed, jnp.int8)
    start, end, tiles = tile_expert_ranges(group_sizes, mp, block_m)
    out = pl.pallas_call(
        functools.partial(_grouped_kernel, k=k, group=group),
        grid=(mp // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            pl.BlockSpec((e, k // 2, block_n), lambda i, j: (0, 0, j)),
            pl.BlockSpec((e, k // group, block_n), lambda i, j: (0, 0, j)),
            pl.BlockSpec((e,), lambda i, j: (0,)),
            pl.BlockSpec((e,), lambda i, j: (0,)),
            pl.BlockSpec((None, 2), lambda i, j: (i, 0)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        interpret=interpret,
        compiler_params=_params(num_warps, num_stages),
        name=f"int4_grouped_matmul_g{group}",
    )(xp, w, scales, start, end, tiles)
    return out[:m]


def _blocks(block_m: int, block_n: int | None, n_default: int) -> tuple[int, int]:
    if not validate.is_pow2(block_m) or block_m < validate.MIN_DOT:
        raise ValueError(f"block_m={block_m} must be a power of two >= {validate.MIN_DOT}")
    bn = n_default if block_n is None else block_n
    if not validate.is_pow2(bn) or bn < validate.MIN_DOT:
        raise ValueError(f"block_n={bn} must be a power of two >= {validate.MIN_DOT}")
    return block_m, bn


def int4_matmul(x, packed, scales, *, group: int, tile: int | None = None, interpret: bool = False,
                block_m: int = 16, block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                out_dtype=None):
    """x [M, K] (bf16/f16/f32) @ int4 weights -> [M, N] in ``out_dtype`` (default x.dtype; the
    f32 accumulator is rounded to it once: float32 keeps a partial sum whole).

    packed [K/2, N] uint8 and scales [K/group, N] (float32, or bf16/f16) as
    ``jaxserve.quant.int4.Int4GroupFormat(group).quantize`` stores them (``values``,
    ``scales``; layout in reference.py); K is the padded K, so pad x with zero columns.
    `tile` only states the packing tile: None or `group` (the only layout).
    block_n defaults to the largest power of two <= 128 dividing N.
    """
    dims = validate.check_weights(x, packed, scales, group, experts=None, tile=tile)
    bm, bn = _blocks(block_m, block_n, dims["block_n"])
    if dims["n"] % bn:
        raise ValueError(f"block_n={bn} must divide N={dims['n']}")
    return _dense(x, packed, scales, group=group, interpret=interpret, block_m=bm, block_n=bn,
                  num_warps=num_warps, num_stages=num_stages, out_dtype=jnp.dtype(out_dtype or x.dtype))


def int4_grouped_matmul(x, packed, scales, group_sizes, *, group: int, tile: int | None = None,
                        interpret: bool = False, block_m: int = 16, block_n: int | None = None,
                        num_warps: int = 4, num_stages: int = 2, out_dtype=None):
    """Ragged-by-expert W4A16 (MoE): x [M, K] sorted by expert; packed [E, K/2, N] uint8;
    scales [E, K/group, N]; group_sizes [E] int32 (rows per expert, in order) -> [M, N] in
    ``out_dtype`` (default x.dtype).
    Weights and `tile` as in `int4_matmul`.

    Rows past sum(group_sizes) come back 0 (like lax.ragged_dot). A row tile that spans
    several experts is computed once per expert and masked, so small block_m wastes least.
    """
    dims = validate.check_weights(x, packed, scales, group, experts=packed.shape[0] if packed.ndim == 3 else -1,
                                  tile=tile)
    validate.check_group_sizes(group_sizes, packed.shape[0], dims["m"])
    bm, bn = _blocks(block_m, block_n, dims["block_n"])
    if dims["n"] % bn:
        raise ValueError(f"block_n={bn} must divide N={dims['n']}")
    return _grouped(x, packed, scales, group_sizes, group=group, interpret=interpret, block_m=bm, block_n=bn,
                    num_warps=num_warps, num_stages=num_stages, out_dtype=jnp.dtype(out_dtype or x.dtype))
