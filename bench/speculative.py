"""Speculative decoding (issue 31): decode tokens/s with n-gram speculation vs without, side by
side in one run on one engine (its speculative decoder set aside for the "off" runs, so both
use the same compiled prefill and decode programs), at 1 and 8 requests, for a workload that
repeats its input (rewrite / code-edit prompts) and for random prompts; greedy.

Decode tok/s = generated tokens after each batch's first token / the wall time after it
(``LLM.stats``). Off and on alternate, ``--rounds`` times each; the ratio is of the medians. The
engine is warmed up first (as ``jaxserve serve`` does), so no timed run compiles a program: the
buckets a run meets depend on the gate's choices, which an untimed run of the same shape need
not repeat.

    .venv/bin/python bench/speculative.py --out bench/results/speculative.json
    .venv/bin/python bench/speculative.py --decode-weights int4:g32 --out bench/results/speculative_int4.json

--decode-weights / --prefill-weights / --tied-head-weights / --kv-format: the engine's formats
(default: as loaded, bf16 KV): on this CPU a verify call (k + 1 rows per request) costs what a
decode step costs only where the decode matrices run a kernel that reads each weight once for
up to 8 rows (the native kernels of the narrow formats).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

CODE = [
    "def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n\n"
    "def mean(xs):\n    return total(xs) / len(xs)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n    else:\n        print(i, 'odd')\n",
    "import os\n\ndef list_files(path):\n    out = []\n    for name in os.listdir(path):\n"
    "        if name.endswith('.py'):\n            out.append(name)\n    return out\n",
]
ASKS = ["Rewrite this code with type hints, keeping everything else the same:\n\n",
        "Repeat this code exactly, adding a docstring to each function:\n\n",
        "Rename the variable names to longer ones in this code and show the whole code:\n\n",
        "Copy this code and add a comment above every line:\n\n"]


def prompts(llm, kind: str, n: int, rng) -> list:
    if kind == "repeat":
        return [llm.apply_chat_template(ASKS[i % len(ASKS)] + CODE[i % len(CODE)]) for i in range(n)]
    return [[int(x) for x in rng.integers(100, llm.engine.cfg.vocab_size, size=64)] for _ in range(n)]


def timed(llm, batch, sp) -> tuple[float, int]:
    llm.reset_prefix_cache()
    outs = llm.generate(batch, sp)
    st = llm.stats
    return st.decode_tokens / st.decode_seconds, sum(len(o) for o in outs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/speculative.json")
    ap.add_argument("--decode-weights", default=None)
    ap.add_argument("--prefill-weights", default=None)
    ap.add_argument("--tied-head-weights", default=None)
    ap.add_argument("--kv-format", default="bf16")
    args = ap.parse_args()
    from jaxserve import LLM
    from jaxserve.engine.sampling_params import SamplingParams

    formats = dict(decode_weights=args.decode_weights, prefill_weights=args.prefill_weights,
                   tied_head_weights=args.tied_head_weights, kv_format=args.kv_format)
    llm = LLM(max_num_seqs=8, num_pages=512, speculative="ngram", num_speculative_tokens=args.k, **formats)
    llm.warmup()  # every bucket built before timing: which ones a run meets depends on the gate's choices
    spec = llm.engine.spec
    calls = {"decode": 0, "verify": 0}  # program calls during the timed "on" runs: what the gate chose

    def count(rec):
        if rec.phase in calls and llm.engine.spec is not None:
            calls[rec.phase] += 1

    llm.engine.add_step_observer(count)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []
    for kind in ("repeat", "random"):
        for n in (1, 8):
            batch = prompts(llm, kind, n, rng)
            res = {"off": [], "on": []}
            for mode in ("off", "on"):  # untimed: every program this shape needs is built
                llm.engine.spec = None if mode == "off" else spec
                llm.generate(batch, sp)
            d0, a0, s0 = spec.drafted, spec.accepted, spec.verify_steps
            calls.update(decode=0, verify=0)
            for _ in range(args.rounds):
                for mode in ("off", "on"):
                    llm.engine.spec = None if mode == "off" else spec
                    res[mode].append(timed(llm, batch, sp)[0])
            drafted, accepted, steps = spec.drafted - d0, spec.accepted - a0, spec.verify_steps - s0
            off, on = statistics.median(res["off"]), statistics.median(res["on"])
            row = dict(workload=kind, requests=n, off_tok_s=round(off, 2), on_tok_s=round(on, 2),
                       ratio=round(on / off, 3), acceptance=round(accepted / drafted, 3) if drafted else None,
                       mean_accepted_length=round(1 + accepted / steps, 2) if steps else None,
                       draft_tokens=drafted, verify_cost_in_decode_steps=round(spec.cost_ratio(n), 2),
                       on_calls=dict(calls), off_runs=[round(x, 2) for x in res["off"]],
                       on_runs=[round(x, 2) for x in res["on"]])
            rows.append(row)
            print(json.dumps(row), flush=True)
    llm.engine.spec = spec
    out = dict(k=args.k, max_tokens=args.max_tokens, rounds=args.rounds, formats=formats, load_avg=os.getloadavg(),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
