"""A well-behaved client under abuse (issue 27): its latency alone and under each abuse, one run.

    python bench/abuse.py                                  # tiny model, this checkout's server
    python bench/abuse.py --server-root /tmp/main-export   # another checkout's server (before/after)
    python bench/abuse.py --model default                  # the embedded SmolLM2-135M (slower)
    python bench/abuse.py --serve-arg=--client-scheduling=fifo
    python bench/abuse.py --pin --abuse churn              # the abusers on a CPU of their own
    python bench/abuse.py --engine-apart --serve-arg=--max-slots-per-client=2   # the engine on a CPU of its own

Starts `jaxserve serve` (gRPC and the OpenAI HTTP API) with two API keys: one for the
well-behaved client, one shared by every abuser (so, with keys, they are two clients for fair
share). Then, one phase after another: `alone` (the well-behaved client only), then each abuse
of the issue beside it:
- churn: 200 streaming clients (a connection each) start a stream, read its first message and
  disconnect, in rounds (--churn-round-s);
- long_chat: four clients sending chats of 10,000 messages over HTTP;
- big_body: a 100 MB body sent chunked (no Content-Length) to /v1/completions;
- huge_top_k: /v1/completions with top_k 2147483648, repeated;
- malformed: JSON nested 100k deep, a lone surrogate, stream_options "x", 401-digit
  temperature / penalties over HTTP, random bytes as a gRPC Generate.
The well-behaved client (a process of its own, with its own event loop) sends gRPC Generate
calls one after another (20 prompt ids, 16 tokens), and the server's own timing of them (time to first token and total from the call's
arrival at the server: what the engine's queue and steps cost, without the event loop's
delivery). `alone` is measured again at the end (`alone_again`: how much the machine's own load
drifted meanwhile). Per phase: its p50/p90/p99/worst latency and the ratio to `alone` (goal <= 2), its failed
calls, the abusers' outcomes (status codes), and the KV pages still held once the abuse has
stopped (GetModelInfo kv_pages.used after --settle-s at most; goal 0). A benchmark, not a
test: the figures depend on the machine (and on its load, printed with them).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cpu_share import CpuShare  # noqa: E402  (bench/, the running script's folder)
from jaxserve.client import AsyncClient  # noqa: E402

GOOD_KEY, ABUSE_KEY = "good-client-key", "abusive-client-key"
MODEL_NAME = "abuse-bench"
ABUSES = ("churn", "long_chat", "big_body", "huge_top_k", "malformed")
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir, or 'default' for SmolLM2 (default: a tiny "
                                                 "random Llama with the SmolLM2 tokenizer)")
    p.add_argument("--server-root", default=str(REPO), help="checkout whose jaxserve serves (cwd of the server)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `jaxserve serve` flag (repeatable)")
    p.add_argument("--abuse", default=",".join(ABUSES), help=f"comma-separated subset of {','.join(ABUSES)}")
    p.add_argument("--phase-s", type=float, default=12.0, help="seconds the well-behaved client is measured per phase")
    p.add_argument("--ramp-s", type=float, default=1.5, help="seconds an abuse runs before measuring starts")
    p.add_argument("--settle-s", type=float, default=15.0, help="longest wait for the pages after an abuse stops")
    p.add_argument("--churn-clients", type=int, default=200)
    p.add_argument("--churn-round-s", type=float, default=1.0)
    p.add_argument("--chat-clients", type=int, default=4)
    p.add_argument("--chat-messages", type=int, default=10_000)
    p.add_argument("--body-mb", type=float, default=100.0)
    p.add_argument("--pin", action="store_true",
                   help="the server on every CPU but the last, this bench (the well-behaved client and every "
                        "abuser) on the last: the abusers' own CPU kept apart from the server's, as when they "
                        "run on other machines")
    p.add_argument("--engine-apart", action="store_true",
                   help="the server with its engine in a process of its own on the first CPU (--engine-process "
                        "--engine-cpus), its front end on the others with this bench on the last: the engine's "
                        "core kept apart from the front end's and the abusers' (excludes --pin)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "abuse.json"))
    return p.parse_args(argv)


# ---------------------------------------------------------------------- the server
def start_server(args, model: str | None):
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--port", "0", "--http-port", "0",
           "--served-model-name", MODEL_NAME, "--metrics-port", "-1", "--log-level", "warning",
           "--num-pages", "512", "--page-size", "16", "--max-num-seqs", "16", "--max-model-len", "1024",
           "--kv-format", "bf16", *(["--model", model] if model else []), *args.serve_arg]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PYTHONDONTWRITEBYTECODE": "1", "JAXSERVE_API_KEY": f"{GOOD_KEY},{ABUSE_KEY}"}
    cpus = sorted(os.sched_getaffinity(0))
    if (args.pin or args.engine_apart) and len(cpus) < 2:
        raise SystemExit("--pin / --engine-apart need two CPUs at least")
    if args.pin and args.engine_apart:
        raise SystemExit("--pin and --engine-apart place the server differently: choose one")
    server_cpus, bench_cpus = (cpus[:-1], cpus[-1:]) if args.pin else (cpus, cpus[-1:]) if args.engine_apart else (cpus, cpus)
    if args.engine_apart:
        cmd += ["--engine-process", f"--engine-cpus={cpus[0]}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=args.server_root, env=env,
                            preexec_fn=lambda: os.sched_setaffinity(0, server_cpus))
    os.sched_setaffinity(0, bench_cpus)
    args.cpus_of = {"server": server_cpus, "bench": bench_cpus}
    lines, http = [], None
    for line in proc.stdout:
        lines.append(line)
        if "OpenAI-compatible HTTP API on " in line:
            http = urlsplit(line.split("HTTP API on ")[1].split()[0])
        if "SERVING on" in line:
            target = line.split("SERVING on ")[1].split()[0]
            threading_drain(proc)
            return proc, target, (http.hostname, http.port)
    raise RuntimeError("server exited before SERVING:\n" + "".join(lines[-40:]))


def threading_drain(proc) -> None:
    """Keep reading the server's output (a full pipe would block it); the tail is kept."""
    import threading

    tail = collections.deque(maxlen=200)
    proc.log_tail = tail
    threading.Thread(target=lambda: [tail.append(x) for x in proc.stdout], daemon=True).start()


