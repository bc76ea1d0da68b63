"""HTTP load test: one `jaxserve serve --http-port` subprocess on loopback, many concurrent
streams through the official ``openai`` client (AsyncOpenAI), as bench/load_test.py does over gRPC.

    python bench/http_load_test.py                     # tiny random model with the SmolLM2 tokenizer
    python bench/http_load_test.py --concurrency 64 --requests 384 --out http_load.json

Up to --concurrency SSE streams at once, chat and completions mixed (text, token-id and
conversation prompts; mixed prompt and output lengths); a fraction is cancelled by the
client (the stream closed after a few tokens), expired by a client-side deadline or aborted
through the gRPC Abort RPC with the id the HTTP response carries; 429 answers are retried
after the server's Retry-After. Every request asks for log-probs (no alternatives), so the
client counts the tokens each chunk carries.

Checks (exit code 1 if any fails): every request ends with a finish reason or an explicit
error; none is lost or duplicated (one outcome per planned request, distinct server ids);
streamed tokens agree with the usage chunk; the server counted every attempt once; no KV
page is leaked (GetModelInfo kv_pages.used == 0) and the queue is empty; nothing compiled
after warm-up. Prints throughput and latency percentiles (client-side) and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from load_test import final_state, make_plan, parse_args, pct, scrape, start_server, tiny_model  # noqa: E402

from jaxserve.cli_args import engine_flags  # noqa: E402
from jaxserve.client import AsyncClient  # noqa: E402

MODEL = "bench"
RPCS = ("http.chat", "http.completions")


def body_of(req: dict) -> tuple[str, dict]:
    """A plan entry -> (endpoint, request body): text prompts alternate chat and completions."""
    body = dict(model=MODEL, max_tokens=req["max_tokens"], temperature=req.get("temperature", 0), stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if "seed" in req:
        body.update(seed=req["seed"], top_p=req["top_p"])
    prompt = req["prompt"]
    if isinstance(prompt, str) and int(req["request_id"].rsplit("-", 1)[1]) % 2:
        return "chat", dict(body, messages=[{"role": "user", "content": prompt}], logprobs=True)
    return "completions", dict(body, prompt=prompt, logprobs=0)


async def consume(stream, req: dict, rec: dict, grpc: AsyncClient, t0: float) -> tuple[int, object, list]:
    """Read one SSE stream -> (tokens, usage, token arrival times); may cancel or abort."""
    mode, cut = req["mode"], random.Random(req["request_id"]).randint(2, 6)
    tokens, usage, times = 0, None, []
    async for chunk in stream:
        rec["ids"].add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            lp = c.logprobs
            n = (len(lp.content or []) if hasattr(lp, "content") else len(lp.tokens)) if lp is not None else 0
            if n:
                times.append(time.perf_counter())
                tokens += n
            if c.finish_reason:
                rec["finish"] = c.finish_reason
        if mode == "cancel" and tokens >= cut:
            rec["outcome"] = "cancelled"
            break
        if mode == "abort" and tokens >= cut and not rec.get("abort_sent"):
            rec["abort_sent"] = True
            rec["abort_found"] = list((await grpc.abort(chunk.id)).aborted) == [chunk.id]
    return tokens, usage, times


async def run_one(client: openai.AsyncOpenAI, grpc: AsyncClient, req: dict, rec: dict, stop_at: float) -> None:
    endpoint, body = body_of(req)
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    for _ in range(50):
        t0 = time.perf_counter()
        try:
            async with await create(**body) as stream:
                work = consume(stream, req, rec, grpc, t0)
                if req["mode"] == "deadline":
                    tokens, usage, times = await asyncio.wait_for(work, 0.25)
                else:
                    tokens, usage, times = await work
        except asyncio.TimeoutError:
            rec["outcome"] = "deadline_exceeded"
            return
        except openai.RateLimitError as e:
            if time.time() < stop_at:
                rec["retries"] += 1
                await asyncio.sleep(float(e.response.headers.get("retry-after-ms", 100)) / 1000)
                continue
            rec["outcome"] = "resource_exhausted"
            return
        except openai.APIStatusError as e:
            rec["outcome"] = f"http_{e.status_code}"
            return
        except openai.APIConnectionError as e:  # not an explicit outcome: the checks fail
            rec["outcome"] = f"connection_error: {e.__cause__!r}"
            return
        rec["tokens"] = tokens
        if rec["outcome"] is None:
            finish = rec.get("finish")
            rec["outcome"] = {"length": "length", "stop": "stop", "abort": "abort"}.get(finish, "no_finish_reason")
            rec["usage_ok"] = usage is not None and usage.completion_tokens == tokens
            rec["length_ok"] = finish != "length" or tokens == req["max_tokens"]
        if times:
            rec["ttft"], rec["itl"], rec["e2e"] = times[0] - t0, list(np.diff(times)), time.perf_counter() - t0
        return
    rec["outcome"] = "resource_exhausted_after_retries"


async def run_load(args, base_url: str, target: str, plan: list[dict], time_limit: float):
    records = {r["request_id"]: dict(outcome=None, ids=set(), retries=0, tokens=0) for r in plan}
    sem = asyncio.Semaphore(args.concurrency)
    stop_at = time.time() + time_limit
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client, \
            AsyncClient(target) as grpc:
        async def guarded(req):
            async with sem:
                if time.time() > stop_at:
                    records[req["request_id"]]["outcome"] = "skipped_time_limit"
                    return
                await run_one(client, grpc, req, records[req["request_id"]], stop_at)

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(guarded(r) for r in plan)), time_limit + 120)
        return records, time.perf_counter() - t0


def checks_of(records, plan, warm, metrics, kv, outcomes) -> dict:
    explicit = {"length", "stop", "abort", "cancelled", "deadline_exceeded", "resource_exhausted",
                "skipped_time_limit"}
    ids = [i for r in records.values() for i in r["ids"]]
    attempts = len(warm) + sum(1 + r["retries"] for r in records.values() if r["outcome"] != "skipped_time_limit")
    served = sum(v for k, v in metrics.items() if k.startswith("jaxserve_requests_total{outcome=")
                 and any(f"rpc={rpc}" in k for rpc in RPCS))
    return {
        "every_request_has_an_explicit_outcome": all(r["outcome"] in explicit for r in records.values()),
        "none_lost_or_duplicated": len(records) == len(plan) and len(ids) == len(set(ids))
        and all(len(r["ids"]) <= 1 for r in records.values()),
        "server_counted_every_attempt_once": served == attempts,
        "stream_tokens_match_usage": all(r.get("usage_ok", True) and r.get("length_ok", True)
                                         for r in records.values()),
        "aborts_found_their_request": all(r.get("abort_found", True) for r in records.values()),
        "no_kv_page_leaked": kv["used"] == 0 and kv["free"] == kv["total"],
        "queue_empty_at_end": metrics.get("jaxserve_queue_depth", -1) == 0,
        "no_compile_after_warmup": metrics.get("jaxserve_compiles_after_warmup", -1) == 0,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out == str(REPO / "bench" / "results" / "load_test.json"):
        args.out = str(REPO / "bench" / "results" / "http_load_test.json")
    rng = random.Random(args.seed)
    model = args.model or tiny_model()
    t_start, lines = time.perf_counter(), []
    proc, target, metrics_port = start_server(args, model, ("--http-port", "0", "--served-model-name", MODEL), lines)
    ready_s = time.perf_counter() - t_start
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # the pipe never fills
    base_url = next(x for x in lines if "HTTP API on" in x).split(" on ")[1].split()[0]
    print(f"server {base_url} (gRPC {target}) ready in {ready_s:.1f}s", flush=True)
    try:
        vocab = asyncio.run(_vocab(target))
        quiet = argparse.Namespace(**{**vars(args), "cancel_fraction": 0, "deadline_fraction": 0, "abort_fraction": 0})
        warm = make_plan(quiet, 2 * args.max_num_seqs, rng, vocab, "warm")  # sampler and log-prob buckets
        asyncio.run(run_load(argparse.Namespace(**{**vars(args), "concurrency": args.max_num_seqs}), base_url, target,
                             warm, 120))
        plan = make_plan(args, args.requests, rng, vocab, "lt")
        records, wall = asyncio.run(run_load(args, base_url, target, plan, args.time_limit))
        kv = asyncio.run(final_state(target))
        metrics = scrape(metrics_port)
    finally:
        proc.terminate()
        proc.wait(60)
    outcomes = collections.Counter(r["outcome"] for r in records.values())
    checks = checks_of(records, plan, warm, metrics, kv, outcomes)
    done = [r for r in records.values() if r["outcome"] in ("length", "stop")]
    tokens = sum(r["tokens"] for r in records.values())
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join(["python bench/http_load_test.py"] + (argv if argv is not None else sys.argv[1:])),
        "server_start_s": round(ready_s, 1),
        "config": {k: getattr(args, k) for k in ("concurrency", "requests", "prompt_len", "max_tokens",
                                                 "cancel_fraction", "deadline_fraction", "abort_fraction",
                                                 "text_fraction", "sampled_fraction", "max_waiting")}
        | {"engine_flags": engine_flags(args)},
        "wall_s": round(wall, 2),
        "outcomes": dict(outcomes),
        "retries_after_429": sum(r["retries"] for r in records.values()),
        "completion_tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 1),
        "requests_per_s": round(len(done) / wall, 2),
        "ttft": pct([r["ttft"] for r in records.values() if "ttft" in r]),
        "inter_token": pct([x for r in records.values() for x in r.get("itl", [])]),
        "e2e_completed": pct([r["e2e"] for r in done if "e2e" in r]),
        "kv_pages_at_end": kv,
        "server_requests_by_outcome": {k: v for k, v in metrics.items() if k.startswith("jaxserve_requests_total")},
        "checks": checks,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("wall_s", "outcomes", "retries_after_429", "throughput_tok_s",
                                             "requests_per_s", "ttft", "inter_token", "e2e_completed",
                                             "kv_pages_at_end", "checks")}, indent=2))
    print(f"wrote {args.out}")
    if not all(checks.values()):
        print("server output:\n" + "".join(lines[-40:]))
    return 0 if all(checks.values()) else 1


async def _vocab(target) -> int:
    async with AsyncClient(target) as c:
        return (await c.model_info()).vocab_size


if __name__ == "__main__":
    sys.exit(main())
