"""The loop of every process but 0: receive each device call from the step channel and make
it on this process's runner, so the same jitted programs run on every process's shards."""
from __future__ import annotations

import logging

from jaxserve.multihost.channel import HEARTBEAT, StepFollower, unpack
from jaxserve.step_batch import StepBatch

log = logging.getLogger("jaxserve.multihost")


HANDOFF_CALLS = ("export", "import", "handoff_warmup")


def _handoff_call(runner, kind: str, arrays, meta: dict) -> None:
    """A prefill or decode worker's KV handoff calls, as process 0 made them (the export's
    payload is process 0's to send; here the call only runs its part of the collectives)."""
    from jaxserve.kv.handoff import KvPayload

    if kind == "export":
        runner.export_pages([int(p) for p in arrays[0]], meta["fmt"])
    elif kind == "import":
        pages, expected, *leaves = arrays
        payload = KvPayload(meta["fmt"], int(meta["num_pages"]), int(meta["bucket"]), list(leaves))
        runner.import_pages([int(p) for p in pages], payload, expected)
    else:
        runner.warmup_handoff(list(meta["formats"]), bool(meta["imports"]))


def follow(runner, channel: StepFollower) -> int:
    """Run calls until ``stop`` (the channel stays open); -> the number of calls made.
    ConnectionError if process 0 closes the channel without a stop."""
    calls = 0
    while True:
        kind, arrays, meta = channel.recv()
        if kind == "stop":
            return calls
        if kind == "step":
            runner.step(unpack(StepBatch, arrays, meta))
        elif kind == "updates":
            runner.apply_padded_updates(*arrays)
        elif kind in HANDOFF_CALLS:
            _handoff_call(runner, kind, arrays, meta)
        elif kind != HEARTBEAT:
            raise ValueError(f"unknown step-channel message {kind!r}")
        calls += 1
