"""KV handoff throughput: a prefill worker process (``jaxserve serve --role prefill``, bf16 pool)
offers a prompt's pages, converted to bf16 (no conversion) or fp8_e4m3 (the decode default),
and this process pulls them the way a decode worker does, over each transport
(``KvHandoff.PullPages`` grpc stream; ``jax.experimental.transfer``). Reported per prompt
length: payload bytes (and what the fp8 conversion saves), pull MB/s per transport (median of
the repetitions), and the decode side's digest-checked import into its pool.

    .venv/bin/python bench/kv_handoff.py                          # SmolLM2-135M, 256 / 1024 / 2048 tokens
    .venv/bin/python bench/kv_handoff.py --tokens 128,512 --reps 3 --json bench/results/kv_handoff.json

The pull time is from the request to the payload on this process's device (grpc: the bytes
parsed into arrays; transfer: the arrays ready); the prefill and the export (gather, convert,
digest) happen before the offer and are not in it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time


def start_prefill_worker(model: str, max_len: int, page_size: int):
    args = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--model", model, "--port", "0",
            "--metrics-port", "-1", "--log-level", "warning", "--role", "prefill", "--kv-format", "bf16",
            "--page-size", str(page_size), "--max-model-len", str(max_len), "--num-pages", str(max_len // page_size + 8),
            "--max-num-seqs", "1", "--max-prefill-seqs", "1", "--prefill-chunk", "512",
            "--max-num-batched-tokens", "512", "--handoff-ttl", "300"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, JAXSERVE_STRICT_COMPILES="0"))
    for line in proc.stdout:
        if "SERVING on" in line:
            return proc, line.split("SERVING on ")[1].split()[0]
    raise RuntimeError("the prefill worker did not start")


async def measure(addr, decode_engine, layouts, tokens_list, reps, vocab):
    import grpc
    import jax
    import numpy as np

    from jaxserve.kv.handoff import parse_digest
    from jaxserve.disagg.transport import GrpcTransport, JaxTransferTransport
    from jaxserve.v1 import handoff_pb2 as hpb
    from jaxserve.v1 import handoff_pb2_grpc as hpb_grpc
    from jaxserve.v1 import jaxserve_pb2 as pb

    channel = grpc.aio.insecure_channel(addr)
    stub = hpb_grpc.KvHandoffStub(channel)
    transports = {"grpc": GrpcTransport(lambda _: channel), "transfer": JaxTransferTransport()}
    rows = []
    rng = np.random.default_rng(0)
    for n_tok in tokens_list:
        ids = [int(x) for x in rng.integers(100, vocab - 1, n_tok)]
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), stop=pb.StopCriteria(max_tokens=1))
        for fmt, engine in decode_engine.items():
            h = engine.runner.handoff
            for name, tr in transports.items():
                times, nbytes, payload, offer = [], 0, None, None
                for _ in range(reps + 1):  # the first is a warm-up (connections, compilation)
                    offer = await stub.Prefill(hpb.PrefillRequest(request=req, target_kv_layout=layouts[fmt],
                                                                  transport=name), timeout=600)
                    n = -(-offer.num_tokens // h.page_size)
                    t0 = time.perf_counter()
                    payload = await tr.pull(offer, h.specs(fmt, n), h.leaf_axes(), n, fmt, 120)
                    jax.block_until_ready(jax.device_put(payload.leaves))
                    times.append(time.perf_counter() - t0)
                    await stub.Release(hpb.ReleaseRequest(transfer_id=offer.transfer_id, pulled=True))
                    nbytes = offer.payload_bytes
                times = times[1:]
                med = float(np.median(times))
                imp = []
                pages = list(range(1, n + 1))
                for _ in range(reps + 1):
                    t0 = time.perf_counter()
                    ok, _ = engine.runner.import_pages(pages, payload, parse_digest(offer.digest))
                    imp.append(time.perf_counter() - t0)
                rows.append(dict(tokens=n_tok, format=fmt, transport=name, payload_bytes=nbytes,
                                 wire_bytes=sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in payload.leaves)
                                 if name == "transfer" else nbytes,
                                 pull_s=med, pull_mb_s=nbytes / med / 1e6, import_s=float(np.median(imp[1:])),
                                 digest_ok=bool(ok)))
                print(json.dumps(rows[-1]), flush=True)
    await channel.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the embedded SmolLM2-135M)")
    ap.add_argument("--tokens", default="256,1024,2048", help="prompt lengths")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.model is None:
        from jaxserve.checkpoint.gguf import default_model_dir

        args.model = str(default_model_dir())
    max_len = max(tokens) + 64
    proc, addr = start_prefill_worker(args.model, max_len, args.page_size)
    try:
        from jaxserve import LLM
        from jaxserve.bench.measure import machine_info

        kw = dict(num_pages=max_len // args.page_size + 8, page_size=args.page_size, max_model_len=max_len,
                  role="decode")
        engines = {fmt: LLM(args.model, kv_format=fmt, **kw).engine for fmt in ("bf16", "fp8_e4m3")}
        layouts = {fmt: e.kv_layout() for fmt, e in engines.items()}
        vocab = next(iter(engines.values())).cfg.vocab_size
        rows = asyncio.run(measure(addr, engines, layouts, tokens, args.reps, vocab))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"\n{'tokens':>7} {'format':>9} {'transport':>9} {'payload MB':>10} {'pull ms':>8} {'MB/s':>7} {'import ms':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['format']:>9} {r['transport']:>9} {r['payload_bytes'] / 1e6:>10.2f} "
              f"{r['pull_s'] * 1e3:>8.1f} {r['pull_mb_s']:>7.0f} {r['import_s'] * 1e3:>9.1f}")
    for t in tokens:
        b = {r["format"]: r["payload_bytes"] for r in rows if r["tokens"] == t}
        print(f"{t} tokens: fp8_e4m3 payload = {b['fp8_e4m3'] / b['bf16']:.3f} x bf16 "
              f"({(b['bf16'] - b['fp8_e4m3']) / 1e6:.2f} MB saved)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine_info(), model=os.path.basename(args.model.rstrip("/")), rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
