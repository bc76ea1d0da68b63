"""Where a generation's events come from: one colocated worker, or a prefill worker's KV handoff
to a decode worker. Both are async generators of ``GenerateStreamResponse`` that retry
elsewhere while nothing has reached the client, and raise ``ServeError`` for the final status.

Disaggregated flow: the decode worker is chosen first (session affinity, else load), then
``KvHandoff.Prefill`` on a prefill worker with the same handoff fingerprint, asking for the
decode worker's KV layout (retried on another prefill worker on UNAVAILABLE, ABORTED,
RESOURCE_EXHAUSTED or a worker going down; with none left, the decode worker prefills the prompt
itself), then ``KvHandoff.Decode`` with the offer, relayed. Requests an offer cannot carry (n > 1,
log-probs) go to the decode worker without one. A pull that fails with ABORTED is retried once
with ``recompute_on_failure``; a decode worker that is gone moves the request to another (also
with recompute; the offer only if that worker holds the same layout); FAILED_PRECONDITION (a
configuration error) goes to the client. An offer no decode call took is released.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from jaxserve.router.pool import Attempt, Worker, WorkerPool
from jaxserve.router.policy import RoutingPolicy
from jaxserve.router.relay import Route, WorkerError, abort_events, call_unary, relay_stream
from jaxserve.server import errors
from jaxserve.v1 import handoff_pb2 as hpb
from jaxserve.v1 import jaxserve_pb2 as pb

log = logging.getLogger("jaxserve.router")
RELEASE_TIMEOUT_S = 5.0


def no_worker(role: str) -> errors.ServeError:
    return errors.ServeError(grpc.StatusCode.UNAVAILABLE, f"no {role} worker is serving; retry later",
                             retry_after_s=1.0)


def handoff_carries(req: pb.GenerateRequest) -> bool:
    """Whether a KV handoff can carry `req`: one choice and no log-probs (an offer holds the
    first token, not its log-prob). Others are prefilled on their decode worker."""
    return (req.n or 1) == 1 and not req.sampling.HasField("logprobs")


def pairs_with(prefill: Worker, decode: Worker) -> bool:
    """Whether `decode` can take `prefill`'s offers: the same handoff fingerprint (unknown: yes)."""
    a = prefill.info.handoff_fingerprint if prefill.info is not None else ""
    b = decode.info.handoff_fingerprint if decode.info is not None else ""
    return not a or not b or a == b


def offer_fits(worker: Worker, offer: hpb.HandoffOffer) -> bool:
    """Whether decode `worker` holds `offer`'s KV layout and fingerprint, as its last ModelInfo says."""
    info = worker.info
    if info is None:
        return True
    return ((not info.kv_layout or info.kv_layout == offer.kv_layout)
            and (not info.handoff_fingerprint or info.handoff_fingerprint == offer.model_fingerprint))


