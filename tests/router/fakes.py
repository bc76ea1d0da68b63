"""In-process fake workers for router tests: grpc.aio servers with grpc health, JaxServe and
KvHandoff, whose tokens can be computed by hand (``expected_tokens``), with switches for the
failures a router must survive (an error before the first token, death mid-stream, a hang,
a failed pull, a fingerprint mismatch) and a record of what each one was asked.

The KvHandoff side is honest enough to exercise routing: a prefill worker keeps each offer until
it is released; a decode worker checks the offer's fingerprint (FAILED_PRECONDITION), "pulls" by
asking the offering worker whether the offer is still there (ABORTED when not, or when told to
fail), releases it, and streams the offer's first token followed by the rest; with
``recompute_on_failure`` (or no offer) it computes the prompt itself: the same tokens.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve.engine.prefix_cache import hash_page, page_tokens
from jaxserve.v1 import handoff_pb2 as hpb
from jaxserve.v1 import handoff_pb2_grpc as hgrpc
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

PAGE_SIZE = 4


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """The fake model: token i depends on the whole prompt and i."""
    base = sum((i + 1) * t for i, t in enumerate(prompt))
    return [(base * 31 + 7 * i) % 50_000 for i in range(n)]


def text_ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@dataclasses.dataclass
class Switches:
    fail_before_start: grpc.StatusCode | None = None  # every generation call fails with it, before Start
    fail_details: str = "fake failure"
    die_after_tokens: int | None = None  # UNAVAILABLE after this many tokens
    hang_after_tokens: int | None = None  # stop sending (the call stays open) after this many
    token_delay_s: float = 0.0
    delta_text_bytes: int = 0  # pad each delta's text to this size (to fill flow-control windows)
    fail_prefill: grpc.StatusCode | None = None
    prefill_delay_s: float = 0.0
    kv_free: int = 64  # of 64 pages, reported in GetModelInfo (the router's load signal)
    fail_pulls: int = 0  # this many Decode calls fail their pull with ABORTED
    fingerprint: str = "fp-A"  # what offers carry and Decode compares
    # With `advertise`, ModelInfo carries role, kv_layout and the fingerprint (as
    # handoff_fingerprint), as a real worker's does; a decode worker with a kv_layout refuses
    # offers in another one (FAILED_PRECONDITION).
    advertise: bool = False
    role: str = ""
    kv_layout: str = ""


class LoopThread:
    """An event loop on a daemon thread, for the fake servers."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


