"""The compute ceiling of the vs-transformers comparison on this machine.

A workload of R requests (prompt p_i, output o_i tokens) on a dense model with N matmul
parameters per layer stack (plus the LM head, applied once per generated token) needs at least
2 * (sum p_i * N_body + sum o_i * (N_body + N_head)) FLOPs of matmul work, however it is
batched. This script measures (and, for the batch-1 bandwidth goal, the rate at which XLA reads
weights in matrix-vector products: large matrices, and the model's own matvec skeleton) the machine's best dense float32 GEMM rate (jax/XLA and torch,
large square-ish products, both cores), and from a vs_transformers results file derives:
transformers' achieved useful GFLOP/s, the fraction of the GEMM peak that is, and the largest
jaxserve / transformers ratio the peak allows (peak / transformers' useful rate).

    .venv/bin/python bench/roofline.py --results bench/results/vs_transformers_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def gemm_peak(sizes=((1024, 2048, 2048), (2048, 2048, 2048), (4096, 576, 1536)), reps=5) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    out = {}
    for m, k, n in sizes:
        a = np.random.rand(m, k).astype(np.float32)
        b = np.random.rand(k, n).astype(np.float32)
        f = jax.jit(lambda x, y: x @ y)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        f(ja, jb).block_until_ready()
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ta @ tb
        for name, run in (("jax", lambda: f(ja, jb).block_until_ready()), ("torch", lambda: ta @ tb)):
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t)
            out[f"{name} {m}x{k}x{n}"] = 2 * m * k * n / min(ts) / 1e9
    return out


def matvec_rates(cfg, reps: int = 20) -> dict:
    """Batch-1 weight reading rates (GB/s) with jax/XLA: 16 large [576, 3072] float32 matrices,
    and the skeleton of the model's decode step (each layer's q, k, v, o, gate, up, down matvecs
    and the tied LM head, nothing else), the most a batch-1 decode through XLA:CPU could read."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    r = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)

    def rate(f, args, nbytes):
        f(*args).block_until_ready()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f(*args).block_until_ready()
            ts.append(time.perf_counter() - t)
        return nbytes / float(np.median(ts)) / 1e9, float(np.median(ts))

    big = [r(576, 3072) for _ in range(16)]
    x = r(1, 576)
    big_gbs, _ = rate(jax.jit(lambda x, ws: sum((x @ w).sum() for w in ws)), (x, big), 16 * 576 * 3072 * 4)
    d, i, h, k, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.attn_head_dim)
    layers = [dict(q=r(d, h * hd), k=r(d, k * hd), v=r(d, k * hd), o=r(h * hd, d), g=r(d, i), u=r(d, i), dn=r(i, d))
              for _ in range(cfg.num_hidden_layers)]
    head = r(cfg.vocab_size, d)

    def skeleton(x, layers, head):
        for p in layers:
            a = (x @ p["q"]) + (x @ p["k"]).sum() + (x @ p["v"]).sum()
            x = x + a @ p["o"]
            x = x + (jax.nn.silu(x @ p["g"]) * (x @ p["u"])) @ p["dn"]
        return x @ head.T

    nbytes = sum(int(a.size) * 4 for p in layers for a in p.values()) + int(head.size) * 4
    sk_gbs, sk_s = rate(jax.jit(skeleton), (x, layers, head), nbytes)
    return dict(large_matvec_gb_s=big_gbs, skeleton_gb_s=sk_gbs, skeleton_step_s=sk_s, skeleton_bytes=nbytes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="bench/results/vs_transformers_smollm2.json")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from jaxserve.bench.measure import machine_info, write_json
    from jaxserve.checkpoint.gguf import default_model_dir
    from jaxserve.loader import load_config

    res = json.load(open(args.results))
    cfg = load_config(res.get("model") or str(default_model_dir()))
    d, i, h, k, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.attn_head_dim)
    n_body = cfg.num_hidden_layers * (d * h * hd * 2 + d * k * hd * 2 + 3 * d * i)
    n_head = d * cfg.vocab_size
    peak = gemm_peak()
    best = max(peak.values())
    print("GEMM float32 GFLOP/s: " + ", ".join(f"{name} {v:.0f}" for name, v in peak.items()) + f" -> peak {best:.0f}")
    mv = matvec_rates(cfg)
    print(f"batch-1 reading rates (jax): large matvecs {mv['large_matvec_gb_s']:.1f} GB/s; the decode step's matvec "
          f"skeleton {mv['skeleton_step_s'] * 1e3:.1f} ms = {mv['skeleton_gb_s']:.1f} GB/s")
    rows = []
    for r in res["results"]:
        prompt, out = r["prompt_tokens_per_call"], r["output_tokens_per_call"]
        useful_gflop = 2 * (prompt * n_body + out * (n_body + n_head)) / 1e9
        hf = r["tok_s_median"][r["transformers_best"]]
        call_s = out / hf
        hf_gflops = useful_gflop / call_s
        js = r["tok_s_median"]["jaxserve"]
        row = dict(batch=r["batch"], useful_gflop_per_call=useful_gflop, transformers_useful_gflops=hf_gflops,
                   transformers_fraction_of_peak=hf_gflops / best, max_ratio_at_peak=best / hf_gflops,
                   jaxserve_useful_gflops=useful_gflop / (out / js), measured_ratio=js / hf)
        rows.append(row)
        print(f"batch {r['batch']:3d}: useful work {useful_gflop:.0f} GFLOP/call; transformers {hf_gflops:.0f} GFLOP/s "
              f"({row['transformers_fraction_of_peak']:.0%} of peak), jaxserve {row['jaxserve_useful_gflops']:.0f} "
              f"GFLOP/s; measured ratio {row['measured_ratio']:.2f}x, ceiling at 100% of peak "
              f"{row['max_ratio_at_peak']:.1f}x")
    if args.json:
        write_json(args.json, dict(benchmark="roofline", command=" ".join(["python"] + sys.argv), results_file=args.results,
                                   params=dict(body=n_body, head=n_head), gemm_gflops=peak, peak_gflops=best, matvec=mv,
                                   rows=rows, machine=machine_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
