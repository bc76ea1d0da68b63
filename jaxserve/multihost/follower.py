"""The loop of every process but 0: receive each device call from the step channel and make
it on this process's runner, so the same jitted programs run on every process's shards."""
from __future__ import annotations

import logging

from jaxserve.multihost.channel import HEARTBEAT, StepFollower

log = logging.getLogger("jaxserve.multihost")


def follow(runner, channel: StepFollower) -> int:
    """Run calls until ``stop`` (the channel stays open); -> the number of calls made.
    ConnectionError if process 0 closes the channel without a stop."""
    calls = 0
    while True:
        kind, arrays, meta = channel.recv()
        if kind == "stop":
            return calls
        if kind == "step":
            runner.step(meta["phase"], *arrays, all_logits=bool(meta.get("all_logits")))
        elif kind == "updates":
            runner.apply_padded_updates(*arrays)
        elif kind != HEARTBEAT:
            raise ValueError(f"unknown step-channel message {kind!r}")
        calls += 1
