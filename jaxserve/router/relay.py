"""Relaying one worker call: its events, its status, and whether it may be retried elsewhere.

A worker's stream is passed on with its Start event held back until the first token delta (or
the End): until then nothing of the attempt has reached the client, so a failure may be retried
on another worker without the client seeing two Starts. A failure after that ends the client's
call with the worker's status (UNAVAILABLE when the worker went away).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import grpc

from jaxserve.server import errors
from jaxserve.server.errors import ServeError
from jaxserve.router.pool import Attempt, Worker
from jaxserve.v1 import jaxserve_pb2 as pb

# Trailers a worker's error carries that mean something to the client: passed on unchanged.
RELAYED_TRAILERS = (errors.PUSHBACK_KEY, errors.RETRY_AFTER_KEY, errors.STATUS_DETAILS_KEY,
                    errors.INTEGRITY_CAUSE_KEY)
# Statuses that say "not here, not now": the request never ran there, another worker may take it.
ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclasses.dataclass(eq=False)
class Route:
    """One generation request at the router (what Abort and the stream watchdog need)."""

    request_id: str
    session_id: str
    owner: tuple  # the caller's credentials: only the same may abort it
    metadata: tuple  # sent with every worker call of this request
    deadline: float | None  # time.monotonic() by which the client's call expires
    stage: str = "routing"  # "routing" -> "prefill" -> "worker" (where the tokens come from)
    worker: Worker | None = None  # during "prefill" / "worker"
    attempt: Attempt | None = None
    aborted: bool = False
    relayed: bool = False  # some event of the current attempt reached the client
    prompt_ids: list | None = None
    writing_since: float | None = None  # for limits.watch_unread
    unread: bool = False
    task: asyncio.Task | None = None
    arrival: float = dataclasses.field(default_factory=time.perf_counter)  # the client's call reached the router


class WorkerError(Exception):
    """A worker call ended with a status (or the worker went down under it: `lost`)."""

    def __init__(self, worker: Worker, code: grpc.StatusCode, details: str, trailers=(), lost: bool = False):
        super().__init__(f"{worker.address}: {code.name}: {details}")
        self.worker, self.code, self.details, self.lost = worker, code, details or "", lost
        self.trailers = tuple((k, v) for k, v in (trailers or ()) if k in RELAYED_TRAILERS)

    @property
    def elsewhere(self) -> bool:
        """The request did not run there; another worker may take it."""
        return self.lost or self.code in ELSEWHERE

    @property
    def cause(self) -> str:
        return "worker_lost" if self.lost else self.code.name.lower()

    def to_serve_error(self) -> ServeError:
        if self.lost:
            return ServeError(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker.address} went down",
                              retry_after_s=1.0)
        return ServeError(self.code, self.details, trailers=self.trailers)

    def mid_stream(self, tokens: int) -> ServeError:
        """The error the client gets when this ends a stream that already had tokens."""
        if not self.elsewhere:
            return ServeError(self.code, self.details, trailers=self.trailers)
        return ServeError(grpc.StatusCode.UNAVAILABLE,
                          f"worker {self.worker.address} failed after {tokens} streamed token(s) "
                          f"({self.cause}: {self.details or 'went down'}); the request did not finish",
                          retry_after_s=1.0)


def from_rpc_error(attempt: Attempt, e: grpc.RpcError) -> WorkerError:
    trailers = e.trailing_metadata() if hasattr(e, "trailing_metadata") else ()
    return WorkerError(attempt.worker, e.code(), e.details() if hasattr(e, "details") else str(e), trailers,
                       lost=attempt.lost)


def lost_or_raise(attempt: Attempt) -> WorkerError | None:
    """In an ``except CancelledError``: None when this task itself is being cancelled (the
    caller re-raises); otherwise only the worker call was cancelled, by the pool (the worker
    went down: ``lost``) or by an Abort of the request (CANCELLED)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return None
    if attempt.lost:
        return WorkerError(attempt.worker, grpc.StatusCode.UNAVAILABLE, "went down", lost=True)
    return WorkerError(attempt.worker, grpc.StatusCode.CANCELLED, "cancelled by the router")


@contextlib.contextmanager
def worker_errors(attempt: Attempt):
    """A worker call's failure as a WorkerError: its RpcError, or its cancellation when the
    worker was taken out (a client's own cancellation goes on as is)."""
    try:
        yield
    except grpc.RpcError as e:
        raise from_rpc_error(attempt, e) from None
    except asyncio.CancelledError:
        lost = lost_or_raise(attempt)
        if lost is None:
            raise
        raise lost from None


