"""Pure-jnp paged decode attention: the specification the Pallas kernels are tested against.

Semantics (both layouts): batch row b attends its one query token to slots
0 .. ctx_lens[b]-1 of its pages page_table[b, :] (slot t lives in page page_table[b, t // S]
at offset t % S). Keys/values are dequantized first (fp8: value = stored.astype(f32) * scale).
Returns the softmax-normalised output over those keys and the log-sum-exp of the scaled
scores, so the caller can merge with other keys (see merge.py). A row with ctx_len 0 returns
out = 0 and lse = -inf. Masked slots never leak: a NaN in an unread slot or page stays out.

Page ids outside [0, P) are redirected to the null page 0 (the kernels do the same, so a bad
id can never read another sequence's page; validate.py rejects them when it can see them).
All arithmetic here is float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def safe_page_table(page_table, num_pages: int):
    """page_table [B, M] -> same, with ids outside [0, P) replaced by the null page 0."""
    return jnp.where((page_table >= 0) & (page_table < num_pages), page_table, 0).astype(jnp.int32)


def _dequant(pages, scales):
    x = pages.astype(jnp.float32)
    return x if scales is None else x * scales[..., None].astype(jnp.float32)


def _softmax_lse(scores, mask, values, eq: str):
    """scores [..., C] f32, mask broadcastable to scores -> (out, lse) via einsum `eq` on values."""
    s = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # empty row: keep exp() finite
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1)
    out = jnp.einsum(eq, p, values, precision=HIGHEST) / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out, lse


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_gqa_reference(q, k_pages, v_pages, k_scale, v_scale, page_table, ctx_lens, *, scale: float):
    """q [B, H, D]; k/v pages [KVH, P, S, D]; k/v scale [KVH, P, S] f32 or None;
    page_table [B, M] int32; ctx_lens [B] int32 -> (out [B, H, D] q.dtype, lse [B, H] f32)."""
    b, h, d = q.shape
    kvh, p, s, _ = k_pages.shape
    m = page_table.shape[1]
    pt = safe_page_table(page_table, p)

    def gather(pages, scales):  # -> [B, KVH, M*S, D] f32
        x = _dequant(pages[:, pt], None if scales is None else scales[:, pt])  # [KVH, B, M, S, D]
        return jnp.moveaxis(x.reshape(kvh, b, m * s, d), 0, 1)

    k, v = gather(k_pages, k_scale), gather(v_pages, v_scale)
    valid = jnp.arange(m * s)[None, :] < ctx_lens[:, None]  # [B, C]
    v = jnp.where(valid[:, None, :, None], v, 0.0)  # 0 * NaN would poison the sum
    qg = q.astype(jnp.float32).reshape(b, kvh, h // kvh, d)
    scores = jnp.einsum("bkgd,bkcd->bkgc", qg, k, precision=HIGHEST) * scale
    out, lse = _softmax_lse(scores, valid[:, None, None, :], v, "bkgc,bkcd->bkgd")
    return out.reshape(b, h, d).astype(q.dtype), lse.reshape(b, h)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_mla_reference(
    q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, page_table, ctx_lens, *, scale: float
):
    """Absorbed MLA. q_lat [B, H, R], q_rope [B, H, Dr]; latent [P, S, R], rope [P, S, Dr];
    scales [P, S] f32 or None -> (out [B, H, R] q_lat.dtype, lse [B, H] f32).

    scores = (q_lat . latent + q_rope . rope) * scale; values = latent."""
    b = q_lat.shape[0]
    p, s, r = latent_pages.shape
    m = page_table.shape[1]
    pt = safe_page_table(page_table, p)

    def gather(pages, scales):  # -> [B, M*S, X] f32
        x = _dequant(pages[pt], None if scales is None else scales[pt])  # [B, M, S, X]
        return x.reshape(b, m * s, x.shape[-1])

    lat, rope = gather(latent_pages, latent_scale), gather(rope_pages, rope_scale)
    valid = jnp.arange(m * s)[None, :] < ctx_lens[:, None]  # [B, C]
    lat = jnp.where(valid[..., None], lat, 0.0)
    rope = jnp.where(valid[..., None], rope, 0.0)
    scores = jnp.einsum("bhr,bcr->bhc", q_lat.astype(jnp.float32), lat, precision=HIGHEST)
    scores += jnp.einsum("bhd,bcd->bhc", q_rope.astype(jnp.float32), rope, precision=HIGHEST)
    out, lse = _softmax_lse(scores * scale, valid[:, None, :], lat, "bhc,bcr->bhr")
    return out.astype(q_lat.dtype), lse


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_attention_mla_reference(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, slots, *,
                                   scale: float):
    """Absorbed MLA over chosen slots. q_lat [N, H, R], q_rope [N, H, Dr]; pages and scales as
    above; slots [N, K] int32 physical ids page * S + offset (-1 or out of range: none)
    -> (out [N, H, R] q_lat.dtype, lse [N, H] f32)."""
    p, s, r = latent_pages.shape
    valid = (slots >= 0) & (slots < p * s)  # [N, K]
    ids = jnp.where(valid, slots, 0)

    def gather(pages, scales):  # -> [N, K, X] f32, 0 where not valid (0 * NaN would poison the sum)
        flat = pages.reshape(p * s, pages.shape[-1])
        x = _dequant(flat[ids], None if scales is None else scales.reshape(p * s)[ids])
        return jnp.where(valid[..., None], x, 0.0)

    lat, rope = gather(latent_pages, latent_scale), gather(rope_pages, rope_scale)
    scores = jnp.einsum("nhr,nkr->nhk", q_lat.astype(jnp.float32), lat, precision=HIGHEST)
    scores += jnp.einsum("nhd,nkd->nhk", q_rope.astype(jnp.float32), rope, precision=HIGHEST)
    out, lse = _softmax_lse(scores * scale, valid[:, None, :], lat, "nhk,nkr->nhr")
    return out.astype(q_lat.dtype), lse
