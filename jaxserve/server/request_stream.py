"""One request as the event loop sees it: created by a front end (through ``Generations``), fed
by the engine thread (``EngineLoop``) with the events of ``jaxserve.server.events`` on its
asyncio.Queue (``Started``, ``Delta``, then one terminal ``Ended`` or ``Failed``)."""
from __future__ import annotations

import asyncio
import dataclasses

from jaxserve.server.events import TERMINAL


@dataclasses.dataclass(eq=False)
class RequestStream:
    """One request as the event loop sees it (created by the service, fed by the engine)."""

    request_id: str  # the client's id (or the generated one)
    engine_id: str  # unique inside the engine
    session_id: str
    arrival: float  # time.perf_counter() when the RPC arrived
    owner: str = ""  # the caller's identity (API key name; "" without keys): who may abort it
    client: str = ""  # the unit of fair share (``generations.client_identity``): the engine's Sequence.client
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    admitted: bool = False  # a start or terminal event arrived (no longer counts as waiting)
    done: bool = False  # the handler consumed the terminal event
    # GenerateStream only: when the write in progress began (None: not writing), the
    # handler's task, and whether the unread-stream watchdog cancelled it.
    writing_since: float | None = None
    task: asyncio.Task | None = None
    unread: bool = False
    # n > 1: this stream is choice 0 and owns the other choices' streams (index 1..n-1), which
    # share its ids and are aborted with it; each is one engine request.
    index: int = 0
    choices: list = dataclasses.field(default_factory=list)

    async def events(self):
        """Yield events up to and including the terminal one."""
        while True:
            ev = await self.queue.get()
            yield ev
            if isinstance(ev, TERMINAL):
                self.done = True
                return
