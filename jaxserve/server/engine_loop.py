"""The engine thread: the one place that touches the (not thread-safe) LLMEngine.

Event loop -> engine thread: commands on a SimpleQueue (add, abort, call, stop), processed
in FIFO order, so an abort can never overtake the add it refers to.
Engine thread -> event loop: per step, one ``loop.call_soon_threadsafe`` hands a batch of
(stream, event) pairs to ``_deliver``, which puts each event on its request's asyncio.Queue
(``request_stream.RequestStream``). Events are the dataclasses of ``jaxserve.server.events``:
``Started`` (once, at admission), ``Delta`` (new tokens and/or text), ``Ended`` (finish reason,
usage, times, the request's error, a handoff's exported pages) and ``Failed`` (rejected by
add_request, or step() failed).

Invariant: every submitted stream receives exactly one terminal event (``Ended`` or ``Failed``),
even when its RPC has already gone away; the queue-depth accounting relies on it.

Engine request ids are internal and unique (``<client id>#<n>``), so a client may reuse its
own id right after cancelling without ever receiving the old request's late events.

The loop uses the engine's public interface only: add_request, abort, step (whose outputs
say when a request is admitted, what it produced and how it ended), has_unfinished,
snapshot and warmup (whose progress it hands to the event loop).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from jaxserve.engine.outputs import RequestOutput
from jaxserve.server import errors
from jaxserve.server.events import Delta, Ended, Failed, Started
from jaxserve.server.request_stream import RequestStream

log = logging.getLogger("jaxserve.server")


@dataclasses.dataclass(eq=False)
class _Live:
    """Engine-thread bookkeeping of a request in the engine."""

    stream: RequestStream
    started: bool = False
    first_token: float | None = None
    last_token: float | None = None


class EngineLoop:
    def __init__(self, engine, metrics, loop: asyncio.AbstractEventLoop,
                 on_ready: Callable[[], None], on_failed: Callable[[BaseException], None],
                 explain_error: Callable[[Exception], Exception] | None = None,
                 on_progress: Callable[[int, int], None] | None = None, serve_while_warming: bool = False):
        """explain_error(e): the error the requests in flight get when a step raises e (on
        the engine thread; e.g. a multi-process replica's lost process behind a failed collective).
        on_progress(done, total): warm-up progress, on the event loop. serve_while_warming: report
        ready once any batch can run, the rest of warm-up building on a thread of its own."""
        self.engine = engine
        self.serve_while_warming = serve_while_warming
        self.metrics = metrics
        self.loop = loop
        self._on_ready, self._on_failed, self._on_progress = on_ready, on_failed, on_progress
        self._explain = explain_error or (lambda e: e)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._out: list = []  # engine thread only: events of this iteration
        self._stopped = False
        self.waiting = 0  # event loop only: submitted, not yet admitted
        snap = engine.snapshot()
        self.kv_pages = (snap.kv_pages_total, snap.kv_pages_used, snap.kv_pages_free)  # total, used, free
        self.recent_duration_s = 1.0  # EWMA of request durations, for retry-after hints
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)

    # ------------------------------------------------------------------ event loop side
    def start(self) -> None:
        self._thread.start()

    def submit(self, stream: RequestStream, prompt_ids: list[int], params, **handoff) -> None:
        """handoff: ``LLMEngine.add_request``'s export_kv / kv_import, if any."""
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)
        self._inbox.put(("add", stream, prompt_ids, params, handoff))

    def abort(self, engine_id: str) -> concurrent.futures.Future:
        """Abort through the engine thread; the future's result: was it running."""
        fut = concurrent.futures.Future()
        self._inbox.put(("abort", engine_id, fut))
        return fut

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps (diagnostics, tests)."""
        fut = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return fut

    def stop(self) -> None:
        """Abort whatever is left (each stream gets UNAVAILABLE) and end the thread."""
        self._inbox.put(("stop",))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The engine thread is still running (e.g. inside a warm-up compile, which cannot be cut short)."""
        return self._thread.is_alive()

    def _deliver(self, batch) -> None:
        for stream, ev in batch:
            if not stream.admitted and not isinstance(ev, Delta):
                stream.admitted = True
                self.waiting -= 1
            stream.queue.put_nowait(ev)
        self.metrics.queue_depth.set(self.waiting)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            if self.serve_while_warming:
                self._warm_in_background()
            else:
                self.engine.warmup(progress=self._progress)
        except BaseException as e:  # the server cannot serve: say so, never report SERVING
            log.exception("warm-up failed")
            self._post(self._on_failed, e)
            return
        self._sync()
        self._post(self._on_ready)
        while not self._stopped:
            self._commands(block=not self.engine.has_unfinished())
            if not self._stopped and self.engine.has_unfinished():
                self._step()
            self._sync()
            self._flush()
        self._reject_rest()

    def _warm_in_background(self) -> None:
        """``engine.warmup`` on a thread of its own; returns once any batch can run (the rest
        builds meanwhile) and raises what warm-up raised before that."""
        serviceable, failed = threading.Event(), []

        def build():
            try:
                self.engine.warmup(progress=self._progress, on_serviceable=serviceable.set)
            except BaseException as e:  # before serving, the caller gets it; after, built buckets serve on
                if serviceable.is_set():
                    log.exception("warm-up failed after serving began")
                failed.append(e)
                serviceable.set()

        threading.Thread(target=build, name="jaxserve-warmup", daemon=True).start()
        serviceable.wait()
        if failed:
            raise failed[0]

    def _progress(self, done: int, total: int) -> None:  # warm-up (engine or compile threads)
        if self._on_progress is not None:
            self._post(self._on_progress, done, total)

    def _reject_rest(self) -> None:
        """After stop: nothing queued behind it may wait forever."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._out.append((cmd[1], Failed(errors.unavailable("shutting down"))))
            elif cmd[0] in ("abort", "call"):
                cmd[2].set_exception(RuntimeError("the engine loop has stopped"))
        self._flush()

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _flush(self) -> None:
        if self._out:
            batch, self._out = self._out, []
            self._post(self._deliver, batch)

    def _sync(self) -> None:
        snap = self.engine.snapshot()
        self.kv_pages = (snap.kv_pages_total, snap.kv_pages_used, snap.kv_pages_free)  # one atomic store
        self.metrics.sync_engine(snap)

    def _commands(self, block: bool) -> None:
        try:
            cmd = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _command(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, stream, ids, params, handoff = cmd
            try:
                self.engine.add_request(ids, params, request_id=stream.engine_id, client=stream.client, **handoff)
            except Exception as e:  # ValueError = bad input; the loop maps the type to a code
                self._out.append((stream, Failed(e)))
                return
            self._live[stream.engine_id] = _Live(stream)
        elif kind == "abort":
            _, eid, fut = cmd
            try:
                ok = self.engine.abort(eid)
            except Exception as e:
                log.exception("abort(%s) failed", eid)
                ok = False
                fut.set_exception(e)
            # Its final output (finish_reason "abort", with usage) comes from the next step().
            if not fut.done():
                fut.set_result(ok)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)
        elif kind == "stop":
            self._stopped = True
            shutting_down = errors.unavailable("shutting down")
            for eid, live in list(self._live.items()):
                self.engine.abort(eid)
                self._out.append((live.stream, Failed(shutting_down)))
            self._live.clear()

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # a bug: fail the requests in flight (INTERNAL), keep serving
            log.exception("engine.step() failed; aborting %d requests in flight", len(self._live))
            self.metrics.engine_errors.inc()
            e = self._explain(e)
            for eid, live in list(self._live.items()):
                try:
                    self.engine.abort(eid)  # frees the pages
                except Exception:
                    log.exception("abort(%s) after a failed step", eid)
                self._out.append((live.stream, Failed(e)))
            self._live.clear()
            return
        now = time.perf_counter()
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:  # ended already (shutdown, a failed step): nobody is listening
                continue
            if out.started:
                self._start(live, out)
            if out.new_token_ids:
                n = len(out.new_token_ids)
                if live.first_token is None:
                    live.first_token = now
                    self.metrics.ttft.observe(now - live.stream.arrival)
                else:
                    self.metrics.itl.observe(now - live.last_token)
                live.last_token = now
                self.metrics.completion_tokens.inc(n)
            if out.new_token_ids or out.new_text:
                self._out.append((live.stream, Delta(list(out.new_token_ids), out.new_text, out.new_logprobs)))
            if out.finished:
                del self._live[out.request_id]
                self._end(live, out)

    def _start(self, live: _Live, out: RequestOutput) -> None:
        """The start event, once the scheduler has admitted the request (the prefix cache
        lookup happens at admission, so that is when cached tokens are known)."""
        live.started = True
        self.metrics.prompt_tokens.inc(out.prompt_tokens)
        self.metrics.cached_tokens.inc(out.cached_tokens)
        self._out.append((live.stream, Started(out.prompt_tokens, out.cached_tokens)))

    def _end(self, live: _Live, out: RequestOutput) -> None:
        now = time.perf_counter()
        stream = live.stream
        total = now - stream.arrival
        ttft = live.first_token - stream.arrival if live.first_token is not None else None
        self.metrics.e2e.observe(total)
        self.recent_duration_s = 0.9 * self.recent_duration_s + 0.1 * total
        self._out.append((stream, Ended(out.finish_reason, out.completion.usage, ttft, total, out.error,
                                        out.kv_export)))
