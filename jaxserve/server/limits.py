"""Bounds on the work one request may ask of the server (``jaxserve serve`` flags).

Everything here is checked on the event loop before anything expensive happens: a prompt
text over ``max_prompt_bytes`` is rejected before it is tokenized, stop criteria over their
limits before the request reaches the engine thread. Each rejection is INVALID_ARGUMENT
naming the flag, so a client (or its operator) knows which knob it hit.

Streams are bounded too: ``StreamSlots`` counts open GenerateStream calls per connection
(the peer address, host and port) and in total; one over either cap is RESOURCE_EXHAUSTED
(a quota, like the waiting queue: retrying elsewhere or later helps, retrying at once on
the same connection does not). A stream whose client stops reading is cancelled after
``stream_idle_timeout_s`` (``watch_unread``).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time

import grpc

from jaxserve.server import errors

log = logging.getLogger("jaxserve.server")

# A token is rarely longer than ~10 bytes of UTF-8 text; 32 leaves room for any tokenizer
# and language while still refusing a text whose tokens could never fit the context.
PROMPT_BYTES_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """The server's limits; None for max_prompt_bytes = PROMPT_BYTES_PER_TOKEN x max context,
    for max_messages = the max context (every chat template marks each message with at least
    one token, so more messages than that cannot fit), for max_body_bytes = what a body within
    max_prompt_bytes can take as JSON (6 bytes per character escaped, plus 1 MiB)."""

    max_stop_strings: int = 64  # --max-stop-strings
    max_stop_bytes: int = 8192  # --max-stop-bytes: UTF-8 bytes of all stop strings together
    max_stop_token_ids: int = 256  # --max-stop-token-ids
    max_prompt_bytes: int | None = None  # --max-prompt-bytes: UTF-8 bytes of a text prompt
    max_streams_per_peer: int = 64  # --max-streams-per-connection
    max_streams: int = 1024  # --max-streams
    stream_idle_timeout_s: float = 30.0  # --stream-idle-timeout
    max_messages: int | None = None  # --max-messages: messages of one chat, checked before templating
    max_body_bytes: int | None = None  # --max-body-bytes: an HTTP body, counted while it arrives
    max_json_depth: int = 64  # --max-json-depth: nesting of an HTTP body, checked before parsing
    # --max-queued-per-client: requests one client may have waiting while another client has
    # requests in flight (0 = no bound; a lone client may fill the whole queue).
    max_queued_per_client: int = 64
    # --client-refusal-rate: refusals a second one client may cause before its next requests are
    # refused at the door (``refusals``; 0 = no bound).
    client_refusal_rate: float = 10.0
    # --door-hold: seconds a refusal at the door may be held before it is answered (``refusals``;
    # it is answered when the client's door reopens, if that is sooner; 0 = at once).
    door_hold_s: float = 1.0

    def __post_init__(self):
        lowest = dict(max_stop_strings=0, max_stop_bytes=0, max_stop_token_ids=0, max_streams_per_peer=1,
                      max_streams=1, max_json_depth=1, max_queued_per_client=0)
        for name, low in lowest.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        for name in ("max_prompt_bytes", "max_messages", "max_body_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.client_refusal_rate >= 0:
            raise ValueError(f"client_refusal_rate must be >= 0, got {self.client_refusal_rate}")
        if not self.door_hold_s >= 0:
            raise ValueError(f"door_hold_s must be >= 0, got {self.door_hold_s}")
        if not self.stream_idle_timeout_s > 0:
            raise ValueError(f"stream_idle_timeout_s must be > 0, got {self.stream_idle_timeout_s}")

    def resolved(self, max_context: int) -> "ServeLimits":
        """These limits with the unset ones filled in from the model's context length."""
        prompt = self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_context
        return dataclasses.replace(self, max_prompt_bytes=prompt, max_messages=self.max_messages or max_context,
                                   max_body_bytes=self.max_body_bytes or 6 * prompt + (1 << 20))


