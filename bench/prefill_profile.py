"""Where a prefill step's time goes: float32 against a prefill weight format, same process order.

For each --prefill-weights spec (``none`` = as loaded, float32), an LLM over the embedded default
model runs C prompts of T random tokens (or, with --min-tokens, lengths drawn from [min, T]: the
step pads them to one length bucket) to their first token (one prefill step, then sampling),
--reps times after two warm-ups; the best time gives prefill tok/s. One more run goes under the
JAX profiler and its XLA ops are grouped by the optimized HLO that XLA dumps at compile time,
with ``jaxserve.bench.decode_profile``'s classifier (matmul / attention softmax and norms / KV
gather / KV write / other); the "other" ops are listed by fusion kind, largest first.

    JAX_PLATFORMS=cpu .venv/bin/python bench/prefill_profile.py --prefill-weights none,bf16 --prompts 8

Op times are CPU time summed over XLA's worker threads.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile
import time

_DUMP = tempfile.mkdtemp(prefix="jaxserve_hlo_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP} --xla_dump_hlo_as_text"
                           " --xla_dump_hlo_module_re=.*jit_step.*").strip()

import jax  # noqa: E402  (after XLA_FLAGS)

from jaxserve import LLM  # noqa: E402
from jaxserve.bench import decode_profile as dp  # noqa: E402
from jaxserve.bench.workload import make_workload  # noqa: E402
from jaxserve.engine.sampling_params import SamplingParams  # noqa: E402


def profile(spec: str, prompts: int, tokens: int, reps: int, min_tokens: int | None = None) -> None:
    kw = {} if spec == "none" else dict(prefill_weights=spec)
    llm = LLM(None, num_pages=prompts * (-(-tokens // 16) + 2) + 4, max_num_seqs=prompts, max_prefill_seqs=prompts,
              prefill_chunk=tokens, max_num_batched_tokens=prompts * tokens, enable_prefix_caching=False, **kw)
    engine = llm.engine
    work = make_workload(prompts, (min_tokens or tokens, tokens), (1, 1), llm.cfg.vocab_size, seed=1)
    real = sum(len(r.prompt_ids) for r in work)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)

    def once() -> float:
        for r in work:
            engine.add_request(r.prompt_ids, sp)
        t = time.perf_counter()
        engine.run_until_done()
        return time.perf_counter() - t

    for _ in range(2):
        once()
    best = min(once() for _ in range(reps))
    trace = tempfile.mkdtemp(prefix="jaxserve_trace_")
    jax.profiler.start_trace(trace)
    once()
    jax.profiler.stop_trace()
    ops = dp.load_trace_ops(trace)
    cats: dict[str, str] = {}
    for f in glob.glob(os.path.join(_DUMP, "*jit_step*after_optimizations.txt")):
        cats.update(dp.parse_hlo_ops(open(f).read()))
    by_cat: dict[str, float] = collections.defaultdict(float)
    other: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for op, us in ops.items():
        cat = cats.get(op, dp.classify(op, ""))
        by_cat[cat] += us
        if cat.startswith("other"):
            kind = op.rstrip("0123456789.")
            other[kind][0] += us
            other[kind][1] += 1
    total = sum(by_cat.values()) or 1.0
    print(f"prefill weights {spec}: {prompts} prompts, {real} tokens (up to {tokens} each), best {best * 1e3:.0f} ms "
          f"({real / best:.1f} tok/s); step program {total / 1e3:.0f} ms CPU")
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:36s} {us / total:6.1%} {us / 1e3:8.1f} ms")
    for kind, (us, n) in sorted(other.items(), key=lambda kv: -kv[1][0])[:10]:
        print(f"    other: {kind:30s} x{n:<4d} {us / 1e3:8.1f} ms")
    print(flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill-weights", default="none,bf16", help="comma-separated specs; none = as loaded")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--min-tokens", type=int, help="prompt lengths drawn from [MIN_TOKENS, TOKENS]")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # compile afresh so XLA dumps the HLO
    for spec in args.prefill_weights.split(","):
        profile(spec.strip(), args.prompts, args.tokens, args.reps, args.min_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
