"""Sampling cost per step: the candidate fast path vs the full vocabulary sort, side by side.

Both are the same jitted ``sample_rows`` (``num_candidates=V`` is exactly the full-sort
path); rows use typical chat settings (temperature 0.7, top-p 0.9 with top-k 50 or without, or
temperature alone)
on logits with a realistic spread. Interleaved repetitions, medians; after warm-up.

    .venv/bin/python bench/sampler.py --vocab 49152 --batches 1,8,32 --json bench/results/sampler.json
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import jax

    from jaxserve.bench.measure import machine_info, median, write_json
    from jaxserve.engine.sampler import NUM_CANDIDATES, sample_rows

    v = args.vocab
    rng = np.random.default_rng(0)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        # Logits shaped like a trained LM's: a few strong tokens over a long Gumbel-like tail.
        logits = (rng.gumbel(size=(b, v)) * 2.0).astype(np.float32)
        for setting, top_k, top_p in (("top_p 0.9", 0, 0.9), ("top_k 50 + top_p 0.9", 50, 0.9),
                                      ("temperature only", 0, 1.0)):
            args_ = (logits, np.arange(b, dtype=np.int32), np.full(b, 0.7, np.float32), np.full(b, top_k, np.int32),
                     np.full(b, top_p, np.float32), np.zeros(b, np.float32), np.arange(b, dtype=np.int32),
                     np.zeros(b, np.int32))
            fns = {
                "candidates": lambda: sample_rows(*args_, all_greedy=False, penalties=False, num_logprobs=0),
                "full_sort": lambda: sample_rows(*args_, all_greedy=False, penalties=False, num_logprobs=0,
                                                 num_candidates=v),
            }
            outs = {k: np.asarray(f()[0]) for k, f in fns.items()}  # warm-up (compile)
            times = {k: [] for k in fns}
            for rep in range(args.reps):
                for k in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
                    t = time.perf_counter()
                    jax.block_until_ready(fns[k]())
                    times[k].append(time.perf_counter() - t)
            med = {k: median(x) * 1e3 for k, x in times.items()}
            row = dict(batch=b, setting=setting, ms=med, speedup=med["full_sort"] / med["candidates"],
                       same_tokens=bool((outs["candidates"] == outs["full_sort"]).all()))
            rows.append(row)
            print(f"batch {b:3d} {setting:22s}: candidates {med['candidates']:7.2f} ms | full sort "
                  f"{med['full_sort']:7.2f} ms | {row['speedup']:.1f}x | same tokens {row['same_tokens']}", flush=True)
    if args.json:
        write_json(args.json, dict(benchmark="sampler", command=" ".join(["python"] + sys.argv), vocab=v,
                                   num_candidates=NUM_CANDIDATES, results=rows, machine=machine_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
