"""Reliability soak: well-behaved clients beside abusive ones, against a `jaxserve serve` subprocess.

    python bench/soak.py --minutes 3                                  # tiny model, this checkout's server
    python bench/soak.py --minutes 1 --server-root /work/other/checkout   # another checkout's server
    python bench/soak.py --serve-arg=--stream-idle-timeout=5          # extra `serve` flags

Phase 1 (--baseline-s): well-behaved clients alone. Phase 2 (the rest of --minutes): the
same clients while abusive ones run: huge text prompts (--huge-prompt-mb), requests with
--stop-strings stop strings, streams opened and never read (on connections with a 64-byte
flow-control window), malformed request bytes, invalid parameters, and requests cancelled or
expired mid-way. At the end the abusers' connections stay open while SIGTERM drains the server.

Prints (and writes as JSON): requests lost (a well-behaved request that did not complete,
or any call that ended without a gRPC status), KV pages leaked after the traffic stops,
latency percentiles of the well-behaved clients in each phase, outcomes of every kind of
traffic, the drain time, and the server's peak RSS (VmHWM). Exit code 1 if anything was
lost or leaked. A benchmark, not a test: the figures depend on the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxserve.client import AsyncClient  # noqa: E402

WORDS = "the of and a to in is you that it he was for on are as with his they at be this from".split()
ABUSE = ("huge_prompt", "stop_strings", "malformed", "invalid", "cancelled", "expired", "unread")
UNREAD_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.lookahead_bytes", 64),
                  ("grpc.http2.bdp_probe", 0)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0, help="whole run (baseline included)")
    p.add_argument("--baseline-s", type=float, default=20.0, help="well-behaved clients alone first")
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random Llama with a tokenizer)")
    p.add_argument("--server-root", default=str(REPO), help="checkout whose jaxserve serves (cwd of the server)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `jaxserve serve` flag (repeatable)")
    p.add_argument("--good-clients", type=int, default=4)
    p.add_argument("--huge-prompt-mb", type=float, default=3.5)
    p.add_argument("--stop-strings", type=int, default=100_000)
    p.add_argument("--unread-per-s", type=float, default=2.0, help="unread streams opened per second")
    p.add_argument("--abuse", default=",".join(ABUSE),
                   help=f"comma-separated kinds of abuse to run (default all: {','.join(ABUSE)})")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "soak.json"))
    return p.parse_args(argv)


def start_server(args, model: str):
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--model", model, "--port", "0",
           "--metrics-port", "-1", "--log-level", "warning", "--drain-timeout", str(args.drain_timeout),
           "--num-pages", "256", "--page-size", "16", "--max-num-seqs", "16", "--max-model-len", "1024",
           "--kv-format", "bf16", *args.serve_arg]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=args.server_root, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "SERVING on" in line:
            return proc, line.split("SERVING on ")[1].split()[0]
    raise RuntimeError("server exited before SERVING:\n" + "".join(lines))


def tiny_model() -> str:
    from tests.server.tiny_model import build_tiny_text_model

    return build_tiny_text_model(Path(tempfile.mkdtemp(prefix="jaxserve_soak_")) / "tiny")


class Tally:
    def __init__(self):
        self.outcomes = collections.Counter()  # (kind, outcome)
        self.latency = collections.defaultdict(list)  # phase -> seconds (well-behaved, completed)
        self.lost = []  # descriptions

    def status(self, kind: str, e: BaseException) -> None:
        if isinstance(e, grpc.RpcError) and isinstance(e.code(), grpc.StatusCode):
            self.outcomes[(kind, e.code().name)] += 1
        else:
            self.outcomes[(kind, "NO_STATUS")] += 1
            self.lost.append(f"{kind}: {type(e).__name__}: {e}")


async def good_client(target: str, rng: random.Random, tally: Tally, phase: list, stop_at: float) -> None:
    async with AsyncClient(target, timeout=120) as client:
        while time.monotonic() < stop_at:
            kw = dict(max_tokens=rng.choice([8, 16, 32]), ignore_eos=True)
            prompt = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) if rng.random() < 0.5
                      else [rng.randrange(100, 40000) for _ in range(rng.randint(4, 60))])
            t = time.perf_counter()
            try:
                if rng.random() < 0.5:
                    r = await client.generate(prompt, **kw)
                    n = len(r.token_ids)
                else:
                    n = 0
                    async for ev in client.generate_stream(prompt, **kw):
                        n += len(ev.delta.token_ids)
                if n != kw["max_tokens"]:
                    tally.lost.append(f"good: {n} tokens, wanted {kw['max_tokens']}")
                tally.latency[phase[0]].append(time.perf_counter() - t)
                tally.outcomes[("good", "OK")] += 1
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the queue is full: allowed, retried
                    tally.outcomes[("good", "RESOURCE_EXHAUSTED")] += 1
                    await asyncio.sleep(0.05)
                    continue
                tally.status("good", e)
                tally.lost.append(f"good: {e.code().name}: {e.details()}")
            except Exception as e:
                tally.status("good", e)


async def abuser(name: str, target: str, rng: random.Random, tally: Tally, stop_at: float, args) -> None:
    """One kind of abuse in a loop until stop_at."""
    n_bytes = int(args.huge_prompt_mb * 1e6)
    huge = " ".join(rng.choice(WORDS) for _ in range(n_bytes // 3))[:n_bytes]  # ~3.7 bytes a word
    stops = [f"zq{i}x" for i in range(args.stop_strings)]
    async with AsyncClient(target, timeout=60) as client:
        while time.monotonic() < stop_at:
            try:
                if name == "huge_prompt":
                    await client.generate(huge, max_tokens=4)
                elif name == "stop_strings":
                    await client.generate([5, 6, 7, 8], max_tokens=16, ignore_eos=True, stop=stops)
                elif name == "malformed":
                    await client.channel.unary_unary("/jaxserve.v1.JaxServe/Generate")(
                        bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))), timeout=10)
                elif name == "invalid":
                    await client.generate([5, 6], max_tokens=4, temperature=-1.0)
                elif name == "cancelled":
                    call = client.generate_stream([rng.randrange(100, 40000) for _ in range(20)], max_tokens=200,
                                                  ignore_eos=True)
                    async for _ in call:
                        break
                    call.cancel()
                    tally.outcomes[(name, "CANCELLED_BY_CLIENT")] += 1
                elif name == "expired":
                    await client.generate([rng.randrange(100, 40000) for _ in range(20)], max_tokens=500,
                                          ignore_eos=True, timeout=0.3)
                if name != "cancelled":
                    tally.outcomes[(name, "OK")] += 1
            except Exception as e:
                tally.status(name, e)
            await asyncio.sleep(0.2 if name in ("huge_prompt", "stop_strings") else 0.05)


async def unread_streams(target: str, tally: Tally, stop_at: float, per_s: float, channels: list) -> None:
    """Open streams and never read them; the connections stay open until the drain."""
    channel = grpc.aio.insecure_channel(target, options=UNREAD_OPTIONS)
    channels.append(channel)
    client = AsyncClient(target, channel=channel)
    opened = 0
    while time.monotonic() < stop_at:
        if opened and opened % 50 == 0:  # a fresh connection now and then (per-connection caps)
            channel = grpc.aio.insecure_channel(target, options=UNREAD_OPTIONS)
            channels.append(channel)
            client = AsyncClient(target, channel=channel)
        channels.append(client.generate_stream([7] * 16, max_tokens=900, ignore_eos=True))  # the call object
        opened += 1
        tally.outcomes[("unread", "OPENED")] += 1
        await asyncio.sleep(1.0 / per_s)


async def kv_used(target: str) -> int:
    async with AsyncClient(target, timeout=30) as client:
        return (await client.model_info()).kv_pages.used


async def run(args, target: str, proc) -> dict:
    rng = random.Random(args.seed)
    tally, phase = Tally(), ["baseline"]
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    goods = [asyncio.ensure_future(good_client(target, random.Random(rng.random()), tally, phase, end))
             for _ in range(args.good_clients)]
    await asyncio.sleep(args.baseline_s)
    phase[0] = "abuse"
    kinds = [k for k in args.abuse.split(",") if k]
    unknown = set(kinds) - set(ABUSE)
    if unknown:
        raise SystemExit(f"unknown --abuse kinds {sorted(unknown)}; choose from {ABUSE}")
    abusers = [asyncio.ensure_future(abuser(k, target, random.Random(rng.random()), tally, end, args))
               for k in kinds if k != "unread"]
    unread_channels: list = []
    if "unread" in kinds:
        abusers.append(asyncio.ensure_future(unread_streams(target, tally, end, args.unread_per_s, unread_channels)))
    await asyncio.gather(*goods, *abusers)
    # The finite requests are done; unread streams may still hold pages until their timeout.
    leak_deadline = time.monotonic() + 60
    used = await kv_used(target)
    while used and time.monotonic() < leak_deadline and proc.poll() is None:
        await asyncio.sleep(1.0)
        used = await kv_used(target)
    kv_after_s = round(time.monotonic() - end, 1)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # with the unread streams' connections still open
    while proc.poll() is None and time.monotonic() - t < args.drain_timeout + 30:
        await asyncio.sleep(0.1)
    drain_s = time.monotonic() - t
    for ch in unread_channels:
        if hasattr(ch, "close"):
            await ch.close()
    return dict(tally=tally, kv_used_at_end=used, kv_settled_after_s=kv_after_s, drain_s=round(drain_s, 2))


def pct(xs) -> dict:
    if not xs:
        return {}
    return {f"p{q}_ms": round(float(np.percentile(xs, q)) * 1000, 1) for q in (50, 99)} | {
        "max_ms": round(max(xs) * 1000, 1), "n": len(xs)}


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model or tiny_model()
    proc, target = start_server(args, model)
    rss = {"peak": None}

    async def with_rss():
        async def watch():
            while proc.poll() is None:
                rss["peak"] = peak_rss_mb(proc.pid) or rss["peak"]
                await asyncio.sleep(0.5)

        w = asyncio.ensure_future(watch())
        try:
            return await run(args, target, proc)
        finally:
            w.cancel()

    try:
        res = asyncio.run(with_rss())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    tally = res.pop("tally")
    lat = {k: pct(v) for k, v in tally.latency.items()}
    p99 = [lat.get(k, {}).get("p99_ms") for k in ("baseline", "abuse")]
    report = dict(
        server_root=args.server_root, serve_args=args.serve_arg, minutes=args.minutes, abuse=args.abuse,
        requests_lost=len(tally.lost), lost_examples=tally.lost[:10], pages_leaked=res["kv_used_at_end"],
        kv_settled_after_s=res["kv_settled_after_s"], good_latency=lat,
        p99_ratio_abuse_vs_baseline=round(p99[1] / p99[0], 2) if all(p99) else None,
        outcomes={f"{k}:{o}": n for (k, o), n in sorted(tally.outcomes.items())},
        drain_s=res["drain_s"], exit_code=proc.returncode, peak_rss_mb=rss["peak"],
    )
    print(json.dumps(report, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["requests_lost"] or report["pages_leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
