"""What one more row costs a native matmul kernel: one weight, calls in a dependent chain.

For each format, weight shape and row count M: one jitted loop of --calls calls of the format's
native kernel (jaxserve.quant.native_paths.KERNELS) on the same weight, each call's input the
last one's output folded back in, so the calls run one after another as a program's layers do
and nothing else runs between them. Reported per call: the median over --reps loops, the stored
bytes read per second, and the time relative to the format's one-row call on that shape (a
kernel bound by its weight bytes stays near 1.0x; one bound by its per-row work grows with M).

    .venv/bin/python bench/kernel_rows.py --formats int4:g32 --rows 1,2,4,8,9,16
    JAXSERVE_NATIVE_AMX_ROWS=int4=2 .venv/bin/python bench/kernel_rows.py ...   # one format's tile threshold
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve import native
from jaxserve.quant import nbytes, quantize
from jaxserve.quant.native_paths import KERNELS
from jaxserve.quant.paths import family_of


def per_call_us(fmt: str, k: int, n: int, m: int, calls: int, reps: int) -> tuple[float, int]:
    """Median microseconds per call of fmt's native kernel at m rows on a k x n weight, and the
    weight's stored bytes."""
    rng = np.random.default_rng(k * n + m)
    qw = quantize((0.05 * rng.standard_normal((k, n))).astype(np.float32), fmt)
    kernel = KERNELS[family_of(fmt)][1]

    @jax.jit
    def loop(x, qw):
        def body(_, h):
            y = kernel(h, qw)
            y = y[:, :k] if n >= k else jnp.tile(y, (1, -(-k // n)))[:, :k]
            return h + 1e-3 * y
        return lax.fori_loop(0, calls, body, x)

    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    loop(x, qw).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        loop(x, qw).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e6 * float(np.median(times)) / calls, nbytes(qw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int4:g32")
    ap.add_argument("--shapes", default="576x576,576x1536,1536x576", help="K x N of the weights")
    ap.add_argument("--rows", default="1,2,4,8,9,16")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    st = native.status()
    print(f"native: {st.reason}")
    out = []
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            base = None
            for m in (int(r) for r in args.rows.split(",")):
                us, stored = per_call_us(fmt, k, n, m, args.calls, args.reps)
                base = base or (us if m == 1 else None)
                rel = f"{us / base:5.2f}x one row" if base else ""
                print(f"{fmt:10s} {k}x{n:<6d} M={m:3d} {us:8.1f} us/call {stored / us / 1e3:6.1f} GB/s  {rel}", flush=True)
                out.append({"format": fmt, "k": k, "n": n, "m": m, "us": us, "bytes": stored})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"native": st.reason, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
