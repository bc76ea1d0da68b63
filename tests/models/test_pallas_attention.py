"""The Pallas attention backend (kernels interpreted on CPU) for prefill chunks and decode steps
equals the one-shot softmax over the gathered context and the step's own tokens
(``attention.gqa_attention`` / ``attention.mla_attention``, written without the kernels): chunks
that read cached pages, chunks longer than one GQA kernel block (split into token blocks),
decode steps, empty contexts and padding rows, in float32, bf16 and fp8 pages."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kv import paged
from jaxserve.kv.formats import get_kv_format
from jaxserve.models import attention, attention_pallas
from jaxserve.models.step import StepInput

PAGE, NUM_PAGES, WIDTH = 8, 24, 6

CASES = [  # (cached lens, new lens, T)
    ([0, 13, 24, 0], [1, 1, 1, 0], 1),  # decode: no context, mid-page, whole pages, a padding row
    ([8, 0, 19], [12, 7, 1], 12),  # prefill chunks after cached pages, a first chunk, a short row
    ([5, 16], [20, 3], 20),  # a chunk longer than one GQA kernel block (GQA_ROWS // group tokens)
]


def _step(rng, cached, new_lens, t):
    perm = rng.permutation(np.arange(1, NUM_PAGES))  # distinct pages per row; 0 is the null page
    table = np.zeros((len(cached), WIDTH), np.int32)
    used = 0
    for i, (c, n) in enumerate(zip(cached, new_lens)):
        k = -(-(c + n) // PAGE)
        table[i, :k] = perm[used: used + k]
        used += k
    tokens = np.zeros((len(cached), t), np.int32)
    return StepInput(jnp.asarray(tokens), jnp.asarray(cached, jnp.int32), jnp.asarray(new_lens, jnp.int32),
                     jnp.asarray(table))


def _pools(rng, fmt, shapes, headed):
    """Every slot of every page filled (what other requests left there must stay invisible)."""
    pools = {}
    for name, shape in shapes.items():
        pools.update(paged.new_pool(fmt, shape, name))
    pg = jnp.repeat(jnp.arange(NUM_PAGES), PAGE)[None]
    off = jnp.tile(jnp.arange(PAGE), NUM_PAGES)[None]
    for name, shape in shapes.items():
        per_token = (shape[0], shape[-1]) if headed else (shape[-1],)
        vals = jnp.asarray(rng.standard_normal((1, NUM_PAGES * PAGE) + per_token), jnp.float32)
        pools = paged.store(fmt, pools, name, vals, pg, off, headed=headed)
    return pools


def _check(got, want, new_lens, t, fmt_name):
    valid = np.arange(t)[None, :] < np.asarray(new_lens)[:, None]
    tol = 2e-5 if fmt_name == "float32" else 2e-2  # the kernel casts reduced pages to the query dtype
    np.testing.assert_allclose(np.asarray(got, np.float32)[valid], np.asarray(want)[valid], atol=tol, rtol=tol)
    assert np.isfinite(np.asarray(got, np.float32)).all()  # padding rows: finite, never NaN


@pytest.mark.parametrize("fmt_name", ["float32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("case", CASES)
def test_gqa_pallas_equals_one_shot(case, fmt_name):
    cached, new_lens, t = case
    kvh, g, d = 2, 4, 16
    rng = np.random.default_rng(0)
    fmt = get_kv_format(fmt_name)
    step = _step(rng, cached, new_lens, t)
    pools = _pools(rng, fmt, {n: (kvh, NUM_PAGES, PAGE, d) for n in ("k", "v")}, headed=True)
    q = jnp.asarray(rng.standard_normal((len(cached), t, kvh * g, d)), jnp.float32)
    nk, nv = (jnp.asarray(rng.standard_normal((len(cached), t, kvh, d)), jnp.float32) for _ in range(2))
    got = attention_pallas.gqa_attention_pallas(q, pools, fmt, nk, nv, step, 0.3, interpret=True)
    ck = paged.load(fmt, pools, "k", step.page_table, jnp.float32, headed=True)
    cv = paged.load(fmt, pools, "v", step.page_table, jnp.float32, headed=True)
    mask = jnp.arange(WIDTH * PAGE)[None, :] < step.cached_lens[:, None]
    want = attention.gqa_attention(q, ck, cv, mask, nk, nv, step.causal_mask(), 0.3)
    _check(got, want, new_lens, t, fmt_name)


@pytest.mark.parametrize("fmt_name", ["float32", "fp8_e4m3"])
@pytest.mark.parametrize("case", CASES)
def test_mla_pallas_equals_one_shot(case, fmt_name):
    cached, new_lens, t = case
    h, r, dr = 3, 16, 16
    rng = np.random.default_rng(1)
    fmt = get_kv_format(fmt_name)
    step = _step(rng, cached, new_lens, t)
    pools = _pools(rng, fmt, {"latent": (NUM_PAGES, PAGE, r), "rope": (NUM_PAGES, PAGE, dr)}, headed=False)
    b = len(cached)
    ql, qr = (jnp.asarray(rng.standard_normal((b, t, h, x)), jnp.float32) for x in (r, dr))
    nl, nr = (jnp.asarray(rng.standard_normal((b, t, x)), jnp.float32) for x in (r, dr))
    got = attention_pallas.mla_attention_pallas(ql, qr, pools, fmt, nl, nr, step, 0.2, interpret=True)
    c_lat = paged.load(fmt, pools, "latent", step.page_table, jnp.float32)
    c_rope = paged.load(fmt, pools, "rope", step.page_table, jnp.float32)
    mask = jnp.arange(WIDTH * PAGE)[None, :] < step.cached_lens[:, None]
    want = attention.mla_attention(ql, qr, c_lat, c_rope, mask, nl, nr, step.causal_mask(), 0.2)
    _check(got, want, new_lens, t, fmt_name)
