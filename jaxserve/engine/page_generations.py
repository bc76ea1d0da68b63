"""The host mirror of the KV pool's page generations (the integrity design; docs/ARCHITECTURE.md,
step 4).

``values[p]`` is bumped when page ``p`` is acquired from free/evictable state (refcount 0 -> 1)
and again when released (1 -> 0): odd = owned, even = not owned. A second sharer of a cached
prefix page does not bump it (``BlockManager`` decides when). The device-side
``PageTracker.check`` compares each row's expected generations with the device copy, which the
runner brings up to date once per step from ``take_updates``.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class GenerationUpdates(NamedTuple):
    """Generation bumps since the last ``take_updates``, for the device copy.

    pages: int32[K], distinct page ids, ascending.
    counts: int32[K], how many times each was bumped (apply with ``gen.at[pages].add``).
    """

    pages: np.ndarray
    counts: np.ndarray


class PageGenerations:
    """Every page's generation, and the bumps the device copy has not taken yet."""

    def __init__(self, num_pages: int):
        self.values = np.zeros(num_pages, dtype=np.int32)  # [num_pages]
        self._pending: dict[int, int] = {}  # page -> bumps not yet taken by the runner

    def bump(self, page: int) -> None:
        self.values[page] += 1
        self._pending[page] = self._pending.get(page, 0) + 1

    def pending(self) -> dict[int, int]:
        """page -> bumps not yet taken (a copy)."""
        return dict(self._pending)

    def take_updates(self) -> GenerationUpdates:
        """The pages bumped since the last call, with counts; afterwards none is pending
        (``PageTracker.apply_updates`` makes the device copy equal ``values``)."""
        pages = np.array(sorted(self._pending), dtype=np.int32)
        counts = np.array([self._pending[p] for p in pages.tolist()], dtype=np.int32)
        self._pending.clear()
        return GenerationUpdates(pages, counts)
