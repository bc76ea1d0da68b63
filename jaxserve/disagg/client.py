"""The disaggregated generation flow, as a client runs it between one prefill worker and one
decode worker (the router runs the same steps): ask the decode worker for its KV layout,
Prefill on the prefill worker (an offer in that layout), then Decode on the decode worker with
the offer, which streams the whole generation (the first token included).

``generate_disaggregated`` returns a ``DisaggResult``: tokens, text, finish reason, usage, and
how the handoff went. A handoff that fails (dead prefill worker, corrupted payload, expired
offer) is retried as a local prefill on the decode worker when ``recompute_on_failure`` (the
default), so the request still ends with its tokens; without it, the error is raised as the
grpc.RpcError the decode worker answered. ``credentials`` (``auth.PeerCredentials``) reach
workers started with TLS (a CA, optional client certificate) and API keys.
"""
from __future__ import annotations

import dataclasses

import grpc

from jaxserve.server.auth import PeerCredentials
from jaxserve.v1 import handoff_pb2 as hpb
from jaxserve.v1 import handoff_pb2_grpc as hpb_grpc
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc


@dataclasses.dataclass
class DisaggResult:
    token_ids: list[int]
    text: str
    finish_reason: int  # pb.FinishReason
    usage: pb.Usage
    offer: hpb.HandoffOffer | None  # None: the prefill worker gave no offer (the decode worker prefilled)
    prefill_error: grpc.StatusCode | None = None  # why there was no offer


def worker_info(channel: grpc.Channel, timeout: float = 10.0, metadata: tuple = ()) -> pb.ModelInfo:
    return pb_grpc.JaxServeStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                                      metadata=metadata or None)


def generate_disaggregated(prefill_addr: str, decode_addr: str, request: pb.GenerateRequest,
                           recompute_on_failure: bool = True, timeout: float = 60.0,
                           before_decode=None, transport: str = "",
                           credentials: PeerCredentials | None = None) -> DisaggResult:
    """One request through a prefill and a decode worker (addresses "host:port").

    A prefill worker that fails or is unreachable leaves the request to the decode worker
    (no offer: it prefills itself), so nothing is lost. ``before_decode(offer)`` runs between
    the two calls (tests use it to inject faults). transport: "grpc" | "transfer" | "" (the
    prefill worker's default)."""
    creds = credentials or PeerCredentials()
    md = creds.metadata or None
    with creds.channel(prefill_addr) as pch, creds.channel(decode_addr) as dch:
        layout = worker_info(dch, timeout, creds.metadata).kv_layout
        offer, perr = None, None
        try:
            offer = hpb_grpc.KvHandoffStub(pch).Prefill(
                hpb.PrefillRequest(request=request, target_kv_layout=layout, transport=transport), timeout=timeout,
                metadata=md)
        except grpc.RpcError as e:
            if not recompute_on_failure:
                raise
            perr = e.code()
        if before_decode is not None and offer is not None:
            before_decode(offer)
        dreq = hpb.DecodeRequest(request=request, recompute_on_failure=recompute_on_failure)
        if offer is not None:
            dreq.offer.CopyFrom(offer)
        ids, text, reason, usage = [], [], pb.FINISH_REASON_UNSPECIFIED, pb.Usage()
        for ev in hpb_grpc.KvHandoffStub(dch).Decode(dreq, timeout=timeout, metadata=md):
            kind = ev.WhichOneof("event")
            if kind == "delta":
                ids += ev.delta.token_ids
                text.append(ev.delta.text)
            elif kind == "end":
                reason, usage = ev.end.finish_reason, ev.end.usage
        return DisaggResult(ids, "".join(text), reason, usage, offer, perr)