def tiny_model() -> str:
    from tests.server.tiny_model import build_tiny_text_model

    return build_tiny_text_model(Path(tempfile.mkdtemp(prefix="jaxserve_abuse_")) / "tiny")


# ---------------------------------------------------------------------- a raw HTTP/1.1 client
async def http_post(addr, path: str, body=None, chunks=None, timeout: float = 60.0) -> int:
    """POST JSON bytes (``body``) or an async iterator of byte chunks sent chunked; -> status
    (0: the connection failed or closed without one)."""
    try:
        return await asyncio.wait_for(_post(addr, path, body, chunks), timeout)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
        return 0


async def _post(addr, path, body, chunks) -> int:
    reader, writer = await asyncio.open_connection(*addr)
    try:
        head = [f"POST {path} HTTP/1.1", f"host: {addr[0]}:{addr[1]}", "content-type: application/json",
                f"authorization: Bearer {ABUSE_KEY}", "connection: close"]
        if chunks is None:
            writer.write(("\r\n".join(head + [f"content-length: {len(body)}", "", ""])).encode() + body)
        else:
            writer.write(("\r\n".join(head + ["transfer-encoding: chunked", "", ""])).encode())
            try:
                async for c in chunks:
                    writer.write(f"{len(c):x}\r\n".encode() + c + b"\r\n")
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            except (ConnectionError, OSError):  # refused mid-way: read the answer below
                pass
        await writer.drain()
        line = await reader.readline()
        return int(line.split()[1]) if line.startswith(b"HTTP/") else 0
    finally:
        writer.close()


