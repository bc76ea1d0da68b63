"""The ``jaxserve.v1.JaxServe`` servicer (grpc.aio): validation, streams, errors, accounting.

Handlers run on the event loop and never touch the engine: they validate the request,
register a ``RequestStream`` and hand it to the engine thread (``EngineLoop.submit``), then
relay its events. Whatever way a generation RPC ends (finished, error, cancelled by the
client, deadline expired), ``_close`` runs: it aborts the request through the engine thread
if it is still running (freeing its pages at once), and counts the outcome.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import time
import uuid

import grpc

from jaxserve.server import convert, errors
from jaxserve.server.auth import ApiKeys
from jaxserve.server.engine_loop import EngineLoop, RequestStream
from jaxserve.server.errors import ServeError
from jaxserve.server.limits import ServeLimits, StreamSlots, check_stop, check_text, watch_unread
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.server")

SESSION_HEADER = "x-session-affinity"
REPLICA_HEADER = "x-jaxserve-replica"
LARGE_TEXT_CHARS = 65536  # texts this long are tokenized on the LARGE_TEXT_WORKERS pool
LARGE_TEXT_WORKERS = 2


def _unary_errors(handler):
    """Map ServeError to its status and anything unexpected to INTERNAL (the server lives on)."""

    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            return await handler(self, request, context)
        except ServeError as e:
            await context.abort(e.code, e.message, e.trailing_metadata())
        except Exception as e:
            log.exception("%s failed", handler.__name__)
            err = errors.internal(e)
            await context.abort(err.code, err.message)

    return wrapped


class JaxServeService(pb_grpc.JaxServeServicer):
    def __init__(self, llm, engine_loop: EngineLoop, metrics, info: pb.ModelInfo, max_waiting: int,
                 keys: ApiKeys | None = None, max_id_length: int = convert.MAX_ID_LENGTH,
                 limits: ServeLimits | None = None):
        self.limits = (limits or ServeLimits()).resolved(info.max_context)
        self.slots = StreamSlots(self.limits)
        self._large_texts = concurrent.futures.ThreadPoolExecutor(LARGE_TEXT_WORKERS, "jaxserve-tokenize")
        self.llm = llm
        self.keys = keys or ApiKeys()
        self.max_id_length = max_id_length
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.info = info
        self.max_waiting = max_waiting
        self.phase = "warming up"  # -> "serving" -> "draining"; or "failed"
        self.warmup_progress = (0, 0)  # serving programs ready, of how many (set by the server)
        self.active: dict[str, RequestStream] = {}  # client request id -> stream
        self._seq = itertools.count()

    def state(self) -> str:
        """The phase as a client reads it: "warming up (12/40 programs ready)" during warm-up."""
        done, total = self.warmup_progress
        return f"{self.phase} ({done}/{total} programs ready)" if self.phase == "warming up" and total else self.phase

    # ------------------------------------------------------------------ generation
    async def Generate(self, request, context):
        stream, outcome, closed = None, "internal", False
        try:
            stream = await self._open(request, context)
            ids, text = [], []
            async for ev in stream.events():
                if ev[0] == "delta":
                    ids += ev[1]
                    text.append(ev[2])
                elif ev[0] in ("end", "error"):
                    reason, usage, ttft, total = self._terminal(ev)
            outcome = reason
            return pb.GenerateResponse(
                request_id=stream.request_id, session_id=stream.session_id, token_ids=ids, text="".join(text),
                finish_reason=convert.FINISH_REASONS[reason], usage=convert.usage(usage),
                timing=convert.timing(ttft, total),
            )
        except ServeError as e:
            outcome = e.outcome
            closed = self._close(stream, "Generate", outcome)  # counted before the client sees the status
            await context.abort(e.code, e.message, e.trailing_metadata())
        except asyncio.CancelledError:
            outcome = self._cancel_outcome(context)
            raise
        except Exception as e:
            log.exception("Generate failed")
            closed = self._close(stream, "Generate", "internal")
            await context.abort(grpc.StatusCode.INTERNAL, errors.internal(e).message)
        finally:
            if not closed:
                self._close(stream, "Generate", outcome)

    async def GenerateStream(self, request, context):
        """Writes with context.write so that a client that stops reading is noticed: each
        write records when it began, and ``watch_unread`` cancels a handler whose write has
        waited longer than the stream idle timeout (the request is aborted, its pages freed)."""
        stream, outcome, closed, peer = None, "internal", False, context.peer() or ""
        try:
            self.slots.acquire(peer)
        except ServeError as e:
            self.metrics.requests.labels("GenerateStream", e.outcome).inc()
            await context.abort(e.code, e.message, e.trailing_metadata())
        try:
            stream = await self._open(request, context)
            stream.task = asyncio.current_task()
            async for ev in stream.events():
                if ev[0] == "start":
                    msg = pb.GenerateStreamResponse(start=pb.StreamStart(
                        request_id=stream.request_id, session_id=stream.session_id,
                        prompt_tokens=ev[1], cached_tokens=ev[2]))
                elif ev[0] == "delta":
                    msg = pb.GenerateStreamResponse(delta=pb.TokenDelta(token_ids=ev[1], text=ev[2]))
                else:
                    reason, usage, ttft, total = self._terminal(ev)
                    outcome = reason
                    msg = pb.GenerateStreamResponse(end=pb.StreamEnd(
                        finish_reason=convert.FINISH_REASONS[reason], usage=convert.usage(usage),
                        timing=convert.timing(ttft, total)))
                stream.writing_since = time.monotonic()
                await context.write(msg)
                stream.writing_since = None
        except ServeError as e:
            outcome = e.outcome
            closed = self._close(stream, "GenerateStream", outcome)  # counted before the client sees the status
            await context.abort(e.code, e.message, e.trailing_metadata())
        except (asyncio.CancelledError, GeneratorExit):
            if stream is None or not stream.unread:
                outcome = self._cancel_outcome(context)
                raise
            # Cancelled by watch_unread: the status waits behind the unread messages (abort
            # would block on them), so it is set and the handler returns at once.
            asyncio.current_task().uncancel()
            outcome = "unread_timeout"
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(f"no stream event read for {self.limits.stream_idle_timeout_s:g}s; "
                                f"cancelled (--stream-idle-timeout)")
        except Exception as e:
            log.exception("GenerateStream failed")
            closed = self._close(stream, "GenerateStream", "internal")
            await context.abort(grpc.StatusCode.INTERNAL, errors.internal(e).message)
        finally:
            self.slots.release(peer)
            if not closed:
                self._close(stream, "GenerateStream", outcome)

    async def watch_unread(self) -> None:
        """Runs while the server does: see ``limits.watch_unread``."""
        await watch_unread(self.active.values, self.limits.stream_idle_timeout_s)

    async def _open(self, req: pb.GenerateRequest, context) -> RequestStream:
        """Validate and submit; raises ServeError (nothing is submitted then)."""
        arrival = time.perf_counter()
        headers = {k: v for k, v in (context.invocation_metadata() or ())}
        # Ids are echoed in response headers: checked first, so a bad one never runs.
        rid = convert.check_id("request_id", req.request_id, self.max_id_length)
        session = req.session_id or str(headers.get(SESSION_HEADER, ""))
        convert.check_id("session_id" if req.session_id else SESSION_HEADER, session, self.max_id_length)
        if self.phase != "serving":
            raise errors.unavailable(self.state())
        check_stop(req.stop.stop, req.stop.stop_token_ids, self.limits)  # before any work on them
        params = convert.sampling_params(req)
        if req.WhichOneof("prompt") == "text":
            check_text(req.text, self.limits)  # before tokenizing it
            ids = await self._off_loop(req.text, convert.prompt_ids, req, self.llm.tokenizer)
        else:
            ids = convert.prompt_ids(req, self.llm.tokenizer)
        rid = rid or f"req-{uuid.uuid4().hex}"
        md = [(REPLICA_HEADER, self.info.replica_id), ("x-request-id", rid)]
        if session:
            md.append((SESSION_HEADER, session))
        await context.send_initial_metadata(tuple(md))
        if self.phase != "serving":  # it may have changed during the awaits above
            raise errors.unavailable(self.state())
        if rid in self.active:
            raise errors.already_exists(rid)
        waiting = self.engine_loop.waiting
        if waiting >= self.max_waiting:
            # Roughly the time for the running batch to turn over once.
            hint = self.engine_loop.recent_duration_s * max(1, waiting) / max(1, self.info.max_num_seqs)
            raise errors.queue_full(waiting, self.max_waiting, min(max(hint, 0.05), 30.0))
        # From here to submit() there is no await: the id check and the registration are atomic.
        stream = RequestStream(rid, f"{rid}#{next(self._seq)}", session, arrival,
                               owner=self.keys.identity(context.invocation_metadata()) or "")
        self.active[rid] = stream
        if session:
            self.metrics.session_requests.inc()
        self._update_sessions()
        self.engine_loop.submit(stream, ids, params)
        return stream

    @staticmethod
    def _terminal(ev):
        """A terminal event -> (reason, usage, ttft, total), or the ServeError it stands for."""
        if ev[0] == "error":
            raise errors.from_exception(ev[1])
        _, reason, usage, ttft, total, error = ev
        if error is not None:  # the page tracker failed this request closed
            raise errors.integrity_aborted(error)
        return reason, usage, ttft, total

    @staticmethod
    def _cancel_outcome(context) -> str:
        # The client's own deadline timer usually cancels the call a moment before the
        # server's fires, so "expired" allows a little slack.
        remaining = context.time_remaining()
        return "deadline_exceeded" if remaining is not None and remaining < 0.05 else "cancelled"

    def _close(self, stream: RequestStream | None, rpc: str, outcome: str) -> bool:
        """Once per generation RPC: abort it if still running, count and log the outcome."""
        if stream is not None:
            if self.active.get(stream.request_id) is stream:
                del self.active[stream.request_id]
            if not stream.done:  # cancelled, expired or failed mid-way: free its pages now
                self.engine_loop.abort(stream.engine_id)
            self._update_sessions()
        self.metrics.requests.labels(rpc, outcome).inc()
        log.info("%s request=%s session=%s outcome=%s", rpc, stream.request_id if stream else "-",
                 (stream.session_id or "-") if stream else "-", outcome)
        return True

    async def _off_loop(self, text: str, fn, *args):
        """fn(*args) (a tokenization of `text`) on a worker thread. Large texts get their own
        small pool, so a burst of them queues there instead of taking every default worker;
        ``Tokenizer.encode`` releases the GIL for them, so the event loop keeps running."""
        if len(text) < LARGE_TEXT_CHARS:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._large_texts, functools.partial(fn, *args))

    def close(self) -> None:
        self._large_texts.shutdown(wait=False, cancel_futures=True)

    def _update_sessions(self) -> None:
        self.metrics.active_sessions.set(len({s.session_id for s in self.active.values() if s.session_id}))

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation is in flight (for a graceful drain); False on timeout."""
        end = time.monotonic() + timeout
        while self.active and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return not self.active

    # ------------------------------------------------------------------ other RPCs
    @_unary_errors
    async def Tokenize(self, request, context):
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        check_text(request.text, self.limits, "the text")
        ids = await self._off_loop(request.text, convert.encode_text, self.llm.tokenizer, request.text,
                                   request.apply_chat_template, add)
        return pb.TokenizeResponse(token_ids=ids)

    @_unary_errors
    async def Detokenize(self, request, context):
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await asyncio.to_thread(convert.decode_ids, self.llm.tokenizer, list(request.token_ids),
                                       self.info.vocab_size, skip)
        return pb.DetokenizeResponse(text=text)

    @_unary_errors
    async def GetModelInfo(self, request, context):
        info = pb.ModelInfo()
        info.CopyFrom(self.info)
        total, used, free = self.engine_loop.kv_pages
        info.kv_pages.CopyFrom(pb.KvPages(total=total, used=used, free=free))
        return info

    @_unary_errors
    async def Abort(self, request, context):
        """With API keys, a caller may abort only requests started with its own key; others'
        ids are reported not found (their existence is not disclosed)."""
        caller = self.keys.identity(context.invocation_metadata()) or ""
        aborted, not_found, pending = [], [], []
        for rid in dict.fromkeys(request.request_ids):  # each id once, order kept
            stream = self.active.get(rid)
            if stream is None or stream.owner != caller:
                not_found.append(rid)
            else:
                pending.append((rid, asyncio.wrap_future(self.engine_loop.abort(stream.engine_id))))
        for rid, fut in pending:
            (aborted if await fut else not_found).append(rid)
        return pb.AbortResponse(aborted=aborted, not_found=not_found)
