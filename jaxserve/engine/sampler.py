"""Batched token sampling with per-row parameters, as one jitted function per bucket.

Order (as vLLM): penalties on the raw logits -> temperature -> top-k -> top-p -> min-p ->
draw. Each row draws with its own key, ``fold_in(key(seed), n)`` where n is the number of
tokens the request has generated so far, so a seeded request gives the same tokens
whatever else shares its batch (and after preemption and recompute). Greedy rows
(temperature 0) take the argmax of the penalised logits. Returned logprobs are those of
the model's raw distribution.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("all_greedy", "penalties", "num_logprobs"))
def sample_rows(
    logits, rows, temperature, top_k, top_p, min_p, seeds, steps,
    counts=None, seen=None, repetition=None, presence=None, frequency=None,
    *, all_greedy: bool, penalties: bool, num_logprobs: int,
):
    """logits f32 [L, V] (a program's output); rows int32 [B]: which logits row each sample
    uses; per-row temperature/top_p/min_p f32 [B], top_k/seeds/steps int32 [B];
    counts int32 [B, V] (generated-token counts), seen bool [B, V] (prompt or generated),
    repetition/presence/frequency f32 [B] (only with penalties=True).

    -> tokens int32 [B], logprob f32 [B], top_ids int32 [B, n], top_logprobs f32 [B, n].
    """
    logits = logits[rows]
    raw_lp = jax.nn.log_softmax(logits, axis=-1)
    x = logits
    if penalties:
        r = repetition[:, None]
        x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
        x = x - presence[:, None] * (counts > 0) - frequency[:, None] * counts
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if all_greedy:
        tokens = greedy
    else:
        v = x.shape[-1]
        scaled = x / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        order = jnp.argsort(-scaled, axis=-1)
        srt = jnp.take_along_axis(scaled, order, axis=-1)
        rank = jnp.arange(v)[None, :]
        keep = rank < jnp.where(top_k > 0, top_k, v)[:, None]
        probs = jax.nn.softmax(jnp.where(keep, srt, -jnp.inf), axis=-1)
        keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # smallest prefix reaching top_p
        keep &= probs >= min_p[:, None] * probs[:, :1]  # min-p relative to the most likely token
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, steps)
        pick = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, jnp.where(keep, srt, -jnp.inf))
        sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
        tokens = jnp.where(temperature > 0, sampled, greedy)
    logprob = jnp.take_along_axis(raw_lp, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw_lp, num_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, logprob, top_ids.astype(jnp.int32), top_lp
