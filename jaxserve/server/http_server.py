"""uvicorn as a task on the server's event loop (no process or signal handling of its own:
``jaxserve serve`` owns the signals and drains gRPC and HTTP together)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import ssl

import uvicorn


@dataclasses.dataclass(frozen=True)
class HttpTls:
    """PEM paths, as for gRPC (--tls-cert, --tls-key, --tls-client-ca: mTLS when set)."""

    cert: str
    key: str
    client_ca: str | None = None


class _EmbeddedUvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the process's own handlers stay in place


class HttpServer:
    """An ASGI app served on host:port (0 = a free port: read ``.port`` after ``start``).

    keep_alive_s: how long an idle connection stays open. Longer than HTTP clients' own idle
    expiry (httpx, under OpenAI's Python client: 5 s), so the client closes an idle connection
    first: were the server to close it as the client sends on it, that request would fail with
    a connection error before reaching the server (uvicorn's default is also 5 s).
    """

    def __init__(self, app, host: str, port: int, tls: HttpTls | None = None, shutdown_timeout_s: float = 1.0,
                 keep_alive_s: float = 75.0):
        self.app, self.host, self.port, self.tls = app, host, port, tls
        self.shutdown_timeout_s, self.keep_alive_s = shutdown_timeout_s, keep_alive_s
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Bind (errors such as a busy port raise here) and serve until ``stop``."""
        family, kind, proto, _, addr = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        tls = {}
        if self.tls is not None:
            tls = dict(ssl_certfile=self.tls.cert, ssl_keyfile=self.tls.key)
            if self.tls.client_ca:
                tls.update(ssl_ca_certs=self.tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False, log_level="warning",
                                timeout_graceful_shutdown=self.shutdown_timeout_s,
                                timeout_keep_alive=self.keep_alive_s, **tls)
        self._server = _EmbeddedUvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # failed to start (e.g. a bad certificate)
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    async def stop(self) -> None:
        """Close the listener and the connections; streams still open are cancelled (their
        requests aborted) after ``shutdown_timeout_s``."""
        if self._server is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._server = None
