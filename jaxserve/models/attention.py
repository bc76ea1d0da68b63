"""Attention over paged context plus in-flight new tokens (the XLA / pure-jnp path).

Every step attends to two key sets: the row's cached context, gathered from KV pages and
dequantized (slots < cached_len), and the step's own new tokens in full precision (causal).
Prefill (T = chunk) and decode (T = 1) are the same computation; the Pallas kernels in
``pallas_kernels/`` implement the paged half for the GPU (``attention_pallas``: prefill and decode).

The serving path (``gqa_attention_paged`` / ``mla_attention_paged``) reads the cached context
in chunks of pages inside a loop whose trip count is the batch's longest cached context, with
an online softmax (running max, denominator and weighted sum in float32). The page table keeps
one fixed width (the longest sequence the engine admits), so there is one program per padding
bucket, yet a step costs what the batch's real context costs, not what the table's width
would. ``gqa_attention`` / ``mla_attention`` are the one-shot forms over an already gathered
context (the reference the chunked form is tested against).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kv import paged

_NEG = -1e30  # finite: a padding row with no visible key stays NaN-free (its output is discarded)


def _softmax(scores, mask):
    s = jnp.where(mask, scores.astype(jnp.float32), _NEG)
    return jax.nn.softmax(s, axis=-1)


def mla_attention(q_lat, q_rope, ctx_lat, ctx_rope, ctx_mask, new_lat, new_rope, causal, scale: float):
    """Absorbed-form MLA (keys and values are the shared latent; kv_b_proj folded into q and o).

    q_lat [B, T, H, R], q_rope [B, T, H, Dr]
    ctx_lat [B, C, R], ctx_rope [B, C, Dr], ctx_mask [B, C]   cached context from pages
    new_lat [B, T, R], new_rope [B, T, Dr], causal [B, T, T]  this step's tokens
    -> latent attention output [B, T, H, R]
    """
    dt = q_lat.dtype
    s_ctx = jnp.einsum("bthr,bcr->bhtc", q_lat, ctx_lat) + jnp.einsum("bthd,bcd->bhtc", q_rope, ctx_rope)
    s_new = jnp.einsum("bthr,bur->bhtu", q_lat, new_lat) + jnp.einsum("bthd,bud->bhtu", q_rope, new_rope)
    c = ctx_lat.shape[1]
    t = q_lat.shape[1]
    mask = jnp.concatenate(
        [jnp.broadcast_to(ctx_mask[:, None, None, :], (ctx_mask.shape[0], 1, t, c)), causal[:, None]], axis=-1
    )
    p = _softmax(jnp.concatenate([s_ctx, s_new], axis=-1) * scale, mask).astype(dt)
    return jnp.einsum("bhtc,bcr->bthr", p[..., :c], ctx_lat) + jnp.einsum("bhtu,bur->bthr", p[..., c:], new_lat)


def gqa_attention(q, ctx_k, ctx_v, ctx_mask, new_k, new_v, causal, scale: float):
    """Grouped-query attention.

    q [B, T, H, D]; ctx_k/ctx_v [B, K, C, D], ctx_mask [B, C]; new_k/new_v [B, T, K, D];
    causal [B, T, T] -> [B, T, H, D]. H = K * G (G query heads share a KV head).
    """
    b, t, h, d = q.shape
    k = ctx_k.shape[1]
    g = h // k
    qg = q.reshape(b, t, k, g, d)
    s_ctx = jnp.einsum("btkgd,bkcd->bkgtc", qg, ctx_k)
    s_new = jnp.einsum("btkgd,bukd->bkgtu", qg, new_k)
    c = ctx_k.shape[2]
    mask = jnp.concatenate(
        [jnp.broadcast_to(ctx_mask[:, None, None, None, :], (b, 1, 1, t, c)), causal[:, None, None]], axis=-1
    )
    p = _softmax(jnp.concatenate([s_ctx, s_new], axis=-1) * scale, mask).astype(q.dtype)
    out = jnp.einsum("bkgtc,bkcd->btkgd", p[..., :c], ctx_v) + jnp.einsum("bkgtu,bukd->btkgd", p[..., c:], new_v)
    return out.reshape(b, t, h, d)


# ----------------------------------------------------------------------------- chunked paged
CHUNK_TOKENS = 64  # context tokens read per loop iteration (rounded to whole pages)


def chunk_pages(page_size: int, width: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Pages per loop iteration: about ``chunk_tokens`` tokens, at most the table width."""
    return max(1, min(width, chunk_tokens // page_size))


def gathered_slots(width: int, page_size: int, context: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Context slots per row the XLA path gathers when the batch's longest cached context is
    ``context`` and the page table is ``width`` pages wide (for benchmarks' byte counts)."""
    cp = chunk_pages(page_size, width, chunk_tokens)
    n_total = -(-width // cp)
    if n_total == 1:
        return width * page_size
    ct = cp * page_size
    return min(-(-context // ct), n_total) * ct


def _context_loop(page_table, cached_lens, page_size: int, cp: int, init, update):
    """Run ``update(page_chunk [B, cp], slot_mask [B, cp*S], carry)`` over the page table in
    chunks of ``cp`` pages, for as many chunks as the longest cached context needs.

    The table is padded with the null page to a whole number of chunks (padded slots are
    masked: they lie past every row's cached length), so no chunk start is ever clamped.
    """
    m = page_table.shape[1]
    n_total = -(-m // cp)
    if n_total * cp != m:
        page_table = jnp.pad(page_table, ((0, 0), (0, n_total * cp - m)))
    ct = cp * page_size
    if n_total == 1:
        # One chunk spans the table: straight-line code. (A loop of at most one trip is
        # simplified by XLA anyway, and then it may fuse the step's one-token KV write into
        # this gather, which costs whole-pool copies; a plain gather after the write does not.)
        pos = jnp.arange(ct, dtype=jnp.int32)
        return update(page_table, pos[None, :] < cached_lens[:, None], init)
    n = jnp.minimum((jnp.max(cached_lens) + ct - 1) // ct, n_total)

    def body(i, carry):
        pt = jax.lax.dynamic_slice_in_dim(page_table, i * cp, cp, axis=1)
        pos = i * ct + jnp.arange(ct, dtype=jnp.int32)
        return update(pt, pos[None, :] < cached_lens[:, None], carry)

    return jax.lax.fori_loop(0, n, body, init)


def _online_start(s, mask):
    """Softmax state from the first key block: scores s [..., U] (f32, scaled), mask [..., U]."""
    s = jnp.where(mask, s, _NEG)
    m = s.max(-1)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    return m, p


def _online_step(m, l, acc, s, mask, values):
    """Fold one more key block into (m, l, acc); ``values(p)`` -> p @ V for the block."""
    s = jnp.where(mask, s, _NEG)
    m_new = jnp.maximum(m, s.max(-1))
    corr = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + values(p)


def _finish(l, acc):
    # A row that sees no key at all (a padding row) gets zeros, not NaN.
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def gqa_attention_paged(q, kv, fmt, page_table, cached_lens, new_k, new_v, causal, scale: float, page_size: int,
                        chunk_tokens: int = CHUNK_TOKENS):
    """Grouped-query attention reading the cached context from pages in chunks.

    q [B, T, H, D]; kv pools "k"/"v" [KVH, P, S, D] (+ scales) in ``fmt``; page_table [B, M];
    cached_lens [B]; new_k/new_v [B, T, KVH, D]; causal [B, T, T] -> [B, T, H, D] in q.dtype.
    """
    b, t, h, d = q.shape
    k = new_k.shape[2]
    g = h // k
    dt = q.dtype
    f32 = jnp.float32
    qg = q.reshape(b, t, k, g, d)
    s_new = jnp.einsum("btkgd,bukd->bkgtu", qg, new_k, preferred_element_type=f32) * scale
    m, p = _online_start(s_new, causal[:, None, None])
    l = p.sum(-1)
    acc = jnp.einsum("bkgtu,bukd->bkgtd", p.astype(dt), new_v, preferred_element_type=f32)

    def update(pt, mask, carry):
        ck = paged.load_chunk(fmt, kv, "k", pt, dt, headed=True)  # [KVH, B, C, D]
        cv = paged.load_chunk(fmt, kv, "v", pt, dt, headed=True)
        s = jnp.einsum("btkgd,kbcd->bkgtc", qg, ck, preferred_element_type=f32) * scale
        return _online_step(
            *carry, s, mask[:, None, None, None, :],
            lambda p: jnp.einsum("bkgtc,kbcd->bkgtd", p.astype(dt), cv, preferred_element_type=f32),
        )

    cp = chunk_pages(page_size, page_table.shape[1], chunk_tokens)
    _, l, acc = _context_loop(page_table, cached_lens, page_size, cp, (m, l, acc), update)
    out = _finish(l, acc)  # [B, K, G, T, D]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d).astype(dt)


def mla_attention_paged(q_lat, q_rope, kv, fmt, page_table, cached_lens, new_lat, new_rope, causal, scale: float,
                        page_size: int, chunk_tokens: int = CHUNK_TOKENS):
    """Absorbed-form MLA reading the cached latent / rope key from pages in chunks.

    q_lat [B, T, H, R], q_rope [B, T, H, Dr]; kv pools "latent" [P, S, R], "rope" [P, S, Dr];
    new_lat [B, T, R], new_rope [B, T, Dr], causal [B, T, T] -> [B, T, H, R] in q_lat.dtype.
    """
    dt = q_lat.dtype
    f32 = jnp.float32

    def scores(lat, rope, spec):
        return (jnp.einsum(f"bthr,{spec}r->bht{spec[-1]}", q_lat, lat, preferred_element_type=f32)
                + jnp.einsum(f"bthd,{spec}d->bht{spec[-1]}", q_rope, rope, preferred_element_type=f32)) * scale

    m, p = _online_start(scores(new_lat, new_rope, "bu"), causal[:, None])
    l = p.sum(-1)
    acc = jnp.einsum("bhtu,bur->bhtr", p.astype(dt), new_lat, preferred_element_type=f32)

    def update(pt, mask, carry):
        c_lat = paged.load_chunk(fmt, kv, "latent", pt, dt)  # [B, C, R]
        c_rope = paged.load_chunk(fmt, kv, "rope", pt, dt)
        return _online_step(
            *carry, scores(c_lat, c_rope, "bc"), mask[:, None, None, :],
            lambda p: jnp.einsum("bhtc,bcr->bhtr", p.astype(dt), c_lat, preferred_element_type=f32),
        )

    cp = chunk_pages(page_size, page_table.shape[1], chunk_tokens)
    _, l, acc = _context_loop(page_table, cached_lens, page_size, cp, (m, l, acc), update)
    return jnp.transpose(_finish(l, acc), (0, 2, 1, 3)).astype(dt)


# ----------------------------------------------------------------------------- Pallas decode
# Decode (one new token per row) with the paged half in a Pallas kernel: the kernel attends
# to the cached context (ctx_len = cached_lens, so it never reads the just-written token back
# quantized), the new token's own key is scored here, and the two are merged exactly by
# log-sum-exp.
