"""What batch-invariant mode costs: the same workload through a default engine and a
``batch_invariant=True`` engine on the same model, interleaved, plus the check that the mode
delivers (one prompt's log-probs alone vs inside a batch, bitwise).

Each repetition runs ``--requests`` greedy requests (random token prompts, ``--output`` tokens,
EOS ignored) through each engine in turn; reported are the medians of wall time and output
tokens/s and their ratio (same run, so the ratio holds on a shared machine where the absolute
figures do not).

    MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python bench/batch_invariant.py --json bench/results/batch_invariant.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the default SmolLM2 model)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-format", default="bf16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxserve import LLM
    from jaxserve.engine.sampling_params import SamplingParams

    kw = dict(kv_format=args.kv_format, max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_len + args.output + 16,
              num_pages=(args.requests + 2) * -(-(args.prompt_len + args.output + 16) // 16) + 1, page_size=16,
              enable_prefix_caching=False)
    engines = {mode: LLM(args.model, batch_invariant=(mode == "batch_invariant"), **kw)
               for mode in ("default", "batch_invariant")}
    rng = np.random.default_rng(0)
    vocab = engines["default"].engine.cfg.vocab_size
    prompts = [[int(x) for x in rng.integers(10, vocab - 10, args.prompt_len)] for _ in range(args.requests)]
    sp = SamplingParams(max_tokens=args.output, ignore_eos=True, logprobs=0)
    for llm in engines.values():
        llm.warmup()
        llm.generate(prompts, sp)  # visit every decode batch size once
    times = {m: [] for m in engines}
    for _ in range(args.reps):
        for mode, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            times[mode].append(time.perf_counter() - t0)
    out = {"model": engines["default"].model_path, "requests": args.requests, "prompt_len": args.prompt_len,
           "output": args.output, "kv_format": args.kv_format}
    for mode, ts in times.items():
        wall = statistics.median(ts)
        out[mode] = {"wall_s": round(wall, 3), "output_tok_s": round(args.requests * args.output / wall, 1)}
        print(f"{mode:16s} wall {wall:7.2f} s   {args.requests * args.output / wall:8.1f} output tok/s")
    out["slowdown"] = round(out["batch_invariant"]["wall_s"] / out["default"]["wall_s"], 2)
    print(f"batch-invariant / default wall time: {out['slowdown']:.2f}x")
    for mode, llm in engines.items():  # one prompt alone vs among the others
        alone = np.array([lp for lp, _ in llm.generate([prompts[0]], sp)[0].logprobs])
        batched = np.array([lp for lp, _ in llm.generate(prompts, sp)[0].logprobs])
        diff = float(np.max(np.abs(alone - batched)))
        out[mode]["logprob_diff_alone_vs_batch"] = diff
        print(f"{mode:16s} max |log-prob alone - in a batch of {args.requests}|: {diff:.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
