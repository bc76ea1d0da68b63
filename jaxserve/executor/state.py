"""What the executor's programs run on and who watches their calls: ``DeviceState`` (the KV pools
and the page generations, replaced by each program that donates them) and ``Mirror`` (the
multi-process hook every device call passes first), shared by the runner's components."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass
class DeviceState:
    kv: Any  # the KV pools (a pytree of arrays: MLA [P, S, X], GQA [KVH, P, S, D])
    generation: Any  # int32 [P] page generations (the integrity check)


class Mirror:
    """fn(kind, arrays, meta) runs before every device call (multi-process serving: process 0
    sends each call's numpy inputs to the other processes); nothing while unset."""

    def __init__(self):
        self.fn: Callable | None = None

    @property
    def on(self) -> bool:
        return self.fn is not None

    def __call__(self, kind: str, arrays=(), meta: dict | None = None) -> None:
        if self.fn is not None:
            self.fn(kind, arrays, meta or {})
