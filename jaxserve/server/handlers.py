"""The ``jaxserve.v1.JaxServe`` method table, with the checks every call passes before its
handler runs: the API key (UNAUTHENTICATED), then the request bytes (INVALID_ARGUMENT when
they are not a valid message; grpc's own deserializer failure would be UNKNOWN with a
traceback per call). Replaces the generated ``add_JaxServeServicer_to_server``.
"""
from __future__ import annotations

import logging

import grpc

from jaxserve.server import errors
from jaxserve.server.auth import ApiKeys
from jaxserve.v1 import jaxserve_pb2 as pb

log = logging.getLogger("jaxserve.server")

SERVICE = pb.DESCRIPTOR.services_by_name["JaxServe"]
GENERATION_RPCS = ("Generate", "GenerateStream")


class Malformed:
    """What the deserializer returns for bytes that do not parse (grpc would log and answer
    UNKNOWN if it raised)."""

    def __init__(self, type_name: str, error: Exception):
        self.type_name, self.error = type_name, error

    def serve_error(self) -> errors.ServeError:
        return errors.invalid_argument(f"malformed {self.type_name}: {self.error}")


def _deserializer(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as e:  # DecodeError for any wire error; whatever it is, the bytes were the client's
            return Malformed(cls.DESCRIPTOR.full_name, e)

    return parse


class _Gate:
    """The checks before a handler; a rejection is counted for generation RPCs."""

    def __init__(self, keys: ApiKeys, metrics):
        self.keys, self.metrics = keys, metrics

    async def admit(self, rpc: str, request, context) -> None:
        err = None
        if self.keys.identity(context.invocation_metadata()) is None:
            err = errors.unauthenticated()
        elif isinstance(request, Malformed):
            err = request.serve_error()
        if err is None:
            return
        log.info("%s rejected: %s", rpc, err.message)
        if rpc in GENERATION_RPCS:
            self.metrics.requests.labels(rpc, err.outcome).inc()
        await context.abort(err.code, err.message)

    def wrap(self, rpc: str, method, server_streaming: bool):
        if server_streaming:
            async def handler(request, context):
                await self.admit(rpc, request, context)
                async for response in method(request, context):
                    yield response
        else:
            async def handler(request, context):
                await self.admit(rpc, request, context)
                return await method(request, context)
        return handler


def add_service(servicer, server, keys: ApiKeys, metrics) -> None:
    """Register every method of the service (from its descriptor) on a grpc.aio server."""
    gate = _Gate(keys, metrics)
    handlers = {}
    for m in SERVICE.methods:
        request_cls, response_cls = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(gate.wrap(m.name, getattr(servicer, m.name), m.server_streaming),
                                request_deserializer=_deserializer(request_cls),
                                response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
