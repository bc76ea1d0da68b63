"""Compile time of the prefill and decode programs for a checkpoint (no persistent cache).

    .venv/bin/python bench/compile_time.py --model checkpoints/tiny-kimi-k2
"""
import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/tiny-kimi-k2")
    ap.add_argument("--kv-format", default="bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prefill-tokens", type=int, default=64)
    ap.add_argument("--pages-per-row", type=int, default=8)
    ap.add_argument("--num-devices", type=int, default=1)
    args = ap.parse_args()

    import jax
    import numpy as np

    from jaxserve import LLM
    from jaxserve.models.step import StepInput

    llm = LLM(args.model, kv_format=args.kv_format, num_devices=args.num_devices, num_pages=128)
    r = llm.runner
    b, m = args.batch, args.pages_per_row
    for name, t in (("prefill", args.prefill_tokens), ("decode", 1)):
        inp = StepInput(
            tokens=np.zeros((b, t), np.int32), cached_lens=np.zeros(b, np.int32),
            new_lens=np.full(b, t, np.int32), page_table=np.zeros((b, m), np.int32),
        )
        t0 = time.perf_counter()
        lowered = r._fn(False).lower(r.params, r.kv, inp)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        print(f"{name:8s} B={b} T={t:3d} M={m}: trace+lower {t1 - t0:.2f}s, compile {t2 - t1:.2f}s "
              f"(jax {jax.__version__}, {args.num_devices} device(s))")


if __name__ == "__main__":
    main()
