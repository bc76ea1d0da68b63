"""The requests in flight, shared by both front ends (gRPC ``service.py``, HTTP ``openai_http.py``).

A front end validates its request, then ``Generations.submit`` checks the server's phase,
the id and the waiting queue, registers a ``RequestStream`` (plus one per extra choice when
n > 1) and hands each to the engine thread, with no await in between (the id check and the
registration are atomic). Each request carries its client (``client_identity``: the hashed API
key, else the connection) into the engine, whose scheduler shares slots fairly between clients;
here a client with ``max_queued_per_client`` requests waiting is refused while another client has
requests in flight. However the call ends, the front end calls ``finish`` once: it
aborts whatever is still running (freeing its pages at once) and counts the outcome.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from jaxserve.engine.outputs import RequestFailed
from jaxserve.server import errors
from jaxserve.server.engine_loop import EngineLoop, RequestStream
from jaxserve.server.events import TERMINAL, Failed

log = logging.getLogger("jaxserve.server")


def client_identity(owner: str, peer: str) -> str:
    """Who a request counts against for fair share: the caller's API key identity (a hash of the
    key, never the key) when keys are on, else its connection (gRPC ``context.peer()``, the HTTP
    client's address and port)."""
    return owner or peer


class Generations:
    def __init__(self, engine_loop: EngineLoop, metrics, max_waiting: int, max_num_seqs: int,
                 max_queued_per_client: int = 0):
        self.engine_loop = engine_loop
        self.max_queued_per_client = max_queued_per_client
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_num_seqs = max_num_seqs
        self.phase = "warming up"  # -> "serving" -> "draining"; or "failed"
        self.warmup_progress = (0, 0)  # serving programs ready, of how many (set by the server)
        self.active: dict[str, RequestStream] = {}  # client request id -> stream (choice 0)
        self._seq = itertools.count()

    def state(self) -> str:
        """The phase as a client reads it: "warming up (12/40 programs ready)" during warm-up."""
        done, total = self.warmup_progress
        return f"{self.phase} ({done}/{total} programs ready)" if self.phase == "warming up" and total else self.phase

    def warmup_progressed(self, done: int, total: int, programs) -> None:
        """Record warm-up progress (``programs``: the engine's ProgramSet): for the UNAVAILABLE
        message of early requests, the metrics, and the log (every tenth of the way)."""
        before = self.warmup_progress[0]
        self.warmup_progress = (done, total)
        self.metrics.warmup_done.set(done)
        self.metrics.warmup_total.set(total)
        self.metrics.programs_compiled.set(programs.compiled)
        self.metrics.programs_loaded.set(programs.loaded)
        if done == total or done * 10 // total != before * 10 // total:
            log.info("warming up: %d/%d serving programs ready (health NOT_SERVING)", done, total)

    def check_serving(self) -> None:
        """Raises UNAVAILABLE (both fronts' message: the state, warm-up progress included)
        unless serving."""
        if self.phase != "serving":
            raise errors.unavailable(self.state())

    def submit(self, prompt_ids: list[int], params: list, request_id: str, session_id: str, owner: str,
               arrival: float, handoff: dict | None = None, client: str = "") -> RequestStream:
        """Register and submit one engine request per SamplingParams in `params` (the choices);
        -> choice 0's stream (the others in its ``choices``). Raises ServeError (UNAVAILABLE,
        ALREADY_EXISTS, RESOURCE_EXHAUSTED with a retry hint) having submitted nothing.
        ``client``: ``client_identity`` of the caller (fair share; the per-client queue bound).
        ``handoff``: ``LLMEngine.add_request``'s KV handoff arguments (one choice only)."""
        self.check_serving()
        if request_id in self.active:
            raise errors.already_exists(request_id)
        waiting = self.engine_loop.waiting
        if waiting >= self.max_waiting:
            # Roughly the time for the running batch to turn over once.
            hint = self.engine_loop.recent_duration_s * max(1, waiting) / max(1, self.max_num_seqs)
            raise errors.queue_full(waiting, self.max_waiting, min(max(hint, 0.05), 30.0))
        self._check_client_queue(client, len(params))
        streams = [RequestStream(request_id, f"{request_id}#{next(self._seq)}", session_id, arrival, owner=owner,
                                 client=client, index=i) for i in range(len(params))]
        first = streams[0]
        first.choices = streams[1:]
        self.active[request_id] = first
        if session_id:
            self.metrics.session_requests.inc()
        self._update_sessions()
        for stream, p in zip(streams, params):
            self.engine_loop.submit(stream, prompt_ids, p, **(handoff or {}))
        return first

    def _check_client_queue(self, client: str, n: int) -> None:
        """RESOURCE_EXHAUSTED when ``client`` would have more than ``max_queued_per_client``
        requests waiting while another client has requests in flight (a lone client is free)."""
        limit = self.max_queued_per_client
        if limit <= 0:
            return
        mine, others = 0, False
        for first in self.active.values():
            for s in (first, *first.choices):
                if s.client != client:
                    others = others or not s.done
                elif not s.admitted:
                    mine += 1
        if others and mine + n > limit:
            hint = self.engine_loop.recent_duration_s * max(1, mine) / max(1, self.max_num_seqs)
            raise errors.client_queue_full(mine, limit, min(max(hint, 0.05), 30.0))

    def finish(self, stream: RequestStream | None, api: str, outcome: str) -> bool:
        """Once per call: abort what still runs, count and log the outcome. -> True."""
        if stream is not None:
            if self.active.get(stream.request_id) is stream:
                del self.active[stream.request_id]
            for s in (stream, *stream.choices):
                if not s.done:  # cancelled, expired or failed mid-way: free its pages now
                    self.engine_loop.abort(s.engine_id)
            self._update_sessions()
        self.metrics.requests.labels(api, outcome).inc()
        log.info("%s request=%s session=%s outcome=%s", api, stream.request_id if stream else "-",
                 (stream.session_id or "-") if stream else "-", outcome)
        return True

    async def abort(self, request_ids, caller: str) -> tuple[list[str], list[str]]:
        """Abort requests by client id (only the caller's own) -> (aborted, not found)."""
        aborted, not_found, pending = [], [], []
        for rid in dict.fromkeys(request_ids):  # each id once, order kept
            stream = self.active.get(rid)
            if stream is None or stream.owner != caller:
                not_found.append(rid)
            else:
                futs = [asyncio.wrap_future(self.engine_loop.abort(s.engine_id)) for s in (stream, *stream.choices)]
                pending.append((rid, futs))
        for rid, futs in pending:
            (aborted if any(await asyncio.gather(*futs)) else not_found).append(rid)
        return aborted, not_found

    def _update_sessions(self) -> None:
        self.metrics.active_sessions.set(len({s.session_id for s in self.active.values() if s.session_id}))

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation is in flight (for a graceful drain); False on timeout."""
        end = time.monotonic() + timeout
        while self.active and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return not self.active


def terminal(ev):
    """A terminal event -> (reason, usage, ttft, total), or the ServeError it stands for."""
    if isinstance(ev, Failed):
        raise errors.from_exception(ev.error)
    reason, usage, ttft, total, error = ev.finish_reason, ev.usage, ev.ttft_s, ev.total_s, ev.error
    if isinstance(error, RequestFailed):  # its own processing raised: INTERNAL, for it alone
        raise errors.internal(error)
    if error is not None:  # the page tracker failed this request closed
        raise errors.integrity_aborted(error)
    return reason, usage, ttft, total


async def choice_events(stream: RequestStream):
    """(choice index, event) of every choice of `stream`, each choice's in order, up to and
    including every choice's terminal event."""
    if not stream.choices:
        async for ev in stream.events():
            yield 0, ev
        return
    streams = [stream, *stream.choices]
    gens = [s.events() for s in streams]
    pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                ev = task.result()
                yield i, ev
                if not isinstance(ev, TERMINAL):
                    pending[asyncio.ensure_future(anext(gens[i]))] = i
    finally:
        for task in pending:
            task.cancel()