# ---------------------------------------------------------------------- the clients
class Phase:
    def __init__(self, name: str):
        self.name = name
        self.measuring = False
        self.latency: list[float] = []
        self.server_ttft: list[float] = []  # the server's own timing of the same calls: from arrival
        self.server_total: list[float] = []  # at the server to the first token / to the end
        self.good_failed = collections.Counter()
        self.outcomes = collections.Counter()


async def good_client(target: str, phase: Phase, stop: asyncio.Event, rng: random.Random, ready=None) -> None:
    async with AsyncClient(target, timeout=120, api_key=GOOD_KEY,
                           channel=grpc.aio.insecure_channel(target, options=OWN_CONNECTION)) as client:
        while not stop.is_set():
            prompt = [rng.randrange(100, 40000) for _ in range(20)]
            t = time.perf_counter()
            try:
                r = await client.generate(prompt, max_tokens=16, ignore_eos=True)
                ok = len(r.token_ids) == 16
            except grpc.RpcError as e:
                ok = False
                if phase.measuring:
                    phase.good_failed[e.code().name] += 1
                await asyncio.sleep(0.05)
            if ready is not None:
                ready.set()
            if ok and phase.measuring:
                phase.latency.append(time.perf_counter() - t)
                phase.server_ttft.append(r.timing.time_to_first_token_s)
                phase.server_total.append(r.timing.total_s)


class _RemotePhase(Phase):
    """The good client's phase in its own process: measuring while the parent's event is set."""

    def __init__(self, measuring):
        super().__init__("good")
        self._measuring = measuring

    measuring = property(lambda self: self._measuring.is_set(), lambda self, v: None)


def good_client_process(target: str, seed: float, ready, measuring, stop, out) -> None:
    """The well-behaved client in a process of its own (its own event loop and gRPC poller: a
    client on another machine), so the abusers' event loop does not delay what it measures."""
    phase = _RemotePhase(measuring)

    async def main():
        done = asyncio.Event()

        async def watch():
            while not stop.is_set():
                await asyncio.sleep(0.02)
            done.set()

        watcher = asyncio.ensure_future(watch())
        await good_client(target, phase, done, random.Random(seed), ready)
        await watcher

    asyncio.run(main())
    out.put((phase.latency, phase.server_ttft, phase.server_total, dict(phase.good_failed)))


async def churn(args, target, phase: Phase, stop: asyncio.Event, rng: random.Random) -> None:
    clients = [AsyncClient(target, timeout=60, api_key=ABUSE_KEY,
                           channel=grpc.aio.insecure_channel(target, options=OWN_CONNECTION))
               for _ in range(args.churn_clients)]

    async def one(client, until):
        call = client.generate_stream([rng.randrange(100, 40000) for _ in range(20)], max_tokens=256,
                                      ignore_eos=True)
        try:
            await asyncio.wait_for(anext(aiter(call)), max(0.01, until - time.monotonic()))
            phase.outcomes["churn:first_message"] += 1
            await asyncio.sleep(max(0.0, until - time.monotonic()))
        except asyncio.TimeoutError:
            phase.outcomes["churn:no_message_in_round"] += 1
        except grpc.RpcError as e:
            phase.outcomes[f"churn:{e.code().name}"] += 1
        finally:
            call.cancel()  # the client goes away

    try:
        while not stop.is_set():
            until = time.monotonic() + args.churn_round_s
            await asyncio.gather(*(one(c, until) for c in clients))
            phase.outcomes["churn:rounds"] += 1
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def http_loop(name: str, phase: Phase, stop: asyncio.Event, make_request, pause: float = 0.0) -> None:
    while not stop.is_set():
        status = await make_request()
        phase.outcomes[f"{name}:{status or 'no_status'}"] += 1
        await asyncio.sleep(pause)


