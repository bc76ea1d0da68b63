"""The router on grpc.aio: ``jaxserve.v1.JaxServe`` (``service.RouterService``), grpc.health.v1,
reflection and a Prometheus endpoint, in front of a ``WorkerPool``.

Health ``""`` / ``jaxserve.v1.JaxServe`` is SERVING while some worker can take a generation (a
colocated worker, or a decode worker: without a prefill worker it prefills itself), and
``worker/<address>`` follows each worker's own health. ``RouterThread`` runs a Router on a
background event loop for synchronous callers (tests).
"""
from __future__ import annotations

import asyncio
import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.router.flows import Dispatcher
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.policy import RoutingPolicy
from jaxserve.router.pool import WorkerPool
from jaxserve.router.service import RouterService
from jaxserve.server.auth import ApiKeys, PeerCredentials
from jaxserve.server.guard import RequestGuard
from jaxserve.server.limits import ServeLimits
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.router")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def worker_health_name(address: str) -> str:
    return f"worker/{address}"


class Router:
    """workers: [(address, role)] with role "both" (colocated) or "prefill" / "decode" (not
    mixed with "both"). health_interval_s / health_timeout_s / unhealthy_after: see
    ``WorkerPool``; peer (``auth.PeerCredentials``): how the router calls workers (TLS with a
    CA and optional client certificate; its API key sent on every worker call instead of the
    client's own credentials); worker_api_key: that key alone (a plaintext peer). The other
    arguments are as for ``jaxserve.server.app.Server``."""

    def __init__(self, workers, host: str = "127.0.0.1", port: int = 0, metrics_port: int | None = 0,
                 metrics_host: str = "127.0.0.1", credentials=None, keys: ApiKeys | None = None,
                 worker_api_key: str | None = None, max_id_length: int = 256, limits: ServeLimits | None = None,
                 health_interval_s: float = 1.0, health_timeout_s: float = 1.0, unhealthy_after: int = 2,
                 session_ttl_s: float = 600.0, prefix_entries: int = 100_000, peer: PeerCredentials | None = None):
        roles = {role for _, role in workers}
        if not workers:
            raise ValueError("the router needs workers: --worker, or --decode (and --prefill)")
        if "both" in roles and roles != {"both"}:
            raise ValueError("colocated workers (--worker) cannot be mixed with --prefill / --decode pools")
        if roles == {"prefill"}:
            raise ValueError("prefill workers need decode workers (--decode) to hand their KV to")
        self.host, self.port, self.metrics_port, self.metrics_host = host, port, metrics_port, metrics_host
        self.credentials, self.keys, self.limits = credentials, keys or ApiKeys(), limits or ServeLimits()
        self.metrics = RouterMetrics()
        if peer is not None and worker_api_key is not None:
            raise ValueError("give the worker API key in peer or worker_api_key, not both")
        self.peer = peer or PeerCredentials(api_key=worker_api_key)
        worker_md = self.peer.metadata
        self.pool = WorkerPool(workers, health_interval_s, health_timeout_s, unhealthy_after, metadata=worker_md,
                               peer=self.peer,
                               on_change=self._worker_changed,
                               on_check_failed=lambda w: self.metrics.health_failures.labels(w.address).inc())
        self.policy = RoutingPolicy(self.pool, prefix_entries, session_ttl_s)
        self.dispatcher = Dispatcher(self.pool, self.policy, self.metrics, worker_md)
        self.service = RouterService(self.dispatcher, self.metrics, self.keys, max_id_length, self.limits)
        self.health = self._grpc = self._http = self._watchdog = None
        for w in self.pool.workers:
            self.metrics.worker_up.labels(w.address, w.role).set(0)
            self.metrics.worker_in_flight.labels(w.address, w.role).set_function(lambda w=w: w.in_flight)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def serving(self) -> bool:
        return bool(self.pool.alive("both") or self.pool.alive("decode"))

    def _worker_changed(self, worker) -> None:
        self.metrics.worker_up.labels(worker.address, worker.role).set(1 if worker.up else 0)
        if not worker.up:
            self.policy.forget(worker)  # its cache may not survive what happened to it
        if self.health is not None:
            asyncio.ensure_future(self._publish_health())

    async def _publish_health(self) -> None:
        for w in self.pool.workers:
            await self.health.set(worker_health_name(w.address), _SERVING if w.up else _NOT_SERVING)
        if self.service.phase != "serving":
            return
        status = _SERVING if self.serving() else _NOT_SERVING
        self.metrics.serving.set(1 if status == _SERVING else 0)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> None:
        self.health = health.aio.HealthServicer()
        await self._publish_health()
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                     interceptors=[RequestGuard(self.keys, self.metrics)])
        pb_grpc.add_JaxServeServicer_to_server(self.service, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        address = f"{self.host}:{self.port}"
        self.port = (self._grpc.add_insecure_port(address) if self.credentials is None
                     else self._grpc.add_secure_port(address, self.credentials))
        await self.pool.start()
        await self._publish_health()
        await self._grpc.start()
        self._watchdog = asyncio.ensure_future(self.service.watch_unread())
        if self.metrics_port is not None:
            self._http, _, self.metrics_port = self.metrics.serve_http(self.metrics_port, self.metrics_host)
        up = sum(w.up for w in self.pool.workers)
        log.info("routing on %s to %d worker(s), %d up", self.target, len(self.pool.workers), up)

    async def stop(self, grace: float = 10.0) -> None:
        """Drain: health NOT_SERVING, new generations UNAVAILABLE, running ones get `grace` seconds."""
        if self._grpc is None:
            return
        self.service.phase = "draining"
        self.metrics.serving.set(0)
        await self.health.enter_graceful_shutdown()
        await self.service.wait_idle(grace)
        await self._grpc.stop(0.5)
        self._watchdog.cancel()
        await self.pool.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self._grpc = None


class RouterThread:
    """A Router on its own event loop thread: ``with RouterThread(workers) as rt: Client(rt.target)``."""

    def __init__(self, workers, **router_kwargs):
        self.router = Router(workers, **router_kwargs)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="jaxserve-router", daemon=True)

    def run(self, coro, timeout: float | None = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "RouterThread":
        self._thread.start()
        self.run(self.router.start())
        return self

    def stop(self, grace: float = 2.0) -> None:
        if self._thread.is_alive():
            self.run(self.router.stop(grace))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)

    @property
    def target(self) -> str:
        return self.router.target

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
