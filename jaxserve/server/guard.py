"""What every call passes before a handler runs, as one grpc.aio server interceptor:

- Every service's methods need an API key when the server has keys (UNAUTHENTICATED):
  ``jaxserve.v1.JaxServe``, ``jaxserve.v1.KvHandoff`` (its offers carry other requests' KV)
  and whatever is added later. Only ``grpc.health.v1`` and reflection stay open: load
  balancers and orchestrators probe health without credentials, and reflection describes the
  public schema (it runs nothing and reads no request's data).
- Request bytes that do not parse as the method's message get INVALID_ARGUMENT, for every
  service (health and reflection included). grpc's own handling of a failing deserializer
  is UNKNOWN plus a logged traceback per call: here the deserializer returns a ``Malformed``
  marker instead of raising, and the wrapped handler turns it into the status.
"""
from __future__ import annotations

import inspect
import logging

import grpc

from jaxserve.server import errors
from jaxserve.server.auth import ApiKeys
from jaxserve.v1 import jaxserve_pb2 as pb

log = logging.getLogger("jaxserve.server")

JAXSERVE_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["JaxServe"].full_name + "/"
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")
GENERATION_RPCS = ("Generate", "GenerateStream")  # rejections are counted in jaxserve_requests_total


class Malformed:
    """What the deserializer returns for bytes that do not parse."""

    def __init__(self, error: Exception):
        self.error = error


def needs_key(method: str) -> bool:
    """Whether a method ("/package.Service/Method") needs an API key when keys are set."""
    return method.split("/")[1] not in OPEN_SERVICES if method.count("/") == 2 else True


def _safe(deserialize):
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError for any wire error; whatever it is, the bytes were the client's
            return Malformed(e)

    return parse


def _malformed(err: Malformed, method: str) -> errors.ServeError:
    return errors.invalid_argument(f"malformed request to {method}: {err.error}")


class RequestGuard(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, metrics):
        self.keys, self.metrics = keys, metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED
            return None
        method = details.method
        rejection = None
        if needs_key(method) and self.keys.identity(details.invocation_metadata) is None:
            rejection = errors.unauthenticated()
        return self._wrap(handler, method, rejection)

    async def _reject(self, method: str, err: errors.ServeError, context) -> None:
        log.info("%s rejected: %s", method, err.message)
        rpc = method.rsplit("/", 1)[-1]
        if method.startswith(JAXSERVE_PREFIX) and rpc in GENERATION_RPCS:
            self.metrics.requests.labels(rpc, err.outcome).inc()
        await context.abort(err.code, err.message)

    async def _check(self, method, request, context, rejection) -> None:
        if rejection is not None:
            await self._reject(method, rejection, context)
        if isinstance(request, Malformed):
            await self._reject(method, _malformed(request, method), context)

    def _checked_stream(self, method, requests, context):
        async def each():
            async for request in requests:
                await self._check(method, request, context, None)
                yield request

        return each()

    def _wrap(self, handler, method: str, rejection):
        """The same handler with the safe deserializer and the checks in front of its behavior."""
        kw = dict(request_deserializer=_safe(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
        if handler.request_streaming:
            inner = handler.stream_stream if handler.response_streaming else handler.stream_unary

            if handler.response_streaming:
                async def behavior(requests, context):
                    await self._check(method, None, context, rejection)
                    async for response in inner(self._checked_stream(method, requests, context), context):
                        yield response

                return grpc.stream_stream_rpc_method_handler(behavior, **kw)

            async def behavior(requests, context):
                await self._check(method, None, context, rejection)
                return await inner(self._checked_stream(method, requests, context), context)

            return grpc.stream_unary_rpc_method_handler(behavior, **kw)
        if handler.response_streaming:
            inner = handler.unary_stream

            async def behavior(request, context):
                await self._check(method, request, context, rejection)
                result = inner(request, context)
                if hasattr(result, "__aiter__"):
                    async for response in result:
                        yield response
                elif inspect.isawaitable(result):  # a handler that writes with context.write()
                    await result
                else:
                    for response in result:
                        yield response

            return grpc.unary_stream_rpc_method_handler(behavior, **kw)
        inner = handler.unary_unary

        async def behavior(request, context):
            await self._check(method, request, context, rejection)
            result = inner(request, context)
            return await result if inspect.isawaitable(result) else result

        return grpc.unary_unary_rpc_method_handler(behavior, **kw)