def long_chat_body(n: int) -> bytes:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} of a long chat"}
            for i in range(n - 1)] + [{"role": "user", "content": "and now?"}]
    return json.dumps({"model": MODEL_NAME, "messages": msgs, "max_tokens": 4}).encode()


async def big_chunks(mb: float):
    n = int(mb * (1 << 20))
    yield b'{"model": "' + MODEL_NAME.encode() + b'", "max_tokens": 4, "prompt": "'
    block = b"a" * (1 << 20)
    for _ in range(n >> 20):
        yield block
    yield b'"}'


def malformed_bodies() -> list[bytes]:
    digits = "9" * 401
    base = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
    out = [b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
           b'{"model": "%s", "prompt": "\\ud800", "max_tokens": 4}' % MODEL_NAME.encode(),
           json.dumps(dict(base, stream=True, stream_options="x")).encode()]
    for field in ("temperature", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        out.append(json.dumps(base)[:-1].encode() + f', "{field}": {digits}}}'.encode())
    return out


async def grpc_garbage(target, phase: Phase, stop: asyncio.Event, rng: random.Random) -> None:
    async with AsyncClient(target, timeout=10, api_key=ABUSE_KEY) as client:
        call = client.channel.unary_unary("/jaxserve.v1.JaxServe/Generate")
        md = (("authorization", f"Bearer {ABUSE_KEY}"),)
        while not stop.is_set():
            try:
                await call(bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))), timeout=10, metadata=md)
                phase.outcomes["grpc_garbage:OK"] += 1
            except grpc.RpcError as e:
                phase.outcomes[f"grpc_garbage:{e.code().name}"] += 1
            await asyncio.sleep(0.05)


def abusers(kind: str, args, target, http, phase, stop, rng) -> list:
    if kind == "churn":
        return [churn(args, target, phase, stop, rng)]
    if kind == "long_chat":
        body = long_chat_body(args.chat_messages)
        return [http_loop("long_chat", phase, stop, lambda: http_post(http, "/v1/chat/completions", body))
                for _ in range(args.chat_clients)]
    if kind == "big_body":
        return [http_loop("big_body", phase, stop,
                          lambda: http_post(http, "/v1/completions", chunks=big_chunks(args.body_mb), timeout=120))]
    if kind == "huge_top_k":
        body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "top_k": 2147483648}).encode()
        return [http_loop("huge_top_k", phase, stop, lambda: http_post(http, "/v1/completions", body), 0.05)]
    if kind == "malformed":
        bodies = malformed_bodies()
        it = iter(range(10**9))
        return [http_loop("malformed", phase, stop,
                          lambda: http_post(http, "/v1/completions", bodies[next(it) % len(bodies)]), 0.02),
                grpc_garbage(target, phase, stop, rng)]
    raise SystemExit(f"unknown abuse {kind!r}; choose from {ABUSES}")


# ---------------------------------------------------------------------- phases
async def pages_used(target: str) -> int | None:
    try:
        async with AsyncClient(target, timeout=10, api_key=GOOD_KEY) as client:
            return (await client.model_info()).kv_pages.used
    except grpc.RpcError:
        return None


