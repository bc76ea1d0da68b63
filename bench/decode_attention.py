"""The decode step's attention alone: SmolLM2-135M's shapes (30 layers, 3 KV heads x 3 queries,
head dim 64, bf16 pages of 16 tokens) in one jitted call, one query a row, for several contexts
and page-table widths; the median of --reps calls per path, the paths interleaved in one process:
``xla64`` / ``xla256`` / ``xla512`` the XLA path reading pages in blocks of that many tokens (64
is the block every program reads), ``native`` the native backend's kernel
(``jaxserve.native.gqa_paged``), ``baseline`` the same kernel from another build of the library
(``--baseline LIB.so``, e.g. a copy of ``jaxserve/native/_kernels*.so`` saved before a change).
A case is rows x queries a row (1: decode; k + 1: a speculative verify) over a context.

    python bench/decode_attention.py [--reps 10] [--paths xla64,native] [--baseline LIB.so --paths baseline,native]
"""
import ctypes
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native
from jaxserve.kv import paged
from jaxserve.kv.formats import get_kv_format
from jaxserve.models import attention

KVH, G, D, S, LAYERS = 3, 3, 64, 16, 30
CASES = [(1, 1, 145, 16), (1, 1, 145, 512), (1, 1, 600, 512), (1, 1, 2000, 512), (8, 1, 145, 512), (8, 1, 600, 512),
         (64, 1, 160, 16), (1, 9, 145, 16), (8, 9, 145, 16)]  # rows, queries a row, context, width


def register_baseline(lib_path: str) -> None:
    """The gqa kernel of the library at lib_path as "baseline_jaxserve_gqa_paged"."""
    lib = ctypes.CDLL(lib_path)
    jax.ffi.register_ffi_target("baseline_jaxserve_gqa_paged", jax.ffi.pycapsule(lib.jaxserve_gqa_paged),
                                platform="cpu")


def baseline_gqa(q, k_pool, v_pool, table, cached, new, scale):
    none = jnp.zeros((0,), jnp.float32)
    return jax.ffi.ffi_call("baseline_jaxserve_gqa_paged", jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k_pool, v_pool, none, none, table, cached, new, scale=np.float32(scale))


def timed(rows: int, queries: int, context: int, width: int, path: str, reps: int) -> float:
    fmt = get_kv_format("bf16")
    rng = np.random.default_rng(0)
    pools = {}
    for name in ("k", "v"):
        pools.update(paged.new_pool(fmt, (KVH, rows * width + 1, S, D), name))
    # keys and values as a model's are, normal floats (bf16 bits drawn at random hold subnormals,
    # which cost the float units far more than real K/V does)
    bits = lambda shape: jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16), jnp.uint16)
    pools = {k: bits(v.shape).astype(v.dtype) for k, v in pools.items()}
    table = jnp.asarray(1 + np.arange(rows * width, dtype=np.int32).reshape(rows, width))
    cached, new = jnp.full((rows,), context - queries, jnp.int32), jnp.full((rows,), queries, jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, queries, KVH * G, D)), jnp.float32)

    @jax.jit
    def layers(q, pools, table, cached, new):
        for _ in range(LAYERS):  # each layer's output is the next one's query: nothing is hoisted
            if path == "native":
                q = native.gqa_paged(q, pools["k"], pools["v"], None, None, table, cached, new, 0.125)
            elif path == "baseline":
                q = baseline_gqa(q, pools["k"], pools["v"], table, cached, new, 0.125)
            else:
                q = attention.gqa_attention_paged(q, pools, fmt, table, cached, new, 0.125, S,
                                                  chunk_tokens=int(path[3:]))
        return q

    args = (q, pools, table, cached, new)
    jax.block_until_ready(layers(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(layers(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--paths", default="xla64,native", help="comma-separated: xla64, xla256, xla512, native, baseline")
    ap.add_argument("--baseline", default=None, help="another build of the kernels (.so): the 'baseline' path")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if args.baseline:
        register_baseline(args.baseline)
    print(f"| rows | queries a row | context | table width (pages) | {' | '.join(paths)} | {paths[0]} / {paths[-1]} |")
    print("|---|---|---|---|" + "---|" * (len(paths) + 1))
    for rows, queries, context, width in CASES:
        ms = {p: [] for p in paths}
        for _ in range(2):  # interleaved twice, the better median kept
            for p in ms:
                ms[p].append(timed(rows, queries, context, width, p, args.reps) * 1e3)
        cells = " | ".join(f"{min(v):.2f} ms" for v in ms.values())
        ratio = min(ms[paths[0]]) / min(ms[paths[-1]])
        print(f"| {rows} | {queries} | {context} | {width} | {cells} | {ratio:.1f}x |", flush=True)

if __name__ == "__main__":
    main()
