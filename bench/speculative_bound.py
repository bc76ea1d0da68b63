"""What n-gram speculation can give at most on bench/speculative.py's workloads, from the greedy
outputs alone: an upper bound on its speedup, by draft length k and the verify call's cost.

The engine generates each workload's prompts greedily without speculation (the formats given);
then, for each k, the n-gram proposer (``NgramProposer``, the engine's) is replayed over prompt +
output: at each step it proposes up to k tokens from the history, the accepted ones are the
greedy output's next tokens it matches (greedy verification accepts exactly those), and the step
emits them plus one. A step with no proposal is a plain decode step. With a plain step costing 1
and a verify call c decode steps, the speedup is tokens / (verify calls x c + plain steps); at
c = 1 (a verify call as cheap as a decode step) it is the proposer's bound whatever the kernels.

With --gated (draft lengths with their measured verify costs, e.g. "4:1.3,8:1.89"), the same
replay runs the engine's batch gate at one request (``gate.BatchGate``: a row's decayed
acceptance, the expected tokens of a verify call against its cost; a plain step's drafts scored
as shadows): each length alone, and the lengths together, where each step verifies with the
length whose expected tokens per cost are highest (a per-request draft length, what two verify
programs would allow), or decodes plainly where none pays.

    .venv/bin/python bench/speculative_bound.py --decode-weights int4:g32 --prefill-weights bf16 \\
        --tied-head-weights bf16 --max-tokens 48 --k 3,4,8
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speculative import prompts  # noqa: E402  (the same workloads)


def matched(draft: list[int], out: list[int], i: int) -> int:
    """How many drafts greedy verification accepts at output position i: those matching out[i:]."""
    a = 0
    while a < len(draft) and draft[a] == out[i + a]:
        a += 1
    return a


def replay(propose, k: int, prompt: list[int], out: list[int]) -> tuple[int, int, int]:
    """(verify calls, tokens they emitted, plain steps) for one request's greedy output."""
    calls = toks = plain = 0
    i = 1  # the first token comes from prefill
    while i < len(out):
        draft = propose(prompt + out[:i], min(k, len(out) - i))
        a = matched(draft, out, i)
        if draft:
            calls, toks = calls + 1, toks + a + 1
        else:
            plain += 1
        i += a + 1
    return calls, toks, plain


def replay_gated(propose, widths: dict[int, float], prompt: list[int], out: list[int]) -> tuple[float, int]:
    """(cost in decode steps, tokens) for one request under the batch gate at one request:
    widths maps each draft length available to its verify call's cost in decode steps."""
    from jaxserve.engine.speculative.gate import Acceptance, BatchGate, expected_tokens

    gate, recent = BatchGate(), Acceptance()
    cost = 0.0
    i = 1
    while i < len(out):
        draft = propose(prompt + out[:i], min(max(widths), len(out) - i))
        a = matched(draft, out, i)
        best, value = None, 1.0
        rate = gate.row_rate(recent)
        for w, c in sorted(widths.items()):
            d = min(w, len(draft))
            v = expected_tokens(rate, d) / c
            if d and v >= value:
                best, value = w, v
        if best is None:  # plain step; the drafts are checked against what it emits (a shadow)
            if draft:
                gate.record(recent, len(draft), a)
            cost, i = cost + 1, i + 1
            continue
        d = min(best, len(draft))
        gate.record(recent, d, min(a, d))
        cost, i = cost + widths[best], i + min(a, d) + 1
    return cost, len(out) - 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", default="3,4,8")
    ap.add_argument("--costs", default="1.0,1.3,1.5", help="verify call costs in decode steps")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--decode-weights", default=None)
    ap.add_argument("--prefill-weights", default=None)
    ap.add_argument("--tied-head-weights", default=None)
    ap.add_argument("--gated", default=None, help='draft lengths and their verify costs, "4:1.3,8:1.89"')
    args = ap.parse_args()
    from jaxserve import LLM
    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.engine.speculative.ngram import NgramProposer

    llm = LLM(max_num_seqs=8, num_pages=256, decode_weights=args.decode_weights,
              prefill_weights=args.prefill_weights, tied_head_weights=args.tied_head_weights)
    costs = [float(c) for c in args.costs.split(",")]
    gated = []
    print("| workload | requests | k | verify calls | plain steps | tokens per verify call | "
          + " | ".join(f"speedup at c={c}" for c in costs) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(costs))
    for kind in ("repeat", "random"):
        for n in (int(r) for r in args.requests.split(",")):
            batch = prompts(llm, kind, n, np.random.default_rng(n))
            outs = llm.generate(batch, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
            ids = [llm.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]  # as LLM.generate encodes
            for k in (int(x) for x in args.k.split(",")):
                propose = NgramProposer(k).propose
                calls = toks = plain = 0
                for p, o in zip(ids, outs):
                    c, t, pl = replay(propose, k, p, list(o.token_ids))
                    calls, toks, plain = calls + c, toks + t, plain + pl
                total = toks + plain
                speed = " | ".join(f"{total / (calls * c + plain):.2f}x" for c in costs)
                print(f"| {kind} | {n} | {k} | {calls} | {plain} | {toks / max(calls, 1):.2f} | {speed} |", flush=True)
            if args.gated:
                gated.append((kind, n, ids, [list(o.token_ids) for o in outs]))
    if args.gated:
        widths = {int(w): float(c) for w, c in (x.split(":") for x in args.gated.split(","))}
        cases = [{w: c} for w, c in widths.items()] + ([widths] if len(widths) > 1 else [])
        print("\n| workload | requests | draft lengths (verify cost) | speedup under the gate |\n|---|---|---|---|")
        for kind, n, ids, outs in gated:
            for case in cases:
                propose = NgramProposer(max(case)).propose
                cost = toks = 0
                for p, o in zip(ids, outs):
                    c, t = replay_gated(propose, case, p, o)
                    cost, toks = cost + c, toks + t
                label = ", ".join(f"{w} ({c:g})" for w, c in case.items())
                print(f"| {kind} | {n} | {label} | {toks / cost:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