async def call_unary(attempt: Attempt, call):
    """Await a unary worker call registered in `attempt`; WorkerError on its failure."""
    attempt.call = call
    with worker_errors(attempt):
        return await call


async def relay_stream(attempt: Attempt, call, route: Route):
    """The messages of a worker stream, the Start events (one per choice) held until the first
    Delta or End (``route.relayed`` turns True with the first message passed on). An End's
    timing, which the worker measures from its call's arrival, is moved to the client call's
    arrival at the router (routing, a handoff's prefill and retries before this call included).
    Raises WorkerError."""
    attempt.call = call
    held, shift = [], time.perf_counter() - route.arrival
    with worker_errors(attempt):
        async for msg in call:
            kind = msg.WhichOneof("event")
            if kind == "start":
                held.append(msg)
                continue
            if kind == "end":
                shift_timing(msg.end.timing, shift)
            route.relayed = True
            for start in held:
                yield start
            held = []
            yield msg


def shift_timing(timing: pb.Timing, seconds: float) -> None:
    """Add `seconds` to a Timing measured from a later start."""
    if timing.HasField("time_to_first_token_s"):
        timing.time_to_first_token_s += seconds
    if timing.total_s:
        timing.total_s += seconds


def abort_events(route: Route, prompt_tokens: int):
    """What a worker sends for a request aborted before it produced a token."""
    yield pb.GenerateStreamResponse(start=pb.StreamStart(request_id=route.request_id, session_id=route.session_id,
                                                         prompt_tokens=prompt_tokens))
    yield pb.GenerateStreamResponse(end=pb.StreamEnd(finish_reason=pb.FINISH_REASON_ABORT,
                                                     usage=pb.Usage(prompt_tokens=prompt_tokens)))


def add_call_deltas(calls: dict[int, pb.ToolCall], deltas) -> None:
    """Join streamed ToolCallDeltas into ``calls`` (index -> ToolCall): the first of an index
    names the call (id, name), every one appends to its arguments."""
    for d in deltas:
        call = calls.setdefault(d.index, pb.ToolCall())
        call.id = call.id or d.id
        call.name = call.name or d.name
        call.arguments += d.arguments


async def collect_response(events, request_id: str, session_id: str, n: int = 1) -> pb.GenerateResponse:
    """A unary GenerateResponse from a worker stream's events, as a worker's Generate builds it:
    choice 0 in the top-level fields (a parsed output's content, reasoning text and tool calls
    too: the stream's pieces joined); with n > 1 every choice in ``choices``, the completion
    tokens summed and the timing spanning them all."""
    choices, ends = [pb.Choice(index=i) for i in range(n)], [None] * n
    calls: list[dict[int, pb.ToolCall]] = [{} for _ in range(n)]
    async for msg in events:
        kind = msg.WhichOneof("event")
        if kind == "delta":
            c = choices[msg.delta.index]
            c.token_ids.extend(msg.delta.token_ids)
            c.text += msg.delta.text
            c.logprobs.extend(msg.delta.logprobs)
            c.content += msg.delta.content
            c.reasoning_text += msg.delta.reasoning_text
            add_call_deltas(calls[msg.delta.index], msg.delta.tool_calls)
        elif kind == "end":
            ends[msg.end.index] = msg.end
            choices[msg.end.index].finish_reason = msg.end.finish_reason
            choices[msg.end.index].completion_tokens = msg.end.usage.completion_tokens
    for c, by_index in zip(choices, calls):
        c.tool_calls.extend(by_index[i] for i in sorted(by_index))
    first, end = choices[0], ends[0] or pb.StreamEnd()
    resp = pb.GenerateResponse(request_id=request_id, session_id=session_id, token_ids=first.token_ids,
                               text=first.text, finish_reason=end.finish_reason, usage=end.usage,
                               timing=end.timing, logprobs=first.logprobs, content=first.content,
                               reasoning_text=first.reasoning_text, tool_calls=first.tool_calls)
    if n > 1:
        done = [e for e in ends if e is not None]
        resp.usage.completion_tokens = sum(e.usage.completion_tokens for e in done)
        firsts = [e.timing.time_to_first_token_s for e in done if e.timing.HasField("time_to_first_token_s")]
        resp.timing.Clear()
        if firsts:
            resp.timing.time_to_first_token_s = min(firsts)
        resp.timing.total_s = max((e.timing.total_s for e in done), default=0.0)
        resp.choices.extend(choices)
    return resp
