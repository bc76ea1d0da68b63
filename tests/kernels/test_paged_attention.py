"""Paged decode attention: Pallas kernels (interpret mode) vs the pure-jnp reference.

Every slot a row must not read is poisoned with NaN (free pages, page 0, slots past ctx_len
in a row's last page, table entries past ctx_len, and their fp8 scales): outputs must stay
finite and match. Ragged ctx lens cover 0, 1, an exactly full page and an exactly full table.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kv.formats import get_kv_format
from pallas_kernels.paged_attention import (
    merge_attention,
    paged_attention_gqa,
    paged_attention_gqa_reference,
    paged_attention_mla,
    paged_attention_mla_reference,
)

NUM_PAGES, PAGES_PER_ROW = 32, 4
TOL = {"bf16": dict(atol=2e-2, rtol=2e-2), "fp8_e4m3": dict(atol=2e-2, rtol=2e-2)}
LSE_TOL = dict(atol=2e-3, rtol=1e-3)


def make_table(rng, page_size: int):
    """-> page_table [B, M] int32, ctx_lens [B] int32, used [P, S] bool (slots some row reads)."""
    m = PAGES_PER_ROW
    ctx = np.array([0, 1, page_size, 2 * page_size + 3, m * page_size], np.int32)
    b = len(ctx)
    owned = rng.permutation(np.arange(1, NUM_PAGES))[: b * m].reshape(b, m)  # distinct, never page 0
    used = np.zeros((NUM_PAGES, page_size), bool)
    table = owned.copy()
    for r, n in enumerate(ctx):
        for t in range(n):
            used[owned[r, t // page_size], t % page_size] = True
    # Entries past a row's context point at poisoned pages or are out of range: never read.
    free = np.setdiff1d(np.arange(NUM_PAGES), np.unique(owned[used.any(axis=1)[owned]]))
    for r, n in enumerate(ctx):
        for j in range(-(-n // page_size), m):
            table[r, j] = rng.choice(free) if j % 2 else NUM_PAGES + 7
    return table.astype(np.int32), ctx, used


def make_pool(rng, fmt_name: str, shape, used, headed: bool):
    """Random pool `shape` ([KVH, P, S, X] headed or [P, S, X]) in `fmt_name`, NaN where not used.
    -> (values, scales [KVH, P, S] | [P, S] | None)."""
    fmt = get_kv_format(fmt_name)
    x = rng.standard_normal(shape).astype(np.float32) * 2.0
    q, s = fmt.quantize(jnp.asarray(x))
    q = np.asarray(q.astype(jnp.float32)) if not fmt.scaled else np.asarray(q)
    mask = np.broadcast_to(used[None] if headed else used, shape[:-1])
    q = np.where(mask[..., None], q, np.nan).astype(np.asarray(jnp.zeros((), fmt.dtype)).dtype)
    if s is not None:
        s = jnp.asarray(np.where(mask, np.asarray(s), np.nan).astype(np.float32))
    return jnp.asarray(q), s


def _close(out, lse, ref_out, ref_lse, ctx, fmt):
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert np.isfinite(out32).all(), "NaN/inf leaked into the output"
    np.testing.assert_allclose(out32, ref32, **TOL[fmt])
    empty = ctx == 0
    assert (out32[empty] == 0).all() and np.isneginf(np.asarray(lse)[empty]).all()
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], **LSE_TOL)


GQA_CASES = [  # (format, page_size, kv_heads, group, num_splits, block_tokens); 16 @ S=16: one page a step
    ("bf16", 8, 1, 4, 1, 32),
    ("bf16", 16, 2, 8, 1, 32),
    ("fp8_e4m3", 8, 2, 8, 2, 32),
    ("fp8_e4m3", 16, 1, 8, 1, 16),
    ("bf16", 8, 2, 4, 3, 16),
]


@pytest.mark.parametrize("fmt,page_size,kvh,group,splits,block_tokens", GQA_CASES)
def test_gqa_matches_reference(fmt, page_size, kvh, group, splits, block_tokens):
    rng = np.random.default_rng(page_size * 10 + kvh * 3 + group)
    d = 32
    table, ctx, used = make_table(rng, page_size)
    b, h = len(ctx), kvh * group
    k, ks = make_pool(rng, fmt, (kvh, NUM_PAGES, page_size, d), used, headed=True)
    v, vs = make_pool(rng, fmt, (kvh, NUM_PAGES, page_size, d), used, headed=True)
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    args = (q, k, v, ks, vs, jnp.asarray(table), jnp.asarray(ctx))
    out, lse = paged_attention_gqa(*args, scale=d ** -0.5, interpret=True, num_splits=splits,
                                   block_tokens=block_tokens)
    assert out.shape == (b, h, d) and out.dtype == q.dtype and lse.shape == (b, h)
    ref_out, ref_lse = paged_attention_gqa_reference(*args, scale=d ** -0.5)
    _close(out, lse, ref_out, ref_lse, ctx, fmt)


MLA_CASES = [  # (format, page_size, heads, num_splits)
    ("bf16", 8, 4, 1),
    ("fp8_e4m3", 16, 4, 1),
    ("fp8_e4m3", 8, 20, 2),
]


@pytest.mark.parametrize("fmt,page_size,heads,splits", MLA_CASES)
def test_mla_matches_reference(fmt, page_size, heads, splits):
    rng = np.random.default_rng(page_size + heads)
    r, dr = 64, 16
    table, ctx, used = make_table(rng, page_size)
    b = len(ctx)
    lat, ls = make_pool(rng, fmt, (NUM_PAGES, page_size, r), used, headed=False)
    rope, rs = make_pool(rng, fmt, (NUM_PAGES, page_size, dr), used, headed=False)
    q_lat = jnp.asarray(rng.standard_normal((b, heads, r)) * 0.3, jnp.bfloat16)
    q_rope = jnp.asarray(rng.standard_normal((b, heads, dr)) * 0.3, jnp.bfloat16)
    args = (q_lat, q_rope, lat, rope, ls, rs, jnp.asarray(table), jnp.asarray(ctx))
    scale = (r + dr) ** -0.5
    out, lse = paged_attention_mla(*args, scale=scale, interpret=True, num_splits=splits)
    assert out.shape == (b, heads, r) and lse.shape == (b, heads)
    ref_out, ref_lse = paged_attention_mla_reference(*args, scale=scale)
    _close(out, lse, ref_out, ref_lse, ctx, fmt)


def test_inside_jit_skips_host_checks_and_matches():
    """The engine calls the kernel inside its jitted step: tracers skip the value checks."""
    rng = np.random.default_rng(7)
    table, ctx, used = make_table(rng, 8)
    k, _ = make_pool(rng, "bf16", (1, NUM_PAGES, 8, 32), used, headed=True)
    q = jnp.asarray(rng.standard_normal((len(ctx), 4, 32)), jnp.bfloat16)
    args = (q, k, k, None, None, jnp.asarray(table), jnp.asarray(ctx))
    step = jax.jit(lambda *a: paged_attention_gqa(*a, scale=0.2, interpret=True))
    out, lse = step(*args)
    ref_out, ref_lse = paged_attention_gqa_reference(*args, scale=0.2)
    _close(out, lse, ref_out, ref_lse, ctx, "bf16")


def test_merge_with_in_flight_token_equals_full_softmax():
    """What the runner does: paged part (kernel semantics) + the new token, merged by lse."""
    rng = np.random.default_rng(0)
    s, d, kvh, group = 8, 16, 2, 2
    ctx = np.array([0, 1, s, 2 * s + 3], np.int32)  # each row has room for one more token
    b, h = len(ctx), kvh * group
    table = np.arange(1, 1 + b * PAGES_PER_ROW, dtype=np.int32).reshape(b, PAGES_PER_ROW)
    k = rng.standard_normal((kvh, NUM_PAGES, s, d)).astype(np.float32)
    v = rng.standard_normal((kvh, NUM_PAGES, s, d)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32)
    tbl, scale = jnp.asarray(table), 0.25
    paged = paged_attention_gqa_reference(q, k, v, None, None, tbl, jnp.asarray(ctx), scale=scale)
    # The in-flight token is the slot at position ctx: its own "attention" is v_new, lse = q.k_new * scale.
    page, off = table[np.arange(b), ctx // s], ctx % s
    k_new, v_new = k[:, page, off], v[:, page, off]  # [KVH, B, D]
    qg = np.asarray(q).reshape(b, kvh, group, d)
    lse_new = np.einsum("bkgd,kbd->bkg", qg, k_new).reshape(b, h) * scale
    out_new = np.repeat(np.moveaxis(v_new, 0, 1), group, axis=1)  # [B, H, D]
    out, lse = merge_attention(paged[0], paged[1], jnp.asarray(out_new), jnp.asarray(lse_new))
    full = paged_attention_gqa_reference(q, k, v, None, None, tbl, jnp.asarray(ctx + 1), scale=scale)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full[0]), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(full[1]), atol=1e-5, rtol=1e-5)
    both_empty = merge_attention(jnp.zeros((1, 2)), jnp.array([-jnp.inf]), jnp.zeros((1, 2)), jnp.array([-jnp.inf]))
    assert np.isneginf(np.asarray(both_empty[1])).all() and (np.asarray(both_empty[0]) == 0).all()


# ---- validation --------------------------------------------------------------------------

def _gqa_args(p=16, s=8, kvh=2, h=4, d=32, m=2, dtype=jnp.bfloat16, scales=False):
    k = jnp.zeros((kvh, p, s, d), dtype)
    sc = jnp.ones((kvh, p, s), jnp.float32) if scales else None
    return dict(q=jnp.zeros((2, h, d), jnp.bfloat16), k_pages=k, v_pages=k, k_scale=sc, v_scale=sc,
                page_table=jnp.ones((2, m), jnp.int32), ctx_lens=jnp.array([3, 9], jnp.int32))


def _call_gqa(**kw):
    a = _gqa_args()
    a.update(kw)
    return paged_attention_gqa(a.pop("q"), a.pop("k_pages"), a.pop("v_pages"), a.pop("k_scale"), a.pop("v_scale"),
                               a.pop("page_table"), a.pop("ctx_lens"), scale=1.0, interpret=True)


def _kv(shape=(2, 16, 8, 32), dtype=jnp.bfloat16):
    return dict(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype))


@pytest.mark.parametrize("override,err,match", [
    (dict(q=jnp.zeros((2, 4, 16), jnp.bfloat16)), ValueError, "head dim"),
    (dict(q=jnp.zeros((2, 3, 32), jnp.bfloat16)), ValueError, "multiple of KV heads"),
    (dict(q=jnp.zeros((2, 4, 32), jnp.int32)), TypeError, "q: dtype"),
    (_kv(dtype=jnp.int8), TypeError, "k_pages"),
    (_kv(dtype=jnp.float8_e4m3fn), ValueError, "need float32 scales"),
    (dict(k_scale=jnp.ones((2, 16, 8)), v_scale=jnp.ones((2, 16, 8))), ValueError, "only fp8"),
    (dict(**_kv(dtype=jnp.float8_e4m3fn), k_scale=jnp.ones((2, 16, 8), jnp.bfloat16),
          v_scale=jnp.ones((2, 16, 8), jnp.bfloat16)), TypeError, "k_scale: dtype"),
    (dict(**_kv(dtype=jnp.float8_e4m3fn), k_scale=jnp.ones((2, 16, 4), jnp.float32),
          v_scale=jnp.ones((2, 16, 4), jnp.float32)), ValueError, "k_scale: expected shape"),
    (_kv(shape=(2, 16, 12, 32)), ValueError, "power of two"),
    (dict(k_pages=jnp.zeros((2, 16, 8, 32), jnp.bfloat16), v_pages=jnp.zeros((2, 16, 16, 32), jnp.bfloat16)),
     ValueError, "v_pages"),
    (dict(page_table=jnp.array([[1, 2], [3, 99]], jnp.int32)), ValueError, r"page_table\[1, 1\] = 99"),
    (dict(page_table=jnp.array([[1, 2], [-1, 3]], jnp.int32)), ValueError, "outside"),
    (dict(ctx_lens=jnp.array([3, 17], jnp.int32)), ValueError, "ctx_lens out of range"),
    (dict(ctx_lens=jnp.array([3.0, 9.0])), TypeError, "ctx_lens"),
    (dict(page_table=jnp.ones((3, 2), jnp.int32)), ValueError, "batch"),
])
def test_gqa_validation_errors(override, err, match):
    with pytest.raises(err, match=match):
        _call_gqa(**override)


def test_unused_table_entries_may_be_anything():
    """Entries past ctx_len are never read: out-of-range ids there pass validation."""
    tbl = jnp.array([[1, 999], [2, 3]], jnp.int32)  # row 0 uses 1 page (ctx 3 < S=8)
    out, lse = _call_gqa(page_table=tbl)
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_triton_rules_and_mla_validation():
    with pytest.raises(ValueError, match="head_dim=48"):
        _call_gqa(**_gqa_args(d=48))
    z = jnp.zeros
    lat, rope = z((16, 8, 64), jnp.bfloat16), z((16, 8, 16), jnp.bfloat16)
    tbl, ctx = jnp.ones((1, 2), jnp.int32), jnp.array([5], jnp.int32)
    with pytest.raises(ValueError, match="rope_pages"):
        paged_attention_mla(z((1, 4, 64), jnp.bfloat16), z((1, 4, 16), jnp.bfloat16), lat, z((16, 8, 32), jnp.bfloat16),
                            None, None, tbl, ctx, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="latent rank"):
        paged_attention_mla(z((1, 4, 32), jnp.bfloat16), z((1, 4, 16), jnp.bfloat16), lat, rope, None, None, tbl, ctx,
                            scale=1.0, interpret=True)
    a = _gqa_args()
    with pytest.raises(ValueError, match="backend"):
        paged_attention_gqa(a["q"], a["k_pages"], a["v_pages"], None, None, a["page_table"], a["ctx_lens"],
                            scale=1.0, interpret=True, backend="mosaic")
