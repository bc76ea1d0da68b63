"""Pallas paged decode attention (GQA and absorbed MLA), written for the Triton GPU backend.

One program per (batch row, KV head or query-head block, context split). It walks the row's
page table in chunks of `pages_per_chunk` pages with a dynamic `fori_loop` bounded by the
row's ctx_len (pages past it are never visited) and keeps an online softmax (running max m,
sum l, output o) in float32. It writes the normalised output and lse = m + log(l); with
num_splits > 1 the splits are merged by log-sum-exp in XLA (flash-decoding).

Why the code looks the way it does (Triton lowering rules, jax 0.10.2):
- A pallas_call without compiler params lowers to Mosaic GPU; we pass Triton CompilerParams.
- Every loaded array must have a power-of-two size and tl.dot needs dims >= 16: the query
  group (GQA) / head block (MLA) is padded to >= 16 and a chunk spans >= 16 tokens.
- No scalar prefetch: the page-table row and ctx_len arrive as ordinary blocks and pages are
  read with a vector index, `k_ref[pages]` (a gather of whole pages).
- fp8 pages are cast to the query dtype before the dot (no mixed-dtype dot); K scales
  multiply the logits and V scales the probabilities (per token, so they commute).
- Slots past ctx_len inside the last chunk may hold garbage or NaN: logits are masked with
  `where` (not added to) and V rows / probabilities are zeroed with `where`, since 0 * NaN
  is NaN.
- Page ids outside [0, P) are redirected to the null page 0 before the call, so the kernel
  can never read out of bounds.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.paged_attention import validate
from pallas_kernels.paged_attention.merge import merge_partials
from pallas_kernels.paged_attention.reference import safe_page_table

# Finite mask value: a fully masked chunk never produces inf - inf.
MASK = -0.7 * float(np.finfo(np.float32).max)
BACKENDS = ("triton",)
_STATIC = ("scale", "interpret", "backend", "block_tokens", "num_splits", "num_warps", "num_stages")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_nt(a, b):
    """a [M, K] . b [N, K]^T -> [M, N] float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def online_update(carry, logits, valid, v_scale, v):
    """One chunk of online softmax.

    carry: o [G, X] f32, m [G] f32, l [G] f32; logits [G, T] f32 (scaled, masked);
    valid [1, T] bool; v_scale [1, T] f32 | None; v [T, X] compute dtype (invalid rows 0).
    """
    o, m, l = carry
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(logits - m_new[:, None]), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=-1)
    if v_scale is not None:
        p = jnp.where(valid, p * v_scale, 0.0)  # an unread slot's scale may be NaN
    o_new = alpha[:, None] * o + lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return o_new, m_new, l_new


