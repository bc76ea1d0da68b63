"""The engine as the event loop sees it: requests submitted as ``RequestStream``s, their events
put on each stream's asyncio.Queue (``request_stream.RequestStream``).

Two kinds behind one interface (start, submit, abort, call, stop, join, alive, waiting,
kv_pages, recent_duration_s):
- ``EngineLoop``: the engine on a thread of this process (``engine_thread.EngineThread``); per
  iteration, one ``loop.call_soon_threadsafe`` hands its batch of events to the loop;
- ``process_engine_loop.ProcessEngineLoop``: the engine in a process of its own, over a socket.
Both keep their streams in a ``StreamTable`` (engine id -> stream, and how many wait).

Engine request ids are internal and unique (``<client id>#<n>``), so a client may reuse its
own id right after cancelling without ever receiving the old request's late events.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Callable

from jaxserve.server.engine_thread import EngineThread
from jaxserve.server.events import TERMINAL, Delta, Failed
from jaxserve.server.request_stream import RequestStream

__all__ = ["EngineLoop", "RequestStream", "StreamTable"]


class StreamTable:
    """The streams submitted and not yet ended, by engine id; event loop only."""

    def __init__(self, metrics):
        self.metrics = metrics
        self._streams: dict[str, RequestStream] = {}
        self.waiting = 0  # submitted, not yet admitted

    def add(self, stream: RequestStream) -> None:
        self._streams[stream.engine_id] = stream
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)

    def deliver(self, batch) -> None:
        """[(engine id, event)] -> each event on its stream's queue (the terminal one ends it)."""
        for eid, ev in batch:
            stream = self._streams.get(eid)
            if stream is None:
                continue
            if not stream.admitted and not isinstance(ev, Delta):
                stream.admitted = True
                self.waiting -= 1
            if isinstance(ev, TERMINAL):
                del self._streams[eid]
            stream.queue.put_nowait(ev)
        self.metrics.queue_depth.set(self.waiting)

    def fail_all(self, error: Exception) -> None:
        """Every stream not yet ended gets ``Failed(error)`` (the engine is gone)."""
        self.deliver([(eid, Failed(error)) for eid in list(self._streams)])


class EngineLoop:
    def __init__(self, engine, metrics, loop: asyncio.AbstractEventLoop,
                 on_ready: Callable[[], None], on_failed: Callable[[BaseException], None],
                 explain_error: Callable[[Exception], Exception] | None = None,
                 on_progress: Callable[[int, int], None] | None = None, serve_while_warming: bool = False):
        """The engine on a thread of this process. on_ready(), on_failed(error) (warm-up
        failed) and on_progress(done, total) run on the event loop; explain_error(e): the error
        the requests in flight get when a step raises e, on the engine thread."""
        self.loop = loop
        self.streams = StreamTable(metrics)
        self._on_ready, self._on_failed, self._on_progress = on_ready, on_failed, on_progress
        self.thread = EngineThread(engine, metrics, lambda batch: self._post(self.streams.deliver, batch),
                                   lambda: self._post(self._on_ready), lambda e: self._post(self._on_failed, e),
                                   explain_error=explain_error,
                                   on_progress=(lambda done, total: self._post(on_progress, done, total))
                                   if on_progress is not None else None,
                                   serve_while_warming=serve_while_warming)

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ------------------------------------------------------------------ event loop side
    def start(self) -> None:
        self.thread.start()

    def submit(self, stream: RequestStream, prompt_ids: list[int], params, **handoff) -> None:
        """handoff: ``LLMEngine.add_request``'s export_kv / kv_import, if any."""
        self.streams.add(stream)
        self.thread.add(stream.engine_id, prompt_ids, params, stream.arrival, stream.client, **handoff)

    def abort(self, engine_id: str) -> concurrent.futures.Future:
        """Abort through the engine thread; the future's result: was it running."""
        return self.thread.abort(engine_id)

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps (diagnostics, tests)."""
        return self.thread.call(fn)

    def stop(self) -> None:
        """Abort whatever is left (each stream gets UNAVAILABLE) and end the thread."""
        self.thread.stop()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The engine thread is still running (e.g. inside a warm-up compile, which cannot be cut short)."""
        return self.thread.alive

    @property
    def waiting(self) -> int:
        return self.streams.waiting

    @property
    def kv_pages(self) -> tuple[int, int, int]:
        return self.thread.kv_pages

    @property
    def recent_duration_s(self) -> float:
        return self.thread.recent_duration_s
