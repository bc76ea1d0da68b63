"""The serving core both front ends wrap: the gRPC servicer (``service.py``) and the OpenAI HTTP
app (``openai_http.py``) each turn their protocol into calls on one ``ServingCore`` and its
events back into their own messages; neither imports the other.

The core holds what a request meets between its front end and the engine thread, in order: the
API keys (``auth``), the ids and the bounds on its work (``convert.check_id``; ``limits``' checks
against ``core.limits``), the open-stream caps (``StreamSlots``), tokenization off the event loop, the grammar check, then
``Generations`` (phase, queue, registry, abort) and the ``EngineLoop`` behind it. It uses the
model only through ``LLM``'s interface (its tokenizer and engine).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools

from jaxserve.server import convert, errors
from jaxserve.server.auth import ApiKeys
from jaxserve.server.engine_loop import EngineLoop, RequestStream
from jaxserve.server.errors import ServeError
from jaxserve.server.events import Failed
from jaxserve.server.generations import Generations
from jaxserve.server.limits import ServeLimits, StreamSlots, watch_unread
from jaxserve.server.refusals import DoorHold, RefusalBudget

LARGE_TEXT_CHARS = 65536  # texts this long are tokenized on the LARGE_TEXT_WORKERS pool
LARGE_TEXT_WORKERS = 2


class ServingCore:
    """One engine's serving state, shared by every front end of a ``Server``.

    model: the ``served_model.ServedModel`` (its tokenizer, config and grammar checks);
    engine_loop: the engine as the event loop sees it (``engine_loop``); info: the static ``ModelInfo``; keys:
    the API keys (none = no authentication); limits: ``ServeLimits`` (None = the defaults),
    resolved against the model's context."""

    def __init__(self, model, engine_loop: EngineLoop, metrics, info, max_waiting: int, keys: ApiKeys | None = None,
                 max_id_length: int = convert.MAX_ID_LENGTH, limits: ServeLimits | None = None):
        self.model, self.engine_loop, self.metrics, self.info = model, engine_loop, metrics, info
        self.max_waiting, self.max_id_length = max_waiting, max_id_length
        self.keys = keys or ApiKeys()
        self.limits = (limits or ServeLimits()).resolved(info.max_context)
        self.slots = StreamSlots(self.limits)
        self.refusals = RefusalBudget(self.limits.client_refusal_rate)
        self.door = DoorHold(self.limits.door_hold_s)
        self.generations = Generations(engine_loop, metrics, max_waiting, info.max_num_seqs,
                                       self.limits.max_queued_per_client)
        self._large_texts = concurrent.futures.ThreadPoolExecutor(LARGE_TEXT_WORKERS, "jaxserve-tokenize")

    # ------------------------------------------------------------------ state
    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def phase(self) -> str:
        return self.generations.phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.generations.phase = value

    @property
    def active(self) -> dict[str, RequestStream]:
        return self.generations.active

    # ------------------------------------------------------------------ checks, in a request's order
    def identity(self, metadata) -> str | None:
        """The caller's identity from its headers (None: a key is required and missing or wrong)."""
        return self.keys.identity(metadata)

    async def past_the_door(self, owner: str, checks, request_bytes=lambda: 0):
        """``await checks()`` (a request's checks and submission) for a caller whose refusal
        bucket (``refusals``; API keys only) is not empty, else RESOURCE_EXHAUSTED / 429 before
        anything of the request is read, after the door's hold; a refusal ``checks`` raises that
        is the caller's fault is counted against it, weighed by ``request_bytes()``: the bytes
        of the request read by then."""
        key = owner if self.keys.enabled else ""  # with keys, every caller's owner is its key's identity
        wait = self.refusals.closed_for(key) if key else None
        if wait is not None:
            await self.door.hold(key, wait)
            raise errors.refused_at_door(self.refusals.closed_for(key) or 0.0)
        try:
            return await checks()
        except ServeError as e:
            if key and e.client_fault:
                self.refusals.refused(key, request_bytes())
            raise

    def check_id(self, kind: str, value: str) -> str:
        return convert.check_id(kind, value, self.max_id_length)

    async def off_loop(self, text: str, fn, *args):
        """fn(*args) (a tokenization of `text`) on a worker thread. Large texts get their own
        small pool, so a burst of them queues there instead of taking every default worker;
        ``Tokenizer.encode`` releases the GIL for them, so the event loop keeps running."""
        if len(text) < LARGE_TEXT_CHARS:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._large_texts, functools.partial(fn, *args))

    async def check_structured(self, spec) -> None:
        """ValueError naming the problem when the grammar ``spec`` cannot compile (off the loop)."""
        await asyncio.to_thread(self.model.check_structured, spec)

    # ------------------------------------------------------------------ generations
    def submit(self, prompt_ids: list[int], params: list, request_id: str, session_id: str, owner: str,
               arrival: float, handoff: dict | None = None, client: str = "") -> RequestStream:
        """``Generations.submit``: register and hand to the engine thread (ServeError: nothing is)."""
        return self.generations.submit(prompt_ids, params, request_id, session_id, owner, arrival, handoff,
                                       client=client)

    def finish(self, stream: RequestStream | None, api: str, outcome: str) -> bool:
        """Once per call, however it ended: abort what still runs, count the outcome. -> True.
        A stream its client dropped before its end (``cancelled``) counts against the client's
        refusal bucket like a refusal: starting requests and walking away is work thrown away,
        and a client that does it in a loop meets the door (with API keys, as refusals do)."""
        if (outcome == "cancelled" and stream is not None and self.keys.enabled
                and not all(s.done for s in (stream, *stream.choices))):
            self.refusals.refused(stream.owner)
        return self.generations.finish(stream, api, outcome)

    async def watch_unread(self) -> None:
        """Runs while the server does: see ``limits.watch_unread``."""
        await watch_unread(self.active.values, self.limits.stream_idle_timeout_s)

    def fail_all(self, error: ServeError) -> None:
        """End every generation in flight with ``error`` now, from the event loop, without
        the engine thread (which may be blocked for good: a lost replica process)."""
        for stream in list(self.active.values()):
            for s in (stream, *stream.choices):
                if not s.done:
                    s.queue.put_nowait(Failed(error))

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation is in flight (for a graceful drain); False on timeout."""
        return await self.generations.wait_idle(timeout)

    def unavailable(self) -> ServeError:
        """UNAVAILABLE with the phase (warm-up progress included), for a front end's health."""
        return errors.unavailable(self.generations.state())

    def close(self) -> None:
        self._large_texts.shutdown(wait=False, cancel_futures=True)