def check_stop(stop_strings, stop_token_ids, limits: ServeLimits) -> None:
    """Stop criteria within their limits, or INVALID_ARGUMENT naming the one exceeded."""
    if len(stop_strings) > limits.max_stop_strings:
        raise errors.invalid_argument(f"{len(stop_strings)} stop strings; the limit is {limits.max_stop_strings} "
                                      f"(--max-stop-strings)")
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in stop_strings)
    if size > limits.max_stop_bytes:
        raise errors.invalid_argument(f"the stop strings total {size} bytes; the limit is {limits.max_stop_bytes} "
                                      f"(--max-stop-bytes)")
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise errors.invalid_argument(f"{len(stop_token_ids)} stop token ids; the limit is "
                                      f"{limits.max_stop_token_ids} (--max-stop-token-ids)")


def check_text(text: str, limits: ServeLimits, what: str = "the prompt text") -> None:
    """A text to tokenize within --max-prompt-bytes (checked before tokenizing it)."""
    # Cheap before exact: a str of n characters holds between n and 4n bytes of UTF-8.
    if len(text) * 4 <= limits.max_prompt_bytes:
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_prompt_bytes:
        raise errors.invalid_argument(f"{what} is {size} bytes; the limit is {limits.max_prompt_bytes} "
                                      f"(--max-prompt-bytes)")


def check_chat(messages, limits: ServeLimits, tools=()) -> None:
    """A conversation (objects with role and content) within --max-messages and, roles,
    contents and the tools' definitions together, --max-prompt-bytes: checked before it is
    templated (the template writes the tools into the prompt). ``tools``: each tool's text as
    the front received it (an OpenAI function as JSON, a gRPC Tool's name, description and
    parameters)."""
    if len(messages) > limits.max_messages:
        raise errors.invalid_argument(f"{len(messages)} messages; the limit is {limits.max_messages} "
                                      f"(--max-messages)", "messages")
    text = "".join(_role(m) + _content(m) for m in messages) + "".join(tools)
    check_text(text, limits, "the messages and tools" if tools else "the messages")


def _role(m) -> str:
    r = m.get("role") if isinstance(m, dict) else getattr(m, "role", "")
    return r if isinstance(r, str) else ""


def _content(m) -> str:
    c = m.get("content") if isinstance(m, dict) else getattr(m, "content", "")
    return c if isinstance(c, str) else ""


class StreamSlots:
    """Open generation streams per peer and in total (event loop only)."""

    def __init__(self, limits: ServeLimits):
        self.limits = limits
        self.per_peer: collections.Counter = collections.Counter()
        self.total = 0

    def acquire(self, peer: str) -> None:
        """Take a slot for `peer` or raise RESOURCE_EXHAUSTED; pair with release()."""
        if self.per_peer[peer] >= self.limits.max_streams_per_peer:
            raise errors.ServeError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this connection has {self.per_peer[peer]} open streams; the limit is "
                f"{self.limits.max_streams_per_peer} (--max-streams-per-connection)", retry_after_s=1.0)
        if self.total >= self.limits.max_streams:
            raise errors.ServeError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server has {self.total} open streams; the limit is {self.limits.max_streams} "
                f"(--max-streams)", retry_after_s=1.0)
        self.per_peer[peer] += 1
        self.total += 1

    def release(self, peer: str) -> None:
        self.total -= 1
        self.per_peer[peer] -= 1
        if self.per_peer[peer] <= 0:
            del self.per_peer[peer]


async def watch_unread(streams, timeout: float) -> None:
    """Forever: cancel the handler of every stream (``streams()`` -> RequestStreams) whose
    current write has waited for the client's flow-control window longer than `timeout`
    seconds; the handler then ends the call and aborts its request."""
    while True:
        await asyncio.sleep(min(1.0, timeout / 4))
        now = time.monotonic()
        for stream in list(streams()):
            since = stream.writing_since
            if since is not None and now - since > timeout and not stream.unread and stream.task is not None:
                log.info("GenerateStream request=%s: client read nothing for %.1fs; cancelling",
                         stream.request_id, now - since)
                stream.unread = True
                stream.task.cancel()
