"""The error catalogue: every failure a client can see, as a gRPC status code with a reason.

Handlers raise ``ServeError``; the service turns it into ``context.abort(code, message,
trailing_metadata)``. The server keeps serving after every one of them.

Retry information for RESOURCE_EXHAUSTED (and UNAVAILABLE while warming up / draining) is
sent the standard ways:
- ``grpc-retry-pushback-ms``: gRPC's own retry pushback, which a channel with a retry policy
  (``Client(retries=N)``, or any gRPC client with a service config) obeys by itself;
- ``grpc-status-details-bin``: the rich error model (a ``google.rpc.Status`` whose details
  hold a ``google.rpc.RetryInfo``), built with grpcio-status (``rpc_status.from_call`` reads it);
- ``retry-after-ms``: the integer trailer earlier releases sent, kept for their clients.
"""
from __future__ import annotations

import functools
import logging

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from jaxserve.multihost.channel import ReplicaLost

PUSHBACK_KEY = "grpc-retry-pushback-ms"
RETRY_AFTER_KEY = "retry-after-ms"
STATUS_DETAILS_KEY = "grpc-status-details-bin"
INTEGRITY_CAUSE_KEY = "x-jaxserve-integrity-cause"
RpcStatus, RetryInfo = status_pb2.Status, error_details_pb2.RetryInfo


CLIENT_FAULT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE})


class ServeError(Exception):
    """A failure with its gRPC status code; `outcome` is the metrics label."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 trailers: tuple[tuple[str, str], ...] = (), param: str | None = None,
                 http_status: int | None = None, client_fault: bool | None = None):
        super().__init__(message)
        # The client's own doing (counted by ``refusals``): by default the codes that say so.
        self.client_fault = code in CLIENT_FAULT_CODES if client_fault is None else client_fault
        self.http_status = http_status  # the HTTP API's status where the code's usual one is not apt
        self.param = param  # the request field at fault, when one is (the HTTP API reports it)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.extra_trailers = tuple(trailers)

    def __reduce__(self):  # whole across a process boundary (the engine in a process of its own)
        return (type(self), (self.code, self.message, self.retry_after_s, self.extra_trailers, self.param,
                             self.http_status, self.client_fault))

    @property
    def outcome(self) -> str:
        return self.code.name.lower()

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        md = list(self.extra_trailers)
        if self.retry_after_s is not None:
            ms = max(1, int(round(self.retry_after_s * 1000)))
            info = RetryInfo()
            info.retry_delay.FromMilliseconds(ms)
            detail = any_pb2.Any()
            detail.Pack(info)
            status = RpcStatus(code=self.code.value[0], message=self.message, details=[detail])
            md += [(PUSHBACK_KEY, str(ms)), (RETRY_AFTER_KEY, str(ms))]
            md += list(rpc_status.to_status(status).trailing_metadata)
        return tuple(md)


def invalid_argument(message: str, param: str | None = None) -> ServeError:
    return ServeError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param)


def too_large(message: str) -> ServeError:
    """A request body over its byte limit: INVALID_ARGUMENT, HTTP 413."""
    return ServeError(grpc.StatusCode.INVALID_ARGUMENT, message, http_status=413)


def not_found(message: str, param: str | None = None) -> ServeError:
    return ServeError(grpc.StatusCode.NOT_FOUND, message, param=param)


def unauthenticated() -> ServeError:
    return ServeError(grpc.StatusCode.UNAUTHENTICATED,
                      "missing or wrong API key: send `authorization: Bearer <key>` or `x-api-key: <key>`")


def failed_precondition(message: str) -> ServeError:
    return ServeError(grpc.StatusCode.FAILED_PRECONDITION, message)


def already_exists(request_id: str) -> ServeError:
    return ServeError(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already running")


def queue_full(waiting: int, limit: int, retry_after_s: float) -> ServeError:
    return ServeError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the waiting queue is full ({waiting} of {limit} requests waiting); retry after {retry_after_s:.2f}s",
        retry_after_s=retry_after_s,
    )


def client_queue_full(waiting: int, limit: int, retry_after_s: float) -> ServeError:
    return ServeError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"this client has {waiting} requests waiting; the limit while other clients are served is {limit} "
        f"(--max-queued-per-client); retry after {retry_after_s:.2f}s",
        retry_after_s=retry_after_s, client_fault=True,
    )


class DoorClosed(ServeError):
    """``refused_at_door``: the HTTP API also closes the connection (the body is never read)."""


def refused_at_door(retry_after_s: float) -> ServeError:
    """A client whose requests keep being refused (``refusals``): RESOURCE_EXHAUSTED, HTTP 429."""
    return DoorClosed(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"too many of this client's requests were refused (invalid, too large or over its queue bound) "
        f"or dropped before their end "
        f"(--client-refusal-rate); retry after {retry_after_s:.2f}s",
        retry_after_s=retry_after_s, http_status=429, client_fault=False,
    )


def unavailable(state: str, retry_after_s: float = 1.0) -> ServeError:
    return ServeError(grpc.StatusCode.UNAVAILABLE, f"the server is {state}; retry later or elsewhere",
                      retry_after_s=retry_after_s)


def integrity_aborted(error: Exception) -> ServeError:
    cause = getattr(error, "cause", "unknown")
    return ServeError(grpc.StatusCode.ABORTED, f"KV page integrity check failed ({cause}): {error}",
                      trailers=((INTEGRITY_CAUSE_KEY, cause),))


def internal(error: BaseException) -> ServeError:
    return ServeError(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def replica_lost(reason: str) -> ServeError:
    return ServeError(grpc.StatusCode.UNAVAILABLE, f"this replica lost one of its processes ({reason}); "
                      "it is restarting: retry elsewhere", retry_after_s=5.0)


def from_exception(error: BaseException) -> ServeError:
    """Engine exceptions -> status: ValueError is bad input, a lost process of a multi-process
    replica UNAVAILABLE, anything else a bug."""
    if isinstance(error, ServeError):
        return error
    if isinstance(error, ReplicaLost):
        return replica_lost(str(error))
    if isinstance(error, ValueError):
        return invalid_argument(str(error))
    return internal(error)


def retry_after_s(err: grpc.RpcError) -> float | None:
    """Client side: the server's retry delay in seconds from a failed call (the rich status's
    RetryInfo, else the pushback trailer), or None."""
    try:
        md = dict(err.trailing_metadata() or ())
    except Exception:  # some RpcError objects (e.g. channel failures) carry no metadata
        return None
    if STATUS_DETAILS_KEY in md:
        status = RpcStatus.FromString(md[STATUS_DETAILS_KEY])
        for detail in status.details:
            info = RetryInfo()
            if detail.Unpack(info):
                return info.retry_delay.ToMilliseconds() / 1000.0
    for key in (PUSHBACK_KEY, RETRY_AFTER_KEY):
        if key in md:
            return int(md[key]) / 1000.0
    return None


def unary_errors(log: logging.Logger):
    """A decorator for unary gRPC handlers: ServeError -> its status; anything unexpected ->
    INTERNAL, logged on ``log`` with its traceback (the server lives on)."""

    def decorate(handler):
        @functools.wraps(handler)
        async def wrapped(self, request, context):
            try:
                return await handler(self, request, context)
            except ServeError as e:
                await context.abort(e.code, e.message, e.trailing_metadata())
            except Exception as e:
                log.exception("%s failed", handler.__name__)
                err = internal(e)
                await context.abort(err.code, err.message)

        return wrapped

    return decorate
