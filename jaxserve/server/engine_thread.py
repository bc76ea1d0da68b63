"""The engine thread: the one place that touches the (not thread-safe) LLMEngine.

Commands come in on a SimpleQueue (add, abort, call, stop), processed in FIFO order, so an
abort can never overtake the add it refers to. Events go out per iteration of the loop: one
``emit(batch)`` call, on this thread, with the iteration's ``(engine id, event)`` pairs, events
being the dataclasses of ``jaxserve.server.events``: ``Started`` (once, at admission), ``Delta``
(new tokens and/or text), ``Ended`` (finish reason, usage, times, the request's error, a
handoff's exported pages) and ``Failed`` (rejected by add_request, or step() failed).

Who listens decides where the events go: ``EngineLoop`` hands them to an asyncio loop in this
process; ``engine_worker`` sends them over a socket to the front end's process.

Invariant: every added request receives exactly one terminal event (``Ended`` or ``Failed``),
even when nobody listens for it any more; the queue-depth accounting relies on it.

The thread uses the engine's public interface only: add_request, abort, step (whose outputs
say when a request is admitted, what it produced and how it ended), has_unfinished, snapshot
and warmup (whose progress it reports).
"""
from __future__ import annotations

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

log = logging.getLogger("jaxserve.server")


@dataclasses.dataclass(eq=False)
class _Live:
    """Engine-thread bookkeeping of a request in the engine."""

    engine_id: str
    arrival: float  # time.perf_counter() when the request reached the server (CLOCK_MONOTONIC)
    first_token: float | None = None
    last_token: float | None = None


class EngineThread:
    def __init__(self, engine, metrics, emit: Callable[[list], None], on_ready: Callable[[], None],
                 on_failed: Callable[[BaseException], None], explain_error: Callable[[Exception], Exception] | None = None,
                 on_progress: Callable[[int, int], None] | None = None, serve_while_warming: bool = False):
        """emit(batch): an iteration's [(engine id, event)], on this thread. on_ready(),
        on_failed(error) (warm-up failed: never serving) and on_progress(done, total) (warm-up)
        are called on this thread too (or on the warm-up's own). explain_error(e): the error the
        requests in flight get when a step raises e (e.g. a multi-process replica's lost process
        behind a failed collective). serve_while_warming: ready once any batch can run, the rest
        of warm-up building on a thread of its own. metrics: ``ServerMetrics`` or anything with
        its ttft / itl / e2e (observe), prompt / cached / completion tokens and engine_errors
        (inc) and sync_engine(snapshot)."""
        self.engine = engine
        self.metrics = metrics
        self.serve_while_warming = serve_while_warming
        self._emit, self._on_ready, self._on_failed, self._on_progress = emit, on_ready, on_failed, on_progress
        self._explain = explain_error or (lambda e: e)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._out: list = []  # engine thread only: events of this iteration
        self._stopped = False
        snap = engine.snapshot()
        # Written on the engine thread, each a single store: readable from any thread.
        self.kv_pages = (snap.kv_pages_total, snap.kv_pages_used, snap.kv_pages_free)  # total, used, free
        self.recent_duration_s = 1.0  # EWMA of request durations, for retry-after hints
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def add(self, engine_id: str, prompt_ids: list[int], params, arrival: float, client: str = "", **handoff) -> None:
        """handoff: ``LLMEngine.add_request``'s export_kv / kv_import, if any."""
        self._inbox.put(("add", engine_id, prompt_ids, params, arrival, client, handoff))

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
        """Abort whatever is left (each request fails UNAVAILABLE) and end the thread."""
        self._inbox.put(("stop",))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The thread is still running (e.g. inside a warm-up compile, which cannot be cut short)."""
        return self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            if self.serve_while_warming:
                self._warm_in_background()
            else:
                self.engine.warmup(progress=self._progress)
        except BaseException as e:  # the server cannot serve: say so, never report SERVING
            log.exception("warm-up failed")
            self._on_failed(e)
            return
        self._sync()
        self._on_ready()
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
            self._on_progress(done, total)

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

    def _flush(self) -> None:
        if self._out:
            batch, self._out = self._out, []
            self._emit(batch)

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
            _, eid, ids, params, arrival, client, handoff = cmd
            try:
                self.engine.add_request(ids, params, request_id=eid, client=client, **handoff)
            except Exception as e:  # ValueError = bad input; the front maps the type to a code
                self._out.append((eid, Failed(e)))
                return
            self._live[eid] = _Live(eid, arrival)
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
            for eid in list(self._live):
                self.engine.abort(eid)
                self._out.append((eid, Failed(shutting_down)))
            self._live.clear()

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # a bug: fail the requests in flight (INTERNAL), keep serving
            log.exception("engine.step() failed; aborting %d requests in flight", len(self._live))
            self.metrics.engine_errors.inc()
            e = self._explain(e)
            for eid in list(self._live):
                try:
                    self.engine.abort(eid)  # frees the pages
                except Exception:
                    log.exception("abort(%s) after a failed step", eid)
                self._out.append((eid, Failed(e)))
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
                    self.metrics.ttft.observe(now - live.arrival)
                else:
                    self.metrics.itl.observe(now - live.last_token)
                live.last_token = now
                self.metrics.completion_tokens.inc(n)
            if out.new_token_ids or out.new_text:
                self._out.append((live.engine_id, Delta(list(out.new_token_ids), out.new_text, out.new_logprobs)))
            if out.finished:
                del self._live[out.request_id]
                self._end(live, out)

    def _start(self, live: _Live, out: RequestOutput) -> None:
        """The start event, once the scheduler has admitted the request (the prefix cache
        lookup happens at admission, so that is when cached tokens are known)."""
        self.metrics.prompt_tokens.inc(out.prompt_tokens)
        self.metrics.cached_tokens.inc(out.cached_tokens)
        self._out.append((live.engine_id, Started(out.prompt_tokens, out.cached_tokens)))

    def _end(self, live: _Live, out: RequestOutput) -> None:
        total = time.perf_counter() - live.arrival
        ttft = live.first_token - live.arrival if live.first_token is not None else None
        self.metrics.e2e.observe(total)
        self.recent_duration_s = 0.9 * self.recent_duration_s + 0.1 * total
        self._out.append((live.engine_id, Ended(out.finish_reason, out.completion.usage, ttft, total, out.error,
                                                out.kv_export)))
