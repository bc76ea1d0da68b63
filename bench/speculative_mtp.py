"""MTP speculative decoding (issue 31, item 2b) on the tiny MTP checkpoint
(``checkpoints/tiny-kimi-k2``: random weights, so its acceptance only shows the path runs; it
says nothing of a trained MTP layer's): acceptance and mean accepted length per k, and the cost
of each program call at 1 and 4 requests, from the engine's step records (median wall time per
call, after an untimed run has built every program):

- decode (MTP loaded): the decode step, which also writes the block's KV one position behind;
- decode (no MTP): the same checkpoint loaded without its MTP layer, the baseline;
- draft: the draft program (the block at the newest position, chained k - 1 times);
- verify: the decode weights over k + 1 positions.

Random drafts pause a request's speculation after its first 16 (the auto-off), so each request
runs 16 / k verify calls, then decodes: enough calls for the medians. Greedy, random prompts.

    .venv/bin/python bench/speculative_mtp.py --out bench/results/speculative_mtp.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

KIMI = "checkpoints/tiny-kimi-k2"
KW = dict(num_pages=256, page_size=16, max_num_seqs=4, max_model_len=512, dtype="float32")


def calls(llm, batch, sp) -> dict:
    """Median seconds per call by (phase, padded rows) over one generate()."""
    seen: dict = {}
    undo = llm.engine.add_step_observer(lambda r: seen.setdefault((r.phase, r.batch), []).append(r.seconds))
    llm.generate(batch, sp)
    undo()
    return {k: statistics.median(v) for k, v in seen.items()}


def _ms(seconds):
    return None if seconds is None else round(1e3 * seconds, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default="bench/results/speculative_mtp.json")
    args = ap.parse_args()
    from jaxserve import LLM
    from jaxserve.engine.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    batches = {n: [[int(x) for x in rng.integers(2, 512, size=24)] for _ in range(n)] for n in (1, 4)}
    base = LLM(KIMI, **KW)
    plain = {}
    for n, batch in batches.items():
        base.generate(batch, sp)
        plain[n] = calls(base, batch, sp)[("decode", n)]
    rows = []
    for k in map(int, args.ks.split(",")):
        llm = LLM(KIMI, speculative="mtp", num_speculative_tokens=k, speculative_policy="always", **KW)
        spec = llm.engine.spec
        for n, batch in batches.items():
            llm.generate(batch, sp)  # untimed: builds every program of this shape
            d0, a0, s0 = spec.drafted, spec.accepted, spec.verify_steps
            on = calls(llm, batch, sp)
            drafted, accepted, steps = spec.drafted - d0, spec.accepted - a0, spec.verify_steps - s0
            llm.engine.spec = None
            off = calls(llm, batch, sp)
            llm.engine.spec = spec
            d, v = on.get(("draft", n)), on.get(("verify", n))
            row = dict(k=k, requests=n, acceptance=round(accepted / drafted, 4) if drafted else None,
                       mean_accepted_length=round(1 + accepted / steps, 3) if steps else None, draft_tokens=drafted,
                       decode_no_mtp_ms=_ms(plain[n]), decode_mtp_ms=_ms(off[("decode", n)]), draft_ms=_ms(d),
                       verify_ms=_ms(v), decode_mtp_in_decode_steps=round(off[("decode", n)] / plain[n], 2),
                       draft_in_decode_steps=round(d / plain[n], 2) if d else None,
                       draft_plus_verify_in_decode_steps=round((d + v) / plain[n], 2) if d and v else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = dict(checkpoint=KIMI, max_tokens=args.max_tokens, load_avg=os.getloadavg(),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