def _chunk_loop(len_ref, out_refs, rows: int, width: int, chunk: int, chunks_per_split: int, body):
    """Run `body(c, carry)` over this split's chunks that hold context, then write (out, lse)."""
    ctx = len_ref[0]
    first = pl.program_id(2) * chunks_per_split
    last = jnp.minimum((ctx + chunk - 1) // chunk, first + chunks_per_split)
    init = (
        jnp.zeros((rows, width), jnp.float32),
        jnp.full((rows,), MASK, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    o, m, l = lax.fori_loop(first, last, body, init)
    o_ref, lse_ref = out_refs
    ok = l > 0
    l_safe = jnp.where(ok, l, 1.0)
    o_ref[...] = (o / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(ok, m + jnp.log(l_safe), -jnp.inf)


def _gqa_kernel(*refs, scale, page_size, pages_per_chunk, chunks_per_split, quantized):
    """Blocks: q [Gp, D]; k/v [P, S, D] (this KV head's pool); k/v scale [P, S];
    page table row [Mp]; ctx_len [1] -> out [Gp, D], lse [Gp]."""
    if quantized:
        q_ref, k_ref, v_ref, ks_ref, vs_ref, pt_ref, len_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, pt_ref, len_ref, o_ref, lse_ref = refs
    chunk = pages_per_chunk * page_size
    q = q_ref[...]
    rows, d = q.shape
    ctx = len_ref[0]

    def body(c, carry):
        pages = pt_ref[pl.ds(c * pages_per_chunk, pages_per_chunk)]
        valid = (c * chunk + jnp.arange(chunk, dtype=jnp.int32)) < ctx  # [T]
        logits = dot_nt(q, k_ref[pages].reshape(chunk, d).astype(q.dtype))
        if quantized:
            logits = logits * ks_ref[pages].reshape(1, chunk)
        logits = jnp.where(valid[None, :], logits * scale, MASK)
        v = jnp.where(valid[:, None], v_ref[pages].reshape(chunk, d).astype(q.dtype), 0)
        vs = vs_ref[pages].reshape(1, chunk) if quantized else None
        return online_update(carry, logits, valid[None, :], vs, v)

    _chunk_loop(len_ref, (o_ref, lse_ref), rows, d, chunk, chunks_per_split, body)


def _mla_kernel(*refs, scale, page_size, pages_per_chunk, chunks_per_split, quantized):
    """Blocks: q_lat [bh, R], q_rope [bh, Dr]; latent [P, S, R], rope [P, S, Dr]; scales
    [P, S]; page table row [Mp]; ctx_len [1] -> out [bh, R], lse [bh]."""
    if quantized:
        ql_ref, qr_ref, lat_ref, rope_ref, ls_ref, rs_ref, pt_ref, len_ref, o_ref, lse_ref = refs
    else:
        ql_ref, qr_ref, lat_ref, rope_ref, pt_ref, len_ref, o_ref, lse_ref = refs
    chunk = pages_per_chunk * page_size
    q_lat, q_rope = ql_ref[...], qr_ref[...]
    rows, r = q_lat.shape
    dr = q_rope.shape[1]
    ctx = len_ref[0]

    def body(c, carry):
        pages = pt_ref[pl.ds(c * pages_per_chunk, pages_per_chunk)]
        valid = (c * chunk + jnp.arange(chunk, dtype=jnp.int32)) < ctx
        lat = lat_ref[pages].reshape(chunk, r).astype(q_lat.dtype)
        s_lat = dot_nt(q_lat, lat)
        s_rope = dot_nt(q_rope, rope_ref[pages].reshape(chunk, dr).astype(q_rope.dtype))
        if quantized:
            s_lat = s_lat * ls_ref[pages].reshape(1, chunk)
            s_rope = s_rope * rs_ref[pages].reshape(1, chunk)
        logits = jnp.where(valid[None, :], (s_lat + s_rope) * scale, MASK)
        v = jnp.where(valid[:, None], lat, 0)
        vs = ls_ref[pages].reshape(1, chunk) if quantized else None
        return online_update(carry, logits, valid[None, :], vs, v)

    _chunk_loop(len_ref, (o_ref, lse_ref), rows, r, chunk, chunks_per_split, body)


def _plan_table(page_table, num_pages: int, page_size: int, block_tokens: int, num_splits: int):
    """-> (table [B, Mp] with safe ids and zero padding, pages_per_chunk, chunks_per_split)."""
    if not validate.is_pow2(block_tokens) or block_tokens < validate.TRITON_MIN_DOT:
        raise ValueError(f"block_tokens={block_tokens}: a power of two >= {validate.TRITON_MIN_DOT}")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    ppc = max(1, block_tokens // page_size)
    m = page_table.shape[1]
    cps = _cdiv(_cdiv(m, ppc), num_splits)  # chunks per split
    pt = safe_page_table(page_table, num_pages)
    pt = jnp.pad(pt, ((0, 0), (0, cps * num_splits * ppc - m)))  # padding -> null page, never valid
    return pt, ppc, cps


def compiler_params(backend: str, num_warps: int, num_stages: int):
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} not supported; choose one of {BACKENDS} (Mosaic GPU is not implemented)")
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _finish(o, lse, num_splits: int, out_dtype):
    """o [B, NS, ..., X], lse [B, NS, ...] -> merged over splits (axis 1)."""
    if num_splits == 1:
        return o[:, 0].astype(out_dtype), lse[:, 0]
    o, lse = merge_partials(o, lse, axis=1)
    return o.astype(out_dtype), lse


@functools.partial(jax.jit, static_argnames=_STATIC)
def _gqa(q, k_pages, v_pages, k_scale, v_scale, page_table, ctx_lens, *, scale, interpret, backend,
         block_tokens, num_splits, num_warps, num_stages):
    b, h, d = q.shape
    kvh, p, s, _ = k_pages.shape
    g = h // kvh
    gp = max(validate.TRITON_MIN_DOT, next_pow2(g))
    qg = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    pt, ppc, cps = _plan_table(page_table, p, s, block_tokens, num_splits)
    quantized = k_scale is not None
    row_block = pl.BlockSpec((None, pt.shape[1]), lambda i, j, k: (i, 0))
    len_block = pl.BlockSpec((None, 1), lambda i, j, k: (i, 0))
    pool = pl.BlockSpec((None, p, s, d), lambda i, j, k: (j, 0, 0, 0))
    scales = pl.BlockSpec((None, p, s), lambda i, j, k: (j, 0, 0))
    in_specs = [pl.BlockSpec((None, None, gp, d), lambda i, j, k: (i, j, 0, 0)), pool, pool]
    args = [qg, k_pages, v_pages]
    if quantized:
        in_specs += [scales, scales]
        args += [k_scale, v_scale]
    in_specs += [row_block, len_block]
    args += [pt, ctx_lens.reshape(b, 1)]
    o_dtype = q.dtype if num_splits == 1 else jnp.float32
    kernel = functools.partial(_gqa_kernel, scale=scale, page_size=s, pages_per_chunk=ppc,
                               chunks_per_split=cps, quantized=quantized)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, num_splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, j, k: (i, k, j, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, k: (i, k, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, num_splits, kvh, gp, d), o_dtype),
            jax.ShapeDtypeStruct((b, num_splits, kvh, gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params(backend, num_warps, num_stages),
        name=f"paged_gqa_s{s}_g{gp}_d{d}",
    )(*args)
    o, lse = _finish(o, lse, num_splits, q.dtype)
    return o[:, :, :g].reshape(b, h, d), lse[:, :, :g].reshape(b, h)


@functools.partial(jax.jit, static_argnames=_STATIC + ("block_h",))
def _mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, page_table, ctx_lens, *, scale,
         interpret, backend, block_tokens, num_splits, num_warps, num_stages, block_h):
    b, h, r = q_lat.shape
    dr = q_rope.shape[2]
    p, s, _ = latent_pages.shape
    bh = max(block_h, validate.TRITON_MIN_DOT)
    hp = _cdiv(h, bh) * bh
    q_lat = jnp.pad(q_lat, ((0, 0), (0, hp - h), (0, 0)))
    q_rope = jnp.pad(q_rope, ((0, 0), (0, hp - h), (0, 0)))
    pt, ppc, cps = _plan_table(page_table, p, s, block_tokens, num_splits)
    quantized = latent_scale is not None
    full = lambda *shape: pl.BlockSpec(shape, lambda i, j, k: (0,) * len(shape))  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, bh, r), lambda i, j, k: (i, j, 0)),
        pl.BlockSpec((None, bh, dr), lambda i, j, k: (i, j, 0)),
        full(p, s, r),
        full(p, s, dr),
    ]
    args = [q_lat, q_rope, latent_pages, rope_pages]
    if quantized:
        in_specs += [full(p, s), full(p, s)]
        args += [latent_scale, rope_scale]
    in_specs += [pl.BlockSpec((None, pt.shape[1]), lambda i, j, k: (i, 0)),
                 pl.BlockSpec((None, 1), lambda i, j, k: (i, 0))]
    args += [pt, ctx_lens.reshape(b, 1)]
    o_dtype = q_lat.dtype if num_splits == 1 else jnp.float32
    kernel = functools.partial(_mla_kernel, scale=scale, page_size=s, pages_per_chunk=ppc,
                               chunks_per_split=cps, quantized=quantized)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, hp // bh, num_splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, bh, r), lambda i, j, k: (i, k, j, 0)),
            pl.BlockSpec((None, None, bh), lambda i, j, k: (i, k, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, num_splits, hp, r), o_dtype),
            jax.ShapeDtypeStruct((b, num_splits, hp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params(backend, num_warps, num_stages),
        name=f"paged_mla_s{s}_h{bh}_r{r}",
    )(*args)
    o, lse = _finish(o, lse, num_splits, q_lat.dtype)
    return o[:, :h], lse[:, :h]


def paged_attention_gqa(q, k_pages, v_pages, k_scale, v_scale, page_table, ctx_lens, *, scale: float,
                        interpret: bool = False, backend: str = "triton", block_tokens: int = 32,
                        num_splits: int = 1, num_warps: int = 4, num_stages: int = 2):
    """Paged decode attention, grouped-query layout.

    q [B, H, D]; k_pages, v_pages [KVH, P, S, D] (bf16/f16/f32, or fp8 with scales);
    k_scale, v_scale [KVH, P, S] float32 or None; page_table [B, M] int32; ctx_lens [B] int32.
    H = KVH * G. Returns (out [B, H, D] in q.dtype, lse [B, H] float32); a row with
    ctx_len 0 gives out 0 and lse -inf. `block_tokens` tokens per inner step (power of two
    >= 16); `num_splits` > 1 splits each row's pages across programs (long contexts).
    """
    dims = validate.check_gqa(q, k_pages, v_pages, k_scale, v_scale, page_table, ctx_lens)
    validate.check_triton_dims(head_dim=dims["head_dim"])
    return _gqa(q, k_pages, v_pages, k_scale, v_scale, page_table, ctx_lens, scale=float(scale),
                interpret=interpret, backend=backend, block_tokens=block_tokens, num_splits=num_splits,
                num_warps=num_warps, num_stages=num_stages)


def paged_attention_mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, page_table, ctx_lens,
                        *, scale: float, interpret: bool = False, backend: str = "triton", block_h: int = 16,
                        block_tokens: int = 32, num_splits: int = 1, num_warps: int = 4, num_stages: int = 2):
    """Paged decode attention, absorbed MLA layout (keys and values are the shared latent).

    q_lat [B, H, R], q_rope [B, H, Dr]; latent_pages [P, S, R], rope_pages [P, S, Dr];
    latent_scale, rope_scale [P, S] float32 or None; page_table [B, M]; ctx_lens [B] int32.
    scores = (q_lat . latent + q_rope . rope) * scale, values = latent.
    Returns (out [B, H, R] in q_lat.dtype, lse [B, H] float32). `block_h` query heads per
    program (power of two >= 16; H is padded up to a multiple).
    """
    dims = validate.check_mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, page_table,
                              ctx_lens)
    validate.check_triton_dims(kv_lora_rank=dims["rank"], rope_dim=dims["rope_dim"], block_h=block_h)
    return _mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, page_table, ctx_lens,
                scale=float(scale), interpret=interpret, backend=backend, block_tokens=block_tokens,
                num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, block_h=block_h)
