"""Paged decode attention: Pallas kernel vs the f32 reference vs the engine's XLA path.

    .venv/bin/python -m pallas_kernels.paged_attention.bench            # sizes for this backend
    .venv/bin/python -m pallas_kernels.paged_attention.bench --size large --kv fp8_e4m3

"xla" is what the engine runs today: gather the row's pages (jaxserve.kv.paged.load), then
jaxserve.models.attention with one in-flight token. The kernel only does the paged half, so
the comparison slightly favours it by the (tiny) in-flight part. On a CPU host the kernel
runs in interpret mode: the ratio there says nothing about GPU speed, only that it runs.
Fixed seed; prints ms per call, ratios, the KV bytes read per second, and the kernel's max
error against the reference (the correctness check on a GPU host).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kv import paged
from jaxserve.kv.formats import get_kv_format
from jaxserve.models import attention
from pallas_kernels.paged_attention import (
    paged_attention_gqa,
    paged_attention_gqa_reference,
    paged_attention_mla,
    paged_attention_mla_reference,
)

# name: (batch, pages, page_size, pages_per_row, gqa (kv_heads, group, head_dim), mla (heads, rank, rope))
SIZES = {
    "small": (4, 64, 16, 8, (2, 4, 64), (16, 128, 32)),
    "large": (32, 4096, 16, 64, (8, 12, 128), (16, 512, 64)),
}


def _time(f, *args, iters: int) -> float:
    jax.block_until_ready(f(*args))  # compile + warm up
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def _inputs(rng, b, p, s, m, kv_fmt):
    """Random page tables (distinct pages per row, page 0 kept null) and ctx lens in [1, m*s]."""
    table = np.stack([rng.choice(np.arange(1, p), m, replace=False) for _ in range(b)]).astype(np.int32)
    ctx = rng.integers(1, m * s + 1, b).astype(np.int32)
    return jnp.asarray(table), jnp.asarray(ctx), get_kv_format(kv_fmt)


def bench_gqa(size: str, kv: str, iters: int, interpret: bool):
    b, p, s, m, (kvh, g, d), _ = SIZES[size]
    rng = np.random.default_rng(0)
    table, ctx, fmt = _inputs(rng, b, p, s, m, kv)
    pool = paged.new_pool(fmt, (kvh, p, s, d), "k") | paged.new_pool(fmt, (kvh, p, s, d), "v")
    kq, ksc = fmt.quantize(jnp.asarray(rng.standard_normal((kvh, p, s, d)), jnp.float32))
    vq, vsc = fmt.quantize(jnp.asarray(rng.standard_normal((kvh, p, s, d)), jnp.float32))
    pool.update(k=kq, v=vq, **({"k_scale": ksc, "v_scale": vsc} if fmt.scaled else {}))
    q = jnp.asarray(rng.standard_normal((b, kvh * g, d)), jnp.bfloat16)
    args = (q, kq, vq, ksc, vsc, table, ctx)
    scale = d ** -0.5

    def kernel(*a):
        return paged_attention_gqa(*a, scale=scale, interpret=interpret)

    @jax.jit
    def xla(q, pool, table, ctx):
        k = paged.load(fmt, pool, "k", table, q.dtype, headed=True)  # [B, KVH, C, D]
        v = paged.load(fmt, pool, "v", table, q.dtype, headed=True)
        mask = jnp.arange(k.shape[2])[None] < ctx[:, None]
        new = jnp.zeros((b, 1, kvh, d), q.dtype)
        return attention.gqa_attention(q[:, None], k, v, mask, new, new, jnp.ones((b, 1, 1), bool), scale)

    ref = jax.jit(lambda *a: paged_attention_gqa_reference(*a, scale=scale))
    times = {
        "kernel": _time(kernel, *args, iters=iters),
        "reference": _time(ref, *args, iters=iters),
        "xla": _time(xla, q, pool, table, ctx, iters=iters),
    }
    token_bytes = 2 * kvh * d * fmt.bytes_per_value + (2 * kvh * 4 if fmt.scaled else 0)
    err = _max_err(kernel(*args)[0], ref(*args)[0])
    _report(f"gqa {size} {kv} B={b} KVH={kvh} G={g} D={d} S={s} M={m}", times, int(ctx.sum()) * token_bytes, err)


def bench_mla(size: str, kv: str, iters: int, interpret: bool):
    b, p, s, m, _, (h, r, dr) = SIZES[size]
    rng = np.random.default_rng(1)
    table, ctx, fmt = _inputs(rng, b, p, s, m, kv)
    lat, ls = fmt.quantize(jnp.asarray(rng.standard_normal((p, s, r)), jnp.float32))
    rope, rs = fmt.quantize(jnp.asarray(rng.standard_normal((p, s, dr)), jnp.float32))
    pool = {"latent": lat, "rope": rope, **({"latent_scale": ls, "rope_scale": rs} if fmt.scaled else {})}
    q_lat = jnp.asarray(rng.standard_normal((b, h, r)) * 0.1, jnp.bfloat16)
    q_rope = jnp.asarray(rng.standard_normal((b, h, dr)) * 0.1, jnp.bfloat16)
    args = (q_lat, q_rope, lat, rope, ls, rs, table, ctx)
    scale = (128 + dr) ** -0.5

    def kernel(*a):
        return paged_attention_mla(*a, scale=scale, interpret=interpret)

    @jax.jit
    def xla(q_lat, q_rope, pool, table, ctx):
        c_lat = paged.load(fmt, pool, "latent", table, q_lat.dtype)  # [B, C, R]
        c_rope = paged.load(fmt, pool, "rope", table, q_lat.dtype)
        mask = jnp.arange(c_lat.shape[1])[None] < ctx[:, None]
        return attention.mla_attention(q_lat[:, None], q_rope[:, None], c_lat, c_rope, mask,
                                       jnp.zeros((b, 1, r), q_lat.dtype), jnp.zeros((b, 1, dr), q_lat.dtype),
                                       jnp.ones((b, 1, 1), bool), scale)

    ref = jax.jit(lambda *a: paged_attention_mla_reference(*a, scale=scale))
    times = {
        "kernel": _time(kernel, *args, iters=iters),
        "reference": _time(ref, *args, iters=iters),
        "xla": _time(xla, q_lat, q_rope, pool, table, ctx, iters=iters),
    }
    token_bytes = (r + dr) * fmt.bytes_per_value + (8 if fmt.scaled else 0)
    err = _max_err(kernel(*args)[0], ref(*args)[0])
    _report(f"mla {size} {kv} B={b} H={h} R={r} Dr={dr} S={s} M={m}", times, int(ctx.sum()) * token_bytes, err)


def _max_err(a, b) -> float:
    """Max |a - b| over outputs (checks the compiled kernel on a real GPU, where tests don't run)."""
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _report(title: str, times: dict, kv_bytes: int, err: float):
    k = times["kernel"]
    print(f"{title}  [{jax.default_backend()}]  max |kernel - reference| = {err:.2e}")
    for name, ms in times.items():
        print(f"  {name:9s} {ms:9.3f} ms  {kv_bytes / ms / 1e6:8.2f} GB/s of KV  kernel speedup x{ms / k:6.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), nargs="*")
    ap.add_argument("--kv", choices=["bf16", "fp8_e4m3"], nargs="*", default=["bf16", "fp8_e4m3"])
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    sizes = args.size or (["small", "large"] if on_gpu else ["small"])
    iters = args.iters or (50 if on_gpu else 3)
    for size in sizes:
        for kv in args.kv:
            bench_gqa(size, kv, iters, interpret=not on_gpu)
            bench_mla(size, kv, iters, interpret=not on_gpu)


if __name__ == "__main__":
    main()
