"""The KvHandoff service's small parts: an ``Offer`` (a prefill worker's exported pages kept
until released or expired), the protocol version and expiry margin, the prefix-hash chain an
offer carries, and the test-only fault list (``$JAXSERVE_HANDOFF_FAULT``)."""
from __future__ import annotations

import dataclasses

from jaxserve.engine import prefix_cache
from jaxserve.kv import handoff
from jaxserve.v1 import handoff_pb2 as hpb

PROTOCOL_VERSION = 1
FAULT_ENV = "JAXSERVE_HANDOFF_FAULT"
EXPIRY_MARGIN_S = 0.5  # an offer this close to its expiry is not pulled (it may be drained meanwhile)


@dataclasses.dataclass
class Offer:
    manifest: hpb.HandoffOffer
    payload: handoff.KvPayload
    expires: float  # time.time()


def prefix_hashes(ids: list[int], page_size: int) -> list[bytes]:
    """The prefix-cache chain hash of every full page of ``ids`` (16 bytes little-endian each)."""
    out, parent = [], None
    for i in range(len(ids) // page_size):
        parent = prefix_cache.hash_page(parent, prefix_cache.page_tokens(ids, i, page_size))
        out.append(parent.to_bytes(16, "little"))
    return out


def parse_faults(spec: str) -> dict[str, str]:
    """``$JAXSERVE_HANDOFF_FAULT`` -> {request id ('' = every request): fault}."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        fault, _, rid = item.partition(":")
        if fault not in ("corrupt_payload", "die_mid_pull"):
            raise ValueError(f"unknown {FAULT_ENV} fault {fault!r}")
        out[rid] = fault
    return out
