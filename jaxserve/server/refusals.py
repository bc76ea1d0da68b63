"""Refusal back-off: a client whose requests keep being refused is refused at the door.

Every bound at the edge (body size, JSON depth, message count, the per-client queue) refuses a
bad request cheaply, but not for free: a 10,000-message chat is received and parsed before its
count is known, and a client can send them in a loop. Each refusal a client causes (its fault:
invalid, too large, not found, over its own queue bound) takes tokens from that client's
bucket, one and one more per ``REFUSAL_BYTES`` of request the server read (a 480 KB chat refused
for its message count takes eight: what the client made the server do, not just how often); the
bucket refills at ``rate`` tokens a second up to ``burst``. Each stream the client drops before
its end takes one too (``ServingCore.finish``: work started and thrown away, which a client
starting and abandoning streams in a loop makes the engine do for nothing). With the bucket
empty the client's next requests are refused at the door, before their HTTP body is read (gRPC: before any
check of the message), with RESOURCE_EXHAUSTED / HTTP 429 and the time until a token is back; refusals at
the door take nothing more. A client that is never refused never meets the bound, and one that
stops misbehaving is served again after ``1 / rate`` seconds.

A client is the caller's API key identity, so the bound applies only when the server has keys
(the multi-tenant setting). Without keys the only identity is a connection, which is either
shared (every client behind a router or proxy comes over its few connections, and one of them
could close the door on all) or renewed at will (a new connection per request gets a full
bucket): neither is worth a bound. Event loop only (no locks).

A refusal at the door is answered after a hold (``DoorHold``): when the client's door reopens,
or ``--door-hold`` seconds later if that is sooner. A client that retries as soon as it is
refused (or starts a stream on each of many connections in a loop) then sends as many requests
a second as it has calls held, not as many as the server can refuse: each refusal still costs
the server the call's set-up, and on a server's shared cores that is what the well-behaved
clients pay for. A held call is a sleeping coroutine; a client has at most ``MAX_HELD`` held at
once, and its calls past that are answered at once.
"""
from __future__ import annotations

import asyncio
import time

MAX_TRACKED = 4096  # buckets kept before the full ones are forgotten
MAX_HELD = 64  # a client's refusals held at the door at once
REFUSAL_BYTES = 65536  # a refusal takes one more token per this many bytes of its request


class RefusalBudget:
    """Per-client token buckets of refusals (see the module doc); rate 0 turns the bound off."""

    def __init__(self, rate: float, burst: float | None = None, clock=time.monotonic):
        if rate < 0:
            raise ValueError(f"the refusal rate must be >= 0, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(1.0, 2 * rate))
        if self.rate and self.burst < 1:
            raise ValueError(f"the refusal burst must be >= 1, got {self.burst}")
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    @property
    def on(self) -> bool:
        return self.rate > 0

    def _tokens(self, client: str, now: float) -> float:
        tokens, at = self._buckets.get(client, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def closed_for(self, client: str) -> float | None:
        """Seconds until ``client`` may be served again, or None when its door is open."""
        if not self.on or client not in self._buckets:
            return None
        tokens = self._tokens(client, self._clock())
        return None if tokens >= 1 else (1 - tokens) / self.rate

    def refused(self, client: str, request_bytes: int = 0) -> None:
        """Count one refusal of ``client``'s, of a request of ``request_bytes`` bytes."""
        if not self.on:
            return
        now = self._clock()
        self._buckets[client] = (self._tokens(client, now) - 1 - request_bytes // REFUSAL_BYTES, now)
        if len(self._buckets) > MAX_TRACKED:
            self._buckets = {c: (t, a) for c, (t, a) in self._buckets.items() if self._tokens(c, now) < self.burst}


class DoorHold:
    """The hold before a refusal at the door (see the module doc); hold_s 0: none."""

    def __init__(self, hold_s: float, max_held: int = MAX_HELD):
        if not hold_s >= 0:
            raise ValueError(f"the door hold must be >= 0 seconds, got {hold_s}")
        self.hold_s, self.max_held = float(hold_s), max_held
        self._held: dict[str, int] = {}  # client -> its calls held now

    def held(self, client: str) -> int:
        return self._held.get(client, 0)

    async def hold(self, client: str, wait: float) -> None:
        """Sleep min(wait, hold_s), unless ``client`` has max_held calls held already."""
        n = self.held(client)
        if self.hold_s <= 0 or wait <= 0 or n >= self.max_held:
            return
        self._held[client] = n + 1
        try:
            await asyncio.sleep(min(wait, self.hold_s))
        finally:
            left = self._held.pop(client) - 1
            if left:
                self._held[client] = left
