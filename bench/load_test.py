"""gRPC load test: one `jaxserve serve` subprocess on loopback, many concurrent streams.

    python bench/load_test.py                        # tiny random model with the SmolLM2 tokenizer
    python bench/load_test.py --model DIR --concurrency 64 --requests 512 --out load.json

Up to --concurrency streams at once (mixed prompt and output lengths; a fraction cancelled
by the client, expired by a deadline or aborted with the Abort RPC; queue-full answers are
retried after the server's retry hint). Bounded by --requests and --time-limit.

Checks (exit code 1 if any fails): every request ends with a completion or an explicit
gRPC status; none is lost or duplicated (request ids, one outcome each); streamed tokens
agree with the end event's usage; no KV page is leaked at the end (ModelInfo kv_pages.used
== 0, free == total) and the queue is empty. Prints throughput and TTFT / inter-token /
end-to-end latency percentiles (client-side) and writes everything as JSON.
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxserve.cli_args import add_engine_args, engine_flags  # noqa: E402
from jaxserve.client import AsyncClient, retry_after_s  # noqa: E402
from jaxserve.engine.config import EngineConfig  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random Llama with a tokenizer)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=384, help="measured requests in total")
    p.add_argument("--time-limit", type=float, default=240.0, help="seconds; unstarted requests are skipped after it")
    p.add_argument("--prompt-len", default="4,200", help="min,max prompt tokens (uniform)")
    p.add_argument("--max-tokens", default="8,32,64,128", help="output lengths to mix")
    p.add_argument("--cancel-fraction", type=float, default=0.06, help="client cancels after a few tokens")
    p.add_argument("--deadline-fraction", type=float, default=0.03, help="a deadline shorter than the work")
    p.add_argument("--abort-fraction", type=float, default=0.03, help="ended by the Abort RPC")
    p.add_argument("--text-fraction", type=float, default=0.25, help="text prompts (need a tokenizer)")
    p.add_argument("--sampled-fraction", type=float, default=0.0,
                   help="non-greedy requests (on CPU a full-vocabulary sort per step dominates a tiny model)")
    p.add_argument("--max-waiting", type=int, default=32, help="server queue limit (RESOURCE_EXHAUSTED beyond)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "load_test.json"))
    add_engine_args(p.add_argument_group("the server's engine (EngineConfig; passed on to jaxserve serve)"))
    args = p.parse_args(argv)
    args.max_num_seqs = args.max_num_seqs or EngineConfig.max_num_seqs
    return args


# ---------------------------------------------------------------------- server
def start_server(args, model: str, extra: tuple = (), lines: list | None = None):
    """-> (process, gRPC target, metrics port) once SERVING; `extra` flags go to jaxserve
    serve, and its output lines so far to `lines`."""
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", "0", "--metrics-port", "0", "--log-level", "warning", "--drain-timeout", "10"]
    cmd += ["--max-waiting", str(args.max_waiting)] + engine_flags(args) + list(extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    metrics_port, lines = None, [] if lines is None else lines
    for line in proc.stdout:
        lines.append(line)
        if "metrics port" in line:
            metrics_port = int(line.split("metrics port ")[1].split(")")[0])
        if "SERVING on" in line:
            return proc, line.split("SERVING on ")[1].split()[0], metrics_port
    raise RuntimeError("server exited before SERVING:\n" + "".join(lines))


def tiny_model() -> str:
    from tests.server.tiny_model import build_tiny_text_model

    return build_tiny_text_model(Path(tempfile.mkdtemp(prefix="jaxserve_load_")) / "tiny")


# ---------------------------------------------------------------------- workload
WORDS = "the of and a to in is you that it he was for on are as with his they at be this from".split()


def make_plan(args, n: int, rng: random.Random, vocab: int, prefix: str) -> list[dict]:
    lo, hi = map(int, args.prompt_len.split(","))
    outs = [int(x) for x in args.max_tokens.split(",")]
    plan = []
    for i in range(n):
        length = rng.randint(lo, hi)
        r = rng.random()
        mode = "complete"
        for name, frac in (("cancel", args.cancel_fraction), ("deadline", args.deadline_fraction),
                           ("abort", args.abort_fraction)):
            if r < frac:
                mode = name
                break
            r -= frac
        req = dict(request_id=f"{prefix}-{i}", max_tokens=rng.choice(outs), ignore_eos=True, mode=mode)
        if mode != "complete":
            req["max_tokens"] = max(outs)  # long enough to be interrupted mid-stream
        if rng.random() < args.text_fraction:
            req["prompt"] = " ".join(rng.choice(WORDS) for _ in range(length))
        else:
            req["prompt"] = [rng.randrange(3, vocab) for _ in range(length)]
        if rng.random() < args.sampled_fraction:
            req.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31 - 1))
        plan.append(req)
    return plan


async def run_one(client: AsyncClient, req: dict, rec: dict, stop_at: float) -> None:
    """One request to its end; fills rec with outcome, token counts and client-side times."""
    kw = {k: v for k, v in req.items() if k not in ("prompt", "mode")}
    mode, rid = req["mode"], req["request_id"]
    cut = random.Random(rid).randint(2, 6)  # tokens before a cancel / abort
    timeout = 0.25 if mode == "deadline" else 600.0
    for attempt in range(50):
        t0 = time.perf_counter()
        call = client.generate_stream(req["prompt"], timeout=timeout, **kw)
        times, tokens, end = [], 0, None
        try:
            async for ev in call:
                kind = ev.WhichOneof("event")
                if kind == "start":
                    rec["start_ids"].append(ev.start.request_id)
                elif kind == "delta":
                    if ev.delta.token_ids:
                        times.append(time.perf_counter())
                        tokens += len(ev.delta.token_ids)
                    if mode == "cancel" and tokens >= cut:
                        call.cancel()
                        break
                    if mode == "abort" and tokens >= cut and not rec.get("abort_sent"):
                        rec["abort_sent"] = True
                        r = await client.abort(rid)
                        rec["abort_found"] = list(r.aborted) == [rid]
                else:
                    end = ev.end
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.time() < stop_at:
                rec["retries"] += 1
                await asyncio.sleep(retry_after_s(e) or 0.1)
                continue
            rec["outcome"] = e.code().name.lower()
        else:
            if mode == "cancel" and end is None:
                rec["outcome"] = "cancelled"
            elif end is not None:
                from jaxserve.client import finish_reason

                rec["outcome"] = finish_reason(end)
                rec["usage_ok"] = end.usage.completion_tokens == tokens
                rec["length_ok"] = rec["outcome"] != "length" or tokens == req["max_tokens"]
            else:
                rec["outcome"] = "stream_ended_without_end_event"
        rec["tokens"] = tokens
        if times:
            rec["ttft"] = times[0] - t0
            rec["itl"] = list(np.diff(times))
            rec["e2e"] = time.perf_counter() - t0
        return
    rec["outcome"] = "resource_exhausted_after_retries"


async def run_load(args, target: str, plan: list[dict], time_limit: float) -> tuple[dict, float]:
    records = {r["request_id"]: dict(outcome=None, start_ids=[], retries=0, tokens=0) for r in plan}
    sem = asyncio.Semaphore(args.concurrency)
    stop_at = time.time() + time_limit
    async with AsyncClient(target) as client:
        async def guarded(req):
            async with sem:
                if time.time() > stop_at:
                    records[req["request_id"]]["outcome"] = "skipped_time_limit"
                    return
                await run_one(client, req, records[req["request_id"]], stop_at)

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(guarded(r) for r in plan)), time_limit + 120)
        return records, time.perf_counter() - t0


def pct(xs, qs=(50, 90, 99)) -> dict:
    if not xs:
        return {}
    return {f"p{q}_ms": round(float(np.percentile(xs, q)) * 1000, 2) for q in qs} | {"n": len(xs)}


async def final_state(target: str) -> dict:
    async with AsyncClient(target) as client:
        for _ in range(100):  # aborts travel through the engine thread: allow it a moment
            kv = (await client.model_info()).kv_pages
            if kv.used == 0:
                break
            await asyncio.sleep(0.05)
        return dict(total=kv.total, used=kv.used, free=kv.free)


def scrape(port: int) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    model = args.model or tiny_model()
    t_start = time.perf_counter()
    proc, target, metrics_port = start_server(args, model)
    ready_s = time.perf_counter() - t_start  # model load + warm-up compilation
    print(f"server {target} ready in {ready_s:.1f}s (metrics :{metrics_port})", flush=True)
    try:
        info = asyncio.run(_info(target))
        # Warm the sampler's batch buckets (engine.warmup compiles the model programs only).
        warm = make_plan(argparse.Namespace(**{**vars(args), "cancel_fraction": 0, "deadline_fraction": 0,
                                              "abort_fraction": 0}), 2 * args.max_num_seqs, rng, info.vocab_size, "warm")
        asyncio.run(run_load(argparse.Namespace(**{**vars(args), "concurrency": args.max_num_seqs}), target, warm, 120))
        plan = make_plan(args, args.requests, rng, info.vocab_size, "lt")
        records, wall = asyncio.run(run_load(args, target, plan, args.time_limit))
        kv = asyncio.run(final_state(target))
        metrics = scrape(metrics_port)
    finally:
        proc.terminate()
        proc.wait(60)
    outcomes = collections.Counter(r["outcome"] for r in records.values())
    dup_starts = [rid for rid, r in records.items() if len(r["start_ids"]) > 1]
    wrong_ids = [rid for rid, r in records.items() if any(s != rid for s in r["start_ids"])]
    explicit = {"length", "stop", "abort", "cancelled", "deadline_exceeded", "resource_exhausted", "unavailable",
                "invalid_argument", "aborted", "internal", "skipped_time_limit"}
    tokens = sum(r["tokens"] for r in records.values())
    # The server counts every attempt once (warm-up, measured, and each queue-full retry).
    attempts = len(warm) + sum(1 + r["retries"] for r in records.values() if r["outcome"] != "skipped_time_limit")
    served = sum(v for k, v in metrics.items() if k.startswith("jaxserve_requests_total{outcome=")
                 and "rpc=GenerateStream" in k)
    checks = {
        "every_request_has_an_explicit_outcome": all(r["outcome"] in explicit for r in records.values()),
        "none_lost_or_duplicated": len(records) == len(plan) and not dup_starts and not wrong_ids,
        "server_counted_every_attempt_once": served == attempts,
        "no_internal_errors": outcomes.get("internal", 0) == 0,
        "stream_tokens_match_usage": all(r.get("usage_ok", True) and r.get("length_ok", True) for r in records.values()),
        "aborts_found_their_request": all(r.get("abort_found", True) for r in records.values()),
        "no_kv_page_leaked": kv["used"] == 0 and kv["free"] == kv["total"],
        "queue_empty_at_end": metrics.get("jaxserve_queue_depth", -1) == 0,
        "no_compile_after_warmup": metrics.get("jaxserve_compiles_after_warmup", -1) == 0,
    }
    done = [r for r in records.values() if r["outcome"] in ("length", "stop")]
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join(["python bench/load_test.py"] + (argv if argv is not None else sys.argv[1:])),
        "server_start_s": round(ready_s, 1),
        "model": info.model, "architecture": info.architecture, "fingerprint": info.fingerprint[:16],
        "config": {k: getattr(args, k) for k in ("concurrency", "requests", "prompt_len", "max_tokens",
                                                 "cancel_fraction", "deadline_fraction", "abort_fraction",
                                                 "text_fraction", "sampled_fraction", "max_waiting")}
        | {"engine_flags": engine_flags(args)},
        "wall_s": round(wall, 2),
        "outcomes": dict(outcomes),
        "retries_after_resource_exhausted": sum(r["retries"] for r in records.values()),
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
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("wall_s", "outcomes", "retries_after_resource_exhausted",
                                             "throughput_tok_s", "requests_per_s", "ttft", "inter_token",
                                             "e2e_completed", "kv_pages_at_end", "checks")}, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(checks.values()) else 1


async def _info(target):
    async with AsyncClient(target) as c:
        return await c.model_info()


if __name__ == "__main__":
    sys.exit(main())
