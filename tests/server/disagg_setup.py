"""What the disaggregated tests share: the workers' engine flags (one set, so every worker and
reference engine compiles the same programs and reads them from the test compile cache), and
the steps of a handoff driven by hand from the test process: Prefill on a prefill worker,
PullPages of the offer's bytes, and an in-process engine that imports exactly those pages (the
single-process reference of a handed-off request). ``creds`` (``auth.PeerCredentials``) reach
workers started with TLS and API keys; None: plaintext, no key."""
from __future__ import annotations

import sys

from jaxserve.server.auth import PeerCredentials
from jaxserve.v1 import handoff_pb2 as hpb
from jaxserve.v1 import handoff_pb2_grpc as hpb_grpc

# Small batches: few warm-up buckets (each worker compiles its own, cold in CI); a context that
# holds a chat prompt with tools described in it (tests/server/constrained.py) and its call.
ENGINE_KW = dict(num_pages=48, page_size=8, max_num_seqs=2, max_prefill_seqs=1, prefill_chunk=32,
                 max_num_batched_tokens=32, max_model_len=256)


def worker_args(model: str, *extra: str) -> list[str]:
    """`jaxserve serve` on a free port with ENGINE_KW (metrics on a free port too)."""
    args = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--model", model, "--port", "0",
            "--metrics-port", "0", "--log-level", "warning", "--drain-timeout", "5"]
    for key, value in ENGINE_KW.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args + list(extra)


def served_address(line: str) -> str:
    """The address in a worker's "jaxserve: SERVING on ADDR (...)" line."""
    return line.split("SERVING on ")[1].split()[0]


def metrics_port(output: str) -> int:
    """The metrics port a worker printed ("... metrics port N)")."""
    return int(output.split("metrics port ")[1].split(")")[0])


def prefill(addr: str, req, layout: str, timeout: float = 60, creds: PeerCredentials | None = None,
            transport: str = "") -> hpb.HandoffOffer:
    creds = creds or PeerCredentials()
    with creds.channel(addr) as ch:
        return hpb_grpc.KvHandoffStub(ch).Prefill(
            hpb.PrefillRequest(request=req, target_kv_layout=layout, transport=transport), timeout=timeout,
            metadata=creds.metadata or None)


def pull_bytes(addr: str, offer, creds: PeerCredentials | None = None) -> bytes:
    """An offer's payload over PullPages (the offer stays until released)."""
    creds = creds or PeerCredentials()
    with creds.channel(addr) as ch:
        chunks = list(hpb_grpc.KvHandoffStub(ch).PullPages(hpb.PullPagesRequest(transfer_id=offer.transfer_id),
                                                            timeout=30, metadata=creds.metadata or None))
    assert [c.index for c in chunks] == list(range(len(chunks))) and chunks[-1].last
    return b"".join(c.data for c in chunks)


def release(addr: str, offer, pulled: bool = True, creds: PeerCredentials | None = None) -> bool:
    creds = creds or PeerCredentials()
    with creds.channel(addr) as ch:
        return hpb_grpc.KvHandoffStub(ch).Release(hpb.ReleaseRequest(transfer_id=offer.transfer_id, pulled=pulled),
                                                  timeout=30, metadata=creds.metadata or None).released


def payload_of(llm, offer, data: bytes):
    """The offer's bytes as a KvPayload in `llm`'s own KV format."""
    from jaxserve.kv import handoff

    h, fmt = llm.engine.runner.handoff, llm.engine.runner.fmt.name
    n = -(-offer.num_tokens // ENGINE_KW["page_size"])
    return handoff.from_bytes(data, h.specs(fmt, n), h.leaf_axes(), n, fmt)


def import_reference(llm, offer, payload, params, request_id: str) -> list[int]:
    """The completion of `llm` (one process) for the offer's prompt, its pages imported from
    `payload` and its first token the offer's: what a decode worker must produce."""
    from jaxserve.disagg.handoff_request import KvImport

    rid = llm.engine.add_request(list(offer.prompt_token_ids), params, request_id, kv_import=KvImport(
        payload, offer.digest, offer.first_token_ids[0], offer.cached_tokens))
    llm.engine.run_until_done()
    return list(llm.engine.completion(rid))
