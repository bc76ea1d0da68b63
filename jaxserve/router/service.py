"""``jaxserve.v1.JaxServe`` at the router: the same API as a worker, answered by the workers.

Generate / GenerateStream get their events from ``flows.Dispatcher`` (one colocated worker, or
prefill + decode workers); Tokenize / Detokenize / GetModelInfo go to any live worker; Abort
goes to the worker where the request runs (or stops it at the router before it reaches one).
The router checks what it must know itself (ids: request_id is generated here when empty, so
Abort can find every request; a duplicate id in flight is ALREADY_EXISTS; open-stream caps);
everything else about the input is the worker's to judge, and its status reaches the client
unchanged, retry hints included.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from jaxserve.router.affinity import two_choices
from jaxserve.router.flows import Dispatcher, no_worker
from jaxserve.router.pool import Attempt, Worker
from jaxserve.router.relay import Route, WorkerError, call_unary, collect_response
from jaxserve.server import call_ends, convert, errors
from jaxserve.server.auth import API_KEY_HEADER, AUTH_HEADER, ApiKeys
from jaxserve.server.errors import ServeError
from jaxserve.server.limits import ServeLimits, StreamSlots, watch_unread
from jaxserve.server.headers import REPLICA_HEADER, SESSION_HEADER
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.router")
FORWARDED_HEADERS = (AUTH_HEADER, API_KEY_HEADER, SESSION_HEADER)


_unary_errors = errors.unary_errors(log)


class RouterService(pb_grpc.JaxServeServicer):
    def __init__(self, dispatcher: Dispatcher, metrics, keys: ApiKeys | None = None,
                 max_id_length: int = convert.MAX_ID_LENGTH, limits: ServeLimits | None = None):
        self.dispatcher, self.pool, self.metrics = dispatcher, dispatcher.pool, metrics
        self.keys, self.max_id_length = keys or ApiKeys(), max_id_length
        self.limits = limits or ServeLimits()
        self.slots = StreamSlots(self.limits)
        self.active: dict[str, Route] = {}
        self.phase = "serving"  # -> "draining"

    # ------------------------------------------------------------------ generation
    def _owner(self, context) -> tuple:
        md = context.invocation_metadata() or ()
        if self.keys.enabled:
            return (self.keys.identity(md),)
        return tuple(sorted((k, v) for k, v in md if k in (AUTH_HEADER, API_KEY_HEADER)))

    def _open(self, req: pb.GenerateRequest, context) -> Route:
        md = tuple(context.invocation_metadata() or ())
        rid = convert.check_id("request_id", req.request_id, self.max_id_length)
        session = req.session_id or str(dict(md).get(SESSION_HEADER, ""))
        convert.check_id("session_id" if req.session_id else SESSION_HEADER, session, self.max_id_length)
        if self.phase != "serving":
            raise errors.unavailable(self.phase)
        if not rid:
            rid = req.request_id = f"req-{uuid.uuid4().hex}"
        if rid in self.active:
            raise errors.already_exists(rid)
        remaining = context.time_remaining()
        route = Route(rid, session, self._owner(context), tuple((k, v) for k, v in md if k in FORWARDED_HEADERS),
                      None if remaining is None else time.monotonic() + remaining)
        self.active[rid] = route
        return route

    async def _headers(self, route: Route, context) -> None:
        worker = route.worker
        md = [(REPLICA_HEADER, worker.info.replica_id if worker and worker.info else ""), ("x-request-id", route.request_id)]
        if route.session_id:
            md.append((SESSION_HEADER, route.session_id))
        await context.send_initial_metadata(tuple(md))

    def _finish(self, route: Route | None, rpc: str, outcome: str) -> None:
        if route is not None and self.active.get(route.request_id) is route:
            del self.active[route.request_id]
        self.metrics.requests.labels(rpc, outcome).inc()
        log.info("%s request=%s session=%s worker=%s outcome=%s", rpc, route.request_id if route else "-",
                 (route.session_id or "-") if route else "-",
                 route.worker.address if route and route.worker else "-", outcome)

    async def Generate(self, request, context):
        route, outcome, events = None, "internal", None
        try:
            route = self._open(request, context)
            events = self.dispatcher.events(request, route)
            resp = await collect_response(events, route.request_id, route.session_id, request.n or 1)
            outcome = self._reason(resp)
            await self._headers(route, context)
            return resp
        except ServeError as e:
            outcome = e.outcome
            self._finish(route, "Generate", outcome)
            route = None
            await context.abort(e.code, e.message, e.trailing_metadata())
        except asyncio.CancelledError:
            outcome = call_ends.cancel_outcome(context)
            raise
        except Exception as e:
            log.exception("Generate failed")
            self._finish(route, "Generate", "internal")
            route = None
            await context.abort(grpc.StatusCode.INTERNAL, errors.internal(e).message)
        finally:
            if events is not None:
                await events.aclose()
            if route is not None:
                self._finish(route, "Generate", outcome)

    def _reason(self, end: pb.StreamEnd) -> str:
        self.metrics.cached_tokens.inc(end.usage.cached_tokens)
        return {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort",
                pb.FINISH_REASON_TOOL_CALLS: "stop"}.get(end.finish_reason, "unspecified")  # as the worker counts it

    async def GenerateStream(self, request, context):
        route, outcome, events, peer = None, "internal", None, context.peer() or ""
        try:
            self.slots.acquire(peer)
        except ServeError as e:
            self.metrics.requests.labels("GenerateStream", e.outcome).inc()
            await context.abort(e.code, e.message, e.trailing_metadata())
        try:
            route = self._open(request, context)
            route.task = asyncio.current_task()
            events = self.dispatcher.events(request, route)
            first = True
            async for msg in events:
                if first:
                    await self._headers(route, context)
                    first = False
                if msg.WhichOneof("event") == "end":
                    outcome = self._reason(msg.end)
                await call_ends.write(route, context, msg)
        except ServeError as e:
            outcome = e.outcome
            self._finish(route, "GenerateStream", outcome)
            route = None
            await context.abort(e.code, e.message, e.trailing_metadata())
        except (asyncio.CancelledError, GeneratorExit):
            if route is None or not route.unread:
                outcome = call_ends.cancel_outcome(context)
                raise
            asyncio.current_task().uncancel()  # cancelled by watch_unread: see server/service.py
            outcome = "unread_timeout"
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(f"no stream event read for {self.limits.stream_idle_timeout_s:g}s; cancelled")
        except Exception as e:
            if await call_ends.client_gone(context, "GenerateStream", e, route):
                outcome = "cancelled"
                return
            log.exception("GenerateStream failed")
            self._finish(route, "GenerateStream", "internal")
            route = None
            await context.abort(grpc.StatusCode.INTERNAL, errors.internal(e).message)
        finally:
            self.slots.release(peer)
            if events is not None:
                await events.aclose()
            if route is not None:
                self._finish(route, "GenerateStream", outcome)

    async def watch_unread(self) -> None:
        await watch_unread(self.active.values, self.limits.stream_idle_timeout_s)

    async def wait_idle(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while self.active and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return not self.active

    # ------------------------------------------------------------------ other RPCs
    def _roles(self) -> tuple[str, ...]:
        return ("decode", "prefill") if self.dispatcher.disaggregated else ("both",)

    async def _forward(self, method: str, request, context):
        """`method` on a live worker (another one if it is gone or busy)."""
        tried, last = set(), None
        metadata = self.dispatcher.worker_metadata or tuple(
            (k, v) for k, v in (context.invocation_metadata() or ()) if k in FORWARDED_HEADERS) or None
        while True:
            # The first role with a live worker: decode workers answer for a disaggregated pool.
            workers = next((ws for ws in ([w for w in self.pool.alive(role) if w not in tried]
                                          for role in self._roles()) if ws), [])
            if not workers:
                raise last.to_serve_error() if last is not None else no_worker("")
            worker = two_choices(workers, Worker.load)
            tried.add(worker)
            remaining = context.time_remaining()
            try:
                with Attempt(worker) as attempt:
                    return await call_unary(attempt, getattr(worker.stub, method)(
                        request, timeout=remaining, metadata=metadata))
            except WorkerError as e:
                if not e.elsewhere:
                    raise e.to_serve_error() from None
                last = e

    @_unary_errors
    async def Tokenize(self, request, context):
        return await self._forward("Tokenize", request, context)

    @_unary_errors
    async def Detokenize(self, request, context):
        return await self._forward("Detokenize", request, context)

    @_unary_errors
    async def GetModelInfo(self, request, context):
        """A decode (or colocated) worker's info. With separate pools the router answers as one
        colocated endpoint: role "both", no KV layout (it takes no handoffs), the prefill
        formats a prefill worker's and the context the smaller of the two."""
        info = pb.ModelInfo()
        info.CopyFrom(await self._forward("GetModelInfo", request, context))
        if not self.dispatcher.disaggregated:
            return info
        info.role, info.kv_layout = "both", ""
        prefill = next((w.info for w in self.pool.alive("prefill") if w.info is not None), None)
        if prefill is not None:
            info.prefill.CopyFrom(prefill.prefill)
            if prefill.max_context:
                info.max_context = min(info.max_context or prefill.max_context, prefill.max_context)
        return info

    @_unary_errors
    async def Abort(self, request, context):
        owner = self._owner(context)
        aborted, by_worker = set(), {}
        for rid in dict.fromkeys(request.request_ids):
            route = self.active.get(rid)
            if route is None or route.owner != owner:
                continue
            if route.stage == "worker" and route.worker is not None:
                by_worker.setdefault(route.worker, []).append(rid)
                continue
            route.aborted = True  # not on a worker yet (routing, prefill): stopped here
            if route.attempt is not None and route.attempt.call is not None:
                route.attempt.call.cancel()
            aborted.add(rid)
        results = await asyncio.gather(*(self._abort_on(w, ids, context) for w, ids in by_worker.items()))
        for ids in results:
            aborted.update(ids)
        ordered = list(dict.fromkeys(request.request_ids))
        return pb.AbortResponse(aborted=[r for r in ordered if r in aborted],
                                not_found=[r for r in ordered if r not in aborted])

    async def _abort_on(self, worker: Worker, ids: list[str], context) -> list[str]:
        metadata = self.dispatcher.worker_metadata or tuple(
            (k, v) for k, v in (context.invocation_metadata() or ()) if k in FORWARDED_HEADERS) or None
        try:
            resp = await worker.stub.Abort(pb.AbortRequest(request_ids=ids), timeout=5.0, metadata=metadata)
            return list(resp.aborted)
        except grpc.RpcError:
            return []
