"""Paged KV storage: writing new tokens into pages and gathering a row's pages back.

Layouts (P pages of S tokens each):
- MLA: ``[P, S, X]`` (latent X = kv_lora_rank, rope key X = qk_rope_head_dim), no head axis:
  the latent is shared by all heads.
- GQA: ``[KVH, P, S, D]`` (heads first, so a tensor-parallel split over KV heads is a split
  of the leading axis).

JAX gather/scatter clip or wrap out-of-range indices. Every index computed here is mapped to
an explicit out-of-range sentinel (P) and written with ``mode="drop"``, so a bad page id or a
position past the page table drops the write instead of landing in somebody else's page.
Reads go through the page tracker's check (engine side), which fails such rows closed.

Pools of a sub-32-bit float format (bf16, fp8) are held in an unsigned-integer container of
the same width and bit-cast at the edges (``storage_dtype``): XLA:CPU updates an integer pool
in place, but widens a bf16/fp8 pool to float32 and back around every scatter, which is a
full copy of the pool per layer per step. The bits stored are exactly the format's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kv.formats import KVFormat


def storage_dtype(fmt: KVFormat):
    """The pool's array dtype: the format's own for 32-bit formats, else uint8/uint16 of the same width."""
    size = jnp.dtype(fmt.dtype).itemsize
    return fmt.dtype if size >= 4 else {1: jnp.uint8, 2: jnp.uint16}[size]


def _to_pool(values, pool_dtype):
    """Format-dtype values -> the pool's container dtype (a bit cast, no rounding)."""
    return values if values.dtype == pool_dtype else jax.lax.bitcast_convert_type(values, pool_dtype)


def values_view(pool, fmt: KVFormat):
    """A pool (or gathered part of one) as the format's dtype: bit-cast back from the container."""
    return pool if pool.dtype == jnp.dtype(fmt.dtype) else jax.lax.bitcast_convert_type(pool, fmt.dtype)


def token_slots(page_table, positions, valid, page_size: int, num_pages: int):
    """page_table [B, M], positions [B, T], valid [B, T] -> (page [B, T], offset [B, T]).

    Invalid tokens, positions past the page table and page ids outside [0, P) get page = P
    (out of range: the scatter drops them).
    """
    m = page_table.shape[1]
    logical = positions // page_size
    in_table = valid & (logical >= 0) & (logical < m)
    page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, m - 1), axis=1)
    ok = in_table & (page >= 0) & (page < num_pages)
    return jnp.where(ok, page, num_pages), positions % page_size


def write_tokens(pool, values, page, offset):
    """pool [P, S, X] <- values [B, T, X] at (page, offset) [B, T]; out-of-range pages dropped."""
    return pool.at[page, offset].set(_to_pool(values, pool.dtype), mode="drop")


def write_tokens_headed(pool, values, page, offset):
    """pool [H, P, S, D] <- values [B, T, H, D] (GQA layout)."""
    v = _to_pool(jnp.moveaxis(values, 2, 0), pool.dtype)  # [H, B, T, D]
    return pool.at[:, page, offset].set(v, mode="drop")


def write_scales(pool, scales, page, offset):
    """pool [P, S] <- scales [B, T] (or [H, P, S] <- [B, T, H] via write_scales_headed)."""
    return pool.at[page, offset].set(scales, mode="drop")


def write_scales_headed(pool, scales, page, offset):
    return pool.at[:, page, offset].set(jnp.moveaxis(scales, 2, 0), mode="drop")


def gather_rows(pool, page_table):
    """pool [P, S, ...] , page_table [B, M] -> [B, M*S, ...] (a row's pages in order)."""
    g = pool[page_table]  # [B, M, S, ...]
    b, m, s = g.shape[:3]
    return g.reshape((b, m * s) + g.shape[3:])


def gather_rows_headed(pool, page_table):
    """pool [H, P, S, ...], page_table [B, M] -> [B, H, M*S, ...]."""
    g = pool[:, page_table]  # [H, B, M, S, ...]
    h, b, m, s = g.shape[:4]
    return jnp.moveaxis(g.reshape((h, b, m * s) + g.shape[4:]), 0, 1)


