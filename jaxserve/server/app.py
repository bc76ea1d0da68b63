"""One engine behind a grpc.aio server: the JaxServe service, grpc.health.v1, server
reflection and a Prometheus endpoint; optionally the OpenAI-compatible HTTP API on the same
event loop and engine; warm-up before SERVING, graceful drain (of both) on stop.

``Server`` lives on an asyncio event loop (``jaxserve serve`` runs it on the main thread);
``ServerThread`` runs one on a background thread for synchronous callers (tests, benches).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.disagg.role import WorkerRole
from jaxserve.disagg.service import KvHandoffService
from jaxserve.server import address, announce, convert
from jaxserve.server.auth import ApiKeys, PeerCredentials
from jaxserve.server.core import ServingCore
from jaxserve.server.served_model import served
from jaxserve.server.guard import RequestGuard
from jaxserve.server.http_server import HttpServer, HttpTls
from jaxserve.server.limits import ServeLimits
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.readiness import NOT_SERVING, SERVICE_NAME, Readiness
from jaxserve.server.service import JaxServeService
from jaxserve.v1 import handoff_pb2 as hpb
from jaxserve.v1 import handoff_pb2_grpc as hpb_grpc
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.server")

HANDOFF_SERVICE_NAME = hpb.DESCRIPTOR.services_by_name["KvHandoff"].full_name


class Server:
    """Serve `llm` on host:port: a jaxserve.LLM (its engine on a thread of this process) or any
    ``served_model.ServedModel`` (``engine_process.EngineProcess``: the engine in a process of
    its own).

    port 0 picks a free port (read ``.port`` after ``start``); metrics_port None turns the
    metrics endpoint off, 0 picks a free port; it binds metrics_host (loopback by default,
    whatever `host` is: the endpoint has no authentication). max_waiting: requests accepted
    but not yet admitted before new ones get RESOURCE_EXHAUSTED. credentials: a
    grpc.ServerCredentials (``auth.server_credentials``) for TLS, None = plaintext. keys:
    the API keys (``auth.ApiKeys``; none = no authentication). max_id_length: the longest
    request / session id accepted. limits: bounds on the work of one request and on open
    streams (``limits.ServeLimits``; None = the defaults). http_port: also serve the
    OpenAI-compatible HTTP API on host:http_port (None = off, 0 = a free port: read
    ``.http_port``), with the same keys and limits, over TLS with http_tls (``HttpTls``);
    served_model_name: the model's name there (default: the checkpoint's directory name).
    serve_while_warming: SERVING as soon as the programs that let any batch run are built, the
    rest built meanwhile (batches padded to built buckets until then; nothing compiles while
    serving). The weights are hashed here, once, for the fingerprint in GetModelInfo. group:
    process 0's ``multihost.StepLeader`` of a multi-process replica (None: one process); when it
    loses a process, the server turns NOT_SERVING, fails every request in flight with
    UNAVAILABLE and sets ``replica_lost``. A prefill or decode worker also serves KvHandoff:
    advertise_host is the host its KV offers name (``address.advertised_host``: default the bound
    one, a routable one when bound to every interface); peer (``auth.PeerCredentials``) is how it
    calls other workers (TLS, client certificate, API key).
    """

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 0, metrics_port: int | None = 0,
                 max_waiting: int = 256, replica_id: str | None = None, metrics_host: str = "127.0.0.1",
                 credentials=None, keys: ApiKeys | None = None, max_id_length: int = convert.MAX_ID_LENGTH,
                 limits: ServeLimits | None = None, http_port: int | None = None, http_tls: HttpTls | None = None,
                 served_model_name: str | None = None, kv_transport: str = "grpc", handoff_ttl_s: float = 30.0,
                 pull_timeout_s: float = 10.0, group=None, serve_while_warming: bool = False,
                 advertise_host: str | None = None, peer: PeerCredentials | None = None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        convert.check_id_options(max_id_length, replica_id)
        self.model = served(llm)
        self.host, self.port, self.metrics_port, self.metrics_host = host, port, metrics_port, metrics_host
        self.credentials, self.keys, self.max_id_length = credentials, keys or ApiKeys(), max_id_length
        self.limits = limits or ServeLimits()
        self.serve_while_warming = serve_while_warming
        self.engine_stopped = True  # False if stop() left a warm-up still compiling
        self.max_waiting = max_waiting
        self.metrics = ServerMetrics()
        self.group = group
        peers = [group.digests[p] for p in sorted(group.digests)] if group is not None else ()
        self.info = self.model.model_info(max_waiting, replica_id or "", peers)
        self._replica_id = replica_id
        # A prefill or decode worker also serves KvHandoff (the KV handoff between them).
        self.handoff_options = dict(transport=kv_transport, ttl_s=handoff_ttl_s, pull_timeout_s=pull_timeout_s,
                                    bind_host=host, peer=peer)
        self.advertise_host = advertise_host
        if WorkerRole(self.info.role).hands_off and self.model.engine is None:
            raise ValueError(f"a {self.info.role} worker hands KV off through its engine: it cannot run in a process "
                             "of its own")
        if WorkerRole(self.info.role).hands_off or advertise_host is not None:  # ValueError before anything binds
            self.advertise_host = address.advertised_host(host, advertise_host)
        self.handoff = self._handoff_watch = None
        self._grpc = self._http = self.service = self.engine_loop = self.core = self.readiness = None
        self.http_port, self.http_tls, self.http = http_port, http_tls, None
        self.served_model_name = served_model_name or self.info.model or "jaxserve"
        self.agent_parsers = dict(tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)

    async def start(self) -> None:
        """Bind and start answering (health NOT_SERVING); warm-up runs on the engine thread
        and turns health SERVING when every serving program is compiled."""
        loop = asyncio.get_running_loop()
        self.engine_loop = self.model.engine_loop(
            self.metrics, loop, lambda: self.readiness.warm(), lambda error: self.readiness.failed(error),
            lambda reason: self.readiness.lose_replica(reason),
            explain_error=self._explain_step_error if self.group is not None else None,
            on_progress=lambda done, total: self.readiness.progressed(done, total),
            serve_while_warming=self.serve_while_warming)
        self.core = ServingCore(self.model, self.engine_loop, self.metrics, self.info, self.max_waiting, keys=self.keys,
                                max_id_length=self.max_id_length, limits=self.limits)
        self.readiness = Readiness(self.core, self.metrics, self.model.programs, self.target)
        await self.readiness.set(NOT_SERVING)
        self.service = JaxServeService(self.core, **self.agent_parsers)
        self._watchdog = asyncio.ensure_future(self.core.watch_unread())
        # so_reuseport off: a second server asking for a busy port must fail, not share it. The
        # guard checks API keys (JaxServe only: health and reflection stay open, probes need them
        # and the schema is public) and turns unparsable request bytes into INVALID_ARGUMENT.
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                     interceptors=[RequestGuard(self.keys, self.metrics)])
        pb_grpc.add_JaxServeServicer_to_server(self.service, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.readiness.health, self._grpc)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        address = f"{self.host}:{self.port}"
        if self.credentials is None:
            self.port = self._grpc.add_insecure_port(address)
        else:
            self.port = self._grpc.add_secure_port(address, self.credentials)
        if WorkerRole(self.info.role).hands_off:
            self.handoff = KvHandoffService(self.service, self.model.engine, self.metrics, self.advertised,
                                            **self.handoff_options)
            hpb_grpc.add_KvHandoffServicer_to_server(self.handoff, self._grpc)
            self._handoff_watch = asyncio.ensure_future(self.handoff.watch_offers())
            names += (HANDOFF_SERVICE_NAME,)
        reflection.enable_server_reflection(names, self._grpc)
        # The default replica id names the port actually bound (a router's key for this replica).
        self.info.replica_id = self._replica_id or f"{socket.gethostname()}:{self.port}"
        self.readiness.target = self.target
        self.metrics.info.info(announce.info_labels(self.info))
        self.metrics.set_matmul_paths(self.model.weight_path_rows())
        await self._grpc.start()
        if self.http_port is not None:
            from jaxserve.server.openai_http import OpenAIFrontEnd  # FastAPI only when asked for

            self.http = HttpServer(OpenAIFrontEnd(self.core, self.served_model_name, **self.agent_parsers).app, self.host,
                                   self.http_port, self.http_tls)
            await self.http.start()
            self.http_port = self.http.port
        if self.metrics_port is not None:
            self._http, _, self.metrics_port = self.metrics.serve_http(self.metrics_port, self.metrics_host)
        announce.log_listening(self)
        if self.group is not None:
            self.group.on_lost(lambda reason: loop.call_soon_threadsafe(self.readiness.lose_replica, reason))
        self.readiness.warming()
        self.engine_loop.start()

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def advertised(self) -> str:
        """host:port as peers reach this server (the address its KV offers name)."""
        return address.join(self.advertise_host or self.host, self.port)

    @property
    def http_target(self) -> str | None:
        """The OpenAI API's base URL (".../v1"), or None when it is off."""
        return f"{self.http.scheme}://{self.host}:{self.http_port}/v1" if self.http is not None else None

    @property
    def metrics_target(self) -> str:
        return f"{self.metrics_host}:{self.metrics_port}" if self.metrics_port is not None else "off"

    # The readiness's state (``readiness.Readiness``; None, or 0 s, before ``start``): the health
    # servicer, the event set when a replica process is lost, why it failed, warm-up's seconds.
    health = property(lambda self: self.readiness and self.readiness.health)
    replica_lost = property(lambda self: self.readiness and self.readiness.replica_lost)
    failure = property(lambda self: self.readiness and self.readiness.failure)
    warmup_seconds = property(lambda self: self.readiness.warmup_seconds if self.readiness else 0.0)

    def _explain_step_error(self, error: Exception) -> Exception:  # engine thread
        """A failed step of a multi-process replica: a lost process if the step channel
        confirms one within its peer timeout, else the error itself."""
        from jaxserve.multihost.channel import ReplicaLost

        reason = self.group.wait_lost(self.group.group.peer_timeout_s)
        return ReplicaLost(reason) if reason is not None else error

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until warm-up is done and health is SERVING; raises if warm-up failed."""
        await self.readiness.wait(timeout)

    async def stop(self, grace: float = 10.0) -> None:
        """Graceful drain: health NOT_SERVING, new requests UNAVAILABLE, running ones get up
        to `grace` seconds to finish; the rest are cancelled (their pages freed)."""
        if self._grpc is None:
            return
        warmed_up = self.core.phase == "serving"
        self.core.phase = "draining"
        self.metrics.serving.set(0)
        await self.health.enter_graceful_shutdown()
        idle = await self.core.wait_idle(grace)
        log.info("drained (%s); stopping", "idle" if idle else f"{len(self.core.active)} cancelled")
        if self.http is not None:
            await self.http.stop()  # closes the connections: what is left aborts in the engine
        await self._grpc.stop(0.5)  # cancels what is left: their handlers abort in the engine
        self._watchdog.cancel()
        if self.handoff is not None:
            self._handoff_watch.cancel()
            await self.handoff.close()
        self.core.close()
        self.engine_loop.stop()
        # A warm-up in progress cannot be cut short (XLA is compiling), so it is not waited
        # for: engine_stopped stays False and the process may exit without it.
        await asyncio.to_thread(self.engine_loop.join, 30.0 if warmed_up else 0.5)
        self.engine_stopped = not self.engine_loop.alive
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self._grpc = None
        self.readiness.release()

    async def wait_for_termination(self) -> None:
        await self._grpc.wait_for_termination()


class ServerThread:
    """A Server on its own event loop thread, for synchronous code:

        with ServerThread(llm) as st:      # bound; warming up
            st.wait_ready()
            Client(st.target).generate("hi")
    """

    def __init__(self, llm, **server_kwargs):
        self.server = Server(llm, **server_kwargs)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="jaxserve-grpc", daemon=True)

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as e:
            self._error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()
        self.loop.close()

    def start(self) -> "ServerThread":
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self, timeout: float | None = 300.0) -> None:
        self.run(self.server.wait_ready(timeout))

    def call(self, fn, timeout: float | None = 60.0):
        """fn(engine) on the engine thread, between steps (fault injection, diagnostics)."""
        return self.server.engine_loop.call(fn).result(timeout)

    def stop(self, grace: float = 5.0) -> None:
        if self.loop is None or not self._thread.is_alive():
            return
        self.run(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)

    @property
    def target(self) -> str:
        return self.server.target

    @property
    def http_target(self) -> str | None:
        return self.server.http_target

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
