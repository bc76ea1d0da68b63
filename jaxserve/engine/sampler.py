"""Batched token sampling with per-row parameters, as one jitted function per bucket.

Order (as vLLM): penalties on the raw logits -> temperature -> top-k -> top-p -> min-p ->
draw. Greedy rows (temperature 0) take the argmax of the penalised logits. Returned logprobs
are those of the model's raw distribution.

The draw is Gumbel-max with the noise indexed by token id: row b's key is
``fold_in(key(seed), n)`` (n = tokens the request has generated so far), ``gumbel(key, (V,))``
gives every token of the vocabulary its noise, and the row takes the kept
token with the largest ``logit / T + g``, which samples exactly from the renormalised kept
distribution. Because the noise belongs to the token id, not to a position in some sorted
order, the token depends only on the row's own logits, parameters, seed and n: the same
whatever else shares the batch (and after preemption and recompute), and the same on both
paths below.

Finding the kept set needs the tokens in descending order, but a full vocabulary sort is by
far the dearest part of sampling (~100 ms for 8 rows of 49k on a CPU). So the fast path
takes the top ``num_candidates`` tokens (``lax.top_k``) and proves, per row, that nothing
past them can be kept: top-k <= candidates, or the candidates' cumulative probability
already reaches top-p, or the last candidate is already below the min-p cut-off. Rows that
truncate nothing (no top-k, top-p 1, min-p 0) draw over the whole vocabulary directly. Only
if some row can be proven neither way does the batch take the full sort (a ``lax.cond``, so
the sort runs only then).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native
from jaxserve.executor.buckets import bucket
from jaxserve.executor.programs import ProgramSpec

NUM_CANDIDATES = 256


def first_argmax(x):
    """``jnp.argmax(x, axis=-1)`` as int32 (the first maximum; the first NaN if a row has one),
    computed as two plain reductions (the maximum, then the smallest index that holds it):
    XLA:CPU runs them vectorized, where argmax's (value, index) pair reduction is a scalar
    loop, several times slower over a 49k vocabulary."""
    m = jnp.max(x, axis=-1, keepdims=True)  # NaN if the row has one (max propagates NaN)
    hit = (x == m) | jnp.isnan(x)  # with no NaN in the row, isnan adds nothing
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, idx, x.shape[-1]), axis=-1)


def token_logprob(logits, tokens):
    """log_softmax(logits)[b, tokens[b]] for logits f32 [B, V], tokens int32 [B], without the
    [B, V] log-softmax: the same operations as ``jax.nn.log_softmax`` on the picked entries."""
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    return jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - lse


def native_greedy() -> bool:
    """Whether all-greedy batches take the native kernel (loaded, and the programs run on CPU)."""
    return jax.default_backend() == "cpu" and native.available()


def row_noise(keys, v: int):
    """Gumbel noise [B, V] for row keys [B]: entry [b, t] belongs to token t of row b."""
    return jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)


def _kept_draw(scaled, noise, top_k, top_p, min_p, lse_all, c: int):
    """Filter the top ``c`` tokens of ``scaled`` [B, V] and draw among the kept ones.

    -> (token int32 [B], proven bool [B]: nothing past the c candidates can be kept).
    With c == V this is the exact full-sort computation (every row proven).
    """
    v = scaled.shape[-1]
    vals, ids = jax.lax.top_k(scaled, c)  # descending
    rank = jnp.arange(c)[None, :]
    limited = (top_k > 0)[:, None]
    in_k = rank < jnp.where(top_k > 0, top_k, v)[:, None]
    # Probabilities as the reference computes them: softmax over the top-k set (all of V when
    # top-k is off, whose normaliser lse_all comes from the whole row).
    lse_k = jax.nn.logsumexp(jnp.where(in_k, vals, -jnp.inf), axis=-1)
    lse = jnp.where(limited[:, 0], lse_k, lse_all)
    probs = jnp.where(in_k, jnp.exp(vals - lse[:, None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    keep = in_k & ((cum - probs) < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])
    noisy = jnp.where(keep, vals + jnp.take_along_axis(noise, ids, axis=-1), -jnp.inf)
    token = jnp.take_along_axis(ids, first_argmax(noisy)[:, None], axis=-1)[:, 0]
    if c == v:
        return token.astype(jnp.int32), jnp.ones(top_k.shape, bool)
    proven = jnp.where(
        limited[:, 0],
        top_k <= c,  # the top-k set (and its normaliser) lies inside the candidates
        (cum[:, -1] >= top_p) | (probs[:, -1] < min_p * probs[:, 0]),
    )
    return token.astype(jnp.int32), proven


@functools.partial(jax.jit, static_argnames=("all_greedy", "penalties", "num_logprobs", "num_candidates", "per_row"))
def sample_rows(
    logits, rows, temperature, top_k, top_p, min_p, seeds, steps, mask=None,
    counts=None, seen=None, repetition=None, presence=None, frequency=None,
    *, all_greedy: bool, penalties: bool, num_logprobs: int, num_candidates: int = NUM_CANDIDATES,
    per_row: bool = False,
):
    """logits f32 [L, V] (a program's output); rows int32 [B]: which logits row each sample
    uses; per-row temperature/top_p/min_p f32 [B], top_k/seeds/steps int32 [B];
    counts int32 [B, V] (generated-token counts), seen bool [B, V] (prompt or generated),
    repetition/presence/frequency f32 [B] (only with penalties=True); mask int32 [B, ceil(V/32)]:
    the allowed tokens packed 32 to a word (bit t % 32 of word t // 32; all ones = no constraint,
    leaving every result bitwise as without it). ``per_row``: one row at
    a time (batch-invariant log-probs: a [B, V] reduction's last bits depend on B).

    -> tokens int32 [B], logprob f32 [B], top_ids int32 [B, n], top_logprobs f32 [B, n].

    An all-greedy batch without penalties or top log-probs runs the native kernel
    (``jaxserve.native.greedy_rows``: the same first argmax, the logprob within float rounding;
    one row at a time, so batch-invariant too) where it is available on a CPU backend.
    """
    if all_greedy and not penalties and not num_logprobs and native_greedy():
        if mask is None:
            mask = jnp.full((rows.shape[0], mask_words(logits.shape[-1])), -1, jnp.int32)
        tokens, logprob = native.greedy_rows(logits, rows, mask)
        empty = jnp.zeros((rows.shape[0], 0), jnp.float32)
        return tokens, logprob, empty.astype(jnp.int32), empty
    batch = functools.partial(_sample_batch, all_greedy=all_greedy, penalties=penalties,
                              num_logprobs=num_logprobs, num_candidates=num_candidates)
    args = (logits[rows], temperature, top_k, top_p, min_p, seeds, steps, mask, counts, seen, repetition, presence,
            frequency)
    if not per_row:
        return batch(*args)
    one = lambda a: jax.tree.map(lambda x: x[0], batch(*jax.tree.map(lambda x: x[None], a)))  # noqa: E731
    return jax.lax.map(one, args)


def _sample_batch(logits, temperature, top_k, top_p, min_p, seeds, steps, mask, counts, seen, repetition, presence,
                  frequency, *, all_greedy: bool, penalties: bool, num_logprobs: int, num_candidates: int):
    x = logits
    if penalties:
        r = repetition[:, None]
        x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
        x = x - presence[:, None] * (counts > 0) - frequency[:, None] * counts
    if mask is not None:  # a grammar's allowed tokens (structured outputs): the others can never be drawn
        x = jnp.where(unpack_mask(mask, x.shape[-1]), x, -jnp.inf)
    greedy = first_argmax(x)
    if all_greedy:
        tokens = greedy
    else:
        v = x.shape[-1]
        c = min(num_candidates, v)
        scaled = x / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, steps)
        lse_all = jax.nn.logsumexp(scaled, axis=-1)
        sampling = temperature > 0
        whole = (top_k <= 0) & (top_p >= 1.0) & (min_p <= 0.0)  # truncates nothing
        noise = row_noise(keys, v)
        fast, proven = _kept_draw(scaled, noise, top_k, top_p, min_p, lse_all, c)
        untruncated = first_argmax(scaled + noise)  # plain temperature rows
        # The full sort, only when some row's kept set may reach past the candidates.
        truncated = jax.lax.cond(
            jnp.any(sampling & ~whole & ~proven),
            lambda: _kept_draw(scaled, noise, top_k, top_p, min_p, lse_all, v)[0],
            lambda: fast,
        )
        sampled = jnp.where(whole, untruncated, truncated)
        tokens = jnp.where(sampling, sampled, greedy)
    logprob = token_logprob(logits, tokens)  # of the raw distribution
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), num_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, logprob, top_ids.astype(jnp.int32), top_lp


def unpack_mask(mask, v: int):
    """int32 [B, W] packed bits -> bool [B, v] (token t allowed: bit t % 32 of word t // 32)."""
    bits = jnp.right_shift(mask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :v].astype(bool)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def sampler_name(rows: int, n: int, greedy: bool, per_row: bool = False) -> str:
    """The ProgramSet name of the plain (no penalties, no logprobs) sampler for logits [rows, V]
    and n sampled rows (``per_row``: the batch-invariant variant, a program of its own)."""
    return f"sample/{rows}x{n}/{'greedy' if greedy else 'sample'}" + ("/per_row" if per_row else "")


def sampler_spec(logits_sharding, rows: int, n: int, vocab_size: int, greedy: bool, per_row: bool = False):
    """The ahead-of-time build of ``sampler_name(rows, n, greedy, per_row)`` (a ProgramSpec)."""
    f32, i32 = np.zeros(n, np.float32), np.zeros(n, np.int32)
    logits = jax.ShapeDtypeStruct((rows, vocab_size), jnp.float32, sharding=logits_sharding)
    mask = np.full((n, mask_words(vocab_size)), -1, np.int32)
    return ProgramSpec(sampler_name(rows, n, greedy, per_row), sample_rows,
                       (logits, i32, f32, i32, np.ones(n, np.float32), f32, i32, i32, mask),
                       dict(all_greedy=greedy, penalties=False, num_logprobs=0, per_row=per_row))


class SamplerPrograms:
    """The plain samplers warm-up builds (``jaxserve.executor.warmup.Samplers``): a spec for
    the ahead-of-time path, whose ``warm`` (the jit path's build) is one call on zeros."""

    def __init__(self, vocab_size: int, per_row: bool = False):
        self.vocab_size, self.per_row = vocab_size, per_row

    def spec(self, logits_sharding, rows: int, n: int, greedy: bool) -> ProgramSpec:
        spec = sampler_spec(logits_sharding, rows, n, self.vocab_size, greedy, self.per_row)
        return dataclasses.replace(spec, warm=lambda: self.run(rows, n, greedy))

    def run(self, rows: int, n: int, greedy: bool) -> None:
        f32, i32 = np.zeros(n, np.float32), np.zeros(n, np.int32)
        mask = np.full((n, mask_words(self.vocab_size)), -1, np.int32)
        sample_rows(np.zeros((rows, self.vocab_size), np.float32), i32, f32, i32, np.ones(n, np.float32), f32, i32,
                    i32, mask, all_greedy=greedy, penalties=False, num_logprobs=0, per_row=self.per_row)


def sample_sequences(logits, rows, vocab_size: int, per_row: bool = False, programs=None, build: bool = False,
                     masks=None):
    """Sample one token for each (logits row index, Sequence) in ``rows`` with its own
    parameters (``per_row``: batch-invariant, see sample_rows) and allowed tokens (``masks``:
    int32 [len(rows), ceil(V/32)] packed, or None: all allowed); -> numpy (tokens, logprobs,
    top ids, top logprobs, top-n bucket). ``programs`` (a ProgramSet) supplies the ahead-of-time
    built plain samplers; with ``build`` a missing one is built into it now (before warm-up)."""
    b = bucket(len(rows))
    greedy = all(s.params.greedy for _, s in rows)
    if programs is not None and not build:  # the smallest built sampler that holds the rows
        while sampler_name(logits.shape[0], b, greedy, per_row) not in programs and b < logits.shape[0]:
            b *= 2
    idx = np.zeros((b,), np.int32)
    temp, top_p, min_p = np.zeros(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.float32)
    top_k, seeds, steps = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
    for j, (i, s) in enumerate(rows):
        p = s.params
        with _row(j):
            idx[j] = i
            temp[j], top_p[j], min_p[j], top_k[j] = p.temperature, p.top_p, p.min_p, p.top_k
            seeds[j], steps[j] = s.seed, len(s.output_ids)
    mask = np.full((b, mask_words(vocab_size)), -1, np.int32)  # always an input: one program either way
    if masks is not None:
        mask[: len(rows)] = masks
    penalties = any(s.params.uses_penalties for _, s in rows)
    extra = _penalty_inputs(rows, b, vocab_size) if penalties else {}
    n_lp = max((s.params.logprobs or 0) for _, s in rows)
    n_lp = 0 if n_lp == 0 and all(s.params.logprobs is None for _, s in rows) else bucket(max(n_lp, 1))
    built = None
    if programs is not None and not penalties and n_lp == 0:
        name = sampler_name(logits.shape[0], b, greedy, per_row)
        if build and name not in programs:
            programs.build([sampler_spec(logits.sharding, logits.shape[0], b, vocab_size, greedy, per_row)])
        built = programs.get(name)
    if built is not None:
        out = built(logits, idx, temp, top_k, top_p, min_p, seeds, steps, mask)
    else:
        out = sample_rows(logits, idx, temp, top_k, top_p, min_p, seeds, steps, mask, **extra,
                          all_greedy=greedy, penalties=penalties, num_logprobs=n_lp, per_row=per_row)
    return (*map(np.asarray, out), n_lp)


def _penalty_inputs(rows, b: int, v: int) -> dict:
    counts, seen = np.zeros((b, v), np.int32), np.zeros((b, v), bool)
    rep, pres, freq = np.ones(b, np.float32), np.zeros(b, np.float32), np.zeros(b, np.float32)
    for j, (_, s) in enumerate(rows):
        with _row(j):
            np.add.at(counts[j], s.output_ids, 1)
            seen[j, s.prompt_ids] = True
            seen[j, s.output_ids] = True
            rep[j], pres[j], freq[j] = s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty
    return dict(counts=counts, seen=seen, repetition=rep, presence=pres, frequency=freq)


class RowError(Exception):
    """Row ``row``'s own inputs could not be packed (``cause``): sample the others without it."""

    def __init__(self, row: int, cause: Exception):
        super().__init__(f"sampling row {row}: {type(cause).__name__}: {cause}")
        self.row, self.cause = row, cause


@contextlib.contextmanager
def _row(j: int):
    try:
        yield
    except (OverflowError, ValueError, TypeError, IndexError) as e:
        raise RowError(j, e) from e


penalty_inputs = _penalty_inputs  # public: speculative decoding's acceptance applies the same penalties
