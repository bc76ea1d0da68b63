"""The lossless acceptance rule over one verify call's logits, as one jitted function.

Row b of a verify call scored its last token and ``num_drafts[b]`` draft tokens: position j's
logits are the target's next-token distribution after the draft tokens before j. Each position's
distribution is processed as the sampler processes one (``jaxserve.engine.sampler``): penalties
on the raw logits (the draft tokens before j counted as generated), a structured output's grammar
mask at position j (after the drafts before j: a draft the grammar forbids was cut before the
call, ``Constraints.draft_masks``), temperature, top-k, top-p, min-p. Then, position by position:

- greedy rows accept draft j when it is the argmax; the first mismatch emits the argmax;
- sampled rows accept draft j with probability p_j(draft_j) (the draft distribution of a
  deterministic proposer is a point mass, so min(1, p/q) = p); the first rejection emits a token
  drawn from p_j with the draft token removed and renormalised. Every token so emitted is
  distributed exactly as p_j (P(d) = p(d); P(x != d) = (1 - p(d)) p(x) / (1 - p(d))).

After an accepted run of every draft the bonus token is drawn from the last position's
distribution. Randomness is per row and position: position j of a row whose request has
generated n tokens uses ``fold_in(key(seed), n + j)``, as the sampler's draw of token n + j
does (its Gumbel noise for the draws; a key folded from it for the acceptance uniform), so the
same seed gives the same tokens whatever else is batched.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native
from jaxserve.engine.sampler import mask_words, native_greedy, row_noise, unpack_mask

_ACCEPT_SALT = 0x5BEC  # the acceptance uniform's key, folded from the position's key


def _kept_mask(scaled, top_k, top_p, min_p):
    """bool [N, V]: the tokens the sampler's kept set holds for each row of ``scaled`` (the exact
    full-sort computation of ``sampler._kept_draw``, scattered back to vocabulary order)."""
    n, v = scaled.shape
    vals, ids = jax.lax.top_k(scaled, v)
    rank = jnp.arange(v)[None, :]
    limited = top_k > 0
    in_k = rank < jnp.where(limited, top_k, v)[:, None]
    lse = jnp.where(limited, jax.nn.logsumexp(jnp.where(in_k, vals, -jnp.inf), axis=-1),
                    jax.nn.logsumexp(scaled, axis=-1))
    probs = jnp.where(in_k, jnp.exp(vals - lse[:, None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    keep = in_k & ((cum - probs) < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])
    return jnp.zeros((n, v), bool).at[jnp.arange(n)[:, None], ids].set(keep)


def _penalised(x, drafts, num_drafts, counts, seen, repetition, presence, frequency):
    """The sampler's penalties at every position: the drafts before position j count as generated."""
    b, t, v = x.shape
    real = jnp.arange(t - 1)[None, :] < num_drafts[:, None]
    onehot = jax.nn.one_hot(drafts, v, dtype=jnp.int32) * real[..., None]  # [B, T-1, V]
    before = jnp.concatenate([jnp.zeros((b, 1, v), jnp.int32), jnp.cumsum(onehot, axis=1)], axis=1)
    c = counts[:, None] + before
    s = seen[:, None] | (before > 0)
    r = repetition[:, None, None]
    x = jnp.where(s, jnp.where(x > 0, x / r, x * r), x)
    return x - presence[:, None, None] * (c > 0) - frequency[:, None, None] * c


