"""DeepSeek sparse attention (DSA): the lightning indexer that picks, per query, the
``index_topk`` cached tokens its layer attends to (GLM-5, DeepSeek-V3.2).

The indexer has its own small heads: a query per head from the MLA query residual
(``q_resid = q_a_norm(q_a(x))``), one key per token from the hidden state (LayerNorm'd), both
rotated (interleaved RoPE) on their first ``qk_rope_head_dim`` dims. A token's score for a
query is ``sum_h w_h * relu(q_h . k * D^-0.5)`` with per-head weights ``w`` projected from the
hidden state; the top ``index_topk`` visible tokens are kept. The keys are cached per token in
the layer's ``index_k`` pool [P, S, D] in the KV format, written before scoring, so a step
scores its own tokens as the cache stores them, as attention does. The choice goes to the
attention backend as positions [B, T, index_topk] (``top_k_indices``): the XLA path reads those
rows (decode) or masks with them (prefill), the Pallas path feeds them to its sparse kernel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.kv import paged
from jaxserve.kv.formats import KVFormat
from jaxserve.models.attention import selection_mask
from jaxserve.models.layers import apply_rope, param
from jaxserve.quant.linear import linear


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias, in float32 (the indexer's key norm)."""

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, (dim,), (None,), dtype, "ones")
        self.bias = param(rngs, (dim,), (None,), dtype, "zeros")

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Indexer(nnx.Module):
    """wq_b [q_lora_rank, IH, D], wk [hidden, D], k_norm, weights_proj [hidden, IH] (float32)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        ih, d = cfg.index_n_heads, cfg.index_head_dim
        self.cfg = cfg
        self.wq_b = param(rngs, (cfg.q_lora_rank, ih, d), (None, None, None), dtype)
        self.wk = param(rngs, (cfg.hidden_size, d), (None, None), dtype)
        self.k_norm = LayerNorm(d, 1e-6, dtype, rngs)
        # float32 even in a bf16 model, as the reference keeps it
        self.weights_proj = param(rngs, (cfg.hidden_size, ih), (None, None), jnp.float32)

    def __call__(self, x, q_resid, rope, step, kv: dict, fmt: KVFormat, page_size: int):
        """Write this step's index keys, then choose each query's tokens.

        x [B, T, hidden], q_resid [B, T, q_lora_rank] -> (kv, select): select is int32
        [B, T, index_topk], the positions of each query's ``index_topk`` best-scored visible
        tokens (-1 for picks past what it sees), or None when the page table holds no more than
        ``index_topk`` slots (every visible token is chosen: dense attention, nothing to score).
        """
        cfg = self.cfg
        cos, sin = rope
        dr = cfg.qk_rope_head_dim
        k = self.k_norm(linear(x, self.wk))  # [B, T, D]
        k = jnp.concatenate([apply_rope(k[..., :dr], cos, sin, True), k[..., dr:]], axis=-1)
        num_pages = kv["index_k"].shape[0]
        page, off = paged.token_slots(step.page_table, step.positions, step.valid, page_size, num_pages)
        kv = paged.store(fmt, kv, "index_k", k, page, off)
        if step.page_table.shape[1] * page_size <= cfg.index_topk:
            return kv, None

        q = linear(q_resid, self.wq_b)  # [B, T, IH, D]
        q = jnp.concatenate([apply_rope(q[..., :dr], cos, sin, True), q[..., dr:]], axis=-1)
        f32 = jnp.float32
        w = linear(x.astype(f32), self.weights_proj, out_dtype=f32) * cfg.index_n_heads**-0.5  # [B, T, IH]
        scores = index_scores(q.astype(f32), w, kv, fmt, step, page_size, cfg.index_head_dim**-0.5)
        return kv, top_k_indices(scores, visible_slots(step, scores.shape[2]), cfg.index_topk)

    def init_kv(self, num_pages: int, page_size: int, fmt: KVFormat) -> dict:
        return paged.new_pool(fmt, (num_pages, page_size, self.cfg.index_head_dim), "index_k")


SCORE_CHUNK = 256  # index keys scored per loop iteration (rounded to whole pages)


def index_scores(q, w, kv: dict, fmt: KVFormat, step, page_size: int, scale: float,
                 chunk_tokens: int = SCORE_CHUNK):
    """sum_h w[b,t,h] * relu(q[b,t,h] . k[b,c] * scale) for every slot c of the page table.

    q f32 [B, T, IH, D], w f32 [B, T, IH] -> f32 [B, T, M*S]. The keys are read and scored a
    chunk of pages at a time, for as many chunks as the batch's longest row needs (so the per-head
    scores never exceed [B, T, IH, chunk_tokens] and a step costs its real context); slots past
    that are left 0 (no query sees them).
    """
    f32 = jnp.float32
    pt = step.page_table
    b, m = pt.shape
    cp = max(1, min(m, chunk_tokens // page_size))
    n_total = -(-m // cp)
    pt = jnp.pad(pt, ((0, 0), (0, n_total * cp - m)))  # padded with the null page
    ct = cp * page_size

    def body(i, scores):
        keys = paged.load_chunk(fmt, kv, "index_k", jax.lax.dynamic_slice_in_dim(pt, i * cp, cp, axis=1), f32)
        s = jax.nn.relu(jnp.einsum("bthd,bcd->bthc", q, keys, preferred_element_type=f32) * scale)
        part = jnp.einsum("bthc,bth->btc", s, w, preferred_element_type=f32)  # [B, T, ct]
        return jax.lax.dynamic_update_slice_in_dim(scores, part, i * ct, axis=2)

    n = jnp.minimum((jnp.max(step.cached_lens + step.new_lens) + ct - 1) // ct, n_total)
    scores = jax.lax.fori_loop(0, n, body, jnp.zeros((b, q.shape[1], n_total * ct), f32))
    return scores[:, :, : m * page_size]


def visible_slots(step, slots: int):
    """bool [B, T, slots]: slot c (position c of the row) is visible to new token t."""
    c = jnp.arange(slots, dtype=jnp.int32)[None, None, :]
    total = (step.cached_lens + step.new_lens)[:, None, None]
    return (c <= step.positions[:, :, None]) & (c < total) & step.valid[:, :, None]


def top_k_indices(scores, visible, k: int):
    """scores f32 [B, T, C], visible bool [B, T, C] -> int32 [B, T, k]: the slots (positions) of
    each query's k best visible scores, best first; -1 for picks past its visible slots."""
    _, idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
    return jnp.where(jnp.take_along_axis(visible, idx, axis=2), idx, -1).astype(jnp.int32)


def top_k_select(scores, visible, k: int):
    """The same choice as a mask: bool [B, T, C], the k best visible slots of each query (all of
    them when fewer than k are visible)."""
    return selection_mask(top_k_indices(scores, visible, k), scores.shape[2])
