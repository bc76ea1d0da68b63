"""jaxserve's native greedy sampler kernel (``jaxserve.native.greedy_rows``) against numpy: the
token is numpy's argmax of the masked row (the mask unpacked here from its bits), the logprob
the float64 log-softmax entry of the raw row; odd vocabularies (not a multiple of 16 or 32),
rows read out of order, constrained and unconstrained rows in one batch, NaN rows and a row
whose allowed tokens are all -inf (first_argmax's rules). And the sampler's all-greedy batches
run it: the sampler program holds the custom call, and its tokens are those of XLA's path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import native
from jaxserve.engine.sampler import first_argmax, mask_words, sample_rows, token_logprob

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status().reason}")


def unpack(mask: np.ndarray, v: int) -> np.ndarray:
    bits = (mask.astype(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :v].astype(bool)


def reference(x: np.ndarray, mask: np.ndarray):
    allowed = unpack(mask, x.shape[1])
    tok = np.argmax(np.where(allowed, x, -np.inf), axis=-1)
    ls = x.astype(np.float64)
    ls = ls - ls.max(-1, keepdims=True)
    ls = ls - np.log(np.exp(ls).sum(-1, keepdims=True))
    return tok, ls[np.arange(len(tok)), tok]


@needs_native
@pytest.mark.parametrize("b,v", [(1, 49152), (7, 1001), (3, 17), (16, 4099)])
def test_tokens_and_logprobs_match_numpy(b, v):
    rng = np.random.default_rng(v)
    logits = (rng.standard_normal((b + 3, v)) * 4).astype(np.float32)
    rows = rng.permutation(b + 3)[:b].astype(np.int32)
    mask = np.full((b, mask_words(v)), -1, np.int32)
    mask[::2] = rng.integers(-2**31, 2**31, mask[::2].shape, dtype=np.int64).astype(np.int32)
    tok, lp = jax.jit(native.greedy_rows)(logits, rows, mask)
    ref_tok, ref_lp = reference(logits[rows], mask)
    np.testing.assert_array_equal(np.asarray(tok), ref_tok)
    np.testing.assert_allclose(np.asarray(lp), ref_lp, rtol=0, atol=2e-5)


@needs_native
def test_nan_and_all_masked_rows_follow_first_argmax():
    v = 40
    x = np.zeros((3, v), np.float32)
    x[0, 3], x[0, 7] = 5, np.nan  # a NaN: its index, logprob NaN
    x[1, :], x[1, 9] = -np.inf, 1.0  # the only finite token masked out: max -inf, index 0
    x[2, 30] = np.nan  # the NaN masked out: the argmax of the rest
    x[2, 33] = 2.0
    mask = np.full((3, 2), -1, np.int32)
    mask[1, 0] = 0
    mask[2, 0] = ~np.int32(1 << 30)
    tok, lp = map(np.asarray, native.greedy_rows(jnp.asarray(x), jnp.arange(3, dtype=jnp.int32), jnp.asarray(mask)))
    allowed = jnp.asarray(unpack(mask, v))
    want = np.asarray(first_argmax(jnp.where(allowed, x, -jnp.inf)))
    np.testing.assert_array_equal(tok, want)
    np.testing.assert_array_equal(tok, [7, 0, 33])
    assert np.isnan(lp[0]) and np.isnan(lp[2])  # a raw row with a NaN has NaN log-probs
    assert lp[1] == np.asarray(token_logprob(jnp.asarray(x[1:2]), jnp.asarray(tok[1:2])))[0] == -np.inf


@needs_native
def test_the_samplers_greedy_batches_run_the_kernel_with_xlas_tokens():
    b, v = 5, 3001
    logits = (np.random.default_rng(1).standard_normal((8, v)) * 3).astype(np.float32)
    z32, z = np.zeros(b, np.float32), np.zeros(b, np.int32)
    rows = np.array([4, 0, 7, 2, 2], np.int32)
    mask = np.full((b, mask_words(v)), -1, np.int32)
    mask[1, :40] = 0  # tokens 0..1279 of row 1 forbidden
    args = (logits, rows, z32, z, np.ones(b, np.float32), z32, z, z, mask)
    kw = dict(all_greedy=True, penalties=False, num_logprobs=0)
    hlo = sample_rows.lower(*args, **kw).as_text()
    assert "jaxserve_greedy_rows" in hlo
    tok, lp, _, _ = map(np.asarray, sample_rows(*args, **kw))
    xla_tok = np.asarray(first_argmax(jnp.where(jnp.asarray(unpack(mask, v)), logits[rows], -jnp.inf)))
    np.testing.assert_array_equal(tok, xla_tok)
    assert tok[1] >= 1280
    np.testing.assert_allclose(lp, np.asarray(token_logprob(jnp.asarray(logits[rows]), jnp.asarray(tok))),
                               rtol=0, atol=1e-5)
