"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), the HTTP adapter of the ``ServingCore``
on the gRPC server's event loop and engine: /v1/chat/completions, /v1/completions, /v1/models
and /health.

Requests go through the core's checks (ids, limits, API keys) and its ``Generations`` (queue
limit, drain, abort on disconnect), as gRPC's do; errors are OpenAI's JSON
``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status
(``openai_responses``). A client that disconnects, mid-stream or while waiting for a whole
response, has its request aborted and its pages freed at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from jaxserve.agents.message import MessageStream
from jaxserve.server import agent_plan, convert, errors, validate
from jaxserve.server import openai_agents as agents
from jaxserve.server import openai_api as api
from jaxserve.server.core import ServingCore
from jaxserve.server.errors import ServeError
from jaxserve.server.events import TERMINAL, Delta, Started
from jaxserve.server.generations import choice_events, client_identity, terminal
from jaxserve.server.headers import REPLICA_HEADER, REQUEST_ID_HEADER, SESSION_HEADER
from jaxserve.server.limits import check_chat, check_stop, check_text
from jaxserve.server.openai_responses import (EventStream, error_body, error_response, http_status, sse,
                                              until_disconnect)

log = logging.getLogger("jaxserve.server")


class OpenAIFrontEnd:
    """The HTTP routes over a ``ServingCore`` (its generations, limits, keys, tokenizer)."""

    def __init__(self, core: ServingCore, model_name: str, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        self.core, self.gens = core, core.generations
        cfg = core.model.cfg
        self.agents = agent_plan.AgentFront(core.tokenizer, cfg.architecture, cfg.model_type, tool_call_parser,
                                        reasoning_parser)
        self.model_name = model_name
        self.created = api.now()
        self.fingerprint = "jaxserve-" + core.info.fingerprint[:12]
        self.text_of = api.TokenText(core.tokenizer)
        app = self.app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_exception_handler(HTTPException, self._http_error)

    async def _http_error(self, request, exc: HTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None,
                                       "code": exc.status_code}}, exc.status_code)

    def _owner(self, request: Request) -> str:
        owner = self.core.identity(list(request.headers.items()))
        if owner is None:
            raise errors.unauthenticated()
        return owner

    async def health(self, request: Request):
        if self.gens.phase != "serving":
            return error_response(self.core.unavailable())
        return JSONResponse({"status": "serving", "model": self.model_name})

    async def models(self, request: Request):
        try:
            self._owner(request)
        except ServeError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "jaxserve",
            "max_model_len": self.core.info.max_context}]})

    async def chat(self, request: Request):
        return await self._generate(request, api.parse_chat, "http.chat")

    async def completions(self, request: Request):
        return await self._generate(request, api.parse_completion, "http.completions")

    async def _generate(self, request: Request, parse, label: str):
        client = request.client  # None on a unix socket: one peer for all
        peer = f"http:{client.host}:{client.port}" if client is not None else "http:local"
        try:
            req, stream, plan, session = await self._submit(request, parse, peer)
        except ClientDisconnect:  # left while sending its body: nobody to answer
            log.info("%s from %s: the client disconnected while sending its body; outcome=cancelled", label, peer)
            self.core.metrics.requests.labels(label, "cancelled").inc()
            return Response(status_code=499)
        except Exception as e:  # not ServeError: this request's failure alone (a bug), logged once
            if not isinstance(e, ServeError):
                log.exception("%s failed", label)
                e = errors.internal(e)
            self.core.metrics.requests.labels(label, e.outcome).inc()
            response = error_response(e)
            if isinstance(e, errors.DoorClosed):  # its body is not read: the connection ends here
                response.headers["connection"] = "close"
            return response
        headers = {REQUEST_ID_HEADER: stream.request_id, REPLICA_HEADER: self.core.info.replica_id}
        if session:
            headers[SESSION_HEADER] = session
        if req.stream:
            state = {"outcome": "cancelled"}  # until the stream says otherwise

            def close():
                self.core.slots.release(peer)
                self.core.finish(stream, label, state["outcome"])

            return EventStream(self._events(req, stream, state, plan), headers, close)
        work = asyncio.ensure_future(self._collect(req, stream, label, plan))
        watcher = asyncio.ensure_future(until_disconnect(request.receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled (the server stopping): nothing runs on
            for task in (work, watcher):
                task.cancel()
            await asyncio.gather(work, watcher, return_exceptions=True)
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody is listening any more
        body, status = work.result()
        return JSONResponse(body, status, headers if status == 200 else None)

    async def _submit(self, request: Request, parse, peer: str):
        """Check and submit one request -> (parsed request, stream, agent plan, session id); raises
        (ServeError, ClientDisconnect, ...) having submitted nothing and holding no stream slot.
        A caller refused too often is refused here before its body is read (``refusals``)."""
        arrival, owner = time.perf_counter(), self._owner(request)
        return await self.core.past_the_door(owner, lambda: self._checked_submit(request, parse, peer, arrival, owner),
                                             lambda: getattr(request.state, "body_bytes", 0))

    async def _checked_submit(self, request: Request, parse, peer: str, arrival: float, owner: str):
        core = self.core
        req = parse(await self._body(request), core.limits.max_messages)
        if req.model != self.model_name:
            raise errors.not_found(f"the model {req.model!r} does not exist; this server serves "
                                   f"{self.model_name!r} (GET /v1/models)", "model")
        session = req.session_id or request.headers.get(SESSION_HEADER, "")
        core.check_id("session_id" if req.session_id else SESSION_HEADER, session)
        self.gens.check_serving()
        check_stop(req.stop, req.sampling["stop_token_ids"], core.limits)
        if req.messages is not None:
            check_chat(req.messages, core.limits, [json.dumps(t, ensure_ascii=False) for t in req.agent.tools])
        else:
            check_text(req.text, core.limits)
        ids, prompt_text = await self._prompt_ids(req)
        plan = self.agents.plan(req.chat, req.agent, prompt_text)
        req.sampling.update(plan.sampling())
        if plan.structured is not None:  # a grammar that cannot compile is refused before anything runs
            await agent_plan.check_grammar(core.check_structured, req.agent, plan.structured)
        params = req.params(len(ids), core.info.max_context, core.info.max_num_seqs)
        if req.stream:
            core.slots.acquire(peer)
        rid = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        try:
            stream = core.submit(ids, params, rid, session, owner, arrival, client=client_identity(owner, peer))
        except BaseException:
            if req.stream:
                core.slots.release(peer)
            raise
        return req, stream, plan, session

    async def _body(self, request: Request):
        """The body as JSON, counted while it arrives (chunked or not): refused (413) as soon
        as it passes --max-body-bytes, without reading the rest; its nesting bounded (--max-json-depth)."""
        limits = self.core.limits
        limit = limits.max_body_bytes
        too_large = errors.too_large(f"the request body is over {limit} bytes (--max-body-bytes)")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise too_large if declared.isdigit() else errors.invalid_argument("bad content-length header")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            request.state.body_bytes = size  # what a refusal weighs (``refusals``)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return validate.parse_json(b"".join(chunks), limits.max_json_depth)

    async def _prompt_ids(self, req) -> tuple[list[int], str]:
        """-> (prompt ids, the prompt's text: "" for ids)."""
        tok, core = self.core.tokenizer, self.core
        if req.messages is not None:
            if tok is None:
                raise errors.failed_precondition("this model has no tokenizer: chat messages need the model's "
                                                 "tokenizer and chat template")
            text = await core.off_loop(req.text, self.agents.render, req.messages, req.agent)
            return await core.off_loop(text, convert.encode_text, tok, text, False), text
        if isinstance(req.prompt, str):
            return await core.off_loop(req.prompt, convert.encode_text, tok, req.prompt, False), req.prompt
        return list(req.prompt), ""

    def _logprobs(self, req, token_ids, logprobs, offset: int):
        if req.logprobs is None or logprobs is None:
            return None
        if req.chat:
            return {"content": self.text_of.chat_logprobs(token_ids, logprobs)}
        return self.text_of.completion_logprobs(token_ids, logprobs, offset)

    def _envelope(self, req, stream, chunk: bool) -> dict:
        return api.envelope(req, stream.request_id, self.model_name, api.now(), self.fingerprint, chunk)

    async def _collect(self, req, stream, label: str, plan) -> tuple[dict, int]:
        """The whole response -> (body, HTTP status); the outcome is counted here."""
        outcome = "internal"
        try:
            n = 1 + len(stream.choices)
            ids, texts, lps, ends = [[] for _ in range(n)], [""] * n, [[] for _ in range(n)], [None] * n
            async for i, ev in choice_events(stream):
                if isinstance(ev, Delta):
                    ids[i] += ev.token_ids
                    texts[i] += ev.text
                    lps[i] += ev.logprobs or []
                elif isinstance(ev, TERMINAL):
                    ends[i] = terminal(ev)
            outcome = ends[0][0]
            body = self._envelope(req, stream, chunk=False)
            body["choices"] = [api.choice(req, i, texts[i], ends[i][0], self._logprobs(req, ids[i], lps[i], 0))
                               for i in range(n)]
            if plan.parser is not None:  # content, reasoning and tool calls from the text
                agents.whole_messages(plan, body["choices"], texts, stream.request_id, self.core.metrics.agents,
                                      self.agents.tool_parser)
            first = ends[0][1]
            sums = [sum(getattr(e[1], f) for e in ends) for f in ("completion_tokens", "draft_tokens", "accepted_draft_tokens")]
            body["usage"] = api.usage(first.prompt_tokens, sums[0], first.cached_tokens, *sums[1:])
            return body, 200
        except ServeError as e:
            outcome = e.outcome
            return error_body(e), http_status(e)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.core.finish(stream, label, outcome)

    async def _events(self, req, stream, state: dict, plan):
        """The SSE body: chunks per choice, a usage chunk if asked, then ``data: [DONE]``;
        state["outcome"]: how it ended (the response's on_close counts it)."""
        n = 1 + len(stream.choices)
        prompt, cached, completion, offsets, drafts = [0] * n, [0] * n, [0] * n, [0] * n, [(0, 0)] * n
        parsed = [MessageStream(plan.parser, agent_plan.call_ids(stream.request_id, i)) for i in range(n)] \
            if plan.parser is not None else None
        try:
            async for i, ev in choice_events(stream):
                out = self._envelope(req, stream, chunk=True)
                if isinstance(ev, Started):
                    prompt[i], cached[i] = ev.prompt_tokens, ev.cached_tokens
                    if not req.chat:
                        continue
                    out["choices"] = [api.chunk_choice(req, i, "", None, None, first=True)]
                elif isinstance(ev, Delta):
                    lp = self._logprobs(req, ev.token_ids, ev.logprobs, offsets[i])
                    offsets[i] += len(ev.text)
                    if parsed is not None:  # content / reasoning / tool-call deltas of the text
                        for choice in agents.delta_choices(i, parsed[i].push(ev.text), lp):
                            yield sse(dict(out, choices=[choice]))
                        continue
                    if not ev.text and lp is None:
                        continue
                    out["choices"] = [api.chunk_choice(req, i, ev.text, None, lp)]
                else:
                    reason, usage, _, _ = terminal(ev)
                    if i == 0:
                        state["outcome"] = reason
                    completion[i] = usage.completion_tokens
                    if parsed is not None:
                        for choice in agents.delta_choices(i, parsed[i].finish(), None):
                            yield sse(dict(out, choices=[choice]))
                        agent_plan.count_calls(self.core.metrics.agents, self.agents.tool_parser, parsed[i].last.calls)
                        reason = "tool_calls" if parsed[i].has_calls and reason == "stop" else reason
                    drafts[i] = (usage.draft_tokens, usage.accepted_draft_tokens)
                    out["choices"] = [api.chunk_choice(req, i, None if req.chat else "", reason, None)]
                yield sse(out)
            if req.include_usage:
                yield sse(dict(self._envelope(req, stream, chunk=True), choices=[],
                               usage=api.usage(prompt[0], sum(completion), cached[0], *map(sum, zip(*drafts)))))
        except ServeError as e:
            state["outcome"] = e.outcome
            yield sse(error_body(e))
        yield b"data: [DONE]\n\n"
