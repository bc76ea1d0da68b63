"""A decoder layer's matmuls at many rows: the format's native path against its XLA formulation.

For each row count M, the seven matrices of one SmolLM2-135M layer (q and o 576 x 576, k and v
576 x 192, gate and up 576 x 1536, down 1536 x 576), each timed alone: --calls calls in one jitted
loop on the same weight, each call's input the last one's with one element moved by its output
(so the calls run one after another and nothing but the call costs time: at hundreds of rows a
fold over the whole output, as bench/kernel_rows.py does for few rows, would cost as much as
the call). Reported: microseconds per call (best of --reps loops) of the native kernel
(jaxserve.quant.native_paths.KERNELS, whatever the registry's row limits) and of the XLA path
the registry falls back to (jaxserve.quant.paths.XLA_PATHS), and their sum over the layer.

    .venv/bin/python bench/matmul_rows.py --format int8 --rows 64,128,256,768
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from jax import lax

from jaxserve import native
from jaxserve.quant import quantize
from jaxserve.quant.native_paths import KERNELS
from jaxserve.quant.paths import XLA_PATHS, family_of

LAYER = [(576, 576, 2), (576, 192, 2), (576, 1536, 2), (1536, 576, 1)]  # (K, N, how many in a layer)


def per_call_us(fn, x, qw, calls: int, reps: int) -> float:
    @jax.jit
    def loop(x, qw):
        def body(_, h):
            return h.at[0, 0].add(1e-9 * fn(h, qw)[0, 0])
        return lax.fori_loop(0, calls, body, x)

    loop(x, qw).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        loop(x, qw).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 1e6 * best / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="int8")
    ap.add_argument("--rows", default="64,128,256,768")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"native: {native.status().reason}")
    fam = family_of(args.format)
    kernel, xla = KERNELS[fam][1], XLA_PATHS[(fam, "cpu")]
    rng = np.random.default_rng(0)
    out = []
    for m in (int(r) for r in args.rows.split(",")):
        total = np.zeros(2)
        for k, n, count in LAYER:
            qw = quantize((0.05 * rng.standard_normal((k, n))).astype(np.float32), args.format)
            x = jax.numpy.asarray(rng.standard_normal((m, k)).astype(np.float32))
            us = np.array([per_call_us(kernel, x, qw, args.calls, args.reps),
                           per_call_us(xla.dense, x, qw, args.calls, args.reps)])
            total += count * us
            out.append({"format": args.format, "rows": m, "k": k, "n": n, "native_us": us[0], "xla_us": us[1]})
            print(f"{args.format:8s} M={m:4d} {k}x{n}: native {us[0]:7.0f} us, {xla.name} {us[1]:7.0f} us", flush=True)
        print(f"{args.format:8s} M={m:4d} layer: native {total[0]:7.0f} us, {xla.name} {total[1]:7.0f} us, "
              f"XLA / native {total[1] / total[0]:.2f}x", flush=True)
        out.append({"format": args.format, "rows": m, "layer_native_us": total[0], "layer_xla_us": total[1]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"native": native.status().reason, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
