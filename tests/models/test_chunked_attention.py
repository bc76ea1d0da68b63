"""The serving attention reads the cached context and the step's own new tokens (already written)
from pages in chunks with an online softmax (``gqa_attention_paged`` / ``mla_attention_paged``);
it must equal the one-shot softmax over the gathered context plus the new tokens as the format
stores them (``gqa_attention`` / ``mla_attention``), for contexts that end inside a chunk, on a
chunk boundary, span several chunks, are empty, and for padding rows. The loop must stop at the
batch's longest sequence: table entries past it point at a page filled with NaN, which would
reach the output (0 * NaN) if any chunk there were read."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kv import paged
from jaxserve.kv.formats import get_kv_format
from jaxserve.models import attention

PAGE = 4
NUM_PAGES = 40
POISON = NUM_PAGES  # one extra page, all NaN: pointed at only where nothing may be read


def _setup(seed, b, width, cached, new_lens):
    rng = np.random.default_rng(seed)
    # Distinct random pages per row (null page 0 excluded), padded with the null page.
    perm = rng.permutation(np.arange(1, NUM_PAGES))
    table = np.zeros((b, width), np.int32)
    used = 0
    for i in range(b):
        n = -(-(cached[i] + new_lens[i]) // PAGE)
        table[i, :n] = perm[used: used + n]
        used += n
    return rng, table


def _filled_pools(rng, fmt, shapes: dict, headed: bool) -> dict:
    """Pools {name: shape} with every page filled with random values (what other requests left
    there must stay invisible), plus the page POISON filled with NaN."""
    pools = {}
    for name, shape in shapes.items():
        pools.update(paged.new_pool(fmt, shape, name))
    pg = jnp.repeat(jnp.arange(NUM_PAGES + 1), PAGE)[None]
    off = jnp.tile(jnp.arange(PAGE), NUM_PAGES + 1)[None]
    for name, shape in shapes.items():
        per_token = (shape[0], shape[-1]) if headed else (shape[-1],)
        vals = rng.standard_normal((1, (NUM_PAGES + 1) * PAGE) + per_token).astype(np.float32)
        vals[:, NUM_PAGES * PAGE:] = np.nan
        pools = paged.store(fmt, pools, name, jnp.asarray(vals), pg, off, headed=headed)
        poison = paged.load(fmt, pools, name, jnp.full((1, 1), POISON, jnp.int32), jnp.float32, headed=headed)
        assert np.isnan(np.asarray(poison)).all()  # the poison survives the format
    return pools


def _poison_past_loop(table, cached, new_lens, width, chunk):
    """The table with every entry past the chunks the loop must read (the longest sequence,
    its new tokens included) pointing at POISON (None when the loop reads the whole table)."""
    n_chunk = attention.chunk_pages(PAGE, width, chunk)
    last = -(-max(c + n for c, n in zip(cached, new_lens)) // (n_chunk * PAGE)) * n_chunk
    if last >= width:
        return None
    poisoned = np.array(table)
    poisoned[:, last:] = POISON
    return jnp.asarray(poisoned)


def _write_new(fmt, pools, name, vals, table, cached, new_lens, headed):
    """Store the step's new tokens in their pages, as the model does before attending; ->
    (pools, the values as stored, read back [B, T, ...])."""
    t = vals.shape[1]
    pos = jnp.asarray(cached)[:, None] + jnp.arange(t)[None, :]
    valid = jnp.arange(t)[None, :] < jnp.asarray(new_lens)[:, None]
    page, off = paged.token_slots(jnp.asarray(table), pos, valid, PAGE, NUM_PAGES)
    pools = paged.store(fmt, pools, name, vals, page, off, headed=headed)
    return pools, fmt.dequantize(*fmt.quantize(vals), jnp.float32)


def _causal(new_lens, t):
    v = np.arange(t)[None, :] < np.asarray(new_lens)[:, None]
    tri = np.tril(np.ones((t, t), bool))
    return jnp.asarray(tri[None] & v[:, None, :] & v[:, :, None])


CASES = [
    # (cached lens, new lens, T, table width, chunk tokens)
    ([0, 5, 8, 23], [1, 1, 1, 1], 1, 8, 8),  # decode: empty, mid-chunk, on a boundary, 3 chunks
    ([3, 16, 0, 0], [4, 2, 3, 0], 4, 6, 8),  # prefill chunks; width not a multiple of the chunk; a padding row
    ([30, 1], [1, 1], 1, 8, 1024),  # one chunk covers the table
]


@pytest.mark.parametrize("fmt_name", ["float32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("case", CASES)
def test_gqa_chunked_equals_one_shot(case, fmt_name):
    cached, new_lens, t, width, chunk = case
    b, kvh, g, d = len(cached), 2, 3, 8
    fmt = get_kv_format(fmt_name)
    rng, table = _setup(0, b, width, cached, new_lens)
    pools = _filled_pools(rng, fmt, {n: (kvh, NUM_PAGES + 1, PAGE, d) for n in ("k", "v")}, headed=True)
    q = jnp.asarray(rng.standard_normal((b, t, kvh * g, d)), jnp.float32)
    nk = jnp.asarray(rng.standard_normal((b, t, kvh, d)), jnp.float32)
    nv = jnp.asarray(rng.standard_normal((b, t, kvh, d)), jnp.float32)
    causal = _causal(new_lens, t)
    cl = jnp.asarray(cached, jnp.int32)
    nl = jnp.asarray(new_lens, jnp.int32)
    tbl = jnp.asarray(table)
    ck = paged.load(fmt, pools, "k", tbl, jnp.float32, headed=True)  # the context, before the write
    cv = paged.load(fmt, pools, "v", tbl, jnp.float32, headed=True)
    pools, nk = _write_new(fmt, pools, "k", nk, table, cached, new_lens, headed=True)
    pools, nv = _write_new(fmt, pools, "v", nv, table, cached, new_lens, headed=True)

    got = attention.gqa_attention_paged(q, pools, fmt, tbl, cl, nl, 0.3, PAGE, chunk_tokens=chunk)
    mask = jnp.arange(width * PAGE)[None, :] < cl[:, None]
    want = attention.gqa_attention(q, ck, cv, mask, nk, nv, causal, 0.3)
    valid = np.arange(t)[None, :] < np.asarray(new_lens)[:, None]  # [B, T]: real new tokens
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(got)).all()  # padding rows: zeros, not NaN
    # The loop really stops at the longest sequence: NaN pages past it change nothing.
    poisoned = _poison_past_loop(table, cached, new_lens, width, chunk)
    if poisoned is not None:
        again = attention.gqa_attention_paged(q, pools, fmt, poisoned, cl, nl, 0.3, PAGE,
                                              chunk_tokens=chunk)
        np.testing.assert_array_equal(np.asarray(again), np.asarray(got))


@pytest.mark.parametrize("fmt_name", ["float32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("case", CASES)
def test_mla_chunked_equals_one_shot(case, fmt_name):
    cached, new_lens, t, width, chunk = case
    b, h, r, dr = len(cached), 3, 16, 4
    fmt = get_kv_format(fmt_name)
    rng, table = _setup(1, b, width, cached, new_lens)
    pools = _filled_pools(rng, fmt, {"latent": (NUM_PAGES + 1, PAGE, r), "rope": (NUM_PAGES + 1, PAGE, dr)},
                          headed=False)
    ql = jnp.asarray(rng.standard_normal((b, t, h, r)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((b, t, h, dr)), jnp.float32)
    nlat = jnp.asarray(rng.standard_normal((b, t, r)), jnp.float32)
    nr = jnp.asarray(rng.standard_normal((b, t, dr)), jnp.float32)
    causal = _causal(new_lens, t)
    cl = jnp.asarray(cached, jnp.int32)
    tbl = jnp.asarray(table)
    c_lat = paged.load(fmt, pools, "latent", tbl, jnp.float32)  # the context, before the write
    c_rope = paged.load(fmt, pools, "rope", tbl, jnp.float32)
    pools, nlat = _write_new(fmt, pools, "latent", nlat, table, cached, new_lens, headed=False)
    pools, nr = _write_new(fmt, pools, "rope", nr, table, cached, new_lens, headed=False)
    got = attention.mla_attention_paged(ql, qr, pools, fmt, tbl, cl, jnp.asarray(new_lens, jnp.int32), 0.2, PAGE,
                                        chunk_tokens=chunk)
    mask = jnp.arange(width * PAGE)[None, :] < cl[:, None]
    want = attention.mla_attention(ql, qr, c_lat, c_rope, mask, nlat, nr, causal, 0.2)
    valid = np.arange(t)[None, :] < np.asarray(new_lens)[:, None]  # [B, T]: real new tokens
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(got)).all()
    poisoned = _poison_past_loop(table, cached, new_lens, width, chunk)
    if poisoned is not None:
        again = attention.mla_attention_paged(ql, qr, pools, fmt, poisoned, cl, jnp.asarray(new_lens, jnp.int32), 0.2,
                                              PAGE, chunk_tokens=chunk)
        np.testing.assert_array_equal(np.asarray(again), np.asarray(got))


def test_gathered_slots_follow_the_longest_context():
    # 16-token pages, 256-token chunks: a 16-page table is one chunk (read whole); a 512-page
    # table (8k context) is read only as far as the longest context, in whole chunks.
    assert attention.gathered_slots(16, 16, 152, chunk_tokens=256) == 256
    assert attention.gathered_slots(512, 16, 152, chunk_tokens=256) == 256
    assert attention.gathered_slots(512, 16, 300, chunk_tokens=256) == 512
    assert attention.gathered_slots(512, 16, 10 ** 6, chunk_tokens=256) == 512 * 16
    assert attention.gathered_slots(16, 16, 152, chunk_tokens=64) == 192


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8_e4m3"])
def test_pallas_decode_reads_the_new_token_as_stored(fmt_name):
    """The Pallas backend (interpreted) attends over the cached context and the step's token as
    the pages store it, like the XLA path: the two agree for a decode batch (empty context,
    mid-page, page boundary, several pages) in both layouts."""
    from jaxserve.models.attention_pallas import gqa_attention_pallas, mla_attention_pallas
    from jaxserve.models.step import StepInput

    cached, new_lens = [0, 5, 8, 23], [1, 1, 1, 1]
    b, width, kvh, g, d, r, dr = 4, 8, 2, 2, 16, 16, 16
    fmt = get_kv_format(fmt_name)
    rng, table = _setup(2, b, width, cached, new_lens)
    tbl, cl, nl = jnp.asarray(table), jnp.asarray(cached, jnp.int32), jnp.asarray(new_lens, jnp.int32)
    step = StepInput(jnp.zeros((b, 1), jnp.int32), cl, nl, tbl)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    pools = _filled_pools(rng, fmt, {n: (kvh, NUM_PAGES + 1, PAGE, d) for n in ("k", "v")}, headed=True)
    stored = []
    for name in ("k", "v"):
        pools, new = _write_new(fmt, pools, name, normal(b, 1, kvh, d), table, cached, new_lens, headed=True)
        stored.append(new)
    q = normal(b, 1, kvh * g, d)
    want = attention.gqa_attention_paged(q, pools, fmt, tbl, cl, nl, 0.3, PAGE)
    got = gqa_attention_pallas(q, pools, fmt, *stored, step, 0.3, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)

    pools = _filled_pools(rng, fmt, {"latent": (NUM_PAGES + 1, PAGE, r), "rope": (NUM_PAGES + 1, PAGE, dr)},
                          headed=False)
    pools, new_lat = _write_new(fmt, pools, "latent", normal(b, 1, r), table, cached, new_lens, headed=False)
    pools, new_rope = _write_new(fmt, pools, "rope", normal(b, 1, dr), table, cached, new_lens, headed=False)
    ql, qr = normal(b, 1, 3, r), normal(b, 1, 3, dr)
    want = attention.mla_attention_paged(ql, qr, pools, fmt, tbl, cl, nl, 0.2, PAGE)
    got = mla_attention_pallas(ql, qr, pools, fmt, new_lat, new_rope, step, 0.2, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
