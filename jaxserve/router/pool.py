"""The router's workers: one channel each, health-checked through grpc.health.v1.

A worker is up while its health check answers SERVING; ``unhealthy_after`` failed checks in a
row (an error, a timeout or another status) take it down: its in-flight calls are cancelled
(``Attempt.lost`` tells the relay that the worker, not the client, ended them), its prefix
entries are forgotten, and it is skipped until a check answers SERVING again. Each good check
also refreshes its ``ModelInfo`` (page size, free KV pages, limits) for the routing policy.
Channels are made by the pool's ``PeerCredentials`` (TLS, client certificate). Why a check
failed is grpc's status and details (a certificate the CA does not sign, TLS against
plaintext, a refused connection, a timeout): logged for a worker that is not up each time the
reason changes, and with the "is down" line for one that was.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.server.auth import PeerCredentials
from jaxserve.v1 import handoff_pb2_grpc as handoff_grpc
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.router")

ROLES = ("both", "prefill", "decode")
# The worker roles (ModelInfo.role, `serve --role`) that can serve each router role: a decode
# worker also generates alone (it prefills itself), a colocated one serves no KvHandoff.
SERVES = {"both": ("both", "decode"), "prefill": ("prefill",), "decode": ("decode",)}
# Reconnect quickly after a worker restarts (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 2000))
_SERVING = health_pb2.HealthCheckResponse.SERVING


class Attempt:
    """One RPC the router has in flight on a worker. The pool cancels it when the worker
    goes down; ``lost`` then says so (the client did not cancel it)."""

    def __init__(self, worker: "Worker", call=None):
        self.worker, self.call, self.lost = worker, call, False

    def __enter__(self) -> "Attempt":
        self.worker.attempts.add(self)
        self.worker.in_flight += 1
        return self

    def __exit__(self, *exc) -> None:
        self.worker.attempts.discard(self)
        self.worker.in_flight -= 1
        if self.call is not None and not self.call.done():
            self.call.cancel()  # the client went away (or we gave up): the worker frees the request

    def abandon(self) -> None:
        self.lost = True
        if self.call is not None:
            self.call.cancel()


class Worker:
    def __init__(self, address: str, role: str, slot: int):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.address, self.role, self.slot = address, role, slot
        self.channel = None
        self.stub = self.handoff = self.health = None
        self.up = False
        self.failures = 0  # consecutive failed health checks
        self.wrong_role = ""  # the worker's own role when it cannot serve this one (logged once)
        self.info: pb.ModelInfo | None = None
        self.in_flight = 0
        self.attempts: set[Attempt] = set()
        self.last_error = ""  # why the last health check failed ("" after a good one)

    def connect(self, peer: PeerCredentials) -> None:
        self.channel = peer.aio_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.JaxServeStub(self.channel)
        self.handoff = handoff_grpc.KvHandoffStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def page_size(self) -> int | None:
        return self.info.page_size if self.info is not None and self.info.page_size else None

    def load(self) -> float:
        """Lower is better: requests in flight per sequence slot, plus the used KV fraction."""
        slots = self.info.max_num_seqs if self.info is not None and self.info.max_num_seqs else 1
        kv = self.info.kv_pages if self.info is not None else None
        used = 1.0 - kv.free / kv.total if kv is not None and kv.total else 0.0
        return self.in_flight / slots + used

    def has_room(self, pages: int) -> bool:
        """Whether the worker had `pages` free KV pages at its last check (unknown: yes)."""
        if self.info is None or not self.info.kv_pages.total:
            return True
        return self.info.kv_pages.free >= pages

    def __repr__(self) -> str:
        return f"Worker({self.address}, {self.role}, {'up' if self.up else 'down'})"


class WorkerPool:
    """The workers and their health loop (event loop only). on_change(worker) runs after a
    worker goes up or down, on_check_failed(worker) after each failed check; metadata is sent
    with GetModelInfo (a worker's API key); peer makes the channels (default plaintext)."""

    def __init__(self, workers: Sequence[tuple[str, str]], interval_s: float = 1.0, timeout_s: float = 1.0,
                 unhealthy_after: int = 2, metadata: tuple = (), on_change: Callable | None = None,
                 on_check_failed: Callable | None = None, peer: PeerCredentials | None = None):
        if interval_s <= 0 or timeout_s <= 0 or unhealthy_after < 1:
            raise ValueError("health interval and timeout must be > 0 and unhealthy_after >= 1")
        seen = set()
        for address, _ in workers:
            if address in seen:
                raise ValueError(f"worker {address} given twice")
            seen.add(address)
        self.workers = [Worker(address, role, i) for i, (address, role) in enumerate(workers)]
        self.interval_s, self.timeout_s, self.unhealthy_after = interval_s, timeout_s, unhealthy_after
        self.metadata = tuple(metadata) or None
        self.peer = peer or PeerCredentials()
        self.on_change = on_change or (lambda worker: None)
        self.on_check_failed = on_check_failed or (lambda worker: None)
        self._task: asyncio.Task | None = None
        self._probes: dict[str, asyncio.Task] = {}

    def alive(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.up]

    def by_address(self, address: str) -> Worker | None:
        return next((w for w in self.workers if w.address == address), None)

    async def start(self) -> None:
        for w in self.workers:
            w.connect(self.peer)
        await self.check_all()
        self._task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    def probe_soon(self, worker: Worker) -> None:
        """Check `worker` now (a call to it failed as if it were gone), once at a time."""
        task = self._probes.get(worker.address)
        if task is None or task.done():
            self._probes[worker.address] = asyncio.ensure_future(self.check(worker))

    async def check(self, worker: Worker) -> bool:
        try:
            resp = await worker.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s)
            ok = resp.status == _SERVING
            if not ok:  # warming up or draining: the worker answers, nothing to log
                worker.last_error = "health " + health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as e:
            ok = False
            self._check_error(worker, f"{e.code().name}: {e.details()}")
        if ok:
            try:  # best effort: a worker whose GetModelInfo needs a key we lack is still up
                worker.info = await worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout_s,
                                                             metadata=self.metadata)
            except grpc.RpcError as e:
                log.debug("GetModelInfo on %s failed: %s", worker.address, e.code())
            ok = self._role_fits(worker)
        if not ok:
            self.on_check_failed(worker)
        if ok:
            worker.failures, worker.last_error = 0, ""
            if not worker.up:
                worker.up = True
                log.info("worker %s (%s) is up", worker.address, worker.role)
                self.on_change(worker)
        else:
            worker.failures += 1
            if worker.up and worker.failures >= self.unhealthy_after:
                self.mark_down(worker)
        return ok

    @staticmethod
    def _check_error(worker: Worker, reason: str) -> None:
        if reason != worker.last_error and not worker.up:
            log.warning("health check of worker %s (%s) failed: %s", worker.address, worker.role, reason)
        worker.last_error = reason

    @staticmethod
    def _role_fits(worker: Worker) -> bool:
        """A worker started with another role than the router was told (``--decode`` at a
        colocated worker, ...) stays out: it cannot answer that role's calls."""
        role = worker.info.role if worker.info is not None else ""
        if not role or role in SERVES[worker.role]:
            worker.wrong_role = ""
            return True
        if worker.wrong_role != role:
            log.error("worker %s runs `serve --role %s`; it cannot serve as a %s worker: kept out", worker.address,
                      role, worker.role)
            worker.wrong_role = role
        return False

    def mark_down(self, worker: Worker) -> None:
        worker.up = False
        log.warning("worker %s (%s) is down (%s); moving %d call(s) in flight", worker.address, worker.role,
                    worker.last_error or "not SERVING", len(worker.attempts))
        for attempt in list(worker.attempts):
            attempt.abandon()
        self.on_change(worker)

    async def close(self) -> None:
        for task in [self._task, *self._probes.values()]:
            if task is not None:
                task.cancel()
        for w in self.workers:
            if w.channel is not None:
                await w.channel.close()