def store(fmt: KVFormat, pools: dict, name: str, values, page, offset, headed: bool = False) -> dict:
    """Quantize `values` with `fmt` and write values (+ scales) into pools[name] (+ name_scale)."""
    q, scale = fmt.quantize(values)  # q in fmt.dtype; written as the pool's container
    out = dict(pools)
    if headed:
        out[name] = write_tokens_headed(pools[name], q, page, offset)
        if scale is not None:
            out[name + "_scale"] = write_scales_headed(pools[name + "_scale"], scale, page, offset)
    else:
        out[name] = write_tokens(pools[name], q, page, offset)
        if scale is not None:
            out[name + "_scale"] = write_scales(pools[name + "_scale"], scale, page, offset)
    return out


def as_stored(fmt: KVFormat, values, dtype):
    """``values`` as the cache stores them: quantized by ``fmt`` and dequantized to ``dtype``,
    what reading them back from their pages gives (the container bit-cast is exact)."""
    q, scale = fmt.quantize(values)
    return fmt.dequantize(q, scale, dtype)


def load(fmt: KVFormat, pools: dict, name: str, page_table, dtype, headed: bool = False):
    """Gather a row's pages for pools[name] and dequantize -> [B, C, X] or [B, H, C, D]."""
    gather = gather_rows_headed if headed else gather_rows
    q = values_view(gather(pools[name], page_table), fmt)
    scale = gather(pools[name + "_scale"], page_table) if fmt.scaled else None
    return fmt.dequantize(q, scale, dtype)


def load_chunk(fmt: KVFormat, pools: dict, name: str, page_chunk, dtype, headed: bool = False):
    """Gather and dequantize the pages ``page_chunk`` [B, c] of pools[name].

    -> [B, c*S, X] (MLA layout), or [H, B, c*S, D] for a headed pool: the head axis stays in
    front, as stored, so no transpose copy is made (the attention einsum takes it as it is).
    """
    def gather(pool):
        g = pool[:, page_chunk] if headed else pool[page_chunk]
        lead = 2 if headed else 1  # [H, B, c, S, ...] or [B, c, S, ...]
        c, s = g.shape[lead], g.shape[lead + 1]
        return g.reshape(g.shape[:lead] + (c * s,) + g.shape[lead + 2:])

    q = values_view(gather(pools[name]), fmt)
    scale = gather(pools[name + "_scale"]) if fmt.scaled else None
    return fmt.dequantize(q, scale, dtype)


def position_slots(page_table, positions, page_size: int, num_pages: int):
    """page_table [B, M], positions [B, T, K] (a row's token positions; -1: none) ->
    (page, offset, ok) [B, T, K]: where each position lives; ``ok`` is False (and page 0) for
    a negative position, one past the table or on a page id outside [0, P)."""
    m = page_table.shape[1]
    logical = positions // page_size
    rows = jnp.arange(page_table.shape[0])[:, None, None]
    page = page_table[rows, jnp.clip(logical, 0, m - 1)]
    ok = (positions >= 0) & (logical < m) & (page >= 0) & (page < num_pages)
    return jnp.where(ok, page, 0), positions % page_size, ok


def load_slots(fmt: KVFormat, pools: dict, name: str, page, offset, dtype):
    """Gather and dequantize single slots of pools[name] [P, S, X] at (page, offset) [...] ->
    [..., X] (the caller masks slots it did not mean to read)."""
    q = values_view(pools[name][page, offset], fmt)
    scale = pools[name + "_scale"][page, offset] if fmt.scaled else None
    return fmt.dequantize(q, scale, dtype)


def new_pool(fmt: KVFormat, shape: tuple[int, ...], name: str) -> dict:
    """Zeroed storage for one cached tensor: values `shape` (+ float32 scales shape[:-1])."""
    pools = {name: jnp.zeros(shape, storage_dtype(fmt))}  # all-zero bits = 0.0 in every format
    if fmt.scaled:
        pools[name + "_scale"] = jnp.zeros(shape[:-1], jnp.float32)
    return pools
