"""A server's readiness: its grpc health status and serving phase moving together.

NOT_SERVING while warming up (the progress in the metrics and the log), SERVING once any batch
can run, NOT_SERVING again when draining, when warm-up failed, or when a process of a
multi-process replica is lost (then every request in flight fails at once, without waiting for
the engine thread, which may be blocked for good). All on the event loop.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

from grpc_health.v1 import health, health_pb2

from jaxserve.server import errors
from jaxserve.server.core import ServingCore
from jaxserve.v1 import jaxserve_pb2 as pb

log = logging.getLogger("jaxserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name  # "jaxserve.v1.JaxServe"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


_freezers = 0  # servers of this process whose objects are frozen (see freeze_long_lived)
_freeze_lock = threading.Lock()


def freeze_long_lived() -> int:
    """What lives at SERVING (the model, its programs, JAX's caches: about a million objects
    for the tiny model) lives as long as the server: collected once, then moved out of the
    cyclic collector's view. Without it every full collection walks all of them while the
    request threads wait on the GIL (gen-2 pauses of 150-400 ms measured under disconnect
    churn: a well-behaved client's p99). Refcounting still frees them; only cycles made before
    SERVING are never collected, and the collection just before takes what is garbage then.
    Returns how many objects are frozen. Each call is matched by one ``thaw`` when its server
    stops; the objects go back into the collector's view when the last server of the process
    has stopped (a process that outlives its servers, tests or an embedding script, collects
    their cycles again; a server still running keeps its objects frozen)."""
    global _freezers
    with _freeze_lock:
        _freezers += 1
        gc.collect()
        gc.freeze()
        return gc.get_freeze_count()


def thaw() -> None:
    """One server that froze has stopped: unfreeze once none is left running."""
    global _freezers
    with _freeze_lock:
        _freezers -= 1
        if _freezers == 0:
            gc.unfreeze()


class Readiness:
    """core: the ``ServingCore`` whose phase this moves; programs: the engine's program set (its
    counts go to the metrics); target: the address named in the log once SERVING."""

    def __init__(self, core: ServingCore, metrics, programs, target: str):
        self.core, self.metrics, self.programs, self.target = core, metrics, programs, target
        self.health = health.aio.HealthServicer()
        self.ready = asyncio.Event()  # SERVING, or warm-up failed, or the replica is lost
        self.replica_lost = asyncio.Event()
        self.failure: BaseException | None = None
        self.frozen = False  # this server's freeze_long_lived is in effect (released by release())
        self.warmup_seconds = 0.0  # engine thread start to SERVING
        self._started = time.perf_counter()

    async def set(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def warming(self) -> None:
        """The engine thread starts warming up now."""
        self._started = time.perf_counter()

    def progressed(self, done: int, total: int) -> None:
        """Warm-up progress (health stays NOT_SERVING): see ``Generations.warmup_progressed``."""
        self.core.generations.warmup_progressed(done, total, self.programs)

    def warm(self) -> None:
        asyncio.ensure_future(self._become_ready())

    async def _become_ready(self) -> None:
        if self.core.phase != "warming up":  # stopped during warm-up: stay NOT_SERVING
            return
        frozen = freeze_long_lived()
        self.frozen = True
        await self.set(SERVING)
        self.core.phase = "serving"
        self.warmup_seconds = time.perf_counter() - self._started
        self.metrics.serving.set(1)
        done, total = self.core.generations.warmup_progress
        log.info("warm-up %s: SERVING on %s (%d long-lived objects out of the cyclic collector's walk)",
                 "done" if done == total else
                 f"serviceable ({done}/{total} programs ready; the rest build while serving)", self.target, frozen)
        self.ready.set()

    def release(self) -> None:
        """The server has stopped: its share of the process's freeze ends (``thaw``)."""
        if self.frozen:
            self.frozen = False
            thaw()

    def failed(self, error: BaseException) -> None:
        self.failure = error
        self.core.phase = "failed"
        self.ready.set()

    def lose_replica(self, reason: str) -> None:
        """A process of the replica is gone: the collectives may never complete, so nothing
        waits for the engine thread. Health NOT_SERVING, new requests UNAVAILABLE, every
        request in flight fails now with UNAVAILABLE naming the cause."""
        if self.replica_lost.is_set():
            return
        self.failure = RuntimeError(f"replica lost: {reason}")
        self.core.phase = "failed"
        self.metrics.serving.set(0)
        self.core.fail_all(errors.replica_lost(reason))
        asyncio.ensure_future(self.set(NOT_SERVING))
        self.replica_lost.set()
        self.ready.set()

    async def wait(self, timeout: float | None = None) -> None:
        """Until warm-up is done and health is SERVING; raises if warm-up failed."""
        await asyncio.wait_for(self.ready.wait(), timeout)
        if self.failure is not None:
            raise RuntimeError(f"warm-up failed: {self.failure!r}") from self.failure
