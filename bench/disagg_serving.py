"""Disaggregated against colocated serving, end to end through gRPC on loopback: time to first
token, inter-token latency and output throughput of

- ``disagg``: ``jaxserve route --prefill P --decode D`` over a ``serve --role prefill`` worker
  (bf16 pool) and a ``serve --role decode`` worker (fp8_e4m3 pool), the KV handed off per request
  (Prefill, converted pages pulled over the grpc stream, Decode);
- ``colocated``: one ``serve`` worker (role both, the engine's default KV format) called directly;
- ``colocated_routed``: the same worker behind ``jaxserve route --worker``.

Every setup runs the same workload: ``--requests`` prompts of ``--prompt-len`` random token ids
(fixed seed; new ids for every setup and round, so no prefix cache hit), greedy, EOS ignored,
``--max-tokens`` output tokens, ``--concurrency`` streams at a time. One untimed round per setup
first (sampler shapes compile on first use), then ``--rounds`` rounds with the setups in rotating
order, so a burst of load from other jobs falls on all of them. Reported per setup: medians over
rounds of TTFT p50 / p90, inter-token p50 (gaps between token deltas at the client), end-to-end
p50, and output tok/s; ratios to ``colocated`` from the same run.

    MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python bench/disagg_serving.py [--model DIR | --tiny] [--json bench/results/disagg_serving.json]

All processes share this machine's cores: on a small CPU host the two disaggregated workers
compete with each other for them, which a deployment on separate hosts would not.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SETUPS = ("colocated", "colocated_routed", "disagg")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded SmolLM2-135M)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama with the SmolLM2 tokenizer instead")
    p.add_argument("--requests", type=int, default=8, help="requests per round and setup")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-flags", default="--max-num-seqs 4 --max-model-len 512 --num-pages 160",
                   help="engine flags every worker gets")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


class Proc:
    """A jaxserve process whose output is read until a marker line."""

    def __init__(self, args: list[str]):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=REPO)
        self.lines: list[str] = []

    def wait_for(self, marker: str) -> str:
        for line in self.proc.stdout:
            self.lines.append(line)
            if marker in line:
                return line
        raise RuntimeError(f"process exited before {marker!r}:\n" + "".join(self.lines))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve(model: str | None, flags: str, *extra: str) -> Proc:
    args = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--port", "0", "--metrics-port", "-1",
            "--log-level", "warning", *flags.split(), *extra]
    return Proc(args + (["--model", model] if model else []))


def serving_address(p: Proc) -> str:
    return p.wait_for("SERVING on").split("SERVING on ")[1].split()[0]


def route(*workers: str) -> tuple[Proc, str]:
    p = Proc([sys.executable, "-m", "jaxserve.router.cli", "route", "--port", "0", "--metrics-port", "-1",
              "--log-level", "warning", *workers])
    return p, p.wait_for("routing on").split("routing on ")[1].split()[0]


async def one(client, ids: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps, n = [], 0
    async for ev in client.generate_stream(ids, max_tokens=max_tokens, ignore_eos=True, temperature=0.0):
        if ev.WhichOneof("event") == "delta" and ev.delta.token_ids:
            stamps.append(time.perf_counter())
            n += len(ev.delta.token_ids)
    if n != max_tokens:
        raise RuntimeError(f"got {n} tokens, asked for {max_tokens}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return dict(ttft=stamps[0] - t0, e2e=stamps[-1] - t0, gaps=gaps, tokens=n)


async def run_round(target: str, prompts: list[list[int]], args) -> dict:
    from jaxserve.client import AsyncClient

    client = AsyncClient(target, timeout=600)
    sem = asyncio.Semaphore(args.concurrency)

    async def guarded(ids):
        async with sem:
            return await one(client, ids, args.max_tokens)

    t0 = time.perf_counter()
    recs = await asyncio.gather(*(guarded(p) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    q = lambda xs, p: statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    ttft, gaps = [r["ttft"] for r in recs], [g for r in recs for g in r["gaps"]]
    return dict(ttft_p50=q(ttft, 50), ttft_p90=q(ttft, 90), itl_p50=q(gaps, 50), itl_p90=q(gaps, 90),
                e2e_p50=q([r["e2e"] for r in recs], 50), tok_s=sum(r["tokens"] for r in recs) / wall, wall=wall)


def prompts_for(rng, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[int(x) for x in rng.integers(100, vocab - 1, length)] for _ in range(n)]


def start(args) -> tuple[dict, list[Proc]]:
    model = args.model
    if args.tiny:
        from tests.server.tiny_model import build_tiny_text_model

        model = build_tiny_text_model(Path(tempfile.mkdtemp(prefix="jaxserve_disagg_")) / "tiny")
    procs, targets = [], {}
    try:  # the three workers warm up at once
        for extra in ((), ("--role", "prefill"), ("--role", "decode")):
            procs.append(serve(model, args.worker_flags, *extra))
        both_addr, pre_addr, dec_addr = (serving_address(p) for p in procs)
        r1, targets["colocated_routed"] = route("--worker", both_addr)
        procs.append(r1)
        r2, targets["disagg"] = route("--prefill", pre_addr, "--decode", dec_addr)
        procs.append(r2)
        targets["colocated"] = both_addr
    except BaseException:
        for p in procs:
            p.close()
        raise
    return targets, procs


async def worker_info(target: str):
    from jaxserve.client import AsyncClient

    client = AsyncClient(target, timeout=60)
    info = await client.model_info()
    await client.close()
    return info


def main(argv=None) -> int:
    import numpy as np

    args = parse_args(argv)
    targets, procs = start(args)
    try:
        infos = {name: asyncio.run(worker_info(t)) for name, t in targets.items()}
        vocab = infos["colocated"].vocab_size
        rng = np.random.default_rng(args.seed)
        for name in SETUPS:  # untimed: sampler shapes, connections
            asyncio.run(run_round(targets[name], prompts_for(rng, args.requests, args.prompt_len, vocab), args))
        rounds = {name: [] for name in SETUPS}
        for r in range(args.rounds):
            for name in SETUPS[r % 3:] + SETUPS[:r % 3]:
                res = asyncio.run(run_round(targets[name], prompts_for(rng, args.requests, args.prompt_len, vocab),
                                            args))
                rounds[name].append(res)
                print(f"round {r} {name:17s} " + " ".join(f"{k}={v:.4f}" for k, v in res.items()), flush=True)
    finally:
        for p in reversed(procs):
            p.close()
    report(args, infos, rounds)
    return 0


def report(args, infos, rounds) -> None:
    keys = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "e2e_p50", "tok_s")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in rounds.items()}
    base = med["colocated"]
    print(f"\n{args.requests} requests x {args.prompt_len} prompt tokens x {args.max_tokens} output tokens, "
          f"concurrency {args.concurrency}, median of {args.rounds} rounds; KV: colocated "
          f"{infos['colocated'].decode.kv_cache}, disagg prefill {infos['disagg'].prefill.kv_cache} -> decode "
          f"{infos['disagg'].decode.kv_cache}")
    print("| setup | TTFT p50 ms | TTFT p90 ms | inter-token p50 ms | inter-token p90 ms | e2e p50 ms | output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for name, m in med.items():
        ratio = {k: m[k] / base[k] for k in keys}
        print(f"| {name} | " + " | ".join(f"{m[k] * 1e3:.0f} ({ratio[k]:.2f}x)" for k in keys[:-1])
              + f" | {m['tok_s']:.1f} ({ratio['tok_s']:.2f}x) |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(args=vars(args), median=med, rounds=rounds), indent=1))


if __name__ == "__main__":
    sys.exit(main())
