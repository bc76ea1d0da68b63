"""Token sampling from float32 logits: greedy, temperature, top-k, top-p.

One jitted function for the whole batch; greedy rows (temperature 0) take the argmax.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError naming the first bad sampling value."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


@jax.jit
def sample(logits, temperature, top_k, top_p, key):
    """logits f32 [B, V]; temperature f32 [B] (0 = greedy); top_k int32 [B] (0 = off);
    top_p f32 [B]; key: a PRNG key -> int32 [B]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    v = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = rank < jnp.where(top_k > 0, top_k, v)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (before < top_p[:, None])
    pick = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
