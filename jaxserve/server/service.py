"""The ``jaxserve.v1.JaxServe`` servicer (grpc.aio): the gRPC adapter of the ``ServingCore``.

Handlers run on the event loop and never touch the engine: they turn the proto into the core's
checks and a submission (``ServingCore.submit``: a ``RequestStream`` handed to the engine
thread), then relay its events as proto messages. Whatever way a generation RPC ends
(finished, error, cancelled by the client, deadline expired), ``_close`` runs: the core aborts
the request if it is still running (freeing its pages at once) and counts the outcome.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from jaxserve.disagg.role import WorkerRole
from jaxserve.server import call_ends, convert, errors, grpc_agents
from jaxserve.server.agent_plan import AgentFront
from jaxserve.server.core import ServingCore
from jaxserve.server.engine_loop import RequestStream
from jaxserve.server.errors import ServeError
from jaxserve.server.events import TERMINAL, Delta, Failed, Started
from jaxserve.server.generations import choice_events, client_identity, terminal
from jaxserve.server.headers import REPLICA_HEADER, REQUEST_ID_HEADER, SESSION_HEADER
from jaxserve.server.limits import check_chat, check_stop, check_text
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.server")

__all__ = ["JaxServeService", "REPLICA_HEADER", "SESSION_HEADER"]

_unary_errors = errors.unary_errors(log)


class JaxServeService(pb_grpc.JaxServeServicer):
    """JaxServe over a ``ServingCore`` (``generations``, ``phase``, ``active``: the core's); the
    KV handoff service reuses its streams (``open_stream`` / ``run_stream`` / ``close_stream``)."""

    def __init__(self, core: ServingCore, tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.core = core
        self.info = core.info
        cfg = core.model.cfg
        self.agents = AgentFront(core.tokenizer, cfg.architecture, cfg.model_type, tool_call_parser, reasoning_parser)

    @property
    def generations(self):
        return self.core.generations

    @property
    def phase(self) -> str:
        return self.core.phase

    @property
    def active(self) -> dict[str, RequestStream]:
        return self.core.active

    async def Generate(self, request, context):
        stream, outcome, closed = None, "internal", False
        try:
            stream, out = await self._submit(request, context)
            n = 1 + len(stream.choices)
            ids, text, lps = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
            ends = [None] * n
            async for i, ev in choice_events(stream):
                if isinstance(ev, Delta):
                    ids[i] += ev.token_ids
                    text[i].append(ev.text)
                    lps[i] += convert.token_logprobs(ev.token_ids, ev.logprobs)
                elif isinstance(ev, TERMINAL):
                    ends[i] = terminal(ev)
            outcome = ends[0][0]
            texts = ["".join(t) for t in text]
            resp = convert.generate_response(stream.request_id, stream.session_id, ids, texts, lps, ends)
            return out.whole(resp, texts) if out else resp
        except ServeError as e:
            outcome = e.outcome
            closed = self._close(stream, "Generate", outcome)  # counted before the client sees the status
            await context.abort(e.code, e.message, e.trailing_metadata())
        except asyncio.CancelledError:
            outcome = call_ends.cancel_outcome(context)
            raise
        except Exception as e:
            if await call_ends.client_gone(context, "Generate", e):
                outcome = "cancelled"
                return None
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
        await self.run_stream(request, context)

    async def run_stream(self, request, context, rpc: str = "GenerateStream", handoff: dict | None = None):
        """GenerateStream's events for ``request``; ``handoff``: ``LLMEngine.add_request``'s
        KV handoff arguments (KvHandoff.Decode streams a handed-off request this way)."""
        stream, outcome, closed, peer = None, "internal", False, context.peer() or ""
        try:
            self.core.slots.acquire(peer)
        except ServeError as e:
            self.core.metrics.requests.labels(rpc, e.outcome).inc()
            await context.abort(e.code, e.message, e.trailing_metadata())
        try:
            stream, out = await self._submit(request, context, handoff)
            stream.task = asyncio.current_task()
            async for i, ev in choice_events(stream):
                if isinstance(ev, Started):
                    msg = pb.GenerateStreamResponse(start=pb.StreamStart(
                        request_id=stream.request_id, session_id=stream.session_id,
                        prompt_tokens=ev.prompt_tokens, cached_tokens=ev.cached_tokens, index=i))
                elif isinstance(ev, Delta):
                    msg = pb.GenerateStreamResponse(delta=pb.TokenDelta(
                        token_ids=ev.token_ids, text=ev.text, index=i, **(out.delta(i, ev.text) if out else {}),
                        logprobs=convert.token_logprobs(ev.token_ids, ev.logprobs)))
                else:
                    reason, usage, ttft, total = terminal(ev)
                    outcome = reason if i == 0 else outcome
                    last = out.end(i) if out else None
                    if last:  # the parsed message's last pieces, held back until the end
                        await call_ends.write(stream, context, pb.GenerateStreamResponse(delta=pb.TokenDelta(index=i, **last)))
                    code = convert.FINISH_REASONS[reason]
                    msg = pb.GenerateStreamResponse(end=pb.StreamEnd(
                        finish_reason=out.reason(i, code) if out else code, usage=convert.usage(usage),
                        timing=convert.timing(ttft, total), index=i))
                await call_ends.write(stream, context, msg)
        except ServeError as e:
            outcome = e.outcome
            closed = self._close(stream, rpc, outcome)  # counted before the client sees the status
            await context.abort(e.code, e.message, e.trailing_metadata())
        except (asyncio.CancelledError, GeneratorExit):
            if stream is None or not stream.unread:
                outcome = call_ends.cancel_outcome(context)
                raise
            # Cancelled by watch_unread: the status waits behind the unread messages (abort
            # would block on them), so it is set and the handler returns at once.
            asyncio.current_task().uncancel()
            outcome = "unread_timeout"
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(f"no stream event read for {self.core.limits.stream_idle_timeout_s:g}s; "
                                f"cancelled (--stream-idle-timeout)")
        except Exception as e:
            if await call_ends.client_gone(context, rpc, e, stream):
                outcome = "cancelled"
                return
            log.exception("%s failed", rpc)
            closed = self._close(stream, rpc, "internal")
            await context.abort(grpc.StatusCode.INTERNAL, errors.internal(e).message)
        finally:
            self.core.slots.release(peer)
            if not closed:
                self._close(stream, rpc, outcome)

    async def _open(self, req: pb.GenerateRequest, context, handoff: dict | None = None) -> RequestStream:
        return (await self._submit(req, context, handoff))[0]

    async def _submit(self, req: pb.GenerateRequest, context, handoff: dict | None = None):
        """Validate and submit -> (stream, its AgentOutput or None); raises ServeError (nothing is
        submitted then). handoff: the engine's KV handoff arguments (export_kv / kv_import). A
        caller refused too often is refused first, before any check (``refusals``)."""
        arrival, owner = time.perf_counter(), self.core.identity(context.invocation_metadata()) or ""
        return await self.core.past_the_door(owner, lambda: self._checked_submit(req, context, handoff, arrival, owner),
                                             req.ByteSize)

    async def _checked_submit(self, req: pb.GenerateRequest, context, handoff: dict | None, arrival: float,
                              owner: str):
        core = self.core
        headers = {k: v for k, v in (context.invocation_metadata() or ())}
        # Ids are echoed in response headers: checked first, so a bad one never runs.
        rid = core.check_id("request_id", req.request_id)
        session = req.session_id or str(headers.get(SESSION_HEADER, ""))
        core.check_id("session_id" if req.session_id else SESSION_HEADER, session)
        core.generations.check_serving()
        if WorkerRole(self.info.role).exports and not handoff:
            raise errors.failed_precondition("a prefill worker serves KvHandoff.Prefill only; send generation "
                                             "requests to a decode (or both) worker or the router")
        check_stop(req.stop.stop, req.stop.stop_token_ids, core.limits)  # before any work on them
        params = convert.choice_params(convert.sampling_params(req), req.n or 1, self.info.max_num_seqs)
        plan, planned = None, grpc_agents.wanted(req)
        if planned:  # tools, reasoning: the plan the OpenAI API follows too (its grammar checked)
            ids, params, plan = await grpc_agents.plan(core, self.agents, req, params)
        else:
            ids = await self.prompt_ids(req)
        if not planned and params[0].structured is not None:  # a grammar that cannot compile: refused, nothing run
            try:
                await core.check_structured(params[0].structured)
            except ValueError as e:
                raise errors.invalid_argument(f"structured: {e}") from None
        rid = rid or f"req-{uuid.uuid4().hex}"
        md = [(REPLICA_HEADER, self.info.replica_id), (REQUEST_ID_HEADER, rid)]
        if session:
            md.append((SESSION_HEADER, session))
        await context.send_initial_metadata(tuple(md))
        if handoff and len(params) > 1:
            raise errors.invalid_argument("n > 1 cannot be combined with a KV handoff")
        if handoff and params[0].logprobs is not None:  # an offer carries the first token, not its log-prob
            raise errors.invalid_argument("log-probs cannot be combined with a KV handoff")
        # It may have stopped serving during the awaits above: submit checks again.
        client = client_identity(owner, context.peer() or "")
        stream = core.submit(ids, params, rid, session, owner, arrival, handoff, client=client)
        out = grpc_agents.AgentOutput(plan, rid, len(params), core.metrics.agents, self.agents.tool_parser) \
            if plan is not None else None
        return stream, out

    async def prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        """The request's prompt as ids (texts and conversations within --max-prompt-bytes,
        tokenized off the event loop)."""
        core = self.core
        max_messages = core.limits.max_messages
        if req.messages:
            check_chat(req.messages, core.limits)  # before templating them
        elif req.WhichOneof("prompt") != "text":
            return convert.prompt_ids(req, core.tokenizer, max_messages)
        else:
            check_text(req.text, core.limits)  # before tokenizing it
        return await core.off_loop(req.text, convert.prompt_ids, req, core.tokenizer, max_messages)

    async def open_stream(self, req: pb.GenerateRequest, context, handoff: dict) -> RequestStream:
        """Validate and submit a KV handoff request (KvHandoff.Prefill); the caller reads its
        events and must ``close_stream`` it."""
        return await self._open(req, context, handoff)

    def close_stream(self, stream: RequestStream | None, rpc: str, outcome: str) -> None:
        self._close(stream, rpc, outcome)

    terminal = staticmethod(terminal)  # public: a terminal event -> (reason, usage, ttft, total), or its ServeError

    def _close(self, stream: RequestStream | None, rpc: str, outcome: str) -> bool:
        return self.core.finish(stream, rpc, outcome)

    # ------------------------------------------------------------------ other RPCs
    @_unary_errors
    async def Tokenize(self, request, context):
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        check_text(request.text, self.core.limits, "the text")
        ids = await self.core.off_loop(request.text, convert.encode_text, self.core.tokenizer, request.text,
                                        request.apply_chat_template, add)
        return pb.TokenizeResponse(token_ids=ids)

    @_unary_errors
    async def Detokenize(self, request, context):
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await asyncio.to_thread(convert.decode_ids, self.core.tokenizer, list(request.token_ids),
                                       self.info.vocab_size, skip)
        return pb.DetokenizeResponse(text=text)

    @_unary_errors
    async def GetModelInfo(self, request, context):
        info = pb.ModelInfo()
        info.CopyFrom(self.info)
        total, used, free = self.core.engine_loop.kv_pages
        info.kv_pages.CopyFrom(pb.KvPages(total=total, used=used, free=free))
        return info

    @_unary_errors
    async def Abort(self, request, context):
        """With API keys, a caller may abort only requests started with its own key; others'
        ids are reported not found (their existence is not disclosed)."""
        caller = self.core.identity(context.invocation_metadata()) or ""
        aborted, not_found = await self.core.generations.abort(request.request_ids, caller)
        return pb.AbortResponse(aborted=aborted, not_found=not_found)
