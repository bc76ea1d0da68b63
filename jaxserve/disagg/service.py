"""The ``jaxserve.v1.KvHandoff`` servicer: a prefill worker's Prefill / PullPages / Release and
a decode worker's Decode (see ``protos/jaxserve/v1/handoff.proto``).

Prefill worker: the request runs through the engine with ``export_kv`` (the decode format the
target layout names); its last output carries the prompt's pages, gathered, converted and
digested on device. They are kept as an *offer* (the pool's pages go back at once: the offer
is a snapshot) until Release, or until it expires (``ttl_s``) and is drained.

Decode worker: checks the manifest before any bytes move (protocol, fingerprint, layout:
FAILED_PRECONDITION), refuses an expired offer, pulls with its own watchdog, tells the
prefill worker to release the offer, and streams the generation with the pages imported into
its own pool (the digest is checked on device there). A failed pull or digest gives ABORTED,
or, with ``recompute_on_failure``, a local prefill of the prompt: nothing is lost.

Calls to the prefill worker (PullPages, Release) go over ``peer`` (``auth.PeerCredentials``:
TLS with its CA and optional client certificate) with its API key, or, without one, the
credentials the Decode call itself came with. The guard checks every KvHandoff call's key.

Test-only fault injection (prefill side): ``$JAXSERVE_HANDOFF_FAULT`` is a comma-separated
list of ``FAULT`` or ``FAULT:REQUEST_ID`` (only that request's offers), FAULT being
``corrupt_payload`` (one bit of the grpc payload flipped) or ``die_mid_pull`` (the process
exits halfway through the PullPages stream).
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time

import grpc

from jaxserve.disagg.handoff_request import KvImport
from jaxserve.disagg.offers import EXPIRY_MARGIN_S, FAULT_ENV, PROTOCOL_VERSION, Offer, parse_faults, prefix_hashes
from jaxserve.disagg.transport import GrpcTransport, JaxTransferTransport, PullError, chunks
from jaxserve.kv import handoff
from jaxserve.server import errors
from jaxserve.server.auth import PeerCredentials, forwarded
from jaxserve.server.errors import ServeError
from jaxserve.server.events import Delta
from jaxserve.v1 import handoff_pb2 as hpb
from jaxserve.v1 import handoff_pb2_grpc as hpb_grpc
from jaxserve.v1 import jaxserve_pb2 as pb

log = logging.getLogger("jaxserve.server")


class KvHandoffService(hpb_grpc.KvHandoffServicer):
    """jax: the JaxServeService (validation, engine streams, accounting); engine: read-only
    facts (layouts, fingerprint) from the LLMEngine; address: this server's gRPC address as
    others reach it (the offers name it); bind_host: where the transfer server listens (the
    gRPC server's bind address; default address's host); peer: credentials for calls to other
    workers."""

    def __init__(self, jax_service, engine, metrics, address: str, transport: str = "grpc", ttl_s: float = 30.0,
                 pull_timeout_s: float = 10.0, max_offers: int = 64, bind_host: str | None = None,
                 peer: PeerCredentials | None = None):
        self.jax, self.engine, self.address = jax_service, engine, address
        self.handoff = engine.kv_handoff  # the engine's KV handoff part: its role, layout, payload shapes
        self.role = self.handoff.role
        self.ttl_s, self.pull_timeout_s, self.max_offers = ttl_s, pull_timeout_s, max_offers
        self.fingerprint = engine.handoff_fingerprint()
        self.layout = engine.kv_layout()
        self.page_size = engine.config.page_size
        self.offers: dict[str, Offer] = {}
        self.metrics = metrics
        self._tasks: set = set()  # background Release calls (kept referenced until done)
        self.faults = parse_faults(os.environ.get(FAULT_ENV, ""))
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.peer = peer or PeerCredentials()
        # The transfer server starts on first use (an offer or a pull over it).
        advertised = address.rsplit(":", 1)[0]
        self.transfer = JaxTransferTransport(bind_host or advertised, advertised)
        self.transports = {"grpc": GrpcTransport(self._channel), "transfer": self.transfer}
        self.transport = transport  # what Prefill offers over unless the request names one

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self.peer.aio_channel(address)
        return self._channels[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    # ------------------------------------------------------------------ prefill side
    async def Prefill(self, request, context):
        refused = self.role.refuses_call("Prefill")
        if refused:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused)
        fmt = self.handoff.format_for_layout(request.target_kv_layout)
        if fmt is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this prefill worker cannot produce the KV layout {request.target_kv_layout!r}")
        if request.transport and request.transport not in self.transports:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown KV transport {request.transport!r}")
        if len(self.offers) >= self.max_offers:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(self.offers)} KV offers await a pull")
        req = pb.GenerateRequest()
        req.CopyFrom(request.request)
        if not req.sampling.HasField("seed"):  # the decode worker must sample with the same seed
            req.sampling.seed = secrets.randbelow(2**31 - 1)
        stream, outcome = None, "internal"
        try:
            stream = await self.jax.open_stream(req, context, dict(export_kv=fmt))
            first, ev = [], None
            async for ev in stream.events():
                if isinstance(ev, Delta):
                    first += ev.token_ids
            _, usage, _, _ = self.jax.terminal(ev)
            payload = ev.kv_export
            if payload is None or not first:
                raise ServeError(grpc.StatusCode.ABORTED, "the request ended before its first token")
            offer = await self._offer(req, stream, payload, first, usage.cached_tokens, fmt,
                                      request.transport or self.transport)
            outcome = "offered"
            return offer
        except ServeError as e:
            outcome = e.outcome
            await context.abort(e.code, e.message, e.trailing_metadata())
        finally:
            self.jax.close_stream(stream, "Prefill", outcome)

    async def _offer(self, req, stream, payload, first, cached_tokens: int, fmt: str,
                     transport: str) -> hpb.HandoffOffer:
        tid = secrets.token_hex(8)
        ids = payload.token_ids
        manifest = hpb.HandoffOffer(
            protocol_version=PROTOCOL_VERSION, transfer_id=tid, request_id=stream.request_id,
            session_id=stream.session_id, model_fingerprint=self.fingerprint,
            kv_layout=self.engine.kv_layout(fmt), num_tokens=len(ids), prompt_token_ids=ids,
            first_token_ids=first[:1], prefix_hashes=prefix_hashes(ids, self.page_size),
            digest=await asyncio.to_thread(handoff.digest_hex, payload.digest), payload_bytes=payload.nbytes,
            expires_unix_s=time.time() + self.ttl_s, address=self.address, transport=transport,
            cached_tokens=cached_tokens, sampling_seed=req.sampling.seed)
        if transport == "transfer":
            manifest.transfer_address = self.transfer.address
            await asyncio.to_thread(self.transfer.offer, tid, payload)
        self.offers[tid] = Offer(manifest, payload, manifest.expires_unix_s)
        self.metrics.handoff_offers.inc()
        self.metrics.handoff_open.set(len(self.offers))
        return manifest

    async def PullPages(self, request, context):
        offer = self.offers.get(request.transfer_id)
        if offer is None or offer.expires < time.time():
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no live KV offer {request.transfer_id!r}")
        if offer.manifest.transport != "grpc":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this offer moves over jax.experimental.transfer")
        axes = self.handoff.leaf_axes(offer.payload.fmt)
        data = await asyncio.to_thread(handoff.to_bytes, offer.payload, axes)
        fault = self.faults.get(offer.manifest.request_id, self.faults.get("", ""))
        if fault == "die_mid_pull":  # test fault: half the bytes, then the process is gone
            yield hpb.PageChunk(index=0, data=data[: len(data) // 2], last=False)
            await asyncio.sleep(0.2)
            os._exit(17)
        for chunk in chunks(data, corrupt=fault == "corrupt_payload"):
            yield chunk

    async def Release(self, request, context):
        offer = self.offers.pop(request.transfer_id, None)
        if offer is None:
            return hpb.ReleaseResponse(released=False)
        await self._retire(offer, pulled=request.pulled)
        return hpb.ReleaseResponse(released=True)

    async def _retire(self, offer: Offer, pulled: bool) -> None:
        """Forget an offer; an unpulled transfer offer is drained out of the transfer server."""
        self.metrics.handoff_open.set(len(self.offers))
        if offer.manifest.transport == "transfer" and not pulled:
            specs = self.handoff.payload_specs(offer.payload.fmt, offer.payload.num_pages)
            await self.transfer.drain(offer.manifest.transfer_id, specs)

    async def watch_offers(self, period_s: float = 0.25) -> None:
        """Runs while the server does: expired offers are dropped (and drained)."""
        while True:
            await asyncio.sleep(period_s)
            now = time.time()
            for tid in [t for t, o in self.offers.items() if o.expires < now]:
                offer = self.offers.pop(tid, None)
                if offer is not None:
                    self.metrics.handoff_expired.inc()
                    log.info("KV offer %s expired unpulled; drained", tid)
                    await self._retire(offer, pulled=False)

    # ------------------------------------------------------------------ decode side
    async def Decode(self, request, context):
        req = pb.GenerateRequest()
        req.CopyFrom(request.request)
        if not request.HasField("offer"):
            await self.jax.run_stream(req, context, "Decode")
            return
        offer = request.offer
        md = self.peer.metadata or forwarded(context.invocation_metadata())  # for the prefill worker
        try:
            live = self._check_offer(offer)
        except ServeError as e:
            self.metrics.handoff_failures.labels(e.outcome).inc()
            if offer.address and e.code != grpc.StatusCode.INVALID_ARGUMENT:
                self._release_later(offer, md, pulled=False)  # refused: the prefill worker may free it now
            await context.abort(e.code, e.message, e.trailing_metadata())
        held = list(offer.prompt_token_ids)  # the ids the pages hold
        if not req.messages:
            req.token_ids.CopyFrom(pb.TokenIds(ids=held))
            req.apply_chat_template = False
        # A chat request is rendered here again: its plan (the grammar of a tool choice, the output
        # parser) is built from its messages, and the engine checks the ids equal the pages' ids.
        if not req.sampling.HasField("seed"):
            req.sampling.seed = offer.sampling_seed
        kw = None
        try:
            if not live:  # never pull an expired offer (a transfer pull of a drained one would hang)
                raise PullError("expired", f"KV offer {offer.transfer_id} has expired")
            payload = await self._pull(offer, md)
            kw = dict(kv_import=KvImport(payload, offer.digest, offer.first_token_ids[0], offer.cached_tokens,
                                         request.recompute_on_failure, held))
        except PullError as e:
            self.metrics.handoff_failures.labels(e.cause).inc()
            log.warning("KV handoff %s: %s%s", offer.transfer_id, e,
                        "; prefilling here" if request.recompute_on_failure else "")
            if not request.recompute_on_failure:
                self._release_later(offer, md, pulled=False)
                await context.abort(grpc.StatusCode.ABORTED, str(e), ((errors.INTEGRITY_CAUSE_KEY, e.cause),))
        self._release_later(offer, md, pulled=kw is not None or offer.transport == "grpc")
        await self.jax.run_stream(req, context, "Decode", kw)

    def _check_offer(self, offer: hpb.HandoffOffer) -> bool:
        """The manifest before any bytes move: FAILED_PRECONDITION for what this worker cannot
        use, INVALID_ARGUMENT for an inconsistent manifest; -> whether the offer is still live."""
        bad = errors.failed_precondition
        if self.role.refuses_call("Decode"):
            raise bad(self.role.refuses_call("Decode"))
        if offer.protocol_version != PROTOCOL_VERSION:
            raise bad(f"KV handoff protocol {offer.protocol_version}; this worker speaks {PROTOCOL_VERSION}")
        if offer.model_fingerprint != self.fingerprint:
            raise bad(f"model fingerprint {offer.model_fingerprint[:12]} != this worker's {self.fingerprint[:12]} "
                      "(other weights or weight formats)")
        if offer.kv_layout != self.layout:
            raise bad(f"KV layout mismatch: offered {offer.kv_layout!r}, this worker holds {self.layout!r}")
        if offer.transport not in self.transports:
            raise bad(f"transport {offer.transport!r} is not enabled here ({sorted(self.transports)})")
        ids = list(offer.prompt_token_ids)
        if (offer.num_tokens != len(ids) or len(offer.first_token_ids) != 1
                or list(offer.prefix_hashes) != prefix_hashes(ids, self.page_size)):
            raise errors.invalid_argument("inconsistent KV offer (token count, first token or prefix-hash chain)")
        try:
            handoff.parse_digest(offer.digest)
        except ValueError as e:
            raise errors.invalid_argument(str(e)) from None
        return offer.expires_unix_s - EXPIRY_MARGIN_S >= time.time()  # False: expired

    async def _pull(self, offer: hpb.HandoffOffer, metadata: tuple) -> handoff.KvPayload:
        n, fmt = -(-offer.num_tokens // self.page_size), self.handoff.kv_format
        left = min(self.pull_timeout_s, offer.expires_unix_s - time.time())
        t0 = time.perf_counter()
        payload = await self.transports[offer.transport].pull(offer, self.handoff.payload_specs(fmt, n),
                                                              self.handoff.leaf_axes(), n, fmt, left, metadata)
        self.metrics.handoff_pulls.labels(offer.transport).inc()
        self.metrics.handoff_bytes.labels(offer.transport).inc(payload.nbytes)
        self.metrics.handoff_seconds.observe(time.perf_counter() - t0)
        log.info("KV handoff %s: %d B over %s in %.1f ms", offer.transfer_id, payload.nbytes, offer.transport,
                 (time.perf_counter() - t0) * 1e3)
        return payload

    def _release_later(self, offer: hpb.HandoffOffer, metadata: tuple, pulled: bool) -> None:
        async def release():
            try:
                stub = hpb_grpc.KvHandoffStub(self._channel(offer.address))
                await stub.Release(hpb.ReleaseRequest(transfer_id=offer.transfer_id, pulled=pulled), timeout=15,
                                   metadata=metadata or None)
            except grpc.aio.AioRpcError as e:  # the prefill worker is gone: its offers went with it
                log.info("Release(%s) failed: %s: %s", offer.transfer_id, e.code().name, e.details())

        task = asyncio.ensure_future(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
