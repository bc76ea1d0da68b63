"""Attention over paged context plus in-flight new tokens (the XLA / pure-jnp path).

Every step attends to two key sets: the row's cached context, gathered from KV pages and
dequantized (slots < cached_len), and the step's own new tokens in full precision (causal).
Prefill (T = chunk) and decode (T = 1) are the same computation; the Pallas kernels in
``pallas_kernels/`` implement the paged half for the hot decode path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

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


# ----------------------------------------------------------------------------- Pallas decode
# Decode (one new token per row) with the paged half in a Pallas kernel: the kernel attends
# to the cached context (ctx_len = cached_lens, so it never reads the just-written token back
# quantized), the new token's own key is scored here, and the two are merged exactly by
# log-sum-exp.

BACKENDS = ("xla", "pallas", "pallas_interpret")


def mla_decode_pallas(q_lat, q_rope, kv, new_lat, new_rope, step, scale: float, interpret: bool):
    """q_lat [B, 1, H, R], q_rope [B, 1, H, Dr], new_lat [B, 1, R], new_rope [B, 1, Dr] -> [B, 1, H, R]."""
    from pallas_kernels.paged_attention import merge_attention, paged_attention_mla

    ql, qr = q_lat[:, 0], q_rope[:, 0]
    out_p, lse_p = paged_attention_mla(
        ql, qr, kv["latent"], kv["rope"], kv.get("latent_scale"), kv.get("rope_scale"),
        step.page_table, step.cached_lens, scale=scale, interpret=interpret,
    )
    s_new = (jnp.einsum("bhr,br->bh", ql, new_lat[:, 0]) + jnp.einsum("bhd,bd->bh", qr, new_rope[:, 0])) * scale
    lse_new = jnp.where(step.new_lens[:, None] > 0, s_new.astype(jnp.float32), -jnp.inf)
    out_new = jnp.broadcast_to(new_lat[:, 0][:, None, :], ql.shape)
    out, _ = merge_attention(out_p, lse_p, out_new.astype(out_p.dtype), lse_new)
    return out[:, None]


def gqa_decode_pallas(q, kv, new_k, new_v, step, scale: float, interpret: bool):
    """q [B, 1, H, D], new_k/new_v [B, 1, K, D] -> [B, 1, H, D]."""
    from pallas_kernels.paged_attention import merge_attention, paged_attention_gqa

    q1 = q[:, 0]
    b, h, d = q1.shape
    k = new_k.shape[2]
    out_p, lse_p = paged_attention_gqa(
        q1, kv["k"], kv["v"], kv.get("k_scale"), kv.get("v_scale"), step.page_table, step.cached_lens,
        scale=scale, interpret=interpret,
    )
    kn = jnp.repeat(new_k[:, 0], h // k, axis=1)  # [B, H, D]: each query head's KV head
    vn = jnp.repeat(new_v[:, 0], h // k, axis=1)
    s_new = jnp.einsum("bhd,bhd->bh", q1, kn) * scale
    lse_new = jnp.where(step.new_lens[:, None] > 0, s_new.astype(jnp.float32), -jnp.inf)
    out, _ = merge_attention(out_p, lse_p, vn.astype(out_p.dtype), lse_new)
    return out[:, None]
