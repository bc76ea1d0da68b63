"""How a gRPC call ended, for the server's and the router's handlers: the outcome of a
cancelled call (``cancel_outcome``), a stream write that records how long it has waited for
the client (``write``), and whether an exception came from a client that has gone
(``client_gone``)."""
from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("jaxserve.server")

# A failed write can come before grpc marks the call cancelled; this long at most is waited
# for the cancellation before the failure counts as the server's own.
WRITE_FAILURE_WAIT_S = 1.0


def cancel_outcome(context) -> str:
    """``deadline_exceeded`` or ``cancelled``. The client's own deadline timer usually cancels
    the call a moment before the server's fires, so "expired" allows a little slack."""
    remaining = context.time_remaining()
    return "deadline_exceeded" if remaining is not None and remaining < 0.05 else "cancelled"


async def write(stream, context, msg) -> None:
    """One stream message; ``stream.writing_since`` (a RequestStream's or a router Route's)
    says since when the write has waited: ``limits.watch_unread`` reads it, and a failure
    while it is set is a failed write (``client_gone``)."""
    stream.writing_since = time.monotonic()
    await context.write(msg)
    stream.writing_since = None


async def client_gone(context, rpc: str, error: Exception, stream=None) -> bool:
    """Whether ``error`` was raised because the client has gone (grpc fails the write or the
    status it could no longer receive, sometimes before it cancels the handler): the outcome
    is then ``cancelled``, logged once at INFO when the call is closed, no traceback. If
    ``stream`` was mid-``write``, up to WRITE_FAILURE_WAIT_S is waited for grpc to mark the
    call cancelled."""
    writing = stream is not None and stream.writing_since is not None
    deadline = time.monotonic() + (WRITE_FAILURE_WAIT_S if writing else 0.0)
    try:
        while not context.cancelled():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
    except asyncio.CancelledError:  # grpc cancelled the handler while it waited: gone
        asyncio.current_task().uncancel()
    log.debug("%s: the client went away (%s: %s)", rpc, type(error).__name__, error)
    return True
