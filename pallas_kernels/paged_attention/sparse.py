"""Pallas sparse MLA attention (DeepSeek sparse attention: each query reads only the cached
slots its indexer picked), written for the Triton GPU backend.

Unlike the paged kernel, which walks a row's page table in order, every query row here carries
its own list of K slots (the indexer's top-k). One program per (query row, query-head block)
walks that list in chunks of ``block_tokens`` ids, gathers those latent / rope rows from the
pools viewed flat as [P*S, X] (a vector-index load, ``lat_ref[ids]``, as the paged kernel
gathers whole pages) and keeps the paged kernel's online softmax. So a query reads K rows
whatever its context length; the indexer that chose them is the only O(context) part.

Slot ids are physical, page * S + offset (``physical_slots`` maps a row's positions through its
page table). An id of -1 is an unused pick (a query that sees fewer than K tokens, a padding
query); it and any id outside [0, P*S) are redirected to slot 0 and masked with ``where``, so an
unread slot's garbage or NaN never reaches the output. A query with no valid id gets out 0 and
lse -inf (merge.py gives it weight 0). The fp8 rules are the paged kernel's (kernel.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import validate
from pallas_kernels.paged_attention.kernel import MASK, compiler_params, dot_nt, online_update

_STATIC = ("scale", "interpret", "backend", "block_tokens", "block_h", "num_warps", "num_stages")


def physical_slots(page_table, positions, page_size: int, num_pages: int):
    """page_table [B, M] int32, positions [B, T, K] int32 (a row's token positions; -1: none)
    -> int32 [B, T, K] physical slot ids page * S + offset, -1 where the position is negative,
    past the table, or on a page id outside [0, P)."""
    m = page_table.shape[1]
    logical = positions // page_size
    ok = (positions >= 0) & (logical < m)
    rows = jnp.arange(page_table.shape[0])[:, None, None]
    page = page_table[rows, jnp.clip(logical, 0, m - 1)]
    ok = ok & (page >= 0) & (page < num_pages)
    return jnp.where(ok, page * page_size + positions % page_size, -1).astype(jnp.int32)


def _sparse_mla_kernel(*refs, scale, chunk, n_chunks, quantized):
    """Blocks: q_lat [bh, R], q_rope [bh, Dr]; latent [P*S, R], rope [P*S, Dr]; scales [P*S];
    slot ids [Kp] -> out [bh, R], lse [bh]."""
    if quantized:
        ql_ref, qr_ref, lat_ref, rope_ref, ls_ref, rs_ref, ids_ref, o_ref, lse_ref = refs
    else:
        ql_ref, qr_ref, lat_ref, rope_ref, ids_ref, o_ref, lse_ref = refs
    q_lat, q_rope = ql_ref[...], qr_ref[...]
    rows, r = q_lat.shape

    def body(c, carry):
        ids = ids_ref[pl.ds(c * chunk, chunk)]
        valid = ids >= 0
        safe = jnp.where(valid, ids, 0)
        lat = lat_ref[safe].astype(q_lat.dtype)  # [chunk, R]
        s_lat = dot_nt(q_lat, lat)
        s_rope = dot_nt(q_rope, rope_ref[safe].astype(q_rope.dtype))
        if quantized:
            s_lat = s_lat * ls_ref[safe].reshape(1, chunk)
            s_rope = s_rope * rs_ref[safe].reshape(1, chunk)
        logits = jnp.where(valid[None, :], (s_lat + s_rope) * scale, MASK)
        v = jnp.where(valid[:, None], lat, 0)
        vs = ls_ref[safe].reshape(1, chunk) if quantized else None
        return online_update(carry, logits, valid[None, :], vs, v)

    init = (jnp.zeros((rows, r), jnp.float32), jnp.full((rows,), MASK, jnp.float32), jnp.zeros((rows,), jnp.float32))
    o, m, l = lax.fori_loop(0, n_chunks, body, init)
    ok = l > 0
    l_safe = jnp.where(ok, l, 1.0)
    o_ref[...] = (o / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(ok, m + jnp.log(l_safe), -jnp.inf)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _sparse_mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, slots, *, scale, interpret,
                backend, block_tokens, block_h, num_warps, num_stages):
    n, h, r = q_lat.shape
    dr = q_rope.shape[2]
    p, s, _ = latent_pages.shape
    bh = max(block_h, validate.TRITON_MIN_DOT)
    hp = -(-h // bh) * bh
    q_lat = jnp.pad(q_lat, ((0, 0), (0, hp - h), (0, 0)))
    q_rope = jnp.pad(q_rope, ((0, 0), (0, hp - h), (0, 0)))
    k = slots.shape[1]
    n_chunks = -(-k // block_tokens)
    ids = jnp.where((slots >= 0) & (slots < p * s), slots, -1).astype(jnp.int32)  # never read out of bounds
    ids = jnp.pad(ids, ((0, 0), (0, n_chunks * block_tokens - k)), constant_values=-1)
    quantized = latent_scale is not None
    full = lambda *shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    in_specs = [pl.BlockSpec((None, bh, r), lambda i, j: (i, j, 0)), pl.BlockSpec((None, bh, dr), lambda i, j: (i, j, 0)),
                full(p * s, r), full(p * s, dr)]
    args = [q_lat, q_rope, latent_pages.reshape(p * s, r), rope_pages.reshape(p * s, dr)]
    if quantized:
        in_specs += [full(p * s), full(p * s)]
        args += [latent_scale.reshape(p * s), rope_scale.reshape(p * s)]
    in_specs.append(pl.BlockSpec((None, ids.shape[1]), lambda i, j: (i, 0)))
    args.append(ids)
    kernel = functools.partial(_sparse_mla_kernel, scale=scale, chunk=block_tokens, n_chunks=n_chunks,
                               quantized=quantized)
    o, lse = pl.pallas_call(
        kernel,
        grid=(n, hp // bh),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bh, r), lambda i, j: (i, j, 0)), pl.BlockSpec((None, bh), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((n, hp, r), q_lat.dtype), jax.ShapeDtypeStruct((n, hp), jnp.float32)],
        interpret=interpret,
        compiler_params=compiler_params(backend, num_warps, num_stages),
        name=f"sparse_mla_s{s}_h{bh}_r{r}_k{n_chunks * block_tokens}",
    )(*args)
    return o[:, :h], lse[:, :h]


def sparse_attention_mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, slots, *,
                         scale: float, interpret: bool = False, backend: str = "triton", block_h: int = 16,
                         block_tokens: int = 32, num_warps: int = 4, num_stages: int = 2):
    """Absorbed MLA over a chosen set of cached slots per query row.

    q_lat [N, H, R], q_rope [N, H, Dr]; latent_pages [P, S, R], rope_pages [P, S, Dr];
    latent_scale, rope_scale [P, S] float32 or None (fp8 pages); slots [N, K] int32 physical
    slot ids (page * S + offset; -1: none). scores = (q_lat . latent + q_rope . rope) * scale
    over row n's slots, values = latent. Returns (out [N, H, R] in q_lat.dtype, lse [N, H]
    float32). ``block_tokens`` slot ids per inner step and ``block_h`` query heads per program
    (powers of two >= 16; K and H are padded up).
    """
    dims = validate.check_sparse_mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, slots)
    validate.check_triton_dims(kv_lora_rank=dims["rank"], rope_dim=dims["rope_dim"], block_h=block_h,
                               block_tokens=block_tokens)
    return _sparse_mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, slots, scale=float(scale),
                       interpret=interpret, backend=backend, block_tokens=block_tokens, block_h=block_h,
                       num_warps=num_warps, num_stages=num_stages)
