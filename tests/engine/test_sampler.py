"""The sampler against an independent numpy statement of top-k / top-p / min-p, and its two
paths (top candidates vs the full sort) against each other."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.sampler import sample_rows, token_logprob

V = 64


def reference_kept(x, temperature, top_k, top_p, min_p):
    """numpy: the kept tokens and their renormalised probabilities (vLLM's order of filters)."""
    s = np.asarray(x, np.float64) / temperature
    order = np.argsort(-s, kind="stable")
    srt = s[order]
    in_k = np.arange(len(s)) < (top_k if top_k > 0 else len(s))
    p = np.where(in_k, np.exp(srt - srt.max()), 0.0)
    p /= p.sum()
    keep = in_k & ((np.cumsum(p) - p) < top_p) & (p >= min_p * p[0])
    probs = np.zeros(len(s))
    probs[order[keep]] = p[keep] / p[keep].sum()
    return probs


def draw(logits, temperature, top_k, top_p, min_p, seeds, steps, num_candidates=256):
    b = len(seeds)
    f = lambda v, dt: np.full(b, v, dt) if np.isscalar(v) else np.asarray(v, dt)
    tokens, lp, _, _ = sample_rows(
        np.asarray(logits, np.float32), np.arange(b, dtype=np.int32), f(temperature, np.float32), f(top_k, np.int32),
        f(top_p, np.float32), f(min_p, np.float32), np.asarray(seeds, np.int32), np.asarray(steps, np.int32),
        all_greedy=False, penalties=False, num_logprobs=0, num_candidates=num_candidates,
    )
    return np.asarray(tokens)


LOGITS = np.random.RandomState(0).randn(V).astype(np.float32) * 2.0

SETTINGS = [
    # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),  # plain temperature: the whole vocabulary
    (0.7, 10, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.9, 20, 0.9, 0.02),
]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("num_candidates", [V, 8])
def test_draws_follow_the_reference_distribution(setting, num_candidates):
    t, k, p, m = setting
    want = reference_kept(LOGITS, t, k, p, m)
    n = 3000
    toks = draw(np.tile(LOGITS, (n, 1)), t, k, p, m, seeds=np.full(n, 5), steps=np.arange(n),
                num_candidates=num_candidates)
    assert set(toks.tolist()) <= set(np.flatnonzero(want).tolist())  # never a filtered-out token
    freq = np.bincount(toks, minlength=V) / n
    tv = 0.5 * np.abs(freq - want).sum()
    assert tv < 0.06, f"total variation {tv:.3f} from the reference distribution"


def test_fast_path_and_full_sort_draw_the_same_token():
    """8 candidates: some rows are proven inside them, others (top-k 40, a flat distribution
    with top-p) force the full sort; every row's token must equal the full-sort-only draw."""
    rng = np.random.RandomState(1)
    b = 12
    logits = rng.randn(b, V).astype(np.float32) * np.linspace(0.1, 4.0, b)[:, None]
    temp = rng.uniform(0.5, 1.5, b)
    top_k = np.array([0, 5, 40, 0, 0, 3, 0, 0, 64, 0, 7, 0])
    top_p = np.array([0.9, 1.0, 1.0, 0.5, 1.0, 0.95, 0.99, 1.0, 0.7, 0.3, 1.0, 1.0])
    min_p = np.array([0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2])
    seeds, steps = np.arange(b) + 100, np.arange(b)
    for rep in range(5):
        full = draw(logits, temp, top_k, top_p, min_p, seeds, steps + rep, num_candidates=V)
        fast = draw(logits, temp, top_k, top_p, min_p, seeds, steps + rep, num_candidates=8)
        np.testing.assert_array_equal(fast, full)


def test_a_rows_token_does_not_depend_on_a_row_forcing_the_full_sort():
    rng = np.random.RandomState(2)
    a = rng.randn(V).astype(np.float32) * 3
    other = rng.randn(V).astype(np.float32) * 0.1  # flat: top-p 0.99 needs most of the vocabulary
    for step in range(10):
        alone = draw(a[None], 0.8, 0, 0.9, 0.0, [7], [step], num_candidates=8)
        mixed = draw(np.stack([other, a]), 0.8, [0, 0], [0.99, 0.9], 0.0, [3, 7], [step, step], num_candidates=8)
        assert alone[0] == mixed[1]


def test_greedy_rows_take_the_argmax():
    rng = np.random.RandomState(3)
    logits = rng.randn(4, V).astype(np.float32)
    toks = draw(logits, [0.0, 1.0, 0.0, 0.7], 0, 1.0, 0.0, [1, 2, 3, 4], [0, 0, 0, 0])
    assert toks[0] == logits[0].argmax() and toks[2] == logits[2].argmax()


def test_first_argmax_is_argmax_ties_nan_and_masked_rows():
    """The two-reduction argmax against numpy's: the first of tied maxima, the first NaN of a
    row holding one, index 0 of a row masked entirely to -inf."""
    import jax.numpy as jnp

    from jaxserve.engine.sampler import first_argmax

    rng = np.random.RandomState(1)
    x = rng.randn(7, 1000).astype(np.float32)
    x[1, [5, 700]] = 9.0  # a tie: the first wins
    x[2, [40, 90]] = np.nan  # the first NaN, as jnp.argmax and np.argmax take it
    x[3] = -np.inf
    x[4, 999] = np.inf
    x[5] = np.round(x[5])  # many ties below the maximum
    got = np.asarray(first_argmax(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def test_greedy_logprob_is_the_raw_log_softmax():
    """A greedy row's token is the argmax and its logprob the float64 log-softmax entry, with and
    without top logprobs asked for (then the full log-softmax path: its top entry is the token's
    logprob to the last bit). Without top logprobs the batch may run the native greedy kernel."""
    rng = np.random.RandomState(2)
    logits = (rng.randn(4, 5000) * 3).astype(np.float32)
    b = logits.shape[0]
    z32, z = np.zeros(b, np.float32), np.zeros(b, np.int32)
    args = (logits, np.arange(b, dtype=np.int32), z32, z, np.ones(b, np.float32), z32, z, z)
    tok, lp, _, _ = map(np.asarray, sample_rows(*args, all_greedy=True, penalties=False, num_logprobs=0))
    np.testing.assert_array_equal(tok, np.argmax(logits, axis=-1))
    x = logits.astype(np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(b), tok], rtol=0, atol=2e-5)
    tok2, lp2, top_ids, top_lp = map(np.asarray, sample_rows(*args, all_greedy=True, penalties=False,
                                                             num_logprobs=2))
    np.testing.assert_array_equal(tok2, tok)
    np.testing.assert_array_equal(top_ids[:, 0], tok)
    np.testing.assert_allclose(lp2, ref[np.arange(b), tok], rtol=0, atol=2e-5)
    np.testing.assert_array_equal(top_lp[:, 0], lp2)


def test_token_logprob_is_the_log_softmax_entry_to_the_last_bit():
    """XLA's formulation without the [B, V] log-softmax gives log_softmax's bits."""
    rng = np.random.RandomState(3)
    logits = jnp.asarray((rng.randn(5, 3001) * 3).astype(np.float32))
    tok = jnp.asarray(rng.randint(0, 3001, 5).astype(np.int32))
    got = jax.jit(token_logprob)(logits, tok)
    full = jax.jit(lambda x, t: jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), t[:, None], axis=-1)[:, 0])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(full(logits, tok)))
