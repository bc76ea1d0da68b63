"""Structured outputs and tools on the default model, side by side in one run:

1. decode tokens/s at 1, 8 and 32 requests (``--batches``) with a JSON-schema constraint on every request vs none
   (the same prompts, max_tokens and sampling; interleaved repetitions, the best of each);
2. grammar compile time of the test schemas (fresh compiler, no cache);
3. tool-call validity on a fixed suite of tool-use prompts (sampled, several seeds), with the
   tool choice free ("auto": the model writes calls if it can) vs enforced ("required": the
   grammar of a Hermes-style call): a trial is valid when a call parses, names a tool and its
   arguments validate against the tool's schema; Wilson 95% intervals.

    .venv/bin/python bench/structured.py --json bench/results/structured.json
    .venv/bin/python bench/structured.py --decode-only --batches 1 8 32 --json bench/results/structured_32.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def decode_rate(llm, prompts, params, observer_log) -> dict:
    observer_log.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    prefill = sum(r.seconds for r in observer_log if r.phase == "prefill")
    tokens = sum(len(o) for o in outs)
    return {"tokens": tokens, "wall_s": wall, "decode_tok_s": (tokens - len(outs)) / max(wall - prefill, 1e-9)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tools-only", action="store_true", help="only the tool-call validity table")
    ap.add_argument("--decode-only", action="store_true", help="only the decode rates (no compile times or tools)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="requests at once, per decode row")
    args = ap.parse_args(argv)
    sys.path.insert(0, ".")
    import jsonschema

    from jaxserve import LLM
    from jaxserve.agents.message import MessageParser
    from jaxserve.agents.tool_parsers import make
    from jaxserve.bench.measure import machine_info, write_json
    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.server.agent_plan import AgentFront, AgentRequest
    from jaxserve.structured.compiler import GrammarCompiler
    from jaxserve.structured.spec import StructuredOutput
    from tests.agents.schemas import SCHEMAS, TOOL_PROMPTS, TOOLS, prompt

    slots = max([8, *args.batches])  # a batch decodes as one step: ~135 tokens a request, 12 pages of 16 fit it
    llm = LLM(None, dtype="float32", kv_format="bf16", num_pages=max(256, 12 * slots), page_size=16,
              max_num_seqs=slots)
    log = []
    llm.engine.add_step_observer(log.append)
    # 1. decode rate: a schema whose answers run long (a list of 40 numbers), and the free prompt
    schema = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                                           "minItems": 40, "maxItems": 40}}, "required": ["numbers"]}
    text = llm.apply_chat_template("List forty numbers as JSON: " + json.dumps(schema))
    rows = []
    for batch in (() if args.tools_only else args.batches):
        prompts = [text] * batch
        free = [SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i, ignore_eos=True)
                for i in range(batch)]
        cons = [SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i,
                               structured=StructuredOutput.json_schema(schema)) for i in range(batch)]
        decode_rate(llm, prompts, free, log), decode_rate(llm, prompts, cons, log)  # compile, untimed
        st = llm.engine.constraints.stats
        mask_s, mask_steps, wait_s = st.mask_seconds, st.mask_steps, st.mask_wait_seconds  # the timed runs' only
        best = {"none": None, "json_schema": None}
        for _ in range(args.reps):
            for name, params in (("none", free), ("json_schema", cons)):
                r = decode_rate(llm, prompts, params, log)
                if best[name] is None or r["decode_tok_s"] > best[name]["decode_tok_s"]:
                    best[name] = r
        steps = max(st.mask_steps - mask_steps, 1)
        rows.append({"batch": batch, **{f"{k}_decode_tok_s": v["decode_tok_s"] for k, v in best.items()},
                     **{f"{k}_tokens": v["tokens"] for k, v in best.items()},
                     "ratio": best["json_schema"]["decode_tok_s"] / best["none"]["decode_tok_s"],
                     "mask_ms_per_step": 1e3 * (st.mask_seconds - mask_s) / steps,
                     "mask_wait_ms_per_step": 1e3 * (st.mask_wait_seconds - wait_s) / steps})
        print(rows[-1], flush=True)
    # 2. compile times, fresh compiler
    comp = GrammarCompiler(llm.tokenizer, llm.cfg.vocab_size, llm.engine.eos_token_ids)
    times = []
    for _, s in ([] if args.tools_only or args.decode_only else SCHEMAS):
        t0 = time.perf_counter()
        comp.matcher(StructuredOutput.json_schema(s))
        times.append(time.perf_counter() - t0)
    compile_ms = {"schemas": len(times), "median_ms": 1e3 * sorted(times)[len(times) // 2],
                  "max_ms": 1e3 * max(times), "min_ms": 1e3 * min(times)} if times else {}
    print(compile_ms, flush=True)
    # 3. tool-call validity, auto (free) vs required (grammar)
    front = AgentFront(llm.tokenizer, llm.cfg.architecture, llm.cfg.model_type)
    params_of = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    validity = {}
    for choice in (() if args.decode_only else ("auto", "required")):
        agent = AgentRequest(tools=TOOLS, tool_choice=choice, parallel=False)
        jobs, params = [], []
        for q, _ in TOOL_PROMPTS:
            text = front.render([{"role": "user", "content": q}], agent)
            plan = front.plan(True, agent, text)
            for seed in range(args.seeds):
                jobs.append(text)
                params.append(SamplingParams(max_tokens=96, temperature=0.7, seed=seed, **plan.sampling()))
        outs = llm.generate(jobs, params)
        parser = MessageParser(make(front.tool_parser, TOOLS))
        ok = 0
        for o in outs:
            calls = parser.parse(o.text, final=True).calls
            try:
                c = calls[0]
                jsonschema.validate(json.loads(c.arguments), params_of[c.name])
                ok += 1
            except (IndexError, KeyError, ValueError, jsonschema.ValidationError):
                pass
        lo, hi = wilson(ok, len(outs))
        validity[choice] = {"valid": ok, "trials": len(outs), "pct": 100 * ok / len(outs),
                            "ci95": [100 * lo, 100 * hi]}
        print(choice, validity[choice], flush=True)
    out = {"machine": machine_info(), "decode": rows, "compile": compile_ms, "tool_call_validity": validity,
           "compiles_after_warmup": llm.engine.snapshot().compiles_after_warmup, "max_tokens": args.max_tokens}
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
