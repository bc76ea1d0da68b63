"""The OpenAI HTTP API's responses: errors in OpenAI's JSON shape with their HTTP status (and
``Retry-After`` on 429 / 503), and server-sent events that notice a client going away."""
from __future__ import annotations

import asyncio
import json
import math

import grpc
from fastapi.responses import JSONResponse, StreamingResponse

from jaxserve.server.errors import ServeError

_C = grpc.StatusCode
# gRPC status -> (HTTP status, OpenAI error type, code)
STATUS = {
    _C.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    _C.FAILED_PRECONDITION: (400, "invalid_request_error", "unsupported"),
    _C.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    _C.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    _C.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    _C.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    _C.ABORTED: (500, "server_error", "integrity_check_failed"),
    _C.INTERNAL: (500, "server_error", "internal_error"),
    _C.UNAVAILABLE: (503, "service_unavailable", "unavailable"),
    _C.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}


def http_status(err: ServeError) -> int:
    return err.http_status or STATUS.get(err.code, STATUS[_C.INTERNAL])[0]


def error_body(err: ServeError) -> dict:
    _, kind, code = STATUS.get(err.code, STATUS[_C.INTERNAL])
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": code}}


def error_response(err: ServeError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:  # HTTP's Retry-After is whole seconds; OpenAI's clients also read -ms
        headers = {"retry-after": str(max(1, math.ceil(err.retry_after_s))),
                   "retry-after-ms": str(max(1, round(err.retry_after_s * 1000)))}
    return JSONResponse(error_body(err), http_status(err), headers)


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that watches for the client going away: when it does,
    the body iterator is cancelled and closed. ``on_close()`` runs however the response
    ends (even if the body was never started): it aborts what still runs and counts it."""

    def __init__(self, body, headers: dict, on_close):
        super().__init__(body, 200, dict(headers, **{"cache-control": "no-cache"}), "text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        writer, watcher = asyncio.ensure_future(stream()), asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)
            try:
                await self.body_iterator.aclose()
            finally:
                self.on_close()


async def until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
