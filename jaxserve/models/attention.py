"""Attention over paged K/V (the XLA / pure-jnp path).

The serving path (``gqa_attention_paged`` / ``mla_attention_paged``) runs after the step has
written its new tokens' K/V into their pages, and reads every key, the step's own included,
back from the pages: each token attends to K/V exactly as the cache stores them (rounded or
quantized by the KV format), in the same blocks of absolute positions, whichever step wrote
them. So a request's numbers do not depend on where its prompt was split into chunks, on a
prefix-cache hit, or on what else is in the batch. Prefill (T = chunk) and decode (T = 1)
are the same computation. The backends (this one, and the Pallas kernels for GPU) are chosen
by name in ``attention_backends``.

Pages are read in chunks of pages inside a loop whose trip count is the batch's longest
sequence, with an online softmax (running max, denominator and weighted sum in float32). The
page table keeps one fixed width (the longest sequence the engine admits), so there is one
program per padding bucket, yet a step costs what the batch's real context costs, not what
the table's width would. ``gqa_attention`` / ``mla_attention`` are one-shot forms over an
already gathered context plus new tokens (the references the paged form is tested against).
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
    """Slots per row the XLA path gathers when the batch's longest sequence (cached + new
    tokens) is ``context`` and the page table is ``width`` pages wide (for benchmarks' byte
    counts)."""
    cp = chunk_pages(page_size, width, chunk_tokens)
    n_total = -(-width // cp)
    if n_total == 1:
        return width * page_size
    ct = cp * page_size
    return min(-(-context // ct), n_total) * ct


def _context_loop(page_table, total_lens, page_size: int, cp: int, init, update):
    """Run ``update(page_chunk [B, cp], slot_pos [cp*S], carry)`` over the page table in chunks
    of ``cp`` pages, for as many chunks as the longest row (``total_lens`` [B]) needs.

    ``slot_pos`` are the chunk's token positions (the same for every row); the caller masks
    them per row and query. The table is padded with the null page to a whole number of
    chunks (padded slots lie past every row's length), so no chunk start is ever clamped.
    """
    m = page_table.shape[1]
    n_total = -(-m // cp)
    if n_total * cp != m:
        page_table = jnp.pad(page_table, ((0, 0), (0, n_total * cp - m)))
    ct = cp * page_size
    if n_total == 1:
        # One chunk spans the table: straight-line code. (A loop of at most one trip is
        # simplified by XLA anyway, and then it may fuse the step's KV write into this
        # gather, which costs whole-pool copies; a plain gather after the write does not.)
        return update(page_table, jnp.arange(ct, dtype=jnp.int32), init)
    n = jnp.minimum((jnp.max(total_lens) + ct - 1) // ct, n_total)

    def body(i, carry):
        pt = jax.lax.dynamic_slice_in_dim(page_table, i * cp, cp, axis=1)
        return update(pt, i * ct + jnp.arange(ct, dtype=jnp.int32), carry)

    # The first chunk outside the loop: every step reads it (a row's own token lies in it or
    # past it), and as straight-line code it costs a few fused ops, where each loop trip costs
    # a dozen small ones. Bitwise the same as the loop's first trip (the same update on the
    # same carry); a short context runs no trip at all.
    first = update(page_table[:, :cp], jnp.arange(ct, dtype=jnp.int32), init)
    return jax.lax.fori_loop(1, n, body, first)


def _visible(slot_pos, cached_lens, new_lens, t: int):
    """bool [B, T, C]: query t of row b (at position cached + t) sees the slots at positions
    <= its own among the row's cached + new tokens."""
    q_pos = cached_lens[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    total = (cached_lens + new_lens)[:, None, None]
    return (slot_pos[None, None, :] <= q_pos[:, :, None]) & (slot_pos[None, None, :] < total)


def _online_empty(shape, width: int):
    """Softmax state before any key: running max, denominator [*shape], weighted sum [*shape, width]."""
    f32 = jnp.float32
    return jnp.full(shape, _NEG, f32), jnp.zeros(shape, f32), jnp.zeros(shape + (width,), f32)


def _online_step(m, l, acc, s, mask, values):
    """Fold one more key block into (m, l, acc); s [..., U] f32 scaled scores, mask [..., U];
    ``values(p)`` -> p @ V for the block."""
    s = jnp.where(mask, s, _NEG)
    m_new = jnp.maximum(m, s.max(-1))
    corr = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + values(p)


def _finish(l, acc):
    # A row that sees no key at all (a padding row) gets zeros, not NaN.
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def gqa_attention_paged(q, kv, fmt, page_table, cached_lens, new_lens, scale: float, page_size: int,
                        chunk_tokens: int = CHUNK_TOKENS):
    """Grouped-query attention over pages that already hold this step's K/V.

    q [B, T, H, D] (row b's query t at position cached_lens[b] + t); kv pools "k"/"v"
    [KVH, P, S, D] (+ scales) in ``fmt``; page_table [B, M]; cached_lens, new_lens [B]
    -> [B, T, H, D] in q.dtype.
    """
    b, t, h, d = q.shape
    k = kv["k"].shape[0]
    g = h // k
    dt = q.dtype
    f32 = jnp.float32
    qg = q.reshape(b, t, k, g, d)

    def update(pt, slot_pos, carry):
        ck = paged.load_chunk(fmt, kv, "k", pt, dt, headed=True)  # [KVH, B, C, D]
        cv = paged.load_chunk(fmt, kv, "v", pt, dt, headed=True)
        s = jnp.einsum("btkgd,kbcd->bkgtc", qg, ck, preferred_element_type=f32) * scale
        return _online_step(
            *carry, s, _visible(slot_pos, cached_lens, new_lens, t)[:, None, None],
            lambda p: jnp.einsum("bkgtc,kbcd->bkgtd", p.astype(dt), cv, preferred_element_type=f32),
        )

    cp = chunk_pages(page_size, page_table.shape[1], chunk_tokens)
    init = _online_empty((b, k, g, t), d)
    _, l, acc = _context_loop(page_table, cached_lens + new_lens, page_size, cp, init, update)
    out = _finish(l, acc)  # [B, K, G, T, D]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d).astype(dt)


def mla_attention_paged(q_lat, q_rope, kv, fmt, page_table, cached_lens, new_lens, scale: float, page_size: int,
                        chunk_tokens: int = CHUNK_TOKENS, select=None):
    """Absorbed-form MLA over pages that already hold this step's latent / rope key.

    q_lat [B, T, H, R], q_rope [B, T, H, Dr] (row b's query t at position cached_lens[b] + t);
    kv pools "latent" [P, S, R], "rope" [P, S, Dr]; cached_lens, new_lens [B];
    select: None, or bool [B, T, M*S]: the positions query t may see at all (sparse attention:
    the indexer's top-k as ``selection_mask``), on top of causality -> [B, T, H, R] in q_lat.dtype.
    The mask form still reads every cached block; ``mla_attention_selected`` reads only the
    chosen rows.
    """
    b, t, h, r = q_lat.shape
    dt = q_lat.dtype
    f32 = jnp.float32
    cp = chunk_pages(page_size, page_table.shape[1], chunk_tokens)
    if select is not None:  # padded like the table in _context_loop: whole chunks, nothing selected
        slots = -(-page_table.shape[1] // cp) * cp * page_size
        select = jnp.pad(select, ((0, 0), (0, 0), (0, slots - select.shape[2])))

    def visible(slot_pos):
        vis = _visible(slot_pos, cached_lens, new_lens, t)
        return vis if select is None else vis & jnp.take(select, slot_pos, axis=2)

    def update(pt, slot_pos, carry):
        c_lat = paged.load_chunk(fmt, kv, "latent", pt, dt)  # [B, C, R]
        c_rope = paged.load_chunk(fmt, kv, "rope", pt, dt)
        s = (jnp.einsum("bthr,bcr->bhtc", q_lat, c_lat, preferred_element_type=f32)
             + jnp.einsum("bthd,bcd->bhtc", q_rope, c_rope, preferred_element_type=f32)) * scale
        return _online_step(
            *carry, s, visible(slot_pos)[:, None],
            lambda p: jnp.einsum("bhtc,bcr->bhtr", p.astype(dt), c_lat, preferred_element_type=f32),
        )

    init = _online_empty((b, h, t), r)
    _, l, acc = _context_loop(page_table, cached_lens + new_lens, page_size, cp, init, update)
    return jnp.transpose(_finish(l, acc), (0, 2, 1, 3)).astype(dt)



# ----------------------------------------------------------------------------- sparse (DSA)


def selection_mask(select, slots: int):
    """Chosen positions int32 [B, T, K] (-1: none) -> bool [B, T, slots]."""
    b, t, _ = select.shape
    at = jnp.where(select >= 0, select, slots)  # out of range: dropped
    rows, toks = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    return jnp.zeros((b, t, slots), bool).at[rows, toks, at].set(True, mode="drop")


def mla_attention_selected(q_lat, q_rope, kv, fmt, page_table, select, scale: float, page_size: int):
    """Absorbed-form MLA over only the chosen cached positions (DeepSeek sparse attention, read
    as a gather: K latent / rope rows per query, whatever the context length).

    q_lat [B, T, H, R], q_rope [B, T, H, Dr]; kv pools "latent" [P, S, R], "rope" [P, S, Dr]
    already holding this step's tokens; select int32 [B, T, K]: positions query t attends to
    (the indexer's top-k, causal by construction; -1: none) -> [B, T, H, R] in q_lat.dtype.
    The gathered rows are [B, T, K, R + Dr]: meant for decode (T small), where it replaces a
    pass over every cached block by K rows.
    """
    dt = q_lat.dtype
    f32 = jnp.float32
    page, off, ok = paged.position_slots(page_table, select, page_size, kv["latent"].shape[0])
    lat = jnp.where(ok[..., None], paged.load_slots(fmt, kv, "latent", page, off, dt), 0)  # [B, T, K, R]
    rope = paged.load_slots(fmt, kv, "rope", page, off, dt)
    s = (jnp.einsum("bthr,btkr->bthk", q_lat, lat, preferred_element_type=f32)
         + jnp.einsum("bthd,btkd->bthk", q_rope, rope, preferred_element_type=f32)) * scale
    mask = ok[:, :, None, :]
    s = jnp.where(mask, s, _NEG)
    p = jnp.where(mask, jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
    l = p.sum(-1)
    acc = jnp.einsum("bthk,btkr->bthr", p.astype(dt), lat, preferred_element_type=f32)
    return (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(dt)
