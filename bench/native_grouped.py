"""jaxserve's native grouped-by-expert kernels (the ragged MoE matmul) vs XLA's ragged paths.

One MoE projection: --experts stacked weights [K, N], --rows routed rows (a decode step of B
tokens with top-k experts routes B * k rows), the rows spread over the experts as a router
would spread them (each of the rows / top-k tokens picks top-k distinct experts at random),
sorted by expert. Per format: the native grouped kernel (experts without rows are not read)
and the XLA ragged formulation the native path replaces, interleaved, best of --reps, in one
process. Reported: ms per call and its ratio to XLA's. "float32" / "bfloat16" are experts kept as
loaded (no format): the registry's plain path, native grouped kernel against ``lax.ragged_dot``.

    .venv/bin/python bench/native_grouped.py --experts 64 --k 1024 --n 512 --rows 8,32,128,512
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native
from jaxserve.quant import quantize
from jaxserve.quant.native_paths import GROUPED
from jaxserve.quant.paths import PATHS, XLA_PATHS, family_of
from native_kernels import best  # bench/, the running script's folder


def routed_sizes(rows: int, experts: int, top_k: int, rng) -> np.ndarray:
    tokens = max(1, rows // top_k)
    picks = np.concatenate([rng.choice(experts, size=min(top_k, experts), replace=False) for _ in range(tokens)])
    return np.bincount(picks[:rows], minlength=experts).astype(np.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--rows", default="8,32,128,512")
    ap.add_argument("--formats", default="int4:g32,int8,bf16,fp8_e4m3")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    assert native.available(), native.status().reason
    rng = np.random.default_rng(0)
    w = (0.02 * rng.standard_normal((args.experts, args.k, args.n))).astype(np.float32)
    print(f"{args.experts} experts of {args.k} x {args.n}, top-{args.top_k}; isa {native.status().isa}")
    for f in args.formats.split(","):
        if f in ("float32", "bfloat16"):  # kept as loaded
            qw = jax.device_put(jnp.asarray(w, f))
            cases = {"native": jax.jit(PATHS[("dense", "cpu")].ragged),
                     "xla": jax.jit(XLA_PATHS[("dense", "cpu")].ragged)}
        else:
            qw = jax.device_put(quantize(w, f))
            fam = family_of(f)
            cases = {"native": jax.jit(GROUPED[fam]), "xla": jax.jit(XLA_PATHS[(fam, "cpu")].ragged)}
        for m in [int(v) for v in args.rows.split(",")]:
            sizes = jnp.asarray(routed_sizes(m, args.experts, args.top_k, rng))
            x = jnp.asarray(rng.standard_normal((m, args.k)), jnp.float32)
            times = {name: [] for name in cases}
            for r in range(args.reps):
                for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
                    times[name].append(best(cases[name], (x, qw, sizes), 1))
            nat, xla = min(times["native"]), min(times["xla"])
            used = int((np.asarray(sizes) > 0).sum())
            print(f"{f:9s} rows {m:4d} ({used:3d} experts used): native {1e3 * nat:8.2f} ms  xla {1e3 * xla:8.2f} ms  "
                  f"native/xla speed {xla / nat:5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
