"""What this process holds of weights sharded over several processes, as one sha256.

Process 0 cannot read the shards on other processes' devices, so the replica's fingerprint
(GetModelInfo) hashes, for such a weight, the shards this process owns (replica 0 of each
slice, so every element is hashed by exactly one process) and adds every other process's
digest of its own, sent when it joins the step channel."""
from __future__ import annotations

import hashlib

import numpy as np


def shard_digest(leaves) -> str:
    """sha256 over (leaf index, slice, dtype, bytes) of this process's replica-0 shards of every
    leaf that is not fully addressable here ("" when every leaf is)."""
    h, any_sharded = hashlib.sha256(), False
    for i, leaf in enumerate(leaves):
        if getattr(leaf, "is_fully_addressable", True):
            continue
        any_sharded = True
        for shard in sorted(leaf.addressable_shards, key=lambda s: str(s.index)):
            if shard.replica_id != 0:
                continue
            a = np.ascontiguousarray(np.asarray(shard.data))
            h.update(f"{i}:{shard.index}:{a.dtype.name}:{a.shape};".encode())
            h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest() if any_sharded else ""
