"""Each registered matmul path (jaxserve.quant.paths) against a float32 dot, side by side.

For each weight shape [K, N] and batch M: L distinct weights per jitted call (so they stream from
memory as a decode step's do), every format's path and float32 interleaved in rotating order,
``--reps`` timed calls each; reported: the best time per matrix, the stored bytes read per second,
and the speed relative to float32 from the same process (>1 = faster).

    .venv/bin/python bench/matmul_paths.py
    .venv/bin/python bench/matmul_paths.py --m 1,8,32 --shapes 576x1536,1536x576,576x49152 --backend cpu
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quant import nbytes, quantize
from jaxserve.quant.linear import matmul, path_for

FORMATS = ("bf16", "int8", "fp8_e4m3", "fp8:block128", "int4:g32")


def timed(fn, *args) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t


def one_shape(k: int, n: int, m: int, formats, backend: str, reps: int, budget: int = 120 << 20) -> list[dict]:
    layers = max(1, min(32, budget // (4 * k * n)))  # ~120 MB of float32 weights per call
    rng = np.random.default_rng(k * n + m)
    ws = [(0.02 * rng.standard_normal((k, n))).astype(np.float32) for _ in range(layers)]
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    cases = {"float32": ([jnp.asarray(w) for w in ws], lambda a, w: jnp.dot(a, w), 4 * k * n)}
    for f in formats:
        qws = [jax.device_put(quantize(w, f)) for w in ws]
        cases[f] = (qws, functools.partial(matmul, backend=backend), nbytes(qws[0]))
    fns = {}
    for name, (weights, op, _) in cases.items():
        fns[name] = jax.jit(lambda a, wl, op=op: sum(op(a, w) for w in wl))
        timed(fns[name], x, weights)  # compile
    times = {name: [] for name in cases}
    names = list(cases)
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timed(fns[name], x, cases[name][0]))
    base = min(times["float32"])
    rows = []
    for name, (_, _, size) in cases.items():
        best = min(times[name]) / layers
        rows.append({"k": k, "n": n, "m": m, "format": name, "layers": layers, "us_per_matrix": best * 1e6,
                     "gb_s": size / best / 1e9, "vs_float32": base / min(times[name]),
                     "path": "xla:dot" if name == "float32" else path_for(name, backend).name})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="576x1536,1536x576,576x49152", help="KxN weights (SmolLM2: MLP, down, head)")
    ap.add_argument("--m", default="1,8,32,128", help="activation rows (the batch bucket)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--backend", default="cpu", choices=["cpu", "gpu", "interpret"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, paths: {args.backend}")
    print(f"{'shape':>10} {'M':>4} {'format':>13} {'path':>22} {'us/matrix':>10} {'GB/s':>6} {'vs f32':>7}")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for m in (int(v) for v in args.m.split(",")):
            for r in one_shape(k, n, m, args.formats.split(","), args.backend, args.reps):
                rows.append(r)
                print(f"{shape:>10} {m:>4} {r['format']:>13} {r['path']:>22} {r['us_per_matrix']:10.1f} "
                      f"{r['gb_s']:6.1f} {r['vs_float32']:7.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "backend": args.backend, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
