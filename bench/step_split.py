"""Where a batch of requests spends its time, program by program: bench/peers.py's jaxserve
workload (the embedded default model, prompts of 32-96 random token ids from peers' seed,
--output-len new tokens each, greedy, EOS ignored, N requests at once, peers' engine settings)
run once untimed and once timed, with a step observer (``LLMEngine.add_step_observer``)
recording every program call: its phase and padded bucket (rows x tokens), calls, wall seconds
with the results on the host, and real against padded tokens.

    .venv/bin/python bench/step_split.py --requests 64 \\
        --config prefill=bf16,decode=int8,kv=bf16,tied_head_weights=bf16
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from peers import JaxServe  # bench/peers.py: the same engine settings

from jaxserve.bench.workload import make_workload
from jaxserve.checkpoint.gguf import default_model_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    ap.add_argument("--config", default="prefill=bf16,decode=int8,kv=bf16,tied_head_weights=bf16",
                    help="a --jaxserve-config of bench/peers.py")
    ap.add_argument("--seed", type=int, default=0, help="as peers' --seed")
    args = ap.parse_args(argv)
    model_dir = str(default_model_dir())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    n = args.requests
    engine = JaxServe(model_dir, args.config, n, args.prompt_len[1] + args.output_len)
    prompts = [r.prompt_ids for r in make_workload(n, tuple(args.prompt_len), (args.output_len, args.output_len),
                                                   vocab, seed=args.seed + n)]
    engine.run(prompts, args.output_len)  # untimed: as peers' warm-up call
    calls = collections.defaultdict(lambda: [0, 0.0, 0])  # (phase, rows, tokens) -> calls, seconds, real tokens

    def seen(rec):
        c = calls[(rec.phase, rec.batch, rec.tokens)]
        c[0], c[1], c[2] = c[0] + 1, c[1] + rec.seconds, c[2] + rec.new_tokens

    remove = engine.llm.engine.add_step_observer(seen)
    t0 = time.perf_counter()
    engine.run(prompts, args.output_len)
    total = time.perf_counter() - t0
    remove()
    in_calls = sum(c[1] for c in calls.values())
    print(f"{n} requests x {args.output_len} tokens: {total:.2f} s, {n * args.output_len / total:.1f} tok/s; "
          f"program calls {in_calls:.2f} s ({in_calls / total:.0%}), the rest host work between them")
    print("| phase | bucket (rows x tokens) | calls | seconds | share | ms a call | real / padded tokens |")
    print("|---|---|---|---|---|---|---|")
    for (phase, b, t), (k, s, real) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
        print(f"| {phase} | {b} x {t} | {k} | {s:.2f} | {s / total:.0%} | {s / k * 1e3:.1f} | "
              f"{real} / {k * b * t} ({real / (k * b * t):.0%}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
