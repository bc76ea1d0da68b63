"""The error catalogue: every failure a client can see, as a gRPC status code with a reason.

Handlers raise ``ServeError``; the service turns it into ``context.abort(code, message,
trailing_metadata)``. The server keeps serving after every one of them.

Retry information for RESOURCE_EXHAUSTED (and UNAVAILABLE while warming up / draining) is
sent two ways, both with plain grpcio (no grpcio-status / googleapis-common-protos needed):
- a ``retry-after-ms`` trailer (an integer), trivial to read from any client;
- a ``grpc-status-details-bin`` trailer holding a serialized ``google.rpc.Status`` whose
  details carry a ``google.rpc.RetryInfo`` (the standard rich-error model, what
  ``grpc_status.rpc_status.from_call`` decodes). The two messages are declared here in a
  private descriptor pool, so installing googleapis-common-protos later cannot conflict.
"""
from __future__ import annotations

import grpc
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, duration_pb2, message_factory

RETRY_AFTER_KEY = "retry-after-ms"
STATUS_DETAILS_KEY = "grpc-status-details-bin"
INTEGRITY_CAUSE_KEY = "x-jaxserve-integrity-cause"


def _rich_status_classes():
    """google.rpc.Status and google.rpc.RetryInfo, wire-identical to googleapis' definitions."""
    pool = descriptor_pool.DescriptorPool()
    for fd in (any_pb2.DESCRIPTOR, duration_pb2.DESCRIPTOR):
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        pool.Add(proto)
    f = descriptor_pb2.FileDescriptorProto(name="jaxserve_private/google_rpc.proto", package="google.rpc",
                                           syntax="proto3")
    f.dependency.extend(["google/protobuf/any.proto", "google/protobuf/duration.proto"])
    F = descriptor_pb2.FieldDescriptorProto
    status = f.message_type.add(name="Status")
    status.field.add(name="code", number=1, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
    status.field.add(name="message", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    status.field.add(name="details", number=3, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                     type_name=".google.protobuf.Any")
    retry = f.message_type.add(name="RetryInfo")
    retry.field.add(name="retry_delay", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                    type_name=".google.protobuf.Duration")
    pool.Add(f)
    get = message_factory.GetMessageClass
    return get(pool.FindMessageTypeByName("google.rpc.Status")), get(pool.FindMessageTypeByName("google.rpc.RetryInfo"))


RpcStatus, RetryInfo = _rich_status_classes()


class ServeError(Exception):
    """A failure with its gRPC status code; `outcome` is the metrics label."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 trailers: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.extra_trailers = tuple(trailers)

    @property
    def outcome(self) -> str:
        return self.code.name.lower()

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        md = list(self.extra_trailers)
        if self.retry_after_s is not None:
            ms = max(1, int(round(self.retry_after_s * 1000)))
            md.append((RETRY_AFTER_KEY, str(ms)))
            info = RetryInfo()
            info.retry_delay.seconds, info.retry_delay.nanos = ms // 1000, (ms % 1000) * 1_000_000
            status = RpcStatus(code=self.code.value[0], message=self.message)
            detail = status.details.add()  # an Any, packed by hand (the classes live in our pool)
            detail.type_url = "type.googleapis.com/google.rpc.RetryInfo"
            detail.value = info.SerializeToString()
            md.append((STATUS_DETAILS_KEY, status.SerializeToString()))
        return tuple(md)


def invalid_argument(message: str) -> ServeError:
    return ServeError(grpc.StatusCode.INVALID_ARGUMENT, message)


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


def unavailable(state: str, retry_after_s: float = 1.0) -> ServeError:
    return ServeError(grpc.StatusCode.UNAVAILABLE, f"the server is {state}; retry later or elsewhere",
                      retry_after_s=retry_after_s)


def integrity_aborted(error: Exception) -> ServeError:
    cause = getattr(error, "cause", "unknown")
    return ServeError(grpc.StatusCode.ABORTED, f"KV page integrity check failed ({cause}): {error}",
                      trailers=((INTEGRITY_CAUSE_KEY, cause),))


def internal(error: BaseException) -> ServeError:
    return ServeError(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def from_exception(error: BaseException) -> ServeError:
    """Engine exceptions -> status: ValueError is bad input, anything else a bug."""
    if isinstance(error, ServeError):
        return error
    if isinstance(error, ValueError):
        return invalid_argument(str(error))
    return internal(error)


def retry_after_s(err: grpc.RpcError) -> float | None:
    """Client side: the server's retry delay in seconds from a failed call's trailers, or None."""
    try:
        md = err.trailing_metadata() or ()
    except Exception:  # some RpcError objects (e.g. channel failures) carry no metadata
        return None
    for key, value in md:
        if key == RETRY_AFTER_KEY:
            return int(value) / 1000.0
    return None
