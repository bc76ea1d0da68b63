"""Combining attention over disjoint key sets via log-sum-exp.

The kernel splits a long context across programs (flash-decoding), and a caller may attend
to other keys elsewhere. Each part returns its softmax-normalised output and the
log-sum-exp of its scaled scores; the exact softmax over the union of keys is

    out = (exp(lse_a - m) * out_a + exp(lse_b - m) * out_b) / (exp(lse_a - m) + exp(lse_b - m))
    lse = m + log(exp(lse_a - m) + exp(lse_b - m)),      m = max(lse_a, lse_b).

An empty part has lse = -inf and out = 0: it gets weight exactly 0. Two empty parts give
out = 0, lse = -inf (never NaN).
"""
from __future__ import annotations

import jax.numpy as jnp


def merge_attention(out_a, lse_a, out_b, lse_b):
    """out_* [..., X], lse_* [...] float32 -> (out [..., X] in out_a.dtype, lse [...] float32)."""
    outs = jnp.stack([out_a.astype(jnp.float32), out_b.astype(jnp.float32)], axis=0)
    lses = jnp.stack([lse_a.astype(jnp.float32), lse_b.astype(jnp.float32)], axis=0)
    out, lse = merge_partials(outs, lses, axis=0)
    return out.astype(out_a.dtype), lse


def merge_partials(outs, lses, axis: int):
    """Merge n partial results along `axis`: outs [..., n, ..., X], lses [..., n, ...] (same
    leading layout, outs with one trailing feature axis) -> (out [..., X] f32, lse [...] f32)."""
    lses = lses.astype(jnp.float32)
    m = jnp.max(lses, axis=axis, keepdims=True)
    # All parts empty -> m = -inf; shift by 0 instead so exp(-inf - 0) = 0 (not NaN).
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lses - m)  # [..., n, ...]; 0 for empty parts
    total = jnp.sum(w, axis=axis)
    out = jnp.sum(outs.astype(jnp.float32) * w[..., None], axis=axis)
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, jnp.squeeze(m, axis) + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return out, lse
