"""Compile time of the serving prefill and decode programs for a checkpoint (no persistent cache).

    .venv/bin/python bench/compile_time.py --model checkpoints/tiny-kimi-k2 [--num-devices 8]

Each program is the runner's checked serving program for one bucket (``ModelRunner.lower``):
batch rows x new tokens, with the page table as wide as ``--max-model-len`` needs (16-token
pages: 128 tokens = 8 pages per row).
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
    ap.add_argument("--max-model-len", type=int, default=128, help="sets the page-table width (16-token pages)")
    ap.add_argument("--num-devices", type=int, default=1)
    args = ap.parse_args()

    import jax

    from jaxserve import LLM

    llm = LLM(args.model, kv_format=args.kv_format, num_devices=args.num_devices, num_pages=128, page_size=16,
              max_model_len=args.max_model_len)
    r = llm.runner
    for phase, t in (("prefill", args.prefill_tokens), ("decode", 1)):
        t0 = time.perf_counter()
        lowered = r.lower(phase, args.batch, t)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        print(f"{phase:8s} B={args.batch} T={t:3d} M={r.max_pages_per_seq}: trace+lower {t1 - t0:.2f}s, "
              f"compile {t2 - t1:.2f}s (jax {jax.__version__}, {args.num_devices} device(s))")


if __name__ == "__main__":
    main()
