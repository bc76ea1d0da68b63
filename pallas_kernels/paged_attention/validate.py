"""Input checks for the paged decode-attention kernels.

Static checks (shapes, dtypes, power-of-two sizes) always run, also under `jax.jit`.
Value checks (page ids in [0, P), 0 <= ctx_len <= pages_per_row * S) need concrete arrays:
they run on the host when the inputs are concrete and are skipped for tracers (inside a
jitted step the engine's page tracker has already checked the table).

Why page ids matter: JAX clips out-of-range gather indices and a GPU kernel would read
out of bounds, so a bad id must be an error here, never a silent read of another page.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Q_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
PAGE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2)
FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
TRITON_MIN_DOT = 16  # tl.dot needs every dimension >= 16


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_dtype(name: str, x, allowed) -> None:
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in allowed]:
        names = ", ".join(jnp.dtype(d).name for d in allowed)
        raise TypeError(f"{name}: dtype {jnp.dtype(x.dtype).name} not supported; expected one of {names}")


def _check_shape(name: str, x, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")


def _check_rank(name: str, x, rank: int, what: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} {what}, got shape {tuple(x.shape)}")


def check_scales(page_dtype, scales: dict, expected_shape: tuple[int, ...]) -> bool:
    """fp8 pages need float32 scales (all of them); other dtypes take none. -> quantized."""
    given = {k: v for k, v in scales.items() if v is not None}
    fp8 = jnp.dtype(page_dtype) in [jnp.dtype(d) for d in FP8_DTYPES]
    if fp8 and len(given) != len(scales):
        missing = sorted(set(scales) - set(given))
        raise ValueError(f"fp8 pages need float32 scales; missing {missing}")
    if not fp8 and given:
        raise ValueError(f"scales {sorted(given)} given for {jnp.dtype(page_dtype).name} pages (only fp8 is scaled)")
    for name, s in given.items():
        _check_shape(name, s, expected_shape)
        _check_dtype(name, s, (jnp.float32,))
    return fp8


def check_table(page_table, ctx_lens, batch: int, num_pages: int, page_size: int) -> int:
    """Static and (when concrete) value checks of page_table [B, M] and ctx_lens [B]. -> M."""
    _check_rank("page_table", page_table, 2, "[B, pages_per_row]")
    _check_dtype("page_table", page_table, (jnp.int32,))
    _check_shape("ctx_lens", ctx_lens, (batch,))
    _check_dtype("ctx_lens", ctx_lens, (jnp.int32,))
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table: batch {page_table.shape[0]} != q batch {batch}")
    if not is_pow2(page_size):
        raise ValueError(f"page_size {page_size} must be a power of two")
    m = page_table.shape[1]
    if _concrete(page_table, ctx_lens):
        check_table_values(np.asarray(page_table), np.asarray(ctx_lens), num_pages, page_size)
    return m


def check_table_values(page_table: np.ndarray, ctx_lens: np.ndarray, num_pages: int, page_size: int) -> None:
    """Host check: ctx lens in range and every page a row reads is a valid id in [0, P).

    Entries past a row's last used page are never read (the kernels also redirect them to
    the null page 0), so they may hold anything.
    """
    m = page_table.shape[1]
    bad_len = (ctx_lens < 0) | (ctx_lens > m * page_size)
    if bad_len.any():
        rows = np.nonzero(bad_len)[0][:8].tolist()
        raise ValueError(f"ctx_lens out of range [0, {m * page_size}] in rows {rows}: {ctx_lens[rows].tolist()}")
    used = np.arange(m)[None, :] < -(-ctx_lens[:, None] // page_size)
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    if bad.any():
        b, j = np.argwhere(bad)[0]
        raise ValueError(
            f"page_table[{b}, {j}] = {page_table[b, j]} is outside [0, {num_pages}) "
            f"({int(bad.sum())} bad entries in used pages)"
        )


def check_triton_dims(**dims: int) -> None:
    """Triton rules for arrays that go through tl.dot: power-of-two and >= 16."""
    for name, d in dims.items():
        if not is_pow2(d) or d < TRITON_MIN_DOT:
            raise ValueError(f"{name}={d}: the Triton backend needs a power of two >= {TRITON_MIN_DOT}")


def check_gqa(q, k_pages, v_pages, k_scale, v_scale, page_table, ctx_lens) -> dict:
    """q [B, H, D]; k/v pages [KVH, P, S, D]; k/v scale [KVH, P, S] f32 | None. -> dims."""
    _check_rank("q", q, 3, "[B, H, D]")
    _check_rank("k_pages", k_pages, 4, "[KVH, P, S, D]")
    _check_dtype("q", q, Q_DTYPES)
    _check_dtype("k_pages", k_pages, PAGE_DTYPES)
    _check_shape("v_pages", v_pages, k_pages.shape)
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"v_pages dtype {v_pages.dtype} != k_pages dtype {k_pages.dtype}")
    b, h, d = q.shape
    kvh, p, s, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head dim: q has {d}, pages have {dk}")
    if h % kvh:
        raise ValueError(f"query heads {h} not a multiple of KV heads {kvh}")
    quantized = check_scales(k_pages.dtype, {"k_scale": k_scale, "v_scale": v_scale}, (kvh, p, s))
    m = check_table(page_table, ctx_lens, b, p, s)
    return dict(batch=b, heads=h, head_dim=d, kv_heads=kvh, num_pages=p, page_size=s, pages_per_row=m,
                group=h // kvh, quantized=quantized)


def _check_mla_operands(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, rows: str):
    """The query and pool checks both MLA kernels share -> (rows, heads, rank, rope dim, P, S, quantized)."""
    _check_rank("q_lat", q_lat, 3, f"[{rows}, H, R]")
    _check_rank("q_rope", q_rope, 3, f"[{rows}, H, Dr]")
    _check_rank("latent_pages", latent_pages, 3, "[P, S, R]")
    _check_rank("rope_pages", rope_pages, 3, "[P, S, Dr]")
    _check_dtype("q_lat", q_lat, Q_DTYPES)
    _check_dtype("latent_pages", latent_pages, PAGE_DTYPES)
    if q_rope.dtype != q_lat.dtype:
        raise TypeError(f"q_rope dtype {q_rope.dtype} != q_lat dtype {q_lat.dtype}")
    if rope_pages.dtype != latent_pages.dtype:
        raise TypeError(f"rope_pages dtype {rope_pages.dtype} != latent_pages dtype {latent_pages.dtype}")
    b, h, r = q_lat.shape
    p, s, rk = latent_pages.shape
    dr = q_rope.shape[2]
    _check_shape("q_rope", q_rope, (b, h, dr))
    if rk != r:
        raise ValueError(f"latent rank: q_lat has {r}, latent_pages have {rk}")
    _check_shape("rope_pages", rope_pages, (p, s, dr))
    quantized = check_scales(latent_pages.dtype, {"latent_scale": latent_scale, "rope_scale": rope_scale}, (p, s))
    return b, h, r, dr, p, s, quantized


def check_mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, page_table, ctx_lens) -> dict:
    """q_lat [B, H, R], q_rope [B, H, Dr]; latent [P, S, R], rope [P, S, Dr]; scales [P, S]."""
    b, h, r, dr, p, s, quantized = _check_mla_operands(q_lat, q_rope, latent_pages, rope_pages, latent_scale,
                                                       rope_scale, "B")
    m = check_table(page_table, ctx_lens, b, p, s)
    return dict(batch=b, heads=h, rank=r, rope_dim=dr, num_pages=p, page_size=s, pages_per_row=m,
                quantized=quantized)


def check_sparse_mla(q_lat, q_rope, latent_pages, rope_pages, latent_scale, rope_scale, slots) -> dict:
    """As ``check_mla``, with slots [N, K] int32 physical slot ids (page * S + offset; -1: none)
    in place of the page table; concrete ids outside [-1, P*S) are an error."""
    n, h, r, dr, p, s, quantized = _check_mla_operands(q_lat, q_rope, latent_pages, rope_pages, latent_scale,
                                                       rope_scale, "N")
    _check_rank("slots", slots, 2, "[N, K]")
    _check_dtype("slots", slots, (jnp.int32,))
    if slots.shape[0] != n:
        raise ValueError(f"slots: {slots.shape[0]} rows != q_lat rows {n}")
    if _concrete(slots):
        ids = np.asarray(slots)
        bad = (ids < -1) | (ids >= p * s)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise ValueError(f"slots[{i}, {j}] = {ids[i, j]} is outside [-1, {p * s}) ({int(bad.sum())} bad ids)")
    return dict(rows=n, heads=h, rank=r, rope_dim=dr, num_pages=p, page_size=s, topk=slots.shape[1],
                quantized=quantized)
