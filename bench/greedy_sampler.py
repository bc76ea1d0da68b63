"""The sampler's all-greedy batch: the native kernel (jaxserve.native.greedy_rows, what
sample_rows runs on CPU) against XLA's formulation of the same results (first_argmax of the
masked rows, token_logprob of the raw rows), side by side in one process, fresh logits per call.

    .venv/bin/python bench/greedy_sampler.py --vocab 49152 --rows 1,8,16,64
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native
from jaxserve.engine.sampler import first_argmax, mask_words, token_logprob, unpack_mask


@jax.jit
def xla_greedy(logits, rows, mask):
    x = logits[rows]
    tok = first_argmax(jnp.where(unpack_mask(mask, x.shape[-1]), x, -jnp.inf))
    return tok, token_logprob(x, tok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", default="1,8,16,64")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    print(native.status().reason)
    rng = np.random.default_rng(0)
    paths = {"xla": xla_greedy, "native": jax.jit(native.greedy_rows)}
    for b in map(int, args.rows.split(",")):
        logits = [jnp.asarray(rng.standard_normal((b, args.vocab)).astype(np.float32)) for _ in range(4)]
        rows, mask = jnp.arange(b, dtype=jnp.int32), jnp.full((b, mask_words(args.vocab)), -1, jnp.int32)
        times = {k: [] for k in paths}
        for f in paths.values():
            jax.block_until_ready(f(logits[0], rows, mask))
        for i in range(args.reps):
            for k, f in paths.items():  # interleaved
                t = time.perf_counter()
                jax.block_until_ready(f(logits[i % 4], rows, mask))
                times[k].append(time.perf_counter() - t)
        xm, nm = (np.median(times[k]) * 1e3 for k in ("xla", "native"))
        print(f"rows {b:3d}: xla {xm:.3f} ms, native {nm:.3f} ms ({xm / nm:.1f}x)")


if __name__ == "__main__":
    main()