class Dispatcher:
    def __init__(self, pool: WorkerPool, policy: RoutingPolicy, metrics, worker_metadata: tuple = ()):
        self.pool, self.policy, self.metrics = pool, policy, metrics
        self.worker_metadata = tuple(worker_metadata)
        self.disaggregated = any(w.role != "both" for w in pool.workers)
        self._background: set[asyncio.Task] = set()
        self._warned: set[tuple[str, str]] = set()  # (prefill, decode) pairs logged as unfit

    # ------------------------------------------------------------------ helpers
    def call_kw(self, route: Route) -> dict:
        timeout = None if route.deadline is None else max(route.deadline - time.monotonic(), 0.001)
        return dict(timeout=timeout, metadata=self.worker_metadata or route.metadata or None)

    def _failed(self, worker: Worker, e: WorkerError) -> None:
        self.metrics.worker_calls.labels(worker.address, worker.role, e.cause).inc()
        if e.lost or e.code == grpc.StatusCode.UNAVAILABLE:
            self.pool.probe_soon(worker)

    async def prompt_ids(self, req: pb.GenerateRequest, route: Route, role: str) -> list[int] | None:
        """The prompt's token ids for prefix affinity: as sent, or a text tokenized by a worker
        exactly as it would tokenize it to generate (None if that fails: the worker that runs
        the request reports any error in the input itself)."""
        kind = req.WhichOneof("prompt")
        if kind == "token_ids":
            return list(req.token_ids.ids)
        worker, _ = self.policy.pick(role, None, "")
        if kind != "text" or worker is None:
            return None
        try:
            with Attempt(worker) as attempt:
                resp = await call_unary(attempt, worker.stub.Tokenize(
                    pb.TokenizeRequest(text=req.text, apply_chat_template=req.apply_chat_template), **self.call_kw(route)))
            return list(resp.token_ids)
        except WorkerError:
            return None

    def events(self, req: pb.GenerateRequest, route: Route):
        return self.disaggregated_events(req, route) if self.disaggregated else self.colocated_events(req, route)

    # ------------------------------------------------------------------ colocated
    async def colocated_events(self, req: pb.GenerateRequest, route: Route):
        ids = route.prompt_ids = await self.prompt_ids(req, route, "both")
        tried, last = set(), None
        while True:
            if route.aborted:
                for msg in abort_events(route, len(ids or ())):
                    yield msg
                return
            worker, reason = self.policy.pick("both", ids, route.session_id, tried)
            if worker is None:
                raise last.to_serve_error() if last is not None else no_worker("colocated")
            tried.add(worker)
            self.metrics.routed.labels("both", reason).inc()
            route.stage, route.worker, route.relayed = "worker", worker, False
            generated = []
            try:
                with Attempt(worker) as attempt:
                    route.attempt = attempt
                    call = worker.stub.GenerateStream(req, **self.call_kw(route))
                    async for msg in relay_stream(attempt, call, route):
                        if not generated and msg.delta.token_ids:  # prefilled: its pages are cached now
                            self.policy.record(worker, ids)
                        if msg.delta.index == 0:  # choice 0's completion (n > 1: the others too)
                            generated += msg.delta.token_ids
                        yield msg
            except WorkerError as e:
                self._failed(worker, e)
                if route.relayed:
                    raise e.mid_stream(len(generated)) from None
                if not e.elsewhere:
                    raise e.to_serve_error() from None
                log.info("request %s: worker %s %s before any token; moving it", route.request_id,
                         worker.address, e.cause)
                self.metrics.retries.labels(e.cause).inc()
                last, route.stage = e, "routing"
                continue
            self.metrics.worker_calls.labels(worker.address, worker.role, "ok").inc()
            self.policy.record(worker, (ids or []) + generated[:-1] if ids else None)
            return

    # ------------------------------------------------------------------ disaggregated
    async def disaggregated_events(self, req: pb.GenerateRequest, route: Route):
        """The decode worker is chosen first (session, load): the prefill worker converts the
        prompt's KV to its layout and must share its handoff fingerprint."""
        ids = route.prompt_ids = await self.prompt_ids(req, route, "prefill")
        target, reason = self.policy.pick("decode", ids, route.session_id)
        if target is None:
            self.metrics.handoffs.labels("failed").inc()
            raise no_worker("decode")
        offer, source = None, None
        if handoff_carries(req):
            offer, source = await self._prefill(req, route, ids, target)
        async for msg in self._decode(req, route, offer, source, target, reason):
            yield msg

    async def _prefill(self, req, route: Route, ids, target: Worker) -> tuple[hpb.HandoffOffer | None, Worker | None]:
        """(offer in `target`'s KV layout, its prefill worker), or (None, None): the decode
        worker prefills itself."""
        unfit = {w for w in self.pool.alive("prefill") if not pairs_with(w, target)}
        if unfit:
            self.metrics.handoff_failures.labels("fingerprint_mismatch").inc()
            self._warn_unfit(unfit, target)
        tried = set(unfit)
        layout = target.info.kv_layout if target.info is not None else ""
        route.stage = "prefill"
        while not route.aborted:
            worker, reason = self.policy.pick("prefill", ids, "", tried)
            if worker is None:
                if not unfit and any(w.role == "prefill" for w in self.pool.workers):
                    self.metrics.handoff_failures.labels("no_prefill_worker").inc()
                return None, None
            tried.add(worker)
            self.metrics.routed.labels("prefill", reason).inc()
            route.worker, t0 = worker, time.perf_counter()
            try:
                with Attempt(worker) as attempt:
                    route.attempt = attempt
                    offer = await call_unary(attempt, worker.handoff.Prefill(
                        hpb.PrefillRequest(request=req, target_kv_layout=layout), **self.call_kw(route)))
            except WorkerError as e:
                self._failed(worker, e)
                if route.aborted:
                    break
                if not (e.elsewhere or e.code == grpc.StatusCode.ABORTED):
                    raise e.to_serve_error() from None
                self.metrics.handoff_failures.labels(f"prefill_{e.cause}").inc()
                log.info("request %s: prefill on %s failed (%s); trying another", route.request_id, worker.address,
                         e.cause)
                continue
            self.metrics.worker_calls.labels(worker.address, worker.role, "ok").inc()
            self.metrics.handoff_seconds.labels("prefill").observe(time.perf_counter() - t0)
            self.metrics.handoff_bytes.inc(offer.payload_bytes)
            self.policy.record(worker, list(offer.prompt_token_ids) or ids)
            return offer, worker
        return None, None

    def _warn_unfit(self, unfit, target: Worker) -> None:
        for w in unfit:
            if (w.address, target.address) not in self._warned:
                self._warned.add((w.address, target.address))
                log.warning("prefill worker %s and decode worker %s have different handoff fingerprints (other "
                            "weights or weight formats): no handoffs between them", w.address, target.address)

    async def _decode(self, req, route: Route, offer, source: Worker | None, worker: Worker | None, reason: str):
        """Decode on `worker` (then others); `offer` is released here unless a decode worker took it."""
        tried, last, recompute, first_try = set(), None, offer is None, True
        try:
            while True:
                if route.aborted:
                    for msg in abort_events(route, len(route.prompt_ids or ())):
                        yield msg
                    return
                if worker is None or not worker.up or worker in tried:
                    ids = route.prompt_ids or (list(offer.prompt_token_ids) if offer is not None else None)
                    worker, reason = self.policy.pick("decode", ids, route.session_id, tried)
                if worker is None:
                    self.metrics.handoffs.labels("failed").inc()
                    raise last.to_serve_error() if last is not None else no_worker("decode")
                self.metrics.routed.labels("decode", reason).inc()
                if offer is not None and not offer_fits(worker, offer):  # a retry on a worker of another layout
                    self.metrics.handoff_failures.labels("offer_mismatch").inc()
                    self._release(source, offer, route)
                    offer, recompute = None, True
                route.stage, route.worker, route.relayed = "worker", worker, False
                dreq = hpb.DecodeRequest(request=req, recompute_on_failure=recompute)
                if offer is not None:
                    dreq.offer.CopyFrom(offer)
                tokens, t0 = 0, time.perf_counter()
                try:
                    with Attempt(worker) as attempt:
                        route.attempt = attempt
                        async for msg in relay_stream(attempt, worker.handoff.Decode(dreq, **self.call_kw(route)),
                                                      route):
                            if t0 is not None:
                                self.metrics.handoff_seconds.labels("decode").observe(time.perf_counter() - t0)
                                t0, offer = None, None  # the decode worker has taken (and released) the offer
                            tokens += len(msg.delta.token_ids)
                            yield msg
                except WorkerError as e:
                    self._failed(worker, e)
                    if route.relayed:
                        raise e.mid_stream(tokens) from None
                    last = e
                    if not self._retry_decode(e, offer is not None and not recompute):
                        raise e.to_serve_error() from None
                    if e.elsewhere:
                        tried.add(worker)
                    log.info("request %s: decode on %s failed (%s); retrying with recompute", route.request_id,
                             worker.address, e.cause)
                    recompute, first_try, worker = True, False, None
                    continue
                self.metrics.worker_calls.labels(worker.address, worker.role, "ok").inc()
                self.metrics.handoffs.labels("no_offer" if recompute and first_try else "ok" if first_try
                                             else "retried").inc()
                return
        finally:
            if offer is not None:  # no decode worker took it
                self._release(source, offer, route)

    def _retry_decode(self, e: WorkerError, had_offer: bool) -> bool:
        """Whether a Decode that failed before any event is retried (with recompute): a failed
        pull (ABORTED), or a decode worker gone or full."""
        if e.code == grpc.StatusCode.ABORTED and had_offer:
            self.metrics.handoff_failures.labels("pull_aborted").inc()
            return True
        if e.elsewhere:
            self.metrics.handoff_failures.labels(f"decode_{e.cause}").inc()
            return True
        if e.code == grpc.StatusCode.FAILED_PRECONDITION:
            self.metrics.handoff_failures.labels("failed_precondition").inc()
        self.metrics.handoffs.labels("failed").inc()
        return False

    def _release(self, worker: Worker, offer, route: Route) -> None:
        """Tell the prefill worker nobody will pull `offer` (best effort, in the background)."""
        metadata = self.worker_metadata or route.metadata or None

        async def release():
            try:
                await worker.handoff.Release(hpb.ReleaseRequest(transfer_id=offer.transfer_id, pulled=False),
                                             timeout=RELEASE_TIMEOUT_S, metadata=metadata)
            except grpc.RpcError as e:
                log.info("release of offer %s on %s failed: %s", offer.transfer_id, worker.address, e.code())

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