async def run_phase(kind: str, args, target, http, rng) -> Phase:
    phase, stop = Phase(kind), asyncio.Event()
    mp = multiprocessing.get_context("spawn")
    ready, measuring, good_stop, out = mp.Event(), mp.Event(), mp.Event(), mp.Queue()
    good = mp.Process(target=good_client_process, args=(target, rng.random(), ready, measuring, good_stop, out))
    good.start()
    if not await asyncio.to_thread(ready.wait, 120):
        raise RuntimeError("the well-behaved client's first call did not return in 120 s")
    tasks = [asyncio.ensure_future(c) for c in abusers(kind, args, target, http, phase, stop, rng)] if kind != "alone" else []
    await asyncio.sleep(args.ramp_s)
    measuring.set()
    share = CpuShare(args.server_pid)
    await asyncio.sleep(args.phase_s)
    measuring.clear()
    phase.cores = share.cores()
    stop.set()
    good_stop.set()
    t = time.monotonic()
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=10)
        for task in pending:  # a long call in flight (a 100 MB body): the client goes away
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    phase.latency, phase.server_ttft, phase.server_total, failed = await asyncio.to_thread(out.get, True, 150)
    phase.good_failed.update(failed)
    await asyncio.to_thread(good.join, 30)
    used = await pages_used(target)
    while used and time.monotonic() - t < args.settle_s:
        await asyncio.sleep(0.25)
        used = await pages_used(target)
    phase.pages_held_after, phase.settle_s = used, round(time.monotonic() - t, 1)
    return phase


def pct(xs) -> dict:
    """p50, p90, p99 and the worst in ms. With a phase's ~100 calls the p99 is its worst call
    or next to it: the p90 says whether a slow tail or one pause."""
    if not xs:
        return {"n": 0}
    return {**{f"p{q}_ms": round(float(np.percentile(xs, q)) * 1e3, 1) for q in (50, 90, 99)},
            "max_ms": round(max(xs) * 1e3, 1), "n": len(xs)}


async def run(args, target, http) -> list[Phase]:
    rng = random.Random(args.seed)
    phases = []
    kinds = ["alone", *[k for k in args.abuse.split(",") if k], "alone_again"]
    for kind in kinds:
        phases.append(await run_phase(kind.removesuffix("_again") if kind == "alone_again" else kind,
                                      args, target, http, rng))
        phases[-1].name = kind
        p = phases[-1]
        print(f"  {kind:<11} good {pct(p.latency)} failed {dict(p.good_failed)} pages after "
              f"{p.pages_held_after} ({p.settle_s}s), cores used {p.cores}", flush=True)
    return phases


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` too stops the server (finally below)
    model = None if args.model == "default" else (args.model or tiny_model())
    t0 = time.monotonic()
    proc, target, http = start_server(args, model)
    args.server_pid = proc.pid
    start_s = time.monotonic() - t0
    try:
        phases = asyncio.run(run(args, target, http))
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    alone = pct(phases[0].latency)
    rows = {}
    for p in phases:
        lat = pct(p.latency)
        ratio = {f"{q}_ratio": round(lat[f"{q}_ms"] / alone[f"{q}_ms"], 2) if lat["n"] and alone["n"] else None
                 for q in ("p50", "p90", "p99")}
        server = {f"server_{w}_p{q}_ms": round(float(np.percentile(xs, q)) * 1e3, 1) if xs else None
                  for w, xs in (("ttft", p.server_ttft), ("total", p.server_total)) for q in (50, 99)}
        rows[p.name] = dict(good=lat, **ratio, **server, good_failed=dict(p.good_failed), pages_held_after=p.pages_held_after,
                            settle_s=p.settle_s, cores_used=p.cores, abuser_outcomes=dict(sorted(p.outcomes.items())),
                            latency_ms=[round(x * 1e3, 1) for x in p.latency])
    report = dict(server_root=args.server_root, model=args.model or "tiny (random 2-layer Llama, SmolLM2 tokenizer)",
                  serve_args=args.serve_arg, phase_s=args.phase_s, pinned=args.pin, engine_apart=args.engine_apart, cpus_of=args.cpus_of, server_start_s=round(start_s, 1),
                  server_alive_at_end=alive, load_avg=os.getloadavg(), cpus=os.cpu_count(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), phases=rows,
                  server_log_tail=list(getattr(proc, "log_tail", []))[-20:])
    print(json.dumps({k: v for k, v in report.items() if k != "server_log_tail"} |
                     {"phases": {n: {k: v for k, v in r.items() if k != "latency_ms"} for n, r in rows.items()}}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
