"""W4A16 matmuls: Pallas kernel vs the f32 reference vs plain XLA (dequantize to bf16 + dot)
vs an unquantized bf16 matmul (the bandwidth baseline int4 should beat at decode sizes).

    .venv/bin/python -m pallas_kernels.int4_matmul.bench                  # sizes for this backend
    .venv/bin/python -m pallas_kernels.int4_matmul.bench --size large --group 32 128

Weights come from jaxserve.quant.int4.Int4GroupFormat(G).quantize, the project's int4 format.
On a CPU host the kernels run in interpret mode: ratios there only show that they run.
Fixed seed; prints ms per call, ratios, weight bytes read per second, and the kernel's
relative error against the reference (the correctness check on a GPU host).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.int4_matmul import (
    dequantize_int4,
    int4_grouped_matmul,
    int4_grouped_matmul_reference,
    int4_matmul,
    int4_matmul_reference,
)
from jaxserve.quant.int4 import Int4GroupFormat

# name: (M tokens, K, N, experts) -- large = one Kimi K2 expert projection (hidden 7168 -> 2048)
SIZES = {"small": (8, 512, 256, 4), "large": (64, 7168, 2048, 16)}


def _time(f, *args, iters: int) -> float:
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def _rel_err(a, b) -> float:
    """max |a - b| / max |b| (checks the compiled kernel on a real GPU, where tests don't run)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-6))


def _report(title: str, times: dict, weight_bytes: int, err: float):
    k = times["kernel"]
    print(f"{title}  [{jax.default_backend()}]  relative error vs reference {err:.2e}")
    for name, ms in times.items():
        print(f"  {name:10s} {ms:9.3f} ms  {weight_bytes / ms / 1e6:8.2f} GB/s of int4 weights  "
              f"kernel speedup x{ms / k:6.2f}")


def _quantize(w: np.ndarray, group: int):
    """w [..., K, N] -> (packed uint8 [..., K/2, N], scales f32 [..., K/G, N]) on the device
    (K is a multiple of the group in every size here, so no padding)."""
    qw = Int4GroupFormat(group).quantize(w)
    return jnp.asarray(qw.values), jnp.asarray(qw.scales)


def bench(size: str, group: int, iters: int, interpret: bool):
    m, k, n, e = SIZES[size]
    rng = np.random.default_rng(group)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    packed, scales = _quantize(w, group)
    w_bf16 = jnp.asarray(w, jnp.bfloat16)
    wbytes = packed.size + scales.size * scales.dtype.itemsize

    times = {
        "kernel": _time(lambda *a: int4_matmul(*a, group=group, interpret=interpret), x, packed, scales, iters=iters),
        "reference": _time(lambda *a: int4_matmul_reference(*a, group=group), x, packed, scales, iters=iters),
        "xla": _time(jax.jit(lambda x, p, s: x @ dequantize_int4(p, s, group, jnp.bfloat16)), x, packed, scales,
                     iters=iters),
        "bf16 dense": _time(jax.jit(lambda x, w: x @ w), x, w_bf16, iters=iters),
    }
    err = _rel_err(int4_matmul(x, packed, scales, group=group, interpret=interpret),
                   int4_matmul_reference(x, packed, scales, group=group))
    _report(f"int4_matmul {size} M={m} K={k} N={n} g={group}", times, wbytes, err)

    ws = (rng.standard_normal((e, k, n)) * 0.05).astype(np.float32)
    packed_e, scales_e = _quantize(ws, group)
    sizes = np.bincount(rng.integers(0, e, m), minlength=e).astype(np.int32)  # tokens sorted by expert
    gs = jnp.asarray(sizes)
    times = {
        "kernel": _time(lambda *a: int4_grouped_matmul(*a, group=group, interpret=interpret), x, packed_e, scales_e,
                        gs, iters=iters),
        "reference": _time(lambda *a: int4_grouped_matmul_reference(*a, group=group), x, packed_e, scales_e, gs,
                           iters=iters),
        "xla": _time(jax.jit(lambda x, p, s, g: lax.ragged_dot(x, dequantize_int4(p, s, group, jnp.bfloat16), g)),
                     x, packed_e, scales_e, gs, iters=iters),
        "bf16 dense": _time(jax.jit(lambda x, w, g: lax.ragged_dot(x, w, g)), x, jnp.asarray(ws, jnp.bfloat16), gs,
                            iters=iters),
    }
    err = _rel_err(int4_grouped_matmul(x, packed_e, scales_e, gs, group=group, interpret=interpret),
                   int4_grouped_matmul_reference(x, packed_e, scales_e, gs, group=group))
    _report(f"int4_grouped_matmul {size} M={m} K={k} N={n} E={e} g={group}", times,
            packed_e.size + scales_e.size * scales_e.dtype.itemsize, err)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), nargs="*")
    ap.add_argument("--group", type=int, nargs="*", default=[32, 128])
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    for size in args.size or (["small", "large"] if on_gpu else ["small"]):
        for group in args.group:
            bench(size, group, args.iters or (50 if on_gpu else 3), interpret=not on_gpu)


if __name__ == "__main__":
    main()
