"""The compute ceiling of the vs-transformers comparison on this machine.

A workload of R requests (prompt p_i, output o_i tokens) on a dense model with N matmul
parameters per layer stack (plus the LM head, applied once per generated token) needs at least
2 * (sum p_i * N_body + sum o_i * (N_body + N_head)) FLOPs of matmul work, however it is
batched. This script measures the machine's best dense float32 GEMM rate (jax/XLA and torch,
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
                                   params=dict(body=n_body, head=n_head), gemm_gflops=peak, peak_gflops=best,
                                   rows=rows, machine=machine_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