@functools.partial(jax.jit, static_argnames=("all_greedy", "penalties", "num_logprobs"))
def verify_rows(logits, rows, drafts, num_drafts, temperature, top_k, top_p, min_p, seeds, steps,
                counts=None, seen=None, repetition=None, presence=None, frequency=None, masks=None,
                *, all_greedy: bool, penalties: bool, num_logprobs: int):
    """logits f32 [L, T, V] (a verify program's output); rows int32 [B]: each row's logits row;
    drafts int32 [B, T-1] (``num_drafts[b]`` real ones); per-row sampling parameters as
    ``sample_rows`` takes them ([B]; steps = tokens generated before this call); masks: None or
    int32 [B, T, ceil(V / 32)], each position's allowed tokens (the sampler's packed layout).

    -> (accepted int32 [B]: drafts accepted, tokens int32 [B, T]: the accepted drafts then the
    emitted correction / bonus token (entries past ``accepted`` + 1 unused), logprob f32 [B, T] of
    each under the raw distribution, top ids int32 [B, T, n], top logprobs f32 [B, T, n]).

    All-greedy calls without penalties or top log-probs run the sampler's native greedy kernel
    where decode runs it: the same first argmax under the mask, and the raw logprob of the
    argmax, which is every token such a call emits (a greedy row accepts a draft only where
    it is the argmax)."""
    if all_greedy and not penalties and not num_logprobs and native_greedy():
        return _greedy_native(logits, rows, drafts, num_drafts, masks)
    x = logits[rows]
    b, t, v = x.shape
    raw_lp = jax.nn.log_softmax(x, axis=-1)
    if penalties:
        x = _penalised(x, drafts, num_drafts, counts, seen, repetition, presence, frequency)
    if masks is not None:  # each position's grammar mask, applied where the sampler applies it
        allowed = unpack_mask(masks.reshape(b * t, -1), v).reshape(b, t, v)
        x = jnp.where(allowed, x, -jnp.inf)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)  # [B, T]
    real = jnp.arange(t - 1)[None, :] < num_drafts[:, None]
    if all_greedy:
        accept, final = drafts == greedy[:, :-1], greedy
    else:
        accept, final = _sampled(x, greedy, drafts, num_drafts, temperature, top_k, top_p, min_p, seeds, steps)
    ok = accept & real
    accepted = _accepted(ok)
    pos = jnp.arange(t)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(pos < accepted[:, None], padded, final)
    logprob = jnp.take_along_axis(raw_lp, tokens[..., None], axis=-1)[..., 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw_lp, num_logprobs)
    else:
        top_lp, top_ids = jnp.zeros((b, t, 0), jnp.float32), jnp.zeros((b, t, 0), jnp.int32)
    return accepted, tokens, logprob, top_ids.astype(jnp.int32), top_lp


def _accepted(ok):
    """The accepted run's length per row: the leading true entries of ok [B, T-1]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _greedy_native(logits, rows, drafts, num_drafts, masks):
    n, t, v = logits.shape
    b = rows.shape[0]
    flat = (rows[:, None] * t + jnp.arange(t, dtype=jnp.int32)[None, :]).reshape(-1)
    mask = jnp.full((b * t, mask_words(v)), -1, jnp.int32) if masks is None else masks.reshape(b * t, -1)
    greedy, logprob = native.greedy_rows(logits.reshape(n * t, v), flat, mask)
    greedy, logprob = greedy.reshape(b, t), logprob.reshape(b, t)
    real = jnp.arange(t - 1)[None, :] < num_drafts[:, None]
    accepted = _accepted((drafts == greedy[:, :-1]) & real)
    empty = jnp.zeros((b, t, 0), jnp.float32)
    return accepted, greedy, logprob, empty.astype(jnp.int32), empty


def _sampled(x, greedy, drafts, num_drafts, temperature, top_k, top_p, min_p, seeds, steps):
    """-> (accept bool [B, T-1], final token [B, T]: at position j the token emitted if the run
    stops there: the residual draw where draft j exists (it was rejected), else the plain draw
    (the bonus after every draft was accepted))."""
    b, t, v = x.shape
    flat = lambda a: jnp.repeat(a, t)  # noqa: E731  per-row parameter -> per (row, position)
    temp = flat(temperature)
    scaled = x.reshape(b * t, v) / jnp.where(temp > 0, temp, 1.0)[:, None]
    whole = (flat(top_k) <= 0) & (flat(top_p) >= 1.0) & (flat(min_p) <= 0.0)
    keep = jax.lax.cond(jnp.all(whole), lambda: jnp.ones(scaled.shape, bool),
                        lambda: _kept_mask(scaled, flat(top_k), flat(top_p), flat(min_p)) | whole[:, None])
    logp = jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1).reshape(b, t, v)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(
        flat(seeds), (steps[:, None] + jnp.arange(t)[None, :]).reshape(-1))
    noise = row_noise(keys, v).reshape(b, t, v)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _ACCEPT_SALT)))(keys).reshape(b, t)
    p_draft = jnp.exp(jnp.take_along_axis(logp[:, :-1], drafts[..., None], axis=-1)[..., 0])
    accept_s = u[:, :-1] < p_draft
    plain = jnp.argmax(logp + noise, axis=-1).astype(jnp.int32)  # the sampler's own draw
    is_draft = jnp.arange(v)[None, None, :] == drafts[..., None]
    resid = jnp.argmax(jnp.where(is_draft, -jnp.inf, logp[:, :-1] + noise[:, :-1]), axis=-1).astype(jnp.int32)
    sampling = temperature > 0
    accept = jnp.where(sampling[:, None], accept_s, drafts == greedy[:, :-1])
    drafted = jnp.arange(t - 1)[None, :] < num_drafts[:, None]
    at_draft = jnp.where(drafted, resid, plain[:, :-1])
    sampled = jnp.concatenate([at_draft, plain[:, -1:]], axis=1)
    return accept, jnp.where(sampling[:, None], sampled, greedy)

