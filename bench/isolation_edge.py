"""Bounded admission, before and after: two `jaxserve serve --http-port` servers run one after
the other in this process's run, one from a BEFORE source tree (e.g. main exported with
`git archive`) and one from AFTER (default: this checkout), same model, flags and client:

1. RSS growth of the server process while a client sends a 100 MB chunked body (no
   Content-Length) to /v1/completions: peak VmRSS minus VmRSS before, and how many bytes the
   client got to send before the answer came.
2. A well-behaved client's latency (sequential short completions) alone, then while four
   clients send 10,000-message chats in a loop: p50 / p99 and their ratios.

    python bench/isolation_edge.py --before /tmp/jaxserve-main --out bench/results/isolation_edge.json

The tiny text model (random weights, the SmolLM2 tokenizer), context 1024: on a tree without
the message limit a 10,000-message chat is templated and tokenized (~50k tokens) before the
context check refuses it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench"
ENGINE = ["--kv-format", "float32", "--num-pages", "256", "--page-size", "16", "--max-num-seqs", "8",
          "--max-model-len", "1024"]


def tiny_model() -> str:
    sys.path.insert(0, str(REPO))  # the test suite's tiny model: tests.server.tiny_model
    from tests.server.tiny_model import build_tiny_text_model

    return build_tiny_text_model(Path(tempfile.mkdtemp(prefix="jaxserve_iso_")) / "tiny")


def start(tree: str, model: str):
    """-> (process, HTTP port) once SERVING, jaxserve imported from `tree`."""
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", "0", "--metrics-port", "-1", "--http-port", "0", "--served-model-name", MODEL,
           "--log-level", "warning", *ENGINE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tree, env=env)
    port, lines = None, []
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        lines.append(line)
        if "OpenAI-compatible HTTP API on" in line:
            port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        if "SERVING on" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep draining
            return proc, port
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(lines))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def chunked_body(port: int, pid: int, total: int = 100 << 20) -> dict:
    """Send `total` bytes chunked; -> RSS growth (peak - before), bytes sent, the status line."""
    before, peak, stop = rss_bytes(pid), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    head = b'{"model": "%s", "max_tokens": 1, "prompt": "' % MODEL.encode()
    sock.sendall(b"%x\r\n%s\r\n" % (len(head), head))
    piece = b"x" * (1 << 16)
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent, t0, reply = len(head), time.perf_counter(), b""
    while sent < total:
        readable, writable, _ = select.select([sock], [sock], [], 60)
        if readable:
            break
        if writable:
            sock.sendall(chunk)
            sent += len(piece)
    if sent >= total:
        tail = b'"}'
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
    sock.settimeout(120)
    while b"\r\n" not in reply:
        data = sock.recv(4096)
        if not data:
            break
        reply += data
    elapsed = time.perf_counter() - t0
    sock.close()
    time.sleep(0.3)
    stop.set()
    sampler.join()
    return {"rss_before_mb": before / 2**20, "rss_peak_mb": peak[0] / 2**20,
            "rss_growth_mb": (peak[0] - before) / 2**20, "sent_mb": sent / 2**20,
            "status": reply.split(b"\r\n")[0].decode(errors="replace"), "seconds": elapsed}


def post(port: int, path: str, body, timeout: float = 120) -> int:
    """POST `body` (a dict, or JSON bytes encoded once by the caller) -> the status."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body)
    conn.request("POST", path, data, {"content-type": "application/json"})
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status


def latencies(port: int, n: int) -> list[float]:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert post(port, "/v1/completions", body) == 200
        out.append(time.perf_counter() - t0)
    return out


def under_chats(port: int, n: int, clients: int = 4, messages: int = 10_000) -> tuple[list[float], dict]:
    chat = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(messages)]}).encode()
    stop, statuses = threading.Event(), {}

    def abuse():
        while not stop.is_set():
            s = post(port, "/v1/chat/completions", chat)
            statuses[s] = statuses.get(s, 0) + 1

    threads = [threading.Thread(target=abuse, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    try:
        lat = latencies(port, n)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    return lat, statuses


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs) * 1000, q))


def measure(tree: str, model: str, n: int) -> dict:
    proc, port = start(tree, model)
    try:
        latencies(port, 5)  # warm
        res = {"chunked_100mb": chunked_body(port, proc.pid)}
        alone = latencies(port, n)
        loaded, statuses = under_chats(port, n)
        res["well_behaved_ms"] = {
            "alone_p50": pct(alone, 50), "alone_p99": pct(alone, 99),
            "under_10k_message_chats_p50": pct(loaded, 50), "under_10k_message_chats_p99": pct(loaded, 99)}
        res["well_behaved_ms"]["p50_ratio"] = res["well_behaved_ms"]["under_10k_message_chats_p50"] / \
            res["well_behaved_ms"]["alone_p50"]
        res["well_behaved_ms"]["p99_ratio"] = res["well_behaved_ms"]["under_10k_message_chats_p99"] / \
            res["well_behaved_ms"]["alone_p99"]
        res["chat_statuses"] = {str(k): v for k, v in statuses.items()}
        return res
    finally:
        proc.kill()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="source tree of the baseline (e.g. main, exported)")
    ap.add_argument("--after", default=str(REPO), help="source tree measured against it (default: this one)")
    ap.add_argument("--requests", type=int, default=40, help="well-behaved requests per phase")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = tiny_model()
    load = os.getloadavg()
    results = {"before": measure(args.before, model, args.requests), "after": measure(args.after, model, args.requests)}
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "loadavg_start": load,
           "loadavg_end": os.getloadavg(), "engine_flags": ENGINE, "requests": args.requests, **results}
    print(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