class FakeWorker(pb_grpc.JaxServeServicer, hgrpc.KvHandoffServicer):
    def __init__(self, name: str):
        self.name = name
        self.sw = Switches()
        self.calls: list[tuple[str, str, str]] = []  # (rpc, request_id, session)
        self.cancelled: list[str] = []  # request ids whose call the router cancelled
        self.offers: dict[str, hpb.HandoffOffer] = {}  # live offers (prefill role)
        self.released: list[tuple[str, bool]] = []
        self.decode_requests: list[hpb.DecodeRequest] = []
        self.prefill_requests: list[hpb.PrefillRequest] = []
        self.cached: set[int] = set()  # chain hashes this worker "holds"
        self.running: dict[str, asyncio.Event] = {}  # request id -> abort flag
        self.server = self.health = None
        self.port = 0

    async def start(self) -> None:
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        pb_grpc.add_JaxServeServicer_to_server(self, self.server)
        hgrpc.add_KvHandoffServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        s = health_pb2.HealthCheckResponse
        await self.health.set("", s.SERVING if serving else s.NOT_SERVING)

    # ---------------------------------------------------------------- the fake model
    def _cached_tokens(self, ids: list[int]) -> int:
        parent, hits = None, 0
        for i in range((len(ids) - 1) // PAGE_SIZE):
            parent = hash_page(parent, page_tokens(ids, i, PAGE_SIZE))
            if parent not in self.cached:
                break
            hits += 1
        parent = None
        for i in range(len(ids) // PAGE_SIZE):
            parent = hash_page(parent, page_tokens(ids, i, PAGE_SIZE))
            self.cached.add(parent)
        return hits * PAGE_SIZE

    @staticmethod
    def _ids(req: pb.GenerateRequest) -> list[int]:
        return list(req.token_ids.ids) if req.WhichOneof("prompt") == "token_ids" else text_ids(req.text)

    async def _stream(self, req: pb.GenerateRequest, context, tokens: list[int], cached: int):
        """Start, one Delta per token (with the switches applied), End."""
        sw, rid, t0, ttft = self.sw, req.request_id, time.perf_counter(), None
        abort = self.running[rid] = asyncio.Event()
        try:
            n_prompt = len(self._ids(req))
            yield pb.GenerateStreamResponse(start=pb.StreamStart(request_id=rid, session_id=req.session_id,
                                                                 prompt_tokens=n_prompt, cached_tokens=cached))
            reason = pb.FINISH_REASON_LENGTH
            for i, t in enumerate(tokens):
                if sw.die_after_tokens is not None and i == sw.die_after_tokens:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker died")
                if sw.hang_after_tokens is not None and i == sw.hang_after_tokens:
                    await asyncio.sleep(3600)
                if abort.is_set():
                    reason = pb.FINISH_REASON_ABORT
                    break
                await asyncio.sleep(sw.token_delay_s)
                text = f"<{t}>".ljust(sw.delta_text_bytes, ".")
                ttft = time.perf_counter() - t0 if ttft is None else ttft
                yield pb.GenerateStreamResponse(delta=pb.TokenDelta(token_ids=[t], text=text))
            usage = pb.Usage(prompt_tokens=n_prompt, completion_tokens=len(tokens), cached_tokens=cached)
            timing = pb.Timing(time_to_first_token_s=ttft, total_s=time.perf_counter() - t0)  # from this call
            yield pb.GenerateStreamResponse(end=pb.StreamEnd(finish_reason=reason, usage=usage, timing=timing))
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(rid)
            raise
        finally:
            self.running.pop(rid, None)

    async def _check(self, req, context, rpc: str) -> None:
        self.calls.append((rpc, req.request_id, req.session_id))
        if not self._ids(req):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        if self.sw.fail_before_start is not None:
            await context.abort(self.sw.fail_before_start, self.sw.fail_details,
                                (("retry-after-ms", "250"),) if self.sw.fail_before_start
                                == grpc.StatusCode.RESOURCE_EXHAUSTED else ())

    # ---------------------------------------------------------------- JaxServe
    async def GenerateStream(self, req, context):
        await self._check(req, context, "GenerateStream")
        ids = self._ids(req)
        async for msg in self._stream(req, context, expected_tokens(ids, req.stop.max_tokens or 16),
                                      self._cached_tokens(ids)):
            yield msg

    async def Tokenize(self, req, context):
        return pb.TokenizeResponse(token_ids=text_ids(req.text))

    async def Detokenize(self, req, context):
        return pb.DetokenizeResponse(text="".join(f"<{t}>" for t in req.token_ids))

    async def GetModelInfo(self, req, context):
        info = self._info()
        if self.sw.advertise:
            info.role, info.kv_layout, info.handoff_fingerprint = self.sw.role, self.sw.kv_layout, self.sw.fingerprint
        return info

    def _info(self) -> pb.ModelInfo:
        return pb.ModelInfo(model="fake", page_size=PAGE_SIZE, num_pages=65, max_num_seqs=8, replica_id=self.name,
                            fingerprint=self.sw.fingerprint, kv_pages=pb.KvPages(total=64, used=64 - self.sw.kv_free,
                                                                                 free=self.sw.kv_free),
                            prefill=pb.PhaseFormats(weights=f"{self.name}-prefill"),
                            decode=pb.PhaseFormats(weights=f"{self.name}-decode"), max_context=256)

    async def Abort(self, req, context):
        found = [r for r in req.request_ids if r in self.running]
        for r in found:
            self.running[r].set()
        return pb.AbortResponse(aborted=found, not_found=[r for r in req.request_ids if r not in found])

    # ---------------------------------------------------------------- KvHandoff
    async def Prefill(self, preq, context):
        req = preq.request
        self.calls.append(("Prefill", req.request_id, req.session_id))
        self.prefill_requests.append(preq)
        if self.sw.fail_prefill is not None:
            await context.abort(self.sw.fail_prefill, "fake prefill failure")
        await asyncio.sleep(self.sw.prefill_delay_s)
        ids = self._ids(req)
        offer = hpb.HandoffOffer(protocol_version=1, transfer_id=uuid.uuid4().hex, request_id=req.request_id,
                                 session_id=req.session_id, model_fingerprint=self.sw.fingerprint,
                                 num_tokens=len(ids), prompt_token_ids=ids, first_token_ids=expected_tokens(ids, 1),
                                 payload_bytes=64 * len(ids), address=self.address, transport="grpc",
                                 kv_layout=preq.target_kv_layout or self.sw.kv_layout,
                                 cached_tokens=self._cached_tokens(ids))
        self.offers[offer.transfer_id] = offer
        return offer

    async def Release(self, req, context):
        self.released.append((req.transfer_id, req.pulled))
        return hpb.ReleaseResponse(released=self.offers.pop(req.transfer_id, None) is not None)

    async def _pull(self, offer) -> bool:
        """The offering worker still has the offer (and this pull is not told to fail)."""
        if self.sw.fail_pulls > 0:
            self.sw.fail_pulls -= 1
            return False
        async with grpc.aio.insecure_channel(offer.address) as ch:
            rel = await hgrpc.KvHandoffStub(ch).Release(hpb.ReleaseRequest(transfer_id=offer.transfer_id,
                                                                           pulled=True), timeout=5)
        return rel.released

    async def Decode(self, dreq, context):
        req = dreq.request
        self.decode_requests.append(dreq)
        await self._check(req, context, "Decode")
        ids, n = self._ids(req), req.stop.max_tokens or 16
        cached = 0
        if dreq.HasField("offer"):
            if dreq.offer.model_fingerprint != self.sw.fingerprint:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "fingerprint mismatch")
            if self.sw.kv_layout and dreq.offer.kv_layout != self.sw.kv_layout:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV layout mismatch")
            if not await self._pull(dreq.offer):
                if not dreq.recompute_on_failure:
                    await context.abort(grpc.StatusCode.ABORTED, "pull failed")
            else:
                cached = dreq.offer.cached_tokens
        tokens = expected_tokens(ids, n)
        async for msg in self._stream(req, context, tokens, cached):
            yield msg


async def start_fakes(names) -> list[FakeWorker]:
    fakes = [FakeWorker(n) for n in names]
    for f in fakes:
        await f.start()
    return fakes
