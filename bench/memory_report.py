"""What the engine allocates per configuration: weight bytes per phase (and resident, shared
arrays once) and the KV pool, from ``LLM.memory_report()`` (the figures GetModelInfo reports).

    .venv/bin/python bench/memory_report.py                                  # SmolLM2 + tiny MoE
    .venv/bin/python bench/memory_report.py --model checkpoints/tiny-kimi-k2 --kv-cache-memory 1MiB
"""
from __future__ import annotations

import argparse

CONFIGS = {
    "as loaded": {},
    "cpu preset": {"preset": "cpu"},
    "article preset": {"preset": "article"},
    "article, one copy": {"kv_format": "fp8_e4m3", "decode_weights": "int4:g32", "prefill_from_decode_weights": True},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None,
                    help="checkpoint dirs (default: the embedded SmolLM2 and checkpoints/tiny-kimi-k2)")
    ap.add_argument("--kv-cache-memory", default="64MiB")
    args = ap.parse_args(argv)
    from jaxserve import LLM

    models = args.model or [None, "checkpoints/tiny-kimi-k2"]
    print(f"KV budget {args.kv_cache_memory} per configuration")
    print(f"{'model':>24} {'config':>18} {'prefill MB':>11} {'decode MB':>10} {'resident MB':>12} "
          f"{'KV fmt':>9} {'KV pages':>9} {'B/token':>8} {'tokens':>9}")
    for model in models:
        for name, kw in CONFIGS.items():
            llm = LLM(model, kv_cache_memory=args.kv_cache_memory, page_size=16, max_num_seqs=4, **kw)
            r = llm.memory_report()
            w = r["weight_bytes"]
            print(f"{(model or 'SmolLM2-135M (embedded)'):>24} {name:>18} {w['prefill'] / 1e6:11.2f} "
                  f"{w['decode'] / 1e6:10.2f} {w['resident'] / 1e6:12.2f} {r['kv_format']:>9} {r['kv_pages']:9d} "
                  f"{r['kv_bytes_per_token']:8d} {r['max_cached_tokens']:9d}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
